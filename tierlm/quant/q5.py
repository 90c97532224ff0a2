"""GGUF's 5-bit types carried at their own size: Q5_0 (5.5 bits a weight), Q5_1 (6) and Q5_K
(5.625 here, 5.5 in the file: its 6-bit sub-scales kept one byte each, as quant/q4k.py keeps them).

A 5-bit code u (0..31) per weight, groups of 32 columns:

    Q5_0   W = (u - 16) * d            fp16 d per group (the offset -16 d is implied)
    Q5_1   W = u * d + m               fp16 d and m per group
    Q5_K   W = u * (d * sc) - dmin * m  quant/q4k.py's super-blocks per 256 columns

each bit for bit the `gguf` package's values (every product is exact in fp32). Layout, what the
native kernels (csrc/gemv.h kInt5, kInt5K) read as stored:

    codes        uint8 [out, in / 32 * 20]: per 32 columns 16 bytes of nibbles in int4.py's
                 order (byte j: column j low, 16 + j high), then the 32 high bits (a
                 little-endian uint32, bit i column i): GGUF Q5_0/Q5_1's own block order
    scales, offsets   fp16 [out, in / 32] (Q5_0: no offsets)   or
    superblocks  uint8 [out, in / 256 * 20] (Q5_K)

`FiveBitWeight` stands where `Int8Weight` does; on an accelerator it becomes an exact `Int8Weight`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tierlm.quant.gguf_layouts import (
    FIVE_BIT_CHUNK,
    Q4K_SUPER_BYTES,
    SUPER_COLUMNS,
    codes5,
    dequantize5,
    five_bit_group_values,
)
from tierlm.quant.packed import PartsWeight

GROUP = 32
CHUNK_BYTES = FIVE_BIT_CHUNK


class FiveBitWeight(PartsWeight):
    """uint8 `codes` [out, in / 32 * 20] with fp16 `scales` (+ `offsets`) [out, in / 32], or
    `superblocks` [out, in / 256 * 20] (module docstring)."""

    group_size = GROUP

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                 superblocks: torch.Tensor | None = None, *, dtype: torch.dtype = torch.float32, kernels=None):  # fmt: skip
        if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] % CHUNK_BYTES:
            raise ValueError(f"codes must be 2-D uint8 of whole 20-byte chunks, got {codes.dtype} {tuple(codes.shape)}")
        rows, groups = codes.shape[0], codes.shape[1] // CHUNK_BYTES
        if (scales is None) == (superblocks is None) or (superblocks is not None and offsets is not None):
            raise ValueError("a 5-bit weight has scales (and offsets), or super-blocks")
        for what, part in (("scales", scales), ("offsets", offsets)):
            if part is not None and (part.dtype != torch.float16 or tuple(part.shape) != (rows, groups)):
                raise ValueError(f"{what} must be float16 {(rows, groups)}, got {part.dtype} {tuple(part.shape)}")
        if superblocks is not None:
            want = (rows, groups * GROUP // SUPER_COLUMNS * Q4K_SUPER_BYTES)
            if groups * GROUP % SUPER_COLUMNS or superblocks.dtype != torch.uint8 or tuple(superblocks.shape) != want:
                raise ValueError(f"superblocks must be uint8 {want} over whole 256-column blocks, got "
                                 f"{superblocks.dtype} {tuple(superblocks.shape)}")  # fmt: skip
        self.codes = codes.contiguous()
        self.scales = None if scales is None else scales.contiguous()
        self.offsets = None if offsets is None else offsets.contiguous()
        self.superblocks = None if superblocks is None else superblocks.contiguous()
        self.dtype = dtype
        self.kernels = kernels

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.codes.shape[1] // CHUNK_BYTES * GROUP))

    def dequantize(self) -> torch.Tensor:
        """The float weight as fp32 [out, in] (the reference every kernel must match)."""
        return dequantize5(self.codes, self.scales, self.offsets, self.superblocks)

    def group_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per group of 32 columns: (scales, offsets) as fp32 [out, in / 32], W = u * s + o."""
        return five_bit_group_values(self.scales, self.offsets, self.superblocks)

    def to(self, device, dtype: torch.dtype | None = None):
        """On the CPU a FiveBitWeight; elsewhere the same values as an exact Int8Weight."""
        if torch.device(device).type == "cpu":
            return FiveBitWeight(**{n: p.to(device) for n, p in self.tensors().items()}, dtype=dtype or self.dtype)
        return self.as_int8(dtype).to(device)

    def as_int8(self, dtype: torch.dtype | None = None):
        """The same values as an Int8Weight: codes with fp32 scales and offsets per 32 columns."""
        from tierlm.quant.int8 import Int8Weight

        scales, offsets = self.group_values()
        return Int8Weight(codes5(self.codes).to(torch.int8), scales, GROUP, offsets=offsets, dtype=dtype or self.dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        parts = {"codes": self.codes}
        for name in ("scales", "offsets", "superblocks"):
            if getattr(self, name) is not None:
                parts[name] = getattr(self, name)
        return parts

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float32):
        """Rebuild from `tensors()` output (e.g. views of a memory-mapped artifact), no copy."""
        return cls(**tensors, dtype=dtype)

    def __repr__(self) -> str:
        kind = "Q5_K" if self.superblocks is not None else "Q5_1" if self.offsets is not None else "Q5_0"
        return f"FiveBitWeight({list(self.shape)}, {kind}, device={self.device})"


def from_gguf_blocks(raw: torch.Tensor, kind: str) -> FiveBitWeight:
    """GGUF Q5_0 / Q5_1 / Q5_K blocks, uint8 [out, row bytes], as a FiveBitWeight (same values)."""
    rows = raw.shape[0]
    if kind == "Q5_K":  # d, dmin, 12 packed scale bytes, qh[32], qs[128]
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 176)
        n = blocks.shape[0]
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16].contiguous().numpy())
        superblocks = torch.cat([blocks[:, 0:4], torch.from_numpy(sc), torch.from_numpy(m)], dim=1)
        # gguf's order: qs 4 x 32 bytes, low nibbles the first 32 of each 64 columns; qh bit b of
        # byte i is column 32 b + i.
        qs = blocks[:, 48:].reshape(n, 4, 1, 32)
        low = torch.cat([qs & 15, qs >> 4], dim=2).reshape(n, 256)
        high = ((blocks[:, 16:48].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1)
        u = (low | (high.reshape(n, 256) << 4)).reshape(rows, -1)
        return FiveBitWeight(_chunks(u), superblocks=superblocks.reshape(rows, -1).contiguous())
    size = 22 if kind == "Q5_0" else 24
    blocks = raw.reshape(-1, size)
    offsets = None
    if kind == "Q5_1":
        offsets = blocks[:, 2:4].contiguous().view(torch.float16).reshape(rows, -1)
    # The block's own order: qh (uint32, bit i column i) then qs (int4.py's nibble order).
    high, qs = blocks[:, size - 20 : size - 16], blocks[:, size - 16 :]
    codes = torch.cat([qs, high], dim=1).reshape(rows, -1)
    return FiveBitWeight(codes, blocks[:, 0:2].contiguous().view(torch.float16).reshape(rows, -1), offsets)


def _chunks(u: torch.Tensor) -> torch.Tensor:
    """5-bit codes u [out, in] in the 20-byte chunk layout."""
    rows = u.shape[0]
    groups = u.view(rows, -1, 2, 16)
    nibbles = (groups[:, :, 0] & 15) | ((groups[:, :, 1] & 15) << 4)
    # Byte b of the high word holds columns 8b..8b+7 (a little-endian uint32, bit i column i).
    bits = (u.view(rows, -1, 4, 8) >> 4) << torch.arange(8, dtype=torch.uint8)
    high = bits.sum(-1, dtype=torch.uint8)
    return torch.cat([nibbles, high], dim=-1).reshape(rows, -1).contiguous()


def quantize_q5(weight: torch.Tensor, kind: str) -> FiveBitWeight:
    """A float weight [out, in] in `kind`'s layout (Q5_0, Q5_1: gguf's own quantizer, llama.cpp's
    rounding; Q5_K: 31 steps per 32 columns under 6-bit sub-scales, as quant/q4k.py does for 15):
    what a LoRA variant of such a base stores for the weights its adapters change."""
    if kind == "Q5_K":
        from tierlm.quant.q4k import super_block_quantize

        u, superblocks = super_block_quantize(weight, levels=31)
        return FiveBitWeight(_chunks(u), superblocks=superblocks)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    raw = quantize(weight.float().numpy(), getattr(GGMLQuantizationType, kind))
    return from_gguf_blocks(torch.from_numpy(raw), kind)
