"""Quant mode names, as the CLI and profiles spell them, parsed into a frozen QuantMode.

    int8          int8 weights, one fp32 scale per output channel (row)
    int8-g<N>     int8 weights, one fp32 scale per group of N input columns (e.g. int8-g128)
    fp16 / bf16 / fp32   no quantization: weights stored in that float dtype

No torch import here: parsing a profile or `--help` must stay instant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tierlm.errors import TierlmError

_FLOATS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_GROUPED = re.compile(r"int8-g(\d+)")
# Group sizes are multiples of 16 so every group starts on a full 16-lane vector.
_MIN_GROUP, _MAX_GROUP = 16, 8192


@dataclass(frozen=True)
class QuantMode:
    """How weights are stored: `weight_dtype` is "int8" or a float dtype name (torch's spelling).

    `group_size` is None for per-channel int8 and for float modes.
    """

    name: str
    weight_dtype: str
    group_size: int | None = None

    @property
    def quantized(self) -> bool:
        return self.weight_dtype == "int8"

    @property
    def key(self) -> str:
        """A stable string for content hashes (artifact keys)."""
        return self.name


def parse_quant_mode(name: str) -> QuantMode:
    """`int8`, `int8-g128` (any `int8-g<N>`, N a multiple of 16), `fp16`, `bf16` or `fp32`."""
    text = name.strip().lower()
    if text == "int8":
        return QuantMode("int8", "int8")
    if text in _FLOATS:
        return QuantMode(text, _FLOATS[text])
    grouped = _GROUPED.fullmatch(text)
    if grouped:
        size = int(grouped.group(1))
        if size % 16 == 0 and _MIN_GROUP <= size <= _MAX_GROUP:
            return QuantMode(f"int8-g{size}", "int8", size)
        raise TierlmError(
            f"quant mode {name!r} has an unusable group size {size}",
            f"use a multiple of 16 between {_MIN_GROUP} and {_MAX_GROUP}, e.g. int8-g128",
        )
    raise TierlmError(
        f"unknown quant mode {name!r}",
        "use int8 (per channel), int8-g128 (groups of 128 columns), fp16, bf16 or fp32",
    )
