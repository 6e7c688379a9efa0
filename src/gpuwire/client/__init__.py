"""The client: the ``gpuwire`` PyTorch device and its connection to a node."""

from .errors import ConnectionLost, GpuwireError, NodeUnreachable, RemoteError

__all__ = ["attach", "detach", "register", "ConnectionLost", "GpuwireError", "NodeUnreachable", "RemoteError"]


def __getattr__(name: str):
    # the device (and torch with it) is imported on first use, not by ``import gpuwire.client.errors``:
    # the CLI's commands that need no torch start in a fraction of a second
    if name in ("attach", "detach", "register"):
        from . import device
        return getattr(device, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
