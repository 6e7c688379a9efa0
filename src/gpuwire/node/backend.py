"""The node's execution device: CUDA when present, else the CPU ("software GPU").

Sits between ``gpuwire serve`` and the sessions: it picks the torch device, describes it to
clients (the Welcome's ``device`` field) and owns the device-wide default random generator.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch


class BackendUnavailable(RuntimeError):
    pass


@dataclass
class Backend:
    kind: str  # "cuda" or "cpu"
    device: torch.device

    @classmethod
    def select(cls, requested: str = "auto", index: int = 0) -> "Backend":
        if requested not in ("auto", "cpu", "cuda"):
            raise BackendUnavailable(f"unknown backend {requested!r}; choose auto, cpu or cuda")
        if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
            if not torch.cuda.is_available():
                raise BackendUnavailable("--backend cuda was asked for, but torch sees no CUDA device on this machine; "
                                         "use --backend cpu for a software GPU")
            if index >= torch.cuda.device_count():
                raise BackendUnavailable(f"CUDA device {index} does not exist (this machine has {torch.cuda.device_count()})")
            return cls("cuda", torch.device("cuda", index))
        return cls("cpu", torch.device("cpu"))

    @property
    def software(self) -> bool:
        return self.kind == "cpu"

    def describe(self) -> dict:
        """What clients see as the GPU's identity (torch.cuda.get_device_properties & co)."""
        if self.kind == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            return {
                "name": props.name, "backend": "cuda", "software": False, "index": self.device.index,
                "total_memory": int(props.total_memory), "major": props.major, "minor": props.minor,
                "multi_processor_count": props.multi_processor_count, "torch": torch.__version__,
            }
        total = _physical_memory()
        cpu_name = platform.processor() or platform.machine() or "CPU"
        return {
            "name": f"gpuwire software GPU (CPU backend: {cpu_name} x{os.cpu_count()} cores)",  # no commas: scripts split CSV on them
            "backend": "cpu", "software": True, "index": 0, "total_memory": total,
            "major": 0, "minor": 0, "multi_processor_count": os.cpu_count() or 1, "torch": torch.__version__,
        }

    def default_generator(self) -> torch.Generator:
        if self.kind == "cuda":
            torch.cuda.init()  # default_generators stays an empty tuple until CUDA is initialised
            return torch.cuda.default_generators[self.device.index or 0]
        return torch.default_generator

    def memory_in_use(self) -> int:
        if self.kind == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return 0

    def free_memory(self) -> int | None:
        """Bytes the device can still give (every process's use counted): the GPU's free memory,
        or for the CPU backend the host's available memory; None where it cannot be read."""
        if self.kind == "cuda":
            return int(torch.cuda.mem_get_info(self.device)[0])
        return _available_host_memory()

    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)


def _available_host_memory() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
