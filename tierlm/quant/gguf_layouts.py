"""The GGUF layouts tierlm keeps as they are (quant/q4k.py, q5.py, q6k.py): their parts unpacked,
and the reference dequantization every kernel must match. Torch alone, like quant/nibbles.py:
the weight objects and the torch kernels both import it.

Every value is formed as gguf forms it (u * s + o per group, each product exact in fp32), so
these are the `gguf` package's values bit for bit.
"""

from __future__ import annotations

import torch

from tierlm.quant.nibbles import unpack_nibbles

SUPER_COLUMNS = 256
Q4K_SUPER_BYTES = 20  # fp16 d, fp16 dmin, sc[8], m[8] (one byte each)
Q6K_SUPER_BYTES = 18  # fp16 d, sc[16] (int8)
FIVE_BIT_CHUNK = 20  # per 32 columns: 16 bytes of nibbles, then 4 bytes of high bits


def q4k_group_values(superblocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of 32 columns: (scales d * sc, offsets -(dmin * m)), fp32 [out, in / 32]."""
    rows = superblocks.shape[0]
    blocks = superblocks.view(rows, -1, Q4K_SUPER_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    scales = d * blocks[..., 4:12].float()
    offsets = -(dmin * blocks[..., 12:20].float())
    return scales.reshape(rows, -1), offsets.reshape(rows, -1)


def q6k_group_scales(superblocks: torch.Tensor) -> torch.Tensor:
    """Per group of 16 columns: d * sc, fp32 [out, in / 16]."""
    rows = superblocks.shape[0]
    blocks = superblocks.view(rows, -1, Q6K_SUPER_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    return (d * blocks[..., 2:].contiguous().view(torch.int8).float()).reshape(rows, -1)


def five_bit_group_values(scales, offsets, superblocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of 32 columns of a 5-bit weight: (scales, offsets) fp32, W = u * s + o."""
    if superblocks is not None:
        return q4k_group_values(superblocks)
    s = scales.float()
    return s, (offsets.float() if offsets is not None else s * -16.0)


def codes6(packed: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Q6_K's 6-bit codes q (0..63), uint8 [out, in], from the low nibbles and the high parts."""
    low = unpack_nibbles(packed)
    rows = high.shape[0]
    chunks = high.view(rows, -1, 1, 8) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    return low | ((chunks & 3).reshape(rows, -1) << 4)


def codes5(codes: torch.Tensor) -> torch.Tensor:
    """The 5-bit codes u (0..31), uint8 [out, in], from the 20-byte chunks."""
    rows = codes.shape[0]
    chunks = codes.view(rows, -1, FIVE_BIT_CHUNK)
    nibbles = chunks[..., :16]
    low = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # columns 0..15, then 16..31
    high = chunks[..., 16:20].contiguous().view(torch.int32)  # [rows, groups, 1]
    bits = (high >> torch.arange(32, dtype=torch.int32)) & 1
    return (low | (bits.to(torch.uint8) << 4)).reshape(rows, -1)


def dequantize4k(packed: torch.Tensor, superblocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Q4_K: fp32 [out, in], u * s + o per group of 32."""
    scales, offsets = q4k_group_values(superblocks)
    return _grouped(unpack_nibbles(packed), scales, offsets, 32, out)


def dequantize6k(packed: torch.Tensor, high: torch.Tensor, superblocks: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Q6_K: fp32 [out, in], (q - 32) * s per group of 16."""
    q = codes6(packed, high)
    out = torch.empty(q.shape, dtype=torch.float32, device=packed.device) if out is None else out
    out.copy_(q).sub_(32)
    n, k = q.shape
    out.view(n, k // 16, 16).mul_(q6k_group_scales(superblocks)[..., None])
    return out


def dequantize5(codes, scales=None, offsets=None, superblocks=None, out=None) -> torch.Tensor:
    """Q5_0 / Q5_1 / Q5_K: fp32 [out, in], u * s + o per group of 32."""
    s, o = five_bit_group_values(scales, offsets, superblocks)
    return _grouped(codes5(codes), s, o, 32, out)


def _grouped(u, scales, offsets, group: int, out) -> torch.Tensor:
    n, k = u.shape
    out = torch.empty(n, k, dtype=torch.float32, device=u.device) if out is None else out
    out.copy_(u)
    out.view(n, k // group, group).mul_(scales[..., None]).add_(offsets[..., None])
    return out


# GGUF IQ4_NL / IQ4_XS's non-linear codebook: a nibble u stands for IQ4_VALUES[u].
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
IQ4X_SUPER_BYTES = 10  # IQ4_XS per 256 columns: fp16 d, then 8 int8 sub-scales (ls - 32)


def iq4_group_scales(scales, superblocks) -> torch.Tensor:
    """Per group of 32 columns of an IQ4 weight: fp32 scales (IQ4_NL's d, IQ4_XS's d * sub)."""
    if superblocks is None:
        return scales.float()
    rows = superblocks.shape[0]
    blocks = superblocks.view(rows, -1, IQ4X_SUPER_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    return (d * blocks[..., 2:].contiguous().view(torch.int8).float()).reshape(rows, -1)


def dequantize_iq4(packed, scales=None, superblocks=None, out=None) -> torch.Tensor:
    """IQ4_NL / IQ4_XS: fp32 [out, in], IQ4_VALUES[u] * s per group of 32."""
    values = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=packed.device)[unpack_nibbles(packed).long()]
    n, k = values.shape
    out = torch.empty(n, k, dtype=torch.float32, device=packed.device) if out is None else out
    out.copy_(values)
    out.view(n, k // 32, 32).mul_(iq4_group_scales(scales, superblocks)[..., None])
    return out


# GGUF Q2_K / Q3_K (quant/low_bit_k.py): per 256 columns 16 groups of 16. Super-block bytes:
# Q2_K fp16 d, fp16 dmin, 16 bytes sc | m << 4; Q3_K fp16 d, then GGUF's 12 bytes of 6-bit scales.
Q2K_SUPER_BYTES, Q3K_SUPER_BYTES = 20, 14
_CRUMB_SHIFTS = (0, 2, 4, 6)


def low_bit_k_group_values(superblocks: torch.Tensor, three_bit: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per group of 16 columns: (scales, offsets) fp32 [out, in / 16] as gguf forms them, Q2_K
    (d * sc, -(dmin * m)) or Q3_K (d * (sc - 32), no offsets: the codes' -4 is applied to u)."""
    rows = superblocks.shape[0]
    if not three_bit:
        blocks = superblocks.view(rows, -1, Q2K_SUPER_BYTES)
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()
        dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
        packed = blocks[..., 4:].to(torch.int32)
        return (d * (packed & 15).float()).reshape(rows, -1), (-(dmin * (packed >> 4).float())).reshape(rows, -1)
    blocks = superblocks.view(rows, -1, Q3K_SUPER_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    packed = blocks[..., 2:].to(torch.int32)
    j = torch.arange(16, device=superblocks.device)
    low = (packed[..., j % 8] >> (4 * (j // 8))) & 15
    high = (packed[..., 8 + j % 4] >> (2 * (j // 4))) & 3
    return (d * ((low | (high << 4)) - 32).float()).reshape(rows, -1), None


def codes_low_bit(crumbs: torch.Tensor, highbits: torch.Tensor | None) -> torch.Tensor:
    """Q2_K / Q3_K codes u (0..3 / 0..7), uint8 [out, in], from the crumbs and the high bits."""
    rows = crumbs.shape[0]
    shifts = torch.tensor(_CRUMB_SHIFTS, dtype=torch.uint8, device=crumbs.device).view(1, 1, 4, 1)
    u = ((crumbs.view(rows, -1, 1, 8) >> shifts) & 3).reshape(rows, -1)
    if highbits is None:
        return u
    words = highbits.view(rows, -1, 4).to(torch.int64)
    word = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)
    bits = (word[..., None] >> torch.arange(32, device=crumbs.device)) & 1
    return u | (bits.reshape(rows, -1).to(torch.uint8) << 2)


def dequantize_low_bit_k(crumbs, highbits, superblocks, out=None) -> torch.Tensor:
    """Q2_K / Q3_K: fp32 [out, in], u * s + o (Q2_K) or (u - 4) * s (Q3_K) per group of 16."""
    scales, offsets = low_bit_k_group_values(superblocks, highbits is not None)
    u = codes_low_bit(crumbs, highbits)
    n, k = u.shape
    out = torch.empty(n, k, dtype=torch.float32, device=crumbs.device) if out is None else out
    out.copy_(u)
    if offsets is None:
        out.sub_(4)
    grouped = out.view(n, k // 16, 16).mul_(scales[..., None])
    if offsets is not None:
        grouped.add_(offsets[..., None])
    return out
