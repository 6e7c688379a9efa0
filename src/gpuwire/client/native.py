"""gpuwire's native client helpers (``native.cpp``), built on first use; Python where they cannot be.

Sits under ``client/device.py`` (installed when a program first attaches to a node) and
``client/wire.py`` (whose hooks it replaces). Two things, both measured on the hot path:

- **The device guard.** PyTorch asks a device's guard for the device type, the current device
  and stream many times an op: the autograd engine about six times for each backward node.
  ``torch._C._acc``'s guard (``torch_module.Guard``) answers each through a pybind11 override,
  the GIL and a Python call each time (~2,800 calls in a 12-layer GPT-2's backward); the C++
  one answers with the same values.
- **Tensor descriptors.** Every gpuwire tensor an op is given crosses the wire as a msgpack
  descriptor (storage, offset, sizes, strides, dtype, conj/neg bits); read through Python's
  tensor methods that is ~2 us a tensor, ~2,500 times a GPT-2 step. Read from the TensorImpl,
  byte for byte what ``wire.encode_default`` packs (the node caches views by those bytes).

Built once per machine and torch build with the system's C++ compiler against torch's c10 and
Python's headers (a few seconds) into ``$GPUWIRE_CACHE_DIR`` (default ``~/.cache/gpuwire``).
Where it cannot be built (no compiler, no headers) the Python paths stay and only speed
differs; ``GPUWIRE_NATIVE=0`` keeps them. ``status()`` says which is in use.

Why by hand: PyTorch gives Python backends only the pybind11 guard, and no library builds a
small extension with less (torch's ``cpp_extension.load`` needs ninja and compiles against all
of torch's headers: about a minute here, not seconds).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native.cpp")
MODULE = "gpuwire_native"
_installed = False
_failure: str | None = None
module = None  # the loaded extension, once installed


def status() -> str:
    """'native', or why the Python guard is in use."""
    if _installed:
        return "native"
    return f"python ({_failure})" if _failure else "python (not attached yet)"


def cache_dir() -> Path:
    configured = os.environ.get("GPUWIRE_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpuwire"


def library_path() -> Path:
    """Where the built guard lives: one per source, torch build and Python build."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), torch.__file__.encode(),
                 str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(), sys.version.encode(), sys.executable.encode()):
        digest.update(part)
    return cache_dir() / f"{MODULE}-{digest.hexdigest()[:16]}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def build(target: Path) -> None:
    """Compile ``SOURCE`` into ``target`` (written whole, then renamed: concurrent builders are fine)."""
    from torch.utils.cpp_extension import include_paths
    torch_lib = Path(torch.__file__).parent / "lib"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".partial")
    os.close(fd)
    command = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *(f"-I{path}" for path in (*include_paths(), sysconfig.get_paths()["include"])), str(SOURCE),
               f"-L{torch_lib}", "-lc10", f"-Wl,-rpath,{torch_lib}", "-o", partial]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {(done.stderr or done.stdout).strip()[-400:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def install() -> bool:
    """Build (if needed) and load the extension, install its guard and its encoders; False,
    with the reason kept for ``status()``, where the Python ones stay. Idempotent."""
    global _installed, _failure, module
    if _installed:
        return True
    if os.environ.get("GPUWIRE_NATIVE", "1") in ("0", ""):
        _failure = "GPUWIRE_NATIVE=0"
        return False
    try:
        path = library_path()
        if not path.exists():
            build(path)
        loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
        spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
        loaded = importlib.util.module_from_spec(spec)
        loader.exec_module(loaded)
        answered = loaded.install_guard()
        if answered != int(torch._C._autograd.DeviceType.PrivateUse1):
            raise RuntimeError(f"the built guard answers device type {answered}")
        from . import wire
        wire.use_native(loaded)
    except (OSError, ImportError, RuntimeError, subprocess.SubprocessError, ValueError, TypeError) as exc:
        _failure = f"{type(exc).__name__}: {exc}"
        return False
    module = loaded
    _installed = True
    _failure = None
    return True
