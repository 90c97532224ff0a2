"""Byte sizes as people write them ("7.5GiB", "800MB", 4096) and as tierlm shows them.

The bottom floor: profiles and quant modes (mixed:5.2GiB) both read sizes, and neither may
import the other.
"""

from __future__ import annotations

import re
from typing import Any

from tierlm.errors import TierlmError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from an int or a string such as "7.5GiB", "800MB", "4096"."""
    if isinstance(value, bool):
        raise TierlmError(f"profile key {key!r}: expected a size like '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise TierlmError(f"profile key {key!r}: size must not be negative")
        return value
    match = _SIZE.match(str(value))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise TierlmError(
            f"profile key {key!r}: cannot read {value!r} as a size",
            "write it like '7.5GiB', '800MB' or a number of bytes",
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
