"""Loaded by every Python interpreter started under ``gpuwire run`` (this folder is put first
on PYTHONPATH for the child only, so ``python -m``, subprocesses and DataLoader workers inherit
it). It imports nothing heavy: it arranges for gpuwire to load right after the program imports
torch (torch's own backend autoload usually does that already; this covers interpreters where
autoload is off). Then it runs any other ``sitecustomize`` the environment had.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys


class _LoadGpuwireAfterTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        original_exec = spec.loader.exec_module

        def exec_module(module):
            original_exec(module)
            try:
                import gpuwire  # noqa: F401 - registers the device; GPUWIRE_CUDA_COMPAT turns on compatibility
            except Exception as exc:  # noqa: BLE001 - never break the user's program at start-up
                print(f"gpuwire: could not load into this interpreter: {exc}", file=sys.stderr)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("GPUWIRE_RUN") == "1" and "torch" not in sys.modules:
    sys.meta_path.insert(0, _LoadGpuwireAfterTorch())


def _chain_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain_next_sitecustomize()
