"""gpuwire's native node helpers (``native.cpp``): a session's per-op bookkeeping in C++.

Sits under ``node/session.py``, which calls these where its Python would otherwise run for
every op a client sends, and keeps the Python for everything else. What crosses the boundary:
a session object, its decoded arguments and results; the helpers read tensor metadata from
the TensorImpl and update the session's own dicts, and answer "not here" (the Python path
decides, copies or raises) for anything but the plain case, so the two paths differ only in
speed. On the node's replay of a GPT-2 tiny step (``python -m bench.node_replay``) they take
about a fifth off what a node spends outside kernels (decoding 14.7 -> ~10 us an event, the
rest 21 -> ~18 us):

- ``TensorHook``: the decoder's ``ext_hook``. A descriptor whose cached view is still valid
  (most arguments: parameters, optimizer state, live activations) is answered without a
  Python call (~2 -> ~0.3 us, ~4 an op); a new one is checked and made in C++ too.
- ``adopt``: storing a result under the client's id as the kernel made it (``Session._adopt``'s
  usual case, 5.7 us in Python, ~1.3 results an op).
- ``signature``: the allocation guard's meta-cost cache key (``session._signature``).
- ``keep_warnings`` / ``take_warnings``: what the kernels of a session's thread warn (c10's
  ``TORCH_WARN``, which an op called as the node calls it hands to the thread's C++ handler),
  kept for the session's client (``server.warnings_notice``); ``quiet_warnings`` around the
  allocation guard's meta pass, which runs an op's checks before its kernel does.

Built by ``gpuwire/_native.py`` when a node starts (a few seconds, once per machine); where it
cannot be (no compiler), or with ``GPUWIRE_NATIVE=0``, the Python paths run. ``status()``
says which is in use (the node logs it at start; ``gpuwire smi --json`` shows it as ``helpers``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from .. import _native

SOURCE = Path(__file__).with_name("native.cpp")
MODULE = "gpuwire_node_native"
# c10::DeviceType numbers of the node devices the helpers store results for
DEVICE_TYPES = {"cpu": 0, "cuda": 1}
module = None  # the loaded extension, once installed
_failure: str | None = None


def status() -> str:
    """'native', or why the Python paths are in use."""
    return _native.status(module, _failure)


def dtype_table(scalar_type) -> dict:
    """{c10::ScalarType number: (wire dtype code, torch.dtype)}, what the C++ helpers decode
    dtypes by (``scalar_type``: a helper module's, which reads the number off a tensor)."""
    from . import session
    table = {}
    with warnings.catch_warnings():  # (complex32: "experimental")
        warnings.simplefilter("ignore")
        for code, dtype in enumerate(session.TORCH_DTYPES):
            if dtype is not None:
                table[scalar_type(torch.empty(0, dtype=dtype))] = (code, dtype)
    return table


def install() -> bool:
    """Build (if needed), load and configure the helpers; False, with the reason kept for
    ``status()``, where the Python paths stay. Idempotent."""
    global module, _failure
    if module is not None:
        return True
    from ..protocol import codec
    from . import session

    def setup(loaded) -> None:
        loaded.configure(torch.Tensor, codec.EXT_TENSOR, dtype_table(loaded.scalar_type), session._LIST,
                         session._KWARGS, session.NODE_ID_BASE, session.VIEW_CACHE_MAX)
        session._QUIET_WARNINGS[0] = loaded.quiet_warnings

    from . import loop
    loop_build = loop.build_in_background()  # (side by side with this one: a first start waits once)
    module, _failure = _native.install(SOURCE, MODULE, setup)
    if loop_build is not None:
        loop_build.join()
    if module is not None:
        loop.install()  # (built on these helpers: node/loop.py)
    return module is not None
