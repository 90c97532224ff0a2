"""GGUF's 2- and 3-bit K-quants carried at their own size: Q2_K (2.625 bits a weight) and Q3_K
(3.4375), the file's bytes re-laid for the kernels, not one bit more.

Per 256 columns, sixteen groups of 16 columns j:

    Q2_K   W = u * (d * sc[j]) - dmin * m[j]   u 0..3, sc and m 4-bit
    Q3_K   W = (u - 4) * (d * (sc[j] - 32))    u 0..7 (two low bits and a high bit), sc 6-bit

each bit for bit the `gguf` package's values (every product is exact in fp32). Layout, what the
native kernels (csrc/gemv.h kInt2K, kInt3K) read as stored:

    crumbs       uint8 [out, in / 4]: u's two low bits, per 32 columns 8 bytes, byte i holding
                 columns i, 8 + i, 16 + i, 24 + i from its lowest bit pair (quant/q6k.py's `high`)
    highbits     uint8 [out, in / 8] (Q3_K): u's third bit, per 32 columns a little-endian
                 uint32, bit i column i (quant/q5.py's high word)
    superblocks  uint8 [out, in / 256 * 20] (Q2_K: fp16 d, fp16 dmin, 16 bytes sc | m << 4) or
                 [out, in / 256 * 14] (Q3_K: fp16 d, then GGUF's 12 bytes of packed 6-bit sc)

`LowBitKWeight` stands where `Int8Weight` does; on an accelerator it becomes an exact `Int8Weight`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tierlm.quant.gguf_layouts import (
    Q2K_SUPER_BYTES,
    Q3K_SUPER_BYTES,
    SUPER_COLUMNS,
    codes_low_bit,
    dequantize_low_bit_k,
    low_bit_k_group_values,
)
from tierlm.quant.packed import PartsWeight

GROUP = 16
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110}  # GGUF's blocks of 256 columns
# tl::WeightKind (csrc/weight.h) of each type.
NATIVE_KINDS = {"Q2_K": 11, "Q3_K": 12}


class LowBitKWeight(PartsWeight):
    """uint8 `crumbs` [out, in / 4], `superblocks` and, for Q3_K, `highbits` [out, in / 8]."""

    group_size = GROUP

    def __init__(self, crumbs: torch.Tensor, superblocks: torch.Tensor, highbits: torch.Tensor | None = None, *,
                 dtype: torch.dtype = torch.float32, kernels=None):  # fmt: skip
        if crumbs.dtype != torch.uint8 or crumbs.dim() != 2 or (4 * crumbs.shape[1]) % SUPER_COLUMNS:
            raise ValueError(f"crumbs must be 2-D uint8 of rows of whole 256-column blocks, got "
                             f"{crumbs.dtype} {tuple(crumbs.shape)}")  # fmt: skip
        rows, cols = crumbs.shape[0], 4 * crumbs.shape[1]
        width = cols // SUPER_COLUMNS * (Q3K_SUPER_BYTES if highbits is not None else Q2K_SUPER_BYTES)
        for what, part, want in (("superblocks", superblocks, width), ("highbits", highbits, cols // 8)):
            if part is not None and (part.dtype != torch.uint8 or tuple(part.shape) != (rows, want)):
                raise ValueError(f"{what} must be uint8 {(rows, want)}, got {part.dtype} {tuple(part.shape)}")
        self.crumbs = crumbs.contiguous()
        self.superblocks = superblocks.contiguous()
        self.highbits = None if highbits is None else highbits.contiguous()
        self.dtype = dtype
        self.kernels = kernels

    @property
    def kind(self) -> str:
        """The GGUF type these bytes are: "Q2_K" or "Q3_K"."""
        return "Q3_K" if self.highbits is not None else "Q2_K"

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.crumbs.shape[0], 4 * self.crumbs.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The float weight as fp32 [out, in] (the reference every kernel must match)."""
        return dequantize_low_bit_k(self.crumbs, self.highbits, self.superblocks)

    def row_slice(self, start: int, stop: int) -> LowBitKWeight:
        """Rows [start, stop) as a LowBitKWeight of views (no copy)."""
        return LowBitKWeight(**{n: p[start:stop] for n, p in self.tensors().items()}, dtype=self.dtype)

    def native_words(self) -> tuple[int, int, int, int, int, int] | None:
        """tl::Weight's (data, scales, offsets, group, kind, half) words for the native kernels,
        or None off the CPU (the parts are contiguous by construction)."""
        if not self.crumbs.is_cpu:
            return None
        high = self.highbits.data_ptr() if self.highbits is not None else 0
        return self.crumbs.data_ptr(), self.superblocks.data_ptr(), high, GROUP, NATIVE_KINDS[self.kind], 0

    def to(self, device, dtype: torch.dtype | None = None):
        """On the CPU a LowBitKWeight; elsewhere the same values as an exact Int8Weight."""
        if torch.device(device).type == "cpu":
            return LowBitKWeight(**{n: p.to(device) for n, p in self.tensors().items()}, dtype=dtype or self.dtype)
        return self.as_int8(dtype).to(device)

    def as_int8(self, dtype: torch.dtype | None = None):
        """The same values as an Int8Weight: codes (Q3_K: u - 4) with fp32 scales (and Q2_K's
        offsets) per 16 columns."""
        from tierlm.quant.int8 import Int8Weight

        scales, offsets = low_bit_k_group_values(self.superblocks, self.highbits is not None)
        codes = codes_low_bit(self.crumbs, self.highbits).to(torch.int8)
        if offsets is None:
            codes = codes - 4
        return Int8Weight(codes, scales, GROUP, offsets=offsets, dtype=dtype or self.dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        parts = {"crumbs": self.crumbs}
        if self.highbits is not None:
            parts["highbits"] = self.highbits
        parts["superblocks"] = self.superblocks  # last, as encodings.part_bytes lists them
        return parts

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float32):
        """Rebuild from `tensors()` output (e.g. views of a memory-mapped artifact), no copy."""
        return cls(**tensors, dtype=dtype)

    def __repr__(self) -> str:
        return f"LowBitKWeight({list(self.shape)}, {self.kind}, device={self.device})"


def from_gguf_blocks(raw: torch.Tensor, kind: str) -> LowBitKWeight:
    """GGUF Q2_K / Q3_K blocks, uint8 [out, row bytes], as a LowBitKWeight (the same values)."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, BLOCK_BYTES[kind])
    n = blocks.shape[0]
    # Both store qs[64] as two halves of 32 bytes, byte i's bit pair s holding column 32 s + i of
    # its half (quants.py's dequantize_blocks); Q3_K's hmask bit b of byte i is column 32 b + i.
    qs = blocks[:, 16:80] if kind == "Q2_K" else blocks[:, 32:96]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    u = ((qs.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(rows, -1)
    highbits = None
    if kind == "Q3_K":
        bits = (blocks[:, 0:32].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
        u = u | (bits.reshape(rows, -1) << 2)
        highbits = _high_words(u >> 2)
        superblocks = torch.cat([blocks[:, 108:110], blocks[:, 96:108]], dim=1)
    else:
        superblocks = torch.cat([blocks[:, 80:84], blocks[:, 0:16]], dim=1)
    return LowBitKWeight(_crumbs(u & 3), superblocks.reshape(rows, -1).contiguous(), highbits)


def _crumbs(low: torch.Tensor) -> torch.Tensor:
    """Two-bit values [out, in] in the crumbs layout (module docstring)."""
    rows = low.shape[0]
    crumbs = low.view(rows, -1, 4, 8)  # per chunk: columns i, 8 + i, 16 + i, 24 + i
    packed = crumbs[:, :, 0] | (crumbs[:, :, 1] << 2) | (crumbs[:, :, 2] << 4) | (crumbs[:, :, 3] << 6)
    return packed.reshape(rows, -1).contiguous()


def _high_words(bits: torch.Tensor) -> torch.Tensor:
    """One bit per column [out, in] as little-endian uint32 words per 32 columns (bit i column i)."""
    rows = bits.shape[0]
    weighted = bits.view(rows, -1, 4, 8) << torch.arange(8, dtype=torch.uint8)
    return weighted.sum(-1, dtype=torch.uint8).reshape(rows, -1).contiguous()


def quantize_low_bit_k(weight: torch.Tensor, kind: str) -> LowBitKWeight:
    """A float weight [out, in] (in a multiple of 256) in `kind`'s layout, rounded to nearest
    (what a LoRA variant of a Q2_K / Q3_K base stores for the weights its adapters change). Each
    sub-scale rounds up, so its group's range stays on the grid: Q3_K maps each group's largest
    magnitude to code -4 (signed 6-bit sub-scales), Q2_K spans [min(w, 0), max(w)] in 3 steps
    (4-bit sub-scales and mins)."""
    rows, cols = weight.shape
    if cols % SUPER_COLUMNS:
        raise ValueError(f"{kind} needs a multiple of {SUPER_COLUMNS} input columns, got {cols}")
    groups = weight.float().reshape(rows, cols // SUPER_COLUMNS, 16, GROUP)
    if kind == "Q3_K":
        extreme = groups.gather(-1, groups.abs().argmax(-1, keepdim=True))[..., 0]
        step = -extreme / 4
        d = (step.abs().amax(-1, keepdim=True) / 31).half()
        sc = _sub_scales(step, d, -32, 31)
        u = (_codes(groups, d.float() * sc, 0, -4, 3) + 4).to(torch.uint8).reshape(rows, cols)
        six_bit = sc.to(torch.int32) + 32
        packed = torch.zeros(rows, cols // SUPER_COLUMNS, 12, dtype=torch.int32)
        for j in range(16):  # GGUF's packing of sixteen 6-bit values into 12 bytes
            packed[..., j % 8] |= (six_bit[..., j] & 15) << (4 * (j // 8))
            packed[..., 8 + j % 4] |= (six_bit[..., j] >> 4) << (2 * (j // 4))
        superblocks = torch.cat([d.view(torch.uint8).view(rows, -1, 2), packed.to(torch.uint8)], dim=-1)
        return LowBitKWeight(_crumbs(u & 3), superblocks.reshape(rows, -1).contiguous(), _high_words(u >> 2))
    low = groups.amin(-1).clamp(max=0)
    step = (groups.amax(-1) - low) / 3
    d = (step.amax(-1, keepdim=True) / 15).half()
    dmin = ((-low).amax(-1, keepdim=True) / 15).half()
    sc, m = _sub_scales(step, d, 0, 15), _sub_scales(-low, dmin, 0, 15)
    offsets = -(dmin.float() * m)
    q = _codes(groups, d.float() * sc, offsets, 0, 3)
    scale_bytes = sc.to(torch.uint8) | (m.to(torch.uint8) << 4)
    superblocks = torch.cat([d.view(torch.uint8).view(rows, -1, 2), dmin.view(torch.uint8).view(rows, -1, 2),
                             scale_bytes], dim=-1)  # fmt: skip
    return LowBitKWeight(_crumbs(q.to(torch.uint8).reshape(rows, cols)), superblocks.reshape(rows, -1).contiguous())


def _sub_scales(values: torch.Tensor, d: torch.Tensor, lowest: int, highest: int) -> torch.Tensor:
    """values [rows, blocks, 16] as integer multiples of each block's fp16 d, rounded away from
    zero (the grid then covers the value), clamped."""
    scale = d.float()
    ratio = torch.where(scale > 0, values / scale.clamp(min=1e-30), torch.zeros_like(values))
    return (ratio.abs().ceil() * ratio.sign()).clamp(lowest, highest)


def _codes(groups, scale, offsets, lowest: int, highest: int) -> torch.Tensor:
    """Each value's code on its group's grid: round((w - o) / s), clamped (0 where s is 0)."""
    safe = torch.where(scale != 0, scale, torch.ones_like(scale))
    shifted = groups - (offsets[..., None] if isinstance(offsets, torch.Tensor) else offsets)
    codes = (shifted / safe[..., None]).round().clamp(lowest, highest)
    return torch.where(scale[..., None] != 0, codes, torch.zeros_like(codes))
