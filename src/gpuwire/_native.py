"""Builds and loads gpuwire's small C++ helpers (``client/native.cpp``, ``node/native.cpp``).

Sits under ``client/native.py`` and ``node/native.py``, which say what each helper does and
when it is used. What crosses this boundary: a C++ source file in, a loaded extension module
(or an exception saying why not) out.

Each helper is built once per machine, source, torch build and Python build with the system's
C++ compiler against torch's c10, dispatcher and Python headers (a few seconds) into
``$GPUWIRE_CACHE_DIR`` (default ``~/.cache/gpuwire``). ``GPUWIRE_NATIVE=0`` turns them all off.

Why by hand: no library builds a small extension with less (torch's ``cpp_extension.load``
needs ninja and compiles against all of torch's headers: about a minute here, not seconds).
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
import threading
from pathlib import Path

import torch

# what a failed build or load raises: the caller keeps the Python path and says why
FAILURES = (OSError, ImportError, RuntimeError, subprocess.SubprocessError, ValueError, TypeError)
COMMON = Path(__file__).with_name("_native_common.h")  # included by every helper's source


def enabled() -> bool:
    return os.environ.get("GPUWIRE_NATIVE", "1") not in ("0", "")


def cache_dir() -> Path:
    configured = os.environ.get("GPUWIRE_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpuwire"


def library_path(source: Path, module: str) -> Path:
    """Where ``source`` built as ``module`` lives: one per source, torch build and Python build."""
    digest = hashlib.sha256()
    for part in (source.read_bytes(), COMMON.read_bytes(), torch.__version__.encode(), torch.__file__.encode(),
                 str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(), sys.version.encode(),
                 # (resolved: ``python`` and ``python3.11`` of one install share a build)
                 os.path.realpath(sys.executable).encode()):
        digest.update(part)
    return cache_dir() / f"{module}-{digest.hexdigest()[:16]}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def build(source: Path, target: Path) -> None:
    """Compile ``source`` into ``target`` (written whole, then renamed: concurrent builders are fine)."""
    from torch.utils.cpp_extension import include_paths
    torch_lib = Path(torch.__file__).parent / "lib"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".partial")
    os.close(fd)
    command = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *(f"-I{path}" for path in (*include_paths(), sysconfig.get_paths()["include"])), str(source),
               f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{torch_lib}", "-o", partial]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {(done.stderr or done.stdout).strip()[-400:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def load(source: Path, module: str):
    """The extension module built from ``source`` (built first if this machine has none yet)."""
    path = library_path(source, module)
    if not path.exists():
        _say_building(module)
        build(source, path)
    loader = importlib.machinery.ExtensionFileLoader(module, str(path))
    spec = importlib.util.spec_from_file_location(module, str(path), loader=loader)
    loaded = importlib.util.module_from_spec(spec)
    loader.exec_module(loaded)
    return loaded


def status(loaded, failure: str | None, not_yet: str = "not installed") -> str:
    """'native' once a helper serves, else 'python (why)': what each helper's ``status()`` says."""
    if loaded is not None:
        return "native"
    return f"python ({failure or not_yet})"


def _say_building(module: str) -> None:
    if sys.stderr.isatty():  # (a pause of seconds at a first attach looks like a hang; logs stay clean)
        sys.stderr.write(f"gpuwire: building its C++ helper {module} for this machine and torch (once, ~15 s; "
                         f"GPUWIRE_NATIVE=0 skips it) ...\n")


def build_in_background(source: Path, module: str):
    """Start building ``source`` as ``module`` in a thread if this machine has no build yet (the
    compiler is a subprocess, so two builds use two cores: a first attach builds the client's
    two helpers side by side, a first node start the node's two). Returns the thread (join it
    before loading; ``load`` would build again, harmlessly, if it had failed) or None."""
    if not enabled():
        return None
    try:
        target = library_path(source, module)
    except FAILURES:
        return None
    if target.exists():
        return None

    def build_quietly() -> None:
        _say_building(module)
        try:
            build(source, target)
        except FAILURES:
            pass  # (``load`` builds again and reports why)
    thread = threading.Thread(target=build_quietly, name=f"gpuwire-build-{module}", daemon=True)
    thread.start()
    return thread


def install(source: Path, module: str, setup) -> tuple[object | None, str | None]:
    """(the helper module, None) once built, loaded and ``setup(module)`` ran without error;
    else (None, why), and its caller keeps the Python paths."""
    if not enabled():
        return None, "GPUWIRE_NATIVE=0"
    try:
        loaded = load(source, module)
        setup(loaded)
    except FAILURES as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return loaded, None
