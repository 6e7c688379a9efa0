"""The embedded node: a local ``gpuwire serve`` child on the CPU backend.

Started on first use of the device when no node is configured (no ``GPUWIRE_NODE``, no
``gpuwire.attach``). It listens on an ephemeral loopback port with a random token, exits
when this process exits (it watches its stdin pipe, so even a SIGKILLed parent leaves no
orphan), and says once on stderr where the device is.
"""

from __future__ import annotations

import atexit
import os
import secrets
import socket
import subprocess
import sys
import threading

_process: subprocess.Popen | None = None
_lock = threading.Lock()
# how long a starting node may take to say it listens; its first start on a machine builds its
# C++ helpers (src/gpuwire/_native.py), 15-35 s on a busy 2-core VM where a start is otherwise ~3 s
STARTUP_TIMEOUT = 120.0


class EmbeddedNodeFailed(RuntimeError):
    pass


def start_embedded_node(backend: str = "cpu") -> tuple[str, str]:
    """Start the child node; return (address, token)."""
    return wait_for_embedded_node(*begin_embedded_node(backend))


def begin_embedded_node(backend: str = "cpu") -> tuple[subprocess.Popen, str]:
    """Start the child node without waiting for it (it takes a second or two to import torch:
    the caller can do its own start-up meanwhile); ``wait_for_embedded_node`` finishes.

    The listening socket is bound here and handed to the node, so its address is known at
    once (``address_of``): a program can be started and connect while the node still starts
    (the kernel queues the connection, the handshake waits for the node). Should the node
    fail, the socket closes with it and the connection is refused."""
    token = secrets.token_hex(16)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        cmd = [sys.executable, "-m", "gpuwire", "serve", "--listen-fd", str(listener.fileno()),
               "--backend", backend, "--exit-with-stdin", "--log-level", "warning"]
        process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=embedded_node_env(token),
                                   text=True, pass_fds=(listener.fileno(),))
        host, port = listener.getsockname()
    finally:
        listener.close()  # the node holds its own copy
    process.gpuwire_address = f"{host}:{port}"
    return process, token


def address_of(process: subprocess.Popen) -> str:
    """The address a node from ``begin_embedded_node`` serves on (known before it listens)."""
    return process.gpuwire_address


def wait_for_embedded_node(process: subprocess.Popen, token: str, *, quiet: bool = False) -> tuple[str, str]:
    """The (address, token) of a node ``begin_embedded_node`` started, once it listens (said on
    stderr unless ``quiet``: ``gpuwire run -q``)."""
    global _process
    with _lock:
        line = _read_line(process, STARTUP_TIMEOUT)
        if not line.startswith("gpuwire node listening on "):
            process.kill()
            raise EmbeddedNodeFailed(f"the embedded gpuwire node did not start (it printed {line!r}); "
                                     "run `gpuwire serve` by hand to see why, or set GPUWIRE_NODE")
        address = line.split()[4]
        global _started_line
        _started_line = line
        _process = process
        atexit.register(stop_embedded_node)
        if not quiet:
            print(f"gpuwire: no node configured (GPUWIRE_NODE unset): started an embedded node at {address} "
                  "on the CPU backend (software GPU)", file=sys.stderr)
        return address, token


_started_line = ""


def started_name() -> str:
    """The device name the embedded node announced ("... listening on ADDR (backend cpu,
    software GPU: NAME)")."""
    head, _, name = _started_line.partition("GPU: ")
    return name[:-1] if head and name.endswith(")") else "gpuwire software GPU"


def embedded_node_env(token: str) -> dict:
    """The embedded node's environment: this process's, plus its token, and OpenMP workers
    that sleep when idle (``OMP_WAIT_POLICY=PASSIVE`` unless the user set a policy).

    The node shares the machine with the program that drives it. With OpenMP's default policy
    the node's idle workers spin between kernels, on the cores the program (and the node's own
    Python thread) needs: on 2 cores a small nanoGPT step flipped between 27 ms and 550 ms
    from run to run. Halving the node's thread count fixed that too, but changed the order of
    CPU reductions (LayerNorm's weight gradient, ...), so results no longer matched a local CPU
    run bit for bit; the wait policy keeps the kernels exactly as a local run runs them.
    """
    env = dict(os.environ, GPUWIRE_NODE_TOKEN=token, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.pop("GPUWIRE_NODE", None)
    if not env.get("OMP_WAIT_POLICY"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def _read_line(process: subprocess.Popen, timeout: float) -> str:
    result = []
    reader = threading.Thread(target=lambda: result.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return result[0].strip() if result else ""


def stop_embedded_node() -> None:
    global _process
    process, _process = _process, None
    if process is None:
        return
    # the launcher of `gpuwire run` never imported torch: importing the device layer only to
    # detach would add torch's import (2-3 s) to every run's exit
    device = sys.modules.get(f"{__package__}.device")
    if device is not None:
        device.detach()
    try:
        process.stdin.close()
        process.wait(timeout=5)
    except Exception:  # noqa: BLE001
        process.kill()
        process.wait()
    if process.stdout is not None:  # (left open, Python warns of it at exit: ResourceWarning)
        process.stdout.close()
