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
import subprocess
import sys
import threading

_process: subprocess.Popen | None = None
_lock = threading.Lock()
STARTUP_TIMEOUT = 60.0


class EmbeddedNodeFailed(RuntimeError):
    pass


def start_embedded_node(backend: str = "cpu") -> tuple[str, str]:
    """Start the child node; return (address, token)."""
    global _process
    with _lock:
        token = secrets.token_hex(16)
        env = dict(os.environ, GPUWIRE_NODE_TOKEN=token, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
        env.pop("GPUWIRE_NODE", None)
        cmd = [sys.executable, "-m", "gpuwire", "serve", "--host", "127.0.0.1", "--port", "0",
               "--backend", backend, "--exit-with-stdin", "--log-level", "warning"]
        threads = embedded_node_threads()
        if threads is not None:
            cmd += ["--threads", str(threads)]
        process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        line = _read_line(process, STARTUP_TIMEOUT)
        if not line.startswith("gpuwire node listening on "):
            process.kill()
            raise EmbeddedNodeFailed(f"the embedded gpuwire node did not start (it printed {line!r}); "
                                     "run `gpuwire serve` by hand to see why, or set GPUWIRE_NODE")
        address = line.split()[4]
        _process = process
        atexit.register(stop_embedded_node)
        print(f"gpuwire: no node configured (GPUWIRE_NODE unset): started an embedded node at {address} "
              "on the CPU backend (software GPU)", file=sys.stderr)
        return address, token


def embedded_node_threads() -> int | None:
    """Intra-op CPU threads for the embedded node's kernels: half the CPUs this process may use
    (at least 1), because the node shares the machine with the program that drives it.

    With torch's default (every core) the node's OpenMP workers and the program competed for
    the same cores: on 2 cores a small nanoGPT step flipped between 27 ms and 550 ms. The
    benchmarks give their node half the CPUs for the same reason. ``OMP_NUM_THREADS`` (which
    the node inherits and torch obeys) or ``GPUWIRE_EMBEDDED_THREADS`` override it.
    """
    explicit = os.environ.get("GPUWIRE_EMBEDDED_THREADS", "").strip()
    if explicit:
        return max(1, int(explicit))
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, usable // 2)


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
    from . import device
    device.detach()
    try:
        process.stdin.close()
        process.wait(timeout=5)
    except Exception:  # noqa: BLE001
        process.kill()
        process.wait()
