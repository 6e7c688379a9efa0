"""Entry point of torch's ``torch.backends`` group (a module of its own beside the gpuwire package, so
that torch loading it imports nothing of gpuwire until the gate below says yes): ``import torch`` registers the gpuwire
device in every process of an environment where gpuwire is installed (no connection is made
until the device is used). Opt out with GPUWIRE_AUTOLOAD=0 or TORCH_DEVICE_BACKEND_AUTOLOAD=0.

Not on a machine with a local GPU, unless asked for: PyTorch's autograd serves one accelerator
per process (pytorch/pytorch#161129), and a registered PrivateUse1 device takes that place, so
``backward()`` through local CUDA tensors would fail in every PyTorch program there (seen on an
H200: ``opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED``). There gpuwire
registers when GPUWIRE_AUTOLOAD=1, GPUWIRE_NODE, GPUWIRE_CUDA_COMPAT (``gpuwire run``) or an
explicit ``import gpuwire`` asks for it.
"""

import glob
import os
import sys


def local_accelerator() -> str | None:
    """The local accelerator PyTorch would use, if any ("cuda", "rocm", "mps", "xpu"), found
    without initialising its runtime (device files, not driver calls: the check runs inside
    ``import torch``, before a program may fork)."""
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    if getattr(version, "cuda", None) and glob.glob("/dev/nvidia[0-9]*"):
        return "cuda"
    if getattr(version, "hip", None) and os.path.exists("/dev/kfd"):
        return "rocm"
    if getattr(version, "xpu", None) and glob.glob("/dev/dri/renderD*"):
        return "xpu"
    mps = getattr(getattr(getattr(torch, "backends", None), "mps", None), "is_available", None)
    if sys.platform == "darwin" and mps is not None and mps():
        return "mps"
    return None


def asked_for() -> bool:
    """This process asked for gpuwire by its environment (not merely by having it installed)."""
    return (os.environ.get("GPUWIRE_AUTOLOAD") == "1" or bool(os.environ.get("GPUWIRE_NODE"))
            or os.environ.get("GPUWIRE_CUDA_COMPAT", "0") not in ("", "0"))


def autoload() -> None:
    if os.environ.get("GPUWIRE_AUTOLOAD", "1") == "0":
        return
    if local_accelerator() and not asked_for():
        return
    import gpuwire  # noqa: F401 - importing registers the device
