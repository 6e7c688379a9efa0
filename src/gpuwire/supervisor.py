"""``gpuwire serve --restart-on-crash``: the node in a child process, started again when it dies.

Sits between the command line (``cli.py serve``) and the node (``gpuwire serve --listen-fd``).
This process binds the listening socket once and hands it to each node process it starts, so
the address stays good across a restart: clients that ask to resume their session hear why it
is gone (``GPUWIRE_NODE_RESTARTED_AFTER``: "the node restarted after its previous process (pid
N) ended: killed by SIGSEGV ...") and start new sessions. What crosses the boundary: the
socket's file descriptor, the command line, SIGTERM/SIGINT (passed on), exit statuses. A node
that exits by itself (a configuration error, a drain) is not started again; one killed by a
signal is, at most 5 times a minute. The embedded node's parent (``client/embedded.py``) does
the same for a program's own node. Beside ``launcher.py`` rather than in ``node/``, whose
package imports torch: this process never does (2-3 s and ~300 MB it would hold for nothing).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from ._io import listen
from ._process import RestartBudget, how_it_ended


def node_arguments(argv: list[str]) -> list[str]:
    """The ``gpuwire serve`` arguments of this command line, less ``--restart-on-crash``."""
    if "serve" not in argv:
        raise ValueError("--restart-on-crash: cannot find the serve arguments on the command line")
    return [a for a in argv[argv.index("serve") + 1:] if a != "--restart-on-crash"]


def supervise(arguments: list[str], host: str, port: int) -> int:
    """Serve on ``host:port`` with a node process given ``arguments``; the exit status to end with."""
    try:
        listener = listen(host, port)
    except OSError as exc:
        print(f"gpuwire serve: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    address = f"{host}:{listener.getsockname()[1]}"
    stopping: list[int] = []
    node: list[subprocess.Popen] = []

    def pass_on(signum, _frame) -> None:
        stopping.append(signum)
        if len(stopping) == 1 and node and node[-1].poll() is None:  # (once: the node may have had it too)
            node[-1].send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, pass_on)
    restarts, restarted_after = RestartBudget(), None
    try:
        while True:
            env = dict(os.environ)
            if restarted_after:
                env["GPUWIRE_NODE_RESTARTED_AFTER"] = restarted_after
            node.append(subprocess.Popen(
                [sys.executable, "-m", "gpuwire", "serve", *arguments, "--listen-fd", str(listener.fileno()),
                 "--exit-with-stdin"], stdin=subprocess.PIPE, env=env, pass_fds=(listener.fileno(),)))
            if stopping:  # (asked to stop while it started)
                node[-1].send_signal(stopping[0])
            returncode = node[-1].wait()
            if stopping or returncode >= 0:
                return 0 if stopping and returncode in (0, -signal.SIGTERM, -signal.SIGINT) else abs(returncode)
            ended = how_it_ended(returncode)
            if not restarts.spend():
                print(f"gpuwire serve: the node (pid {node[-1].pid}) ended: {ended}, more than "
                      f"{restarts.per_minute} times within a minute; not starting it again", file=sys.stderr, flush=True)
                return 1
            print(f"gpuwire serve: the node (pid {node[-1].pid}) ended: {ended}; its sessions are lost. Starting it "
                  f"again on {address}: clients start new sessions", file=sys.stderr, flush=True)
            restarted_after = f"its previous process (pid {node[-1].pid}) ended: {ended}"
            node.pop().stdin.close()
    finally:
        listener.close()
        for process in node:
            if process.poll() is None:
                process.kill()
                process.wait()
