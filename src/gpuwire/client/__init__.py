"""The client: the ``gpuwire`` PyTorch device and its connection to a node."""

from .device import attach, detach, register
from .errors import ConnectionLost, GpuwireError, NodeUnreachable, RemoteError

__all__ = ["attach", "detach", "register", "ConnectionLost", "GpuwireError", "NodeUnreachable", "RemoteError"]
