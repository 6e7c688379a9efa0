"""gpuwire's native client helpers (``native.cpp``), built on first use; Python where they cannot be.

Sits under ``client/device.py`` (installed when a program first attaches to a node) and
``client/wire.py`` (whose hooks it replaces). Four things, each measured on the hot path:

- **The device guard.** PyTorch asks a device's guard for the device type, the current device
  and stream many times an op: the autograd engine about six times for each backward node.
  ``torch._C._acc``'s guard (``torch_module.Guard``) answers each through a pybind11 override,
  the GIL and a Python call each time (~2,800 calls in a 12-layer GPT-2's backward); the C++
  one answers with the same values.
- **Tensor descriptors.** Every gpuwire tensor an op is given crosses the wire as a msgpack
  descriptor (storage, offset, sizes, strides, dtype, conj/neg bits); read through Python's
  tensor methods that is ~2 us a tensor, ~2,500 times a GPT-2 step. Read from the TensorImpl,
  byte for byte what ``wire.encode_default`` packs (the node caches views by those bytes).
- **View kernels.** A view op (``view``, ``as_strided``, which ``t``/``transpose``/``expand``/
  slicing call, ...) is metadata over its input's storage: its Python kernel redispatched to
  CPU's kernel, which makes it for any device. The C++ kernel does the same redispatch without
  the GIL and a Python call: 3.3 -> 1.2 us a ``view``, ~560 of them a 12-layer GPT-2 step
  (``device.use_native_kernels``).
- **Op kernels.** An op with fresh results (``add``, ``mul``, ``addmm``, ``mm``,
  ``native_layer_norm`` and its backward, ``clone``, ``zeros``, casts ...) or in place on its
  first argument (``add_``, ``mul_`` ...): ~790 ops whose plan is a ``DirectPlan`` or a
  ``FunctionalPlan``, most of a training step's messages, whose call
  signature its plan has served is keyed, encoded and its result tensors made in C++; Python is
  called once, to number and queue the message (``Runtime.submit_native``). Every other call
  goes to the op's plan as its Python kernel was called (``device._native_learn``). 12-layer
  GPT-2 step issue time (``python -m bench --only issue``) 36-43 -> 24-27 ms (docs/performance.md).

Built at a program's first attach (``gpuwire/_native.py`` builds and caches it: a few seconds
once per machine). Where it cannot be built (no compiler, no headers) the Python paths stay and
only speed differs; ``GPUWIRE_NATIVE=0`` keeps them. ``status()`` says which is in use.

Why by hand: PyTorch gives Python backends only the pybind11 guard.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .. import _native

SOURCE = Path(__file__).with_name("native.cpp")
MODULE = "gpuwire_native"
_installed = False
_failure: str | None = None
module = None  # the loaded extension, once installed


def status() -> str:
    """'native', or why the Python guard is in use."""
    return _native.status(module if _installed else None, _failure, "not attached yet")


_early = None  # the helper register_hooks loaded at the device's registration


def register_hooks() -> bool:
    """At the device's registration (inside ``import torch``, before any attach): the C++ device
    hooks (``native.cpp`` ``GpuwireHooks``: pinned host memory for PyTorch's own C++, which DDP's
    reducer with ``find_unused_parameters`` needs) from this machine's built helper. A process
    that asked for gpuwire by its environment (``gpuwire run``, ``GPUWIRE_NODE``) builds the
    helper now if the machine has none (what its first attach would do, once per machine); any
    other ``import torch`` never builds. False, and the caller registers PyTorch's Python hooks,
    where there is no helper."""
    if not _native.enabled():
        return False
    try:
        if not _native.library_path(SOURCE, MODULE).exists() and not (
                os.environ.get("GPUWIRE_RUN") == "1" or os.environ.get("GPUWIRE_NODE")):
            return False
        global _early
        _early = _native.load(SOURCE, MODULE)
        return bool(_early.register_hooks())
    except _native.FAILURES:
        return False


def install_guard(loaded=None) -> None:
    """The C++ device guard in place of PyTorch's Python one (``native.cpp`` ``GpuwireGuard``),
    from ``loaded`` or the helper ``register_hooks`` loaded."""
    from . import torch_module
    loaded = loaded or _early or _native.load(SOURCE, MODULE)
    answered = loaded.install_guard(torch_module.synchronize)
    if answered != int(torch._C._autograd.DeviceType.PrivateUse1):
        raise RuntimeError(f"the built guard answers device type {answered}")


def install() -> bool:
    """Build (if needed) and load the extension, install its guard and its encoders; False,
    with the reason kept for ``status()``, where the Python ones stay. Idempotent."""
    global _installed, _failure, module
    if _installed:
        return True

    def setup(loaded) -> None:
        install_guard(loaded)
        from . import device, runtime, wire
        wire.use_native(loaded)
        runtime.use_native(loaded)
        device.use_native_kernels(loaded)  # (if the device is registered yet; else register() does)

    from . import autocast
    autocast_build = _native.build_in_background(autocast.SOURCE, autocast.MODULE)  # (side by side)
    loaded, _failure = _native.install(SOURCE, MODULE, setup)
    if autocast_build is not None:
        autocast_build.join()
    if loaded is None:
        return False
    module = loaded
    _installed = True
    autocast.use_native()  # (its own helper: where it cannot be built, autocast's Python kernels stay)
    return True
