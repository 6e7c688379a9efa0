"""Entry point of torch's ``torch.backends`` group: ``import torch`` registers the gpuwire
device in every process of an environment where gpuwire is installed (no connection is made
until the device is used). Opt out with GPUWIRE_AUTOLOAD=0 or TORCH_DEVICE_BACKEND_AUTOLOAD=0.
"""

import os


def autoload() -> None:
    if os.environ.get("GPUWIRE_AUTOLOAD", "1") == "0":
        return
    import gpuwire  # noqa: F401 - importing registers the device
