"""GGUF Q6_K carried at its own size: 6-bit codes and, per 256 columns, the block's fp16 d with
sixteen int8 sub-scales (6.5625 bits a weight, exactly the GGUF's).

Group j (16 columns) of a super-block is W = (q - 32) * (d * sc[j]): the `gguf` package's Q6_K
values bit for bit (every product exact in fp32). Layout, what the native kernels (csrc/gemv.h
kInt6K) read as stored:

    packed       uint8 [out, in / 2]: the codes' low nibbles in int4.py's packing
    high         uint8 [out, in / 4]: their 2-bit high parts, per 32 columns 8 bytes, byte i
                 holding columns i, 8 + i, 16 + i, 24 + i in its bit pairs from the lowest
    superblocks  uint8 [out, in / 256 * 18]: per super-block fp16 d, then sc[16] (int8)

`Q6KWeight` stands where `Int8Weight` does (`linear`, `rows`); on an accelerator it becomes the
same values as an exact `Int8Weight` (codes with fp32 scales per 16 columns).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tierlm.quant.gguf_layouts import Q6K_SUPER_BYTES, SUPER_COLUMNS, codes6, dequantize6k, q6k_group_scales
from tierlm.quant.nibbles import pack_nibbles
from tierlm.quant.packed import PackedNibbles

GROUP = 16
BLOCK_BYTES = 210  # a GGUF Q6_K block: ql[128], qh[64], sc[16], d


class Q6KWeight(PackedNibbles):
    """uint8 `packed` [out, in / 2], `high` [out, in / 4], `superblocks` [out, in / 256 * 18]."""

    group_size = GROUP

    def __init__(self, packed: torch.Tensor, high: torch.Tensor, superblocks: torch.Tensor, *,
                 dtype: torch.dtype = torch.float32, kernels=None):  # fmt: skip
        if packed.dtype != torch.uint8 or packed.dim() != 2 or (2 * packed.shape[1]) % SUPER_COLUMNS:
            raise ValueError(f"packed must be 2-D uint8 of rows of whole 256-column blocks, got "
                             f"{packed.dtype} {tuple(packed.shape)}")  # fmt: skip
        rows, cols = packed.shape[0], 2 * packed.shape[1]
        for what, part, width in (("high", high, cols // 4), ("superblocks", superblocks,
                                                              cols // SUPER_COLUMNS * Q6K_SUPER_BYTES)):
            if part.dtype != torch.uint8 or tuple(part.shape) != (rows, width):
                raise ValueError(f"{what} must be uint8 {(rows, width)}, got {part.dtype} {tuple(part.shape)}")
        self.packed = packed.contiguous()
        self.high = high.contiguous()
        self.superblocks = superblocks.contiguous()
        self.dtype = dtype
        self.kernels = kernels


    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.high.nbytes + self.superblocks.nbytes

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Embedding lookup: ids (any shape) -> dequantized rows [*ids.shape, in] in `dtype`."""
        flat = ids.reshape(-1)
        rows = dequantize6k(*(part.index_select(0, flat) for part in (self.packed, self.high, self.superblocks)))
        return rows.to(dtype or self.dtype).view(*ids.shape, rows.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float weight as fp32 [out, in] (the reference every kernel must match)."""
        return dequantize6k(self.packed, self.high, self.superblocks)

    def to(self, device, dtype: torch.dtype | None = None):
        """On the CPU a Q6KWeight; elsewhere the same values as an exact Int8Weight."""
        if torch.device(device).type == "cpu":
            return Q6KWeight(self.packed.to(device), self.high.to(device), self.superblocks.to(device),
                             dtype=dtype or self.dtype)  # fmt: skip
        return self.as_int8(dtype).to(device)

    def as_int8(self, dtype: torch.dtype | None = None):
        """The same values as an Int8Weight: codes q - 32 with fp32 scales per 16 columns."""
        from tierlm.quant.int8 import Int8Weight

        codes = (codes6(self.packed, self.high).to(torch.int16) - 32).to(torch.int8)
        return Int8Weight(codes, q6k_group_scales(self.superblocks), GROUP, dtype=dtype or self.dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "high": self.high, "superblocks": self.superblocks}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float32) -> Q6KWeight:
        """Rebuild from `tensors()` output (e.g. views of a memory-mapped artifact), no copy."""
        return cls(tensors["packed"], tensors["high"], tensors["superblocks"], dtype=dtype)

    def __repr__(self) -> str:
        return f"Q6KWeight({list(self.shape)}, device={self.device})"


def from_gguf_blocks(raw: torch.Tensor) -> Q6KWeight:
    """GGUF Q6_K blocks, uint8 [out, in / 256 * 210], as a Q6KWeight holding the same values."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, BLOCK_BYTES)
    n = blocks.shape[0]
    # gguf's order: ql's 128 bytes are two halves of 64, low nibbles first; qh's 64 bytes two
    # halves of 32, four 2-bit parts each (quants.py Q6_K.dequantize_blocks).
    low = (blocks[:, :128].reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 15
    high = (blocks[:, 128:192].reshape(n, 2, 1, 32)
            >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3  # fmt: skip
    codes = low.reshape(n, 256) | (high.reshape(n, 256) << 4)
    codes = codes.reshape(rows, -1)
    crumbs = (codes >> 4).view(rows, -1, 4, 8)  # per chunk: columns i, 8 + i, 16 + i, 24 + i
    packed_high = crumbs[:, :, 0] | (crumbs[:, :, 1] << 2) | (crumbs[:, :, 2] << 4) | (crumbs[:, :, 3] << 6)
    superblocks = torch.cat([blocks[:, 208:210], blocks[:, 192:208]], dim=1).reshape(rows, -1)
    return Q6KWeight(pack_nibbles(codes & 15), packed_high.reshape(rows, -1).contiguous(), superblocks.contiguous())


def quantize_q6k(weight: torch.Tensor) -> Q6KWeight:
    """A float weight [out, in] (in a multiple of 256) in Q6_K's layout: per 16 columns a scale
    max|w| / 31, the 16 scales of a super-block as int8 multiples of its fp16 d, the codes rounded
    to nearest in -32..31 (what a LoRA variant of a Q6_K base stores for the weights it changes)."""
    rows, cols = weight.shape
    if cols % SUPER_COLUMNS:
        raise ValueError(f"Q6_K needs a multiple of {SUPER_COLUMNS} input columns, got {cols}")
    groups = weight.float().reshape(rows, cols // SUPER_COLUMNS, 16, GROUP)
    step = groups.abs().amax(-1) / 31
    d = (step.amax(-1, keepdim=True) / 127).half()
    sc = torch.where(d.float() > 0, step / d.float().clamp(min=1e-30), torch.zeros_like(step)).round().clamp(-128, 127)
    scale = d.float() * sc
    safe = torch.where(scale != 0, scale, torch.ones_like(scale))
    q = ((groups / safe[..., None]).round().clamp(-32, 31) + 32).to(torch.uint8).reshape(rows, cols)
    crumbs = (q >> 4).view(rows, -1, 4, 8)  # per chunk: columns i, 8 + i, 16 + i, 24 + i
    high = crumbs[:, :, 0] | (crumbs[:, :, 1] << 2) | (crumbs[:, :, 2] << 4) | (crumbs[:, :, 3] << 6)
    blocks = torch.cat([d.view(torch.uint8).view(rows, -1, 2), sc.to(torch.int8).view(torch.uint8)], dim=-1)
    return Q6KWeight(pack_nibbles(q & 15), high.reshape(rows, -1).contiguous(), blocks.reshape(rows, -1).contiguous())
