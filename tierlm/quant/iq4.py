"""GGUF IQ4_NL and IQ4_XS carried at their own size: 4-bit indices into a 16-value non-linear
codebook (quant/gguf_layouts.py IQ4_VALUES), scaled per 32 columns (4.5 and 4.3125 bits a
weight; IQ4_XS's 6-bit sub-scales are kept one byte each: the file's 4.25).

    IQ4_NL   W = IQ4_VALUES[u] * d          fp16 d per group of 32
    IQ4_XS   W = IQ4_VALUES[u] * (d * sub)  per 256 columns fp16 d, per 32 an int8 sub (ls - 32)

each bit for bit the `gguf` package's values. Layout, what the native kernels (csrc/gemv.h kIQ4,
kIQ4X) read as stored: `packed` uint8 [out, in / 2] in int4.py's nibble order (IQ4's own order)
and `scales` fp16 [out, in / 32] (IQ4_NL) or `superblocks` uint8 [out, in / 256 * 10] (IQ4_XS).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tierlm.quant.gguf_layouts import IQ4_VALUES, IQ4X_SUPER_BYTES, SUPER_COLUMNS, dequantize_iq4, iq4_group_scales
from tierlm.quant.nibbles import pack_nibbles, unpack_nibbles
from tierlm.quant.packed import PackedNibbles

GROUP = 32


class IQ4Weight(PackedNibbles):
    """uint8 `packed` [out, in / 2] with fp16 `scales` [out, in / 32] or `superblocks`."""

    group_size = GROUP
    codebook = True  # what dispatch and the fused step tell it from the other packed weights by

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor | None = None,
                 superblocks: torch.Tensor | None = None, *, dtype: torch.dtype = torch.float32, kernels=None):  # fmt: skip
        if packed.dtype != torch.uint8 or packed.dim() != 2 or (2 * packed.shape[1]) % GROUP:
            raise ValueError(f"packed must be 2-D uint8 of whole 32-column groups, got {packed.dtype} "
                             f"{tuple(packed.shape)}")  # fmt: skip
        rows, cols = packed.shape[0], 2 * packed.shape[1]
        if (scales is None) == (superblocks is None):
            raise ValueError("an IQ4 weight has scales (IQ4_NL) or super-blocks (IQ4_XS)")
        if scales is not None and (scales.dtype != torch.float16 or tuple(scales.shape) != (rows, cols // GROUP)):
            raise ValueError(f"scales must be float16 {(rows, cols // GROUP)}, got {scales.dtype} {tuple(scales.shape)}")
        if superblocks is not None:
            want = (rows, cols // SUPER_COLUMNS * IQ4X_SUPER_BYTES)
            if cols % SUPER_COLUMNS or superblocks.dtype != torch.uint8 or tuple(superblocks.shape) != want:
                raise ValueError(f"superblocks must be uint8 {want} over whole 256-column blocks, got "
                                 f"{superblocks.dtype} {tuple(superblocks.shape)}")  # fmt: skip
        self.packed = packed.contiguous()
        self.scales = None if scales is None else scales.contiguous()
        self.superblocks = None if superblocks is None else superblocks.contiguous()
        self.dtype = dtype
        self.kernels = kernels

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.tensors().values())

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Embedding lookup: ids (any shape) -> dequantized rows [*ids.shape, in] in `dtype`."""
        flat = ids.reshape(-1)
        rows = IQ4Weight(**{n: p.index_select(0, flat) for n, p in self.tensors().items()}).dequantize()
        return rows.to(dtype or self.dtype).view(*ids.shape, rows.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float weight as fp32 [out, in] (the reference every kernel must match)."""
        return dequantize_iq4(self.packed, self.scales, self.superblocks)

    def to(self, device, dtype: torch.dtype | None = None):
        """On the CPU an IQ4Weight; elsewhere the same values as an exact Int8Weight."""
        if torch.device(device).type == "cpu":
            return IQ4Weight(**{n: p.to(device) for n, p in self.tensors().items()}, dtype=dtype or self.dtype)
        return self.as_int8(dtype).to(device)

    def as_int8(self, dtype: torch.dtype | None = None):
        """The same values as an Int8Weight: codebook values as int8 codes, fp32 scales per 32."""
        from tierlm.quant.int8 import Int8Weight

        codes = torch.tensor(IQ4_VALUES, dtype=torch.int8)[unpack_nibbles(self.packed).long()]
        return Int8Weight(codes, iq4_group_scales(self.scales, self.superblocks), GROUP, dtype=dtype or self.dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        parts = {"packed": self.packed}
        if self.scales is not None:
            parts["scales"] = self.scales
        if self.superblocks is not None:
            parts["superblocks"] = self.superblocks
        return parts

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float32) -> IQ4Weight:
        """Rebuild from `tensors()` output (e.g. views of a memory-mapped artifact), no copy."""
        return cls(**tensors, dtype=dtype)

    def __repr__(self) -> str:
        return f"IQ4Weight({list(self.shape)}, {'IQ4_XS' if self.superblocks is not None else 'IQ4_NL'})"


def from_gguf_blocks(raw: torch.Tensor, kind: str) -> IQ4Weight:
    """GGUF IQ4_NL / IQ4_XS blocks, uint8 [out, row bytes], as an IQ4Weight (the same values)."""
    rows = raw.shape[0]
    if kind == "IQ4_NL":  # d, then 16 bytes of nibbles in int4.py's order
        blocks = raw.reshape(-1, 18)
        return IQ4Weight(blocks[:, 2:].reshape(rows, -1).contiguous(),
                         blocks[:, :2].contiguous().view(torch.float16).reshape(rows, -1))  # fmt: skip
    blocks = raw.reshape(-1, 136)  # d, scales_h (uint16), scales_l[4], qs[128]
    n = blocks.shape[0]
    low = (blocks[:, 4:8].reshape(n, 4, 1) >> torch.tensor([0, 4], dtype=torch.uint8)) & 15
    high = (blocks[:, 2:4].contiguous().view(torch.int16).to(torch.int32).reshape(n, 1)
            >> (2 * torch.arange(8, dtype=torch.int32))) & 3  # fmt: skip
    sub = (low.reshape(n, 8).to(torch.int32) | (high << 4)) - 32
    superblocks = torch.cat([blocks[:, :2], sub.to(torch.int8).view(torch.uint8)], dim=1)
    return IQ4Weight(blocks[:, 8:].reshape(rows, -1).contiguous(), superblocks=superblocks.reshape(rows, -1).contiguous())


def quantize_iq4(weight: torch.Tensor, kind: str) -> IQ4Weight:
    """A float weight [out, in] in `kind`'s layout: per 32 columns the scale that puts the largest
    magnitude on the codebook's end (IQ4_XS: as 6-bit multiples of a fp16 d per 256), each value
    its nearest codebook entry. What a LoRA variant of such a base stores for the weights it changes."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // GROUP, GROUP)
    peak = groups.abs().amax(-1)
    step = torch.where(peak > 0, peak / 127.0, torch.ones_like(peak))
    if kind == "IQ4_NL":
        scale = step.half().float()
        scales = step.half()
    else:
        blocks = step.reshape(rows, cols // SUPER_COLUMNS, 8)
        d = (blocks.amax(-1, keepdim=True) / 31).half()
        sub = (blocks / d.float().clamp(min=1e-30)).round().clamp(-32, 31)
        scale = (d.float() * sub).reshape(rows, -1)
        header = d.view(torch.uint8).view(rows, -1, 2)
        superblocks = torch.cat([header, sub.to(torch.int8).view(torch.uint8)], dim=-1).reshape(rows, -1)
    safe = torch.where(scale != 0, scale, torch.ones_like(scale))
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32)
    nearest = ((groups / safe[..., None])[..., None] - table).abs().argmin(-1).to(torch.uint8)
    packed = pack_nibbles(nearest.reshape(rows, cols))
    if kind == "IQ4_NL":
        return IQ4Weight(packed, scales)
    return IQ4Weight(packed, superblocks=superblocks.contiguous())
