"""Process helpers shared by the command-line entry points."""

from __future__ import annotations

import os
import signal
import sys


def exit_when_stdin_closes() -> None:
    """Run in a daemon thread of a child process started with a stdin pipe: when the parent
    goes away (even by SIGKILL) the pipe closes and the child exits, leaving no orphan."""
    try:
        while sys.stdin.read(1 << 16):
            pass
    finally:
        os._exit(0)


def how_it_ended(returncode: int) -> str:
    """A node process's exit status in words: "killed by SIGSEGV (...)", "exited with status 1"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        crashed = "a kernel crashed; with GPUWIRE_SYNC=1 the line whose op crashed it raises"
        hint = {"SIGSEGV": crashed, "SIGBUS": crashed, "SIGILL": crashed, "SIGFPE": crashed,
                "SIGABRT": crashed.replace("crashed;", "aborted;"),
                "SIGKILL": "the out-of-memory killer, or a kill -9"}.get(name)
        return f"killed by {name}" + (f" ({hint})" if hint else "")
    return f"exited with status {returncode}"


class RestartBudget:
    """At most ``per_minute`` restarts in any minute: more is a node that cannot run here."""

    def __init__(self, per_minute: int = 5):
        self.per_minute = per_minute
        self._deaths: list[float] = []

    def spend(self) -> bool:
        """Note a death; False when the budget is spent (do not start it again)."""
        import time
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < 60] + [now]
        return len(self._deaths) <= self.per_minute
