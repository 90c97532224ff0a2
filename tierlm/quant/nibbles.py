"""The INT4 packed layout (quant/int4.py's docstring): packing, unpacking, and the reference
dequantization the kernels must match. Torch alone: the kernels and the weight object import it.
"""

from __future__ import annotations

import torch

CHUNK = 32  # columns per packed chunk (16 bytes); group sizes and `in` are multiples of it
ZERO_POINT = 8  # the nibble that means 0 in the symmetric modes


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """u [N, K] (values 0..15, any integer dtype) -> uint8 [N, K / 2] in the chunk order above."""
    n, k = u.shape
    chunks = u.to(torch.uint8).view(n, k // CHUNK, 2, CHUNK // 2)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> uint8 [N, K] of values 0..15 (inverse of `pack_nibbles`)."""
    n, half = packed.shape
    chunks = packed.view(n, half // (CHUNK // 2), CHUNK // 2)
    return torch.stack([chunks & 15, chunks >> 4], dim=2).reshape(n, 2 * half)


def dequantize4(packed, scales, group_size: int, offsets=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [N, K] from packed [N, K / 2], fp16 scales (and offsets) [N, G] (the reference).

    Formed as u * s + o in fp32 with o = -8 s when symmetric, as the native kernels form it.
    """
    u = unpack_nibbles(packed)
    n, k = u.shape
    out = torch.empty(n, k, dtype=torch.float32, device=packed.device) if out is None else out
    out.copy_(u)
    s = _per_column(scales.float(), group_size, k)
    o = _per_column(offsets.float(), group_size, k) if offsets is not None else s * -ZERO_POINT
    return out.mul_(s).add_(o)


def _per_column(values: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """[N, G] per-group values -> [N, K] per column (the last group may be short)."""
    return values.repeat_interleave(group, dim=1)[:, :k]
