"""GGUF blocks as the tierlm weight that carries them at their own size (mixed:source's carry).

Every common GGUF type has one form that holds its values exactly in the file's bytes (within the
few bytes some layouts add per 256 columns): its own layout (Q4_K, Q5_x, Q6_K, IQ4_NL/IQ4_XS,
Q2_K/Q3_K: tierlm/quant/q4k.py, q5.py, q6k.py, iq4.py, low_bit_k.py), int8 codes under the
blocks' fp16 d (Q8_0 as q8_0), or int4.py's nibbles, which are GGUF's own packing (Q4_0 as
int4-g32, Q4_1 as int4-g32-asym with m as the offset). Dequantizing any of them gives the `gguf`
package's values bit for bit (tests/test_gguf_carry.py, on random and edge blocks).
tierlm.quant.modes.own_mode names each form.
"""

from __future__ import annotations

import numpy as np
import torch


def carry_weight(kind: str, raw: np.ndarray):
    """`raw` uint8 [rows, row bytes] of GGUF type `kind` (one of modes.CARRIED_SOURCE_TYPES) as the
    weight holding it at its own size."""
    from tierlm.quant import iq4, low_bit_k, q4k, q5, q6k

    blocks = torch.from_numpy(np.ascontiguousarray(raw))
    if kind in ("Q8_0", "Q4_0", "Q4_1"):
        return _grid_weight(kind, blocks)
    if kind in ("Q4_K", "Q6_K"):
        return (q4k if kind == "Q4_K" else q6k).from_gguf_blocks(blocks)
    own = iq4 if kind.startswith("IQ4") else low_bit_k if kind in ("Q2_K", "Q3_K") else q5
    return own.from_gguf_blocks(blocks, kind)


def fused_rows(weights):
    """Weights of one form (as `carry_weight` makes them) fused by rows: each part concatenated."""
    from tierlm.quant.int4 import Int4Weight
    from tierlm.quant.int8 import Int8Weight

    first = weights[0]
    parts = {name: torch.cat([w.tensors()[name] for w in weights]) for name in first.tensors()}
    if isinstance(first, (Int8Weight, Int4Weight)):
        return type(first).from_tensors(parts, first.group_size)
    return type(first).from_tensors(parts)


def _grid_weight(kind: str, blocks: torch.Tensor):
    """Q8_0 (fp16 d, 32 int8 codes) as an Int8Weight with fp16 scales per 32 columns; Q4_0 (d,
    16 nibble bytes) and Q4_1 (d, m, nibbles) as an Int4Weight: W = (u - 8) d, or u d + m."""
    from tierlm.quant.int4 import Int4Weight
    from tierlm.quant.int8 import Int8Weight

    rows = blocks.shape[0]
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    chunks = blocks.reshape(rows, -1, size)
    half = lambda field: field.contiguous().view(torch.float16).reshape(rows, -1)  # noqa: E731
    if kind == "Q8_0":
        return Int8Weight(chunks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1), half(chunks[..., 0:2]), 32)
    packed = chunks[..., size - 16 :].reshape(rows, -1)
    offsets = half(chunks[..., 2:4]) if kind == "Q4_1" else None
    return Int4Weight(packed, half(chunks[..., 0:2]), 32, offsets=offsets)
