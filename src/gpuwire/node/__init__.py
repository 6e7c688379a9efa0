"""The GPU node: serves sessions over TCP and runs their ATen ops on CUDA or the CPU."""

from .backend import Backend
from .server import NodeServer

__all__ = ["Backend", "NodeServer"]
