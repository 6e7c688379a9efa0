"""Human sizes: ``"4GiB"`` -> 4294967296 and back.

Used by the CLI, the client and the API (which also accepts sizes as strings). Binary units
(KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers of 1000, and a
bare number is bytes. The single letters K, M, G, T are read as binary units, as most GPU
tools (and ``nvidia-smi``) print them.
"""

from __future__ import annotations

import re

UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10 ** 3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10 ** 6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10 ** 9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10 ** 12,
    "p": 1 << 50, "pib": 1 << 50, "pb": 10 ** 15,
}
MAX_BYTES = 1 << 50  # 1 PiB: larger sizes are a typo, not a GPU
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` ("4GiB", "512 MiB", "1.5G", "1000000"); raises ValueError with a hint."""
    if isinstance(text, bool):
        raise ValueError(f"invalid size {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _PATTERN.match(str(text))
        if not match or match.group(2).lower() not in UNITS:
            raise ValueError(f"invalid size {text!r}: use bytes or a number with a unit, e.g. 512MiB, 4GiB, 8GB")
        number, unit = match.groups()
        value = int(float(number) * UNITS[unit.lower()]) if "." in number else int(number) * UNITS[unit.lower()]
    if value < 0:
        raise ValueError(f"invalid size {text!r}: must not be negative")
    if value > MAX_BYTES:
        raise ValueError(f"invalid size {text!r}: larger than 1 PiB")
    return value


def format_size(n: int | float | None) -> str:
    """``4294967296`` -> ``"4GiB"``; ``1610612736`` -> ``"1.5GiB"``."""
    if n is None:
        return "-"
    n = int(n)
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n}B"
