"""gpuwire's data-plane protocol: events, value codec and a sans-IO connection.

Nothing in this package performs I/O or imports torch; the client runtime and the node
server feed it bytes and act on the events it returns.
"""

from .codec import DTYPE_CODES, DTYPE_ITEMSIZE, DTYPE_NAMES, DecodeError
from .connection import (CLOSED, NEED_DATA, Connection, Limits, ProtocolError, Role, State, StreamCut, VersionMismatch,
                         check_hello)
from .events import *  # noqa: F403
from .events import PROTOCOL_VERSION, Event

__all__ = [
    "CLOSED", "NEED_DATA", "Connection", "Limits", "ProtocolError", "Role", "State", "StreamCut", "VersionMismatch",
    "check_hello", "DTYPE_CODES", "DTYPE_ITEMSIZE", "DTYPE_NAMES", "DecodeError", "PROTOCOL_VERSION", "Event",
]
