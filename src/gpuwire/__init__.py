"""gpuwire: network-attached GPUs for PyTorch.

``import gpuwire`` registers the ``gpuwire`` device (torch also does this by itself through
its backend entry point). The first op on the device connects to the node named by
``GPUWIRE_NODE`` (or ``gpuwire.attach("host:port")``), else starts an embedded CPU node.
"""

from ._version import __version__
from .client.errors import ConnectionLost, GpuwireError, NodeUnreachable, RemoteError

__all__ = ["__version__", "attach", "detach", "synchronize", "ConnectionLost", "GpuwireError", "NodeUnreachable",
           "RemoteError", "device", "stats"]


def attach(node: str | None = None, *, token: str | None = None, cuda_compat: bool = False):
    """Use the node at ``node`` (``HOST:PORT``; default ``GPUWIRE_NODE``, else an embedded CPU
    node). With ``cuda_compat=True``, code written for ``"cuda"`` runs on it unchanged."""
    from .client.device import attach as _attach
    runtime = _attach(node, token=token)
    if cuda_compat:
        from .client import cuda_compat as _compat
        _compat.enable()
    return runtime


def detach() -> None:
    from .client.device import detach as _detach
    _detach()


def synchronize() -> None:
    """Wait for every queued op to finish on the node; raise the first error among them."""
    from .client.device import current_runtime
    rt = current_runtime()
    if rt is not None:
        rt.synchronize()


def stats() -> dict:
    """Counters of this process's session: round trips, ops sent, bytes moved, live storages."""
    from .client.device import current_runtime
    rt = current_runtime()
    if rt is None:
        return {"connected": False}
    recovery = rt.recovery
    return {"connected": True, "node": rt.address, "round_trips": rt.round_trips, "ops_sent": rt.ops_sent,
            "bytes_sent": rt.bytes_sent, "bytes_received": rt.bytes_received, "live_storages": rt.live_storages,
            "durability": recovery.mode, "recovery_log_bytes": recovery.log_bytes,
            "recovery_snapshot_bytes": recovery.snapshot_bytes, **recovery.stats}


def _register_now() -> None:
    try:
        from .client import autocast, cuda_compat
        from .client.device import register
        from .client.shims import install
    except ImportError:
        # gpuwire is being imported from inside torch's own import (backend autoload) while
        # this module is itself half-imported; the outer import registers at its end
        return
    import os
    register()
    install()
    autocast.register()
    if os.environ.get("GPUWIRE_CUDA_COMPAT", "0") not in ("", "0"):
        cuda_compat.enable()
    else:
        _warn_if_a_local_accelerator()


def _warn_if_a_local_accelerator() -> None:
    """Said once: with gpuwire registered, this process's local GPU can run no backward."""
    from gpuwire_autoload import local_accelerator
    local = local_accelerator()
    if local:
        import warnings
        warnings.warn(f"gpuwire: this process also has a local {local} device. PyTorch's autograd serves one "
                      f"accelerator per process (pytorch/pytorch#161129), and with gpuwire registered backward() "
                      f"through local {local} tensors fails ('opt_ready_stream && opt_parent_stream INTERNAL "
                      "ASSERT FAILED'). Train on the local GPU in another process (without gpuwire imported), or "
                      "run this program under `gpuwire run`, where 'cuda' means the remote GPU.",
                      RuntimeWarning, stacklevel=3)


def _started_as_the_cli() -> bool:
    """This process is the ``gpuwire`` command (console script or ``python -m gpuwire``): it
    imports torch only for the subcommands that need it, so ``gpuwire --help``, ``ls``, ``pool``
    ... answer in a fraction of a second."""
    import os
    import sys
    argv = getattr(sys, "orig_argv", None) or sys.argv
    i = 1
    while i < len(argv):  # ``python [-X importtime -u ...] -m gpuwire``
        arg = argv[i]
        if arg == "-m":
            if argv[i + 1:i + 2] == ["gpuwire"]:
                return True
            break
        if not arg.startswith("-") or arg == "-c":
            break
        i += 2 if arg in ("-X", "-W") else 1
    return bool(sys.argv) and os.path.basename(sys.argv[0]) in ("gpuwire", "gpuwire.exe") and "torch" not in sys.modules


if not _started_as_the_cli():
    _register_now()


def device(index: int = 0):
    import torch
    return torch.device("gpuwire", index)


def load_ipython_extension(ipython) -> None:
    """``%load_ext gpuwire`` in IPython/Jupyter: adds the ``%gpuwire`` magic."""
    from .jupyter import load_ipython_extension as load
    load(ipython)
