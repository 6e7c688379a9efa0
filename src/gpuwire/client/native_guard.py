"""The gpuwire device's guard in C++, built on first use; the Python guard where it cannot be.

Sits under ``client/device.py``'s registration. PyTorch asks a device's guard for the device
type, the current device and stream many times an op: the autograd engine about six times for
each backward node. ``torch._C._acc``'s guard (``torch_module.Guard``) answers each through a
pybind11 override, that is the GIL and a Python call each time (~2,800 calls in a 12-layer
GPT-2's backward). This one answers in C++ with the same values (``native_guard.cpp``).

It is compiled once per machine and torch build with the system's C++ compiler against
torch's c10 headers (~3 s) into ``$GPUWIRE_CACHE_DIR`` (default ``~/.cache/gpuwire``), and
installed when a program first attaches to a node, so a plain ``import torch`` never waits for
it. Where it cannot be built (no compiler, no headers) the Python guard stays and only speed
differs; ``GPUWIRE_NATIVE_GUARD=0`` keeps the Python guard. ``status()`` says which is in use.

Why by hand: a device guard must be a C++ ``DeviceGuardImplInterface``; PyTorch gives Python
backends only the pybind11 one, and no library builds a 40-line extension with less (torch's
``cpp_extension.load`` pulls in ninja and the whole torch headers: a minute, not seconds).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native_guard.cpp")
_installed = False
_failure: str | None = None


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
                 str(torch._C._GLIBCXX_USE_CXX11_ABI).encode()):
        digest.update(part)
    return cache_dir() / f"native_guard-{digest.hexdigest()[:16]}.so"


def build(target: Path) -> None:
    """Compile ``SOURCE`` into ``target`` (written whole, then renamed: concurrent builders are fine)."""
    from torch.utils.cpp_extension import include_paths
    torch_lib = Path(torch.__file__).parent / "lib"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".partial")
    os.close(fd)
    command = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *(f"-I{path}" for path in include_paths()), str(SOURCE),
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
    """Install the C++ guard (building it first if needed); False, with the reason kept for
    ``status()``, where the Python guard stays. Idempotent."""
    global _installed, _failure
    if _installed:
        return True
    if os.environ.get("GPUWIRE_NATIVE_GUARD", "1") in ("0", ""):
        _failure = "GPUWIRE_NATIVE_GUARD=0"
        return False
    try:
        path = library_path()
        if not path.exists():
            build(path)
        library = ctypes.CDLL(str(path))
        answered = library.gpuwire_install_guard()
        if answered != int(torch._C._autograd.DeviceType.PrivateUse1):
            raise RuntimeError(f"the built guard answers device type {answered}")
    except (OSError, RuntimeError, subprocess.SubprocessError, ValueError) as exc:
        _failure = f"{type(exc).__name__}: {exc}"
        return False
    _installed = True
    _failure = None
    return True
