"""Exceptions a gpuwire user can catch. Each message says what happened and what to do."""

from __future__ import annotations

import builtins


class GpuwireError(Exception):
    """Base of every gpuwire error."""


class NodeUnreachable(GpuwireError, ConnectionError):
    """No gpuwire node answered at the configured address."""


class ConnectionLost(GpuwireError, ConnectionError):
    """The connection to the node broke while the program was using it."""


class RemoteError(GpuwireError):
    """An op failed on the node. ``op``, ``seq`` and ``remote_type`` say which and why.

    Raised at the next sync point after the failing op (like CUDA errors); set
    ``GPUWIRE_SYNC=1`` to raise it at the line that issued the op.
    """

    def __init__(self, message: str, *, op: str = "", seq: int = 0, remote_type: str = "", remote_message: str = ""):
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.remote_type = remote_type
        self.remote_message = remote_message


_REMOTE_SUBCLASSES: dict[str, type] = {}
_MIRRORED = ("RuntimeError", "ValueError", "TypeError", "IndexError", "NotImplementedError", "KeyError",
             "ZeroDivisionError", "OverflowError", "AssertionError")


def out_of_memory_prefix() -> str:
    """How an out-of-memory message starts. Under CUDA compatibility it starts as CUDA's does,
    since libraries recognise an OOM by its text to retry with a smaller batch: accelerate's
    ``find_executable_batch_size`` and the transformers Trainer's ``auto_find_batch_size`` look
    for "CUDA out of memory.", Lightning's batch-size finder for "CUDA" and "out of memory"."""
    from . import cuda_compat
    return "CUDA out of memory. " if cuda_compat.enabled() else "gpuwire device out of memory. "


def remote_error(op: str, seq: int, exc_type: str, message: str, node: str) -> RemoteError:
    """A RemoteError that is also an instance of the node-side builtin exception type, so
    ``except RuntimeError`` and torch's own error checks behave as with a local device."""
    text = f"{message}\n  (gpuwire: {op} failed on node {node}, op #{seq}; set GPUWIRE_SYNC=1 to raise at the failing line)"
    base = None
    if exc_type == "OutOfMemoryError":
        import torch
        base = torch.OutOfMemoryError
        text = out_of_memory_prefix() + text
    elif exc_type in ("_LinAlgError", "LinAlgError"):  # (a RuntimeError: ``except torch.linalg.LinAlgError``)
        import torch
        base = torch.linalg.LinAlgError
    elif exc_type in _MIRRORED:
        base = getattr(builtins, exc_type)
    elif exc_type.endswith("Error") and exc_type not in ("SessionError", "OpRefused"):
        base = RuntimeError
    if base is None:
        return RemoteError(text, op=op, seq=seq, remote_type=exc_type, remote_message=message)
    cls = _REMOTE_SUBCLASSES.get(exc_type)
    if cls is None:
        cls = _REMOTE_SUBCLASSES[exc_type] = type(f"Remote{base.__name__.lstrip('_')}", (RemoteError, base), {})
    err = cls.__new__(cls)
    RemoteError.__init__(err, text, op=op, seq=seq, remote_type=exc_type, remote_message=message)
    return err
