"""``gpuwire run``: start a program with its GPU on a gpuwire node.

Sits at the CLI edge. Before the program starts it resolves the node (``--node``,
``GPUWIRE_NODE``, else an embedded CPU node shared by every process of the run), checks it
answers (one clear line and a non-zero exit if not), and says once where the GPU is. The
child gets: GPUWIRE_NODE/TOKEN, GPUWIRE_CUDA_COMPAT, this package's ``_boot`` folder first
on PYTHONPATH (gpuwire loads after torch in every Python it starts, ``python -m``,
subprocesses and DataLoader workers included) and an ``nvidia-smi`` on PATH that shows the
remote GPU. Signals are forwarded; the exit code is the child's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _say(message: str) -> None:
    print(f"gpuwire: {message}", file=sys.stderr, flush=True)


def _nvidia_smi_dir() -> str:
    folder = tempfile.mkdtemp(prefix="gpuwire-bin-")
    script = os.path.join(folder, "nvidia-smi")
    with open(script, "w") as f:
        f.write(f"#!/bin/sh\nexec \"{sys.executable}\" -m gpuwire smi --nvidia-smi \"$@\"\n")
    os.chmod(script, 0o755)
    return folder


def run(argv: list[str], *, node: str | None, token: str | None, cuda_compat: bool, quiet: bool = False) -> int:
    if not argv:
        print("gpuwire run: no command given; usage: gpuwire run [OPTIONS] -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    from .client.errors import GpuwireError
    from .client.runtime import Runtime

    node = node or os.environ.get("GPUWIRE_NODE") or None
    token = token or os.environ.get("GPUWIRE_TOKEN") or None
    embedded = None
    if node is None:
        from .client import embedded as embedded_module
        try:
            node, token = embedded_module.start_embedded_node()
        except Exception as exc:  # noqa: BLE001
            print(f"gpuwire run: could not start an embedded node: {exc}", file=sys.stderr)
            return 2
        embedded = embedded_module
    try:
        probe = Runtime(node, token=token)
        info = probe.device_info
        probe.close()
    except (GpuwireError, ValueError) as exc:
        print(f"gpuwire run: {exc}", file=sys.stderr)
        if embedded:
            embedded.stop_embedded_node()
        return 2
    if not quiet:
        name = info.get("name", "?")
        if info.get("software") and "software" not in name:
            name += " (software GPU, CPU backend)"
        _say(f"GPU 0 is {name} on node {node}"
             + ("; CUDA programs run unchanged" if cuda_compat else ""))

    bin_dir = _nvidia_smi_dir()
    env = dict(os.environ)
    env.update(GPUWIRE_NODE=node, GPUWIRE_RUN="1", GPUWIRE_CUDA_COMPAT="1" if cuda_compat else "0")
    if token:
        env["GPUWIRE_TOKEN"] = token
    env["PYTHONPATH"] = BOOT_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    try:
        try:
            child = subprocess.Popen(argv, env=env)
        except FileNotFoundError:
            print(f"gpuwire run: command not found: {argv[0]}", file=sys.stderr)
            return 127
        except PermissionError:
            print(f"gpuwire run: permission denied: {argv[0]}", file=sys.stderr)
            return 126
        previous = {}
        for sig in FORWARDED_SIGNALS:
            previous[sig] = signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
        try:
            code = child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return code if code >= 0 else 128 - code
    finally:
        shutil.rmtree(bin_dir, ignore_errors=True)
        if embedded:
            embedded.stop_embedded_node()
