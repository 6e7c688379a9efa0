"""Process helpers shared by the command-line entry points."""

from __future__ import annotations

import os
import sys


def exit_when_stdin_closes() -> None:
    """Run in a daemon thread of a child process started with a stdin pipe: when the parent
    goes away (even by SIGKILL) the pipe closes and the child exits, leaving no orphan."""
    try:
        while sys.stdin.read(1 << 16):
            pass
    finally:
        os._exit(0)
