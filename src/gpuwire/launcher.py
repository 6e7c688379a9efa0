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

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _say(message: str) -> None:
    print(f"gpuwire: {message}", file=sys.stderr, flush=True)


def _nvidia_smi_dir() -> tuple[str, bool]:
    """A folder holding the ``nvidia-smi`` the program finds first on its PATH, and whether it
    is a temporary one to remove afterwards. It lives in the user's cache, one per Python
    interpreter, written once: a run that is killed (SIGKILL cannot be cleaned up after) leaves
    nothing behind. Without a writable cache, a temporary folder."""
    content = f"#!/bin/sh\nexec \"{sys.executable}\" -m gpuwire smi --nvidia-smi \"$@\"\n"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(cache, "gpuwire", "bin-" + hashlib.sha256(sys.executable.encode()).hexdigest()[:12])
    script = os.path.join(folder, "nvidia-smi")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        with open(script) as f:
            if f.read() == content and os.access(script, os.X_OK):
                return folder, False
    except OSError:
        pass
    try:
        staged = f"{script}.{os.getpid()}"
        with open(staged, "w") as f:
            f.write(content)
        os.chmod(staged, 0o755)
        os.replace(staged, script)  # atomic: a run starting beside this one sees the whole script
        return folder, False
    except OSError:
        folder = tempfile.mkdtemp(prefix="gpuwire-bin-")
        script = os.path.join(folder, "nvidia-smi")
        with open(script, "w") as f:
            f.write(content)
        os.chmod(script, 0o755)
        return folder, True


def _lease_from_pool(pool: str, request: dict, quiet: bool):
    """Ask the pool for a lease (waiting in its queue, saying where we are); keep it renewed and
    mirror each fresh token into a file the program's client re-reads."""
    from .pool.client import PoolClient, PoolError

    client = PoolClient(pool)
    positions = []

    def on_position(position: int, data: dict) -> None:
        positions.append(position)
        if not quiet:
            _say(f"waiting for a GPU: {data.get('position_text') or position} in queue")

    try:
        lease = client.request_lease(on_position=on_position, **request)
    except PoolError as exc:
        raise LaunchError(f"the pool refused the lease: {exc}") from None
    if request.get("gpus", 1) > 1 and not quiet:
        _say(f"lease {lease.id} has {request['gpus']} GPUs: the ranks a launcher starts (torchrun, accelerate "
             f"launch: LOCAL_RANK i) use GPU i; a single process uses the first (one device per session)")
    token_dir = tempfile.mkdtemp(prefix="gpuwire-lease-")
    token_file = os.path.join(token_dir, "token")

    def write_token(token: str, path: str = token_file) -> None:
        temporary = path + ".tmp"
        with open(temporary, "w") as f:
            f.write(token)
        os.replace(temporary, path)

    def tokens() -> list:
        """The lease's token, then one per GPU for a lease of several (``token.<i>``)."""
        allocations = lease.allocations
        return [lease.token] + ([a.get("token") for a in allocations] if len(allocations) > 1 else [])

    def write_tokens(current: list) -> None:
        write_token(current[0])
        for index, token in enumerate(current[1:]):
            if token:
                write_token(token, f"{token_file}.{index}")

    written = tokens()
    write_tokens(written)
    lease.keep_alive(on_lost=lambda _lease, why: _say(f"lease lost: {why}"))
    stop = threading.Event()

    def mirror_tokens() -> None:
        last = written
        while not stop.wait(0.5):
            current = tokens()
            if current[0] and current != last:
                write_tokens(current)
                last = current

    threading.Thread(target=mirror_tokens, daemon=True, name="gpuwire-token-mirror").start()

    def release() -> None:
        stop.set()
        try:
            lease.release()
        finally:
            shutil.rmtree(token_dir, ignore_errors=True)
    return lease, token_file, release


class LaunchError(Exception):
    pass


def run(argv: list[str], *, node: str | None, token: str | None, cuda_compat: bool, quiet: bool = False,
        pool: str | None = None, lease_request: dict | None = None, durability: str | None = None) -> int:
    if not argv:
        print("gpuwire run: no command given; usage: gpuwire run [OPTIONS] -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    from .client import embedded as embedded_module
    from .client.errors import GpuwireError

    node = node or os.environ.get("GPUWIRE_NODE") or None
    starting = None
    if node is None and not pool:
        # started first: it imports torch while the program does (this process never does)
        starting = embedded_module.begin_embedded_node()

    token = token or os.environ.get("GPUWIRE_TOKEN") or None
    embedded = None
    release_lease = None
    token_file = None
    if pool and not node:
        try:
            lease, token_file, release_lease = _lease_from_pool(pool, lease_request or {}, quiet)
        except (LaunchError, Exception) as exc:  # noqa: BLE001 - one clear line, never a traceback
            print(f"gpuwire run: {exc}", file=sys.stderr)
            return 2
        node, token = lease.address, lease.token
        if not quiet:
            from .pool.sizes import format_size
            _say(f"lease {lease.id}: {format_size(lease.memory)}, share {lease.share} of GPU {lease.device} "
                 f"on node {lease.node_id}")
    child = None
    if node is None and starting:
        # the embedded node's address is known before it listens: the program starts now and
        # imports torch while the node does; its first connection waits for the node
        node, token = embedded_module.address_of(starting[0]), starting[1]
        embedded = embedded_module
    elif node is None:
        try:
            node, token = embedded_module.start_embedded_node()
        except Exception as exc:  # noqa: BLE001
            print(f"gpuwire run: could not start an embedded node: {exc}", file=sys.stderr)
            return 2
        embedded = embedded_module

    bin_dir, bin_dir_is_temporary = _nvidia_smi_dir()
    env = dict(os.environ)
    env.update(GPUWIRE_NODE=node, GPUWIRE_RUN="1", GPUWIRE_CUDA_COMPAT="1" if cuda_compat else "0")
    if starting and not os.environ.get("GPUWIRE_CONNECT_TIMEOUT"):
        # the program's first connection waits for the node's start as long as this launcher
        # does (it kills the program should the node fail): a first start on a machine builds
        # the node's C++ helpers, and the client's default 10 s ended such a run with "did not
        # answer the gpuwire handshake". A later reconnect to this local node is refused at once
        # if it is gone, so the longer wait costs nothing there.
        env["GPUWIRE_CONNECT_TIMEOUT"] = f"{embedded_module.STARTUP_TIMEOUT:g}"
    if token:
        env["GPUWIRE_TOKEN"] = token
    if token_file:
        env["GPUWIRE_TOKEN_FILE"] = token_file
        # the program's client asks the pool itself for a replacement GPU if its node is lost
        env.update(GPUWIRE_POOL=pool, GPUWIRE_LEASE_ID=lease.id)
        addresses = [a.get("address") for a in lease.allocations]
        if len(addresses) > 1 and all(addresses):
            # one GPU per launcher rank (``client.device.default_node``), token in token.<i>
            env["GPUWIRE_NODES"] = ",".join(addresses)
    if durability:
        env["GPUWIRE_DURABILITY"] = durability
    env["PYTHONPATH"] = BOOT_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")

    def cleanup() -> None:
        if bin_dir_is_temporary:
            shutil.rmtree(bin_dir, ignore_errors=True)
        if embedded:
            embedded.stop_embedded_node()
        if release_lease:
            release_lease()

    def start_child():
        try:
            return subprocess.Popen(argv, env=env), None
        except FileNotFoundError:
            print(f"gpuwire run: command not found: {argv[0]}", file=sys.stderr)
            return None, 127
        except PermissionError:
            print(f"gpuwire run: permission denied: {argv[0]}", file=sys.stderr)
            return None, 126

    if starting:
        child, failed = start_child()
        if child is None:
            starting[0].kill()
            cleanup()
            return failed
    try:
        if starting:  # a node of our own: what it said when it started is all there is to check
            embedded_module.wait_for_embedded_node(*starting, quiet=quiet)
            info = {"name": embedded_module.started_name(), "software": True}
        else:
            from .client.probe import NodeProbe  # (not the runtime: it imports torch, 2-3 s here)
            with NodeProbe(node, token=token) as probe:
                info = dict(probe.welcome.device)
    except (GpuwireError, ValueError, embedded_module.EmbeddedNodeFailed) as exc:
        what = "could not start an embedded node: " if isinstance(exc, embedded_module.EmbeddedNodeFailed) else ""
        print(f"gpuwire run: {what}{exc}", file=sys.stderr)
        if child is not None:
            child.kill()
            child.wait()
        cleanup()
        return 2
    except BaseException:  # Ctrl-C while the node starts: nothing left behind
        if child is not None:
            child.kill()
            child.wait()
        cleanup()
        raise
    if not quiet:
        name = info.get("name", "?")
        if info.get("software") and "software" not in name:
            name += " (software GPU, CPU backend)"
        _say(f"GPU 0 is {name} on node {node}"
             + ("; CUDA programs run unchanged" if cuda_compat else ""))

    try:
        if child is None:
            child, failed = start_child()
            if child is None:
                return failed
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
        cleanup()
