"""Quant mode names, as the CLI and profiles spell them, parsed into a frozen QuantMode.

    int8          int8 weights, one fp32 scale per output channel (row)
    int8-g<N>     int8 weights, one fp32 scale per group of N input columns (e.g. int8-g128)
    int8-asym, int8-g<N>-asym   the same with a float offset per row/group (zero point): the
                  256 levels span [min, max] instead of [-max|w|, max|w|]. Costs 4 more bytes per
                  group; reproduces 4-bit affine sources (GGUF Q4_0/Q4_1, groups of 32) exactly.
    fp16 / bf16 / fp32   no quantization: weights stored in that float dtype

No torch import here: parsing a profile or `--help` must stay instant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tierlm.errors import TierlmError

_FLOATS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_INT8 = re.compile(r"int8(?:-g(\d+))?(-asym)?")
# Group sizes are multiples of 16 so every group starts on a full 16-lane vector.
_MIN_GROUP, _MAX_GROUP = 16, 8192


@dataclass(frozen=True)
class QuantMode:
    """How weights are stored: `weight_dtype` is "int8" or a float dtype name (torch's spelling).

    `group_size` is None for per-channel int8 and for float modes; `asymmetric` adds offsets.
    """

    name: str
    weight_dtype: str
    group_size: int | None = None
    asymmetric: bool = False

    @property
    def quantized(self) -> bool:
        return self.weight_dtype == "int8"

    @property
    def key(self) -> str:
        """A stable string for content hashes (artifact keys)."""
        return self.name


def parse_quant_mode(name: str) -> QuantMode:
    """`int8`, `int8-g128` (any `int8-g<N>`, N a multiple of 16), either with `-asym`, `fp16`,
    `bf16` or `fp32`."""
    text = name.strip().lower()
    if text in _FLOATS:
        return QuantMode(text, _FLOATS[text])
    int8 = _INT8.fullmatch(text)
    if int8:
        group, asymmetric = int8.group(1), bool(int8.group(2))
        if group is None:
            return QuantMode(text, "int8", None, asymmetric)
        size = int(group)
        if size % 16 == 0 and _MIN_GROUP <= size <= _MAX_GROUP:
            return QuantMode(text, "int8", size, asymmetric)
        raise TierlmError(
            f"quant mode {name!r} has an unusable group size {size}",
            f"use a multiple of 16 between {_MIN_GROUP} and {_MAX_GROUP}, e.g. int8-g128",
        )
    raise TierlmError(
        f"unknown quant mode {name!r}",
        "use int8 (per channel), int8-g128 (groups of 128 columns), int8-g32-asym (groups with "
        "offsets), fp16, bf16 or fp32",
    )
