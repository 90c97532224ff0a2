"""GGUF Q4_K carried at its own size: 4-bit codes, and per 256 columns the block's fp16 d and
dmin with eight 6-bit sub-scales and sub-mins (4.625 bits a weight; the GGUF's 4.5 pack the
sub-scales into 12 bytes, here one byte each so the kernels read them without bit-twiddling).

Group j (32 columns) of a super-block is W = u * (d * sc[j]) - dmin * m[j], u the nibble: the
`gguf` package's Q4_K values bit for bit, since d * sc, dmin * m and u times the former are exact
in fp32. Layout, what the native kernels (csrc/gemv.h kInt4K) read as stored:

    packed       uint8 [out, in / 2]: the nibbles in int4.py's packing (quant/nibbles.py)
    superblocks  uint8 [out, in / 256 * 20]: per super-block fp16 d, fp16 dmin, sc[8], m[8]

`Q4KWeight` stands where `Int8Weight`/`Int4Weight` do (`linear`, `rows`); on an accelerator it
becomes the same values as an `Int8Weight` (codes with fp32 scales and offsets, exact).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tierlm.quant.gguf_layouts import Q4K_SUPER_BYTES, SUPER_COLUMNS, dequantize4k, q4k_group_values
from tierlm.quant.nibbles import pack_nibbles, unpack_nibbles
from tierlm.quant.packed import PackedNibbles

GROUP = 32


class Q4KWeight(PackedNibbles):
    """uint8 `packed` [out, in / 2] and `superblocks` [out, in / 256 * 20] (module docstring)."""

    group_size = GROUP

    def __init__(self, packed: torch.Tensor, superblocks: torch.Tensor, *, dtype: torch.dtype = torch.float32,
                 kernels=None):  # fmt: skip
        if packed.dtype != torch.uint8 or packed.dim() != 2 or (2 * packed.shape[1]) % SUPER_COLUMNS:
            raise ValueError(f"packed must be 2-D uint8 of rows of whole 256-column blocks, got "
                             f"{packed.dtype} {tuple(packed.shape)}")  # fmt: skip
        want = (packed.shape[0], 2 * packed.shape[1] // SUPER_COLUMNS * Q4K_SUPER_BYTES)
        if superblocks.dtype != torch.uint8 or tuple(superblocks.shape) != want:
            raise ValueError(f"superblocks must be uint8 {want}, got {superblocks.dtype} {tuple(superblocks.shape)}")
        self.packed = packed.contiguous()
        self.superblocks = superblocks.contiguous()
        self.dtype = dtype
        self.kernels = kernels


    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.superblocks.nbytes

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Embedding lookup: ids (any shape) -> dequantized rows [*ids.shape, in] in `dtype`."""
        flat = ids.reshape(-1)
        rows = dequantize4k(self.packed.index_select(0, flat), self.superblocks.index_select(0, flat))
        return rows.to(dtype or self.dtype).view(*ids.shape, rows.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float weight as fp32 [out, in] (the reference every kernel must match)."""
        return dequantize4k(self.packed, self.superblocks)

    def to(self, device, dtype: torch.dtype | None = None):
        """On the CPU a Q4KWeight; elsewhere the same values as an exact Int8Weight (the device
        kernels read int8 codes with fp32 scales and offsets)."""
        if torch.device(device).type == "cpu":
            return Q4KWeight(self.packed.to(device), self.superblocks.to(device), dtype=dtype or self.dtype)
        return self.as_int8(dtype).to(device)

    def as_int8(self, dtype: torch.dtype | None = None):
        """The same values as an Int8Weight: codes with fp32 scales and offsets per 32 columns."""
        from tierlm.quant.int8 import Int8Weight

        scales, offsets = q4k_group_values(self.superblocks)
        return Int8Weight(unpack_nibbles(self.packed).to(torch.int8), scales, GROUP, offsets=offsets,
                          dtype=dtype or self.dtype)  # fmt: skip

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "superblocks": self.superblocks}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float32) -> Q4KWeight:
        """Rebuild from `tensors()` output (e.g. views of a memory-mapped artifact), no copy."""
        return cls(tensors["packed"], tensors["superblocks"], dtype=dtype)

    def __repr__(self) -> str:
        return f"Q4KWeight({list(self.shape)}, device={self.device})"


def from_gguf_blocks(raw: torch.Tensor) -> Q4KWeight:
    """GGUF Q4_K blocks, uint8 [out, in / 256 * 144], as a Q4KWeight holding the same values."""
    from gguf.quants import Q4_K

    rows = raw.shape[0]
    blocks = raw.reshape(-1, 144)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].contiguous().numpy())
    superblocks = torch.cat([blocks[:, 0:4], torch.from_numpy(sc), torch.from_numpy(m)], dim=1)
    # Q4_K keeps 64 columns in 32 bytes (low nibbles the first 32); int4.py's packing is per 32.
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
    codes = torch.cat([qs & 15, qs >> 4], dim=2).reshape(rows, -1)
    return Q4KWeight(pack_nibbles(codes), superblocks.reshape(rows, -1).contiguous())


def quantize_q4k(weight: torch.Tensor) -> Q4KWeight:
    """A float weight [out, in] (in a multiple of 256) in Q4_K's layout: per 32 columns the span
    from min(0, low) to the high end in 15 steps, the 8 steps and offsets of a super-block as
    6-bit multiples of its fp16 d and dmin, the nibbles rounded to nearest on the grid that gives.
    What a LoRA variant of a Q4_K base stores for the weights its adapters change (llama.cpp's
    quantizer searches the scales further; the touched weights are few)."""
    u, superblocks = super_block_quantize(weight, levels=15)
    return Q4KWeight(pack_nibbles(u), superblocks)


def super_block_quantize(weight: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes u [out, in] in 0..levels, superblocks uint8 [out, in / 256 * 20]): per 32-column group
    W ~ u * (d * sc) - dmin * m, sc and m 6-bit, d and dmin fp16 per 256 columns (Q4_K, Q5_K)."""
    rows, cols = weight.shape
    if cols % SUPER_COLUMNS:
        raise ValueError(f"super-block layouts need a multiple of {SUPER_COLUMNS} input columns, got {cols}")
    groups = weight.float().reshape(rows, cols // SUPER_COLUMNS, 8, GROUP)
    low = groups.amin(-1).clamp(max=0.0)
    step = (groups.amax(-1) - low) / levels
    d = (step.amax(-1, keepdim=True) / 63).half()
    dmin = ((-low).amax(-1, keepdim=True) / 63).half()
    sc = torch.where(d.float() > 0, step / d.float().clamp(min=1e-30), torch.zeros_like(step)).round().clamp(0, 63)
    m = torch.where(dmin.float() > 0, -low / dmin.float().clamp(min=1e-30), torch.zeros_like(low)).round().clamp(0, 63)
    scale, offset = d.float() * sc, dmin.float() * m
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    u = ((groups + offset[..., None]) / safe[..., None]).round().clamp(0, levels).to(torch.uint8)
    header = torch.cat([d.view(torch.uint8).view(rows, -1, 2), dmin.view(torch.uint8).view(rows, -1, 2)], dim=-1)
    blocks = torch.cat([header, sc.to(torch.uint8), m.to(torch.uint8)], dim=-1)
    return u.reshape(rows, cols), blocks.reshape(rows, -1).contiguous()
