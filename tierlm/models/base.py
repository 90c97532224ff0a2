"""Shared decoder layers as functions over weight tensors: RMSNorm, RoPE, attention, SwiGLU.

Functions take their weights as arguments because the model does not own its weights:
a weight store hands each block's tensors to the forward pass and takes them back.
A weight is either a torch.Tensor or an object with `.linear(x, bias)` / `.rows(ids)`
(the quantized formats), so the same code serves float and INT8 blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tierlm.config import RopeConfig
from tierlm.models.attention_blocks import query_block
from tierlm.quant.kernel_api import Weight


def linear(x: torch.Tensor, weight: torch.Tensor | Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T (+ bias) -> [..., out]."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    return weight.linear(x, bias)


def embed(weight: torch.Tensor | Weight, ids: torch.Tensor) -> torch.Tensor:
    """Rows of the embedding [V, H] for token ids [B, T] -> [B, T, H]."""
    if isinstance(weight, torch.Tensor):
        return F.embedding(ids, weight)
    return weight.rows(ids)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 as the reference implementations do."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    normed = F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
    return weight * normed


def rope_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Inverse frequencies [dim // 2] for `dim` rotated channels, in fp32, scaled as `rope.rope_type` says.

    Computed with the same fp32 operations as transformers so positions far into the
    context rotate identically.
    """
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryTable:
    """Precomputed cos/sin [max_len, rotary_dim] for RoPE.

    `rotary_dim` (default: all of `head_dim`) is how many leading channels of each head rotate;
    the rest pass through (GLM's partial rotary). Pairs are (i, i + rotary_dim/2) (rotate_half,
    Llama) or, with `interleaved`, (2i, 2i + 1) (GLM, ChatGLM), so cos/sin repeat each frequency
    as [f0..fn, f0..fn] or [f0, f0, f1, f1, ...] to match.
    """

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        max_len: int,
        device,
        dtype,
        *,
        rotary_dim: int | None = None,
        interleaved: bool = False,
    ):
        self.rotary_dim = rotary_dim or head_dim
        self.interleaved = interleaved
        inv_freq = rope_inv_freq(rope, self.rotary_dim)
        positions = torch.arange(max_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        if interleaved:
            angles = freqs.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)

    def slice(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions start..start+length-1, shaped [length, 1, rotary_dim]."""
        return (
            self.cos[start : start + length, None, :],
            self.sin[start : start + length, None, :],
        )

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for one position per sequence: positions [B] -> [B, 1, 1, rotary_dim] each."""
        return self.cos[positions][:, None, None, :], self.sin[positions][:, None, None, :]


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate x [B, T, heads, D] by cos/sin [T, 1, R] (R <= D; channels R.. pass unrotated).

    Pairs are (i, i + R/2), or (2i, 2i + 1) when `interleaved`, as `RotaryTable` laid out cos/sin.
    """
    dim = cos.shape[-1]
    rot = x if dim == x.shape[-1] else x[..., :dim]
    if interleaved:
        rotated = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    else:
        half = dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return out if rot is x else torch.cat((out, x[..., dim:]), dim=-1)


def attention_mask(
    query_len: int, key_len: int, groups: int, window: int | None, device
) -> torch.Tensor | None:
    """Boolean mask [groups * query_len, key_len] (True = attend) for the newest `query_len` keys.

    None when every query may see every key (a single decode step inside the window).
    Rows repeat per query group because grouped-query heads are folded into the row axis.
    """
    past = key_len - query_len
    if query_len == 1 and (window is None or key_len <= window):
        return None
    q_pos = torch.arange(past, key_len, device=device)[:, None]
    k_pos = torch.arange(key_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask.repeat(groups, 1) if groups > 1 else mask


def position_mask(positions: torch.Tensor, key_len: int, window: int | None) -> torch.Tensor:
    """Boolean mask [B, 1, 1, key_len] (True = attend) for one query per sequence at `positions` [B].

    Each sequence sees its own keys up to its position (and within the sliding window); the
    positions past it belong to no one yet, or to a longer sequence in the batch.
    """
    k_pos = torch.arange(key_len, device=positions.device)[None, :]
    q_pos = positions[:, None]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask[:, None, None, :]


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Grouped-query attention without repeating K/V.

    q [B, n_heads, T, D]; k, v [B, n_kv, S, D]; mask [groups*T, S], [B, 1, 1, S] (one query per
    sequence, see `position_mask`) or None -> [B, n_heads, T, D].
    Query heads sharing a KV head are folded into the query-row axis, so one SDPA call
    reads each KV head once; over a long context the queries go in blocks (attention_blocks.py).
    """
    batch, n_heads, length, dim = q.shape
    n_kv, groups = k.shape[1], n_heads // k.shape[1]
    block = query_block(batch, n_heads, length, k.shape[2])
    if block < length:  # a long context: the queries in blocks, so scores and mask stay bounded
        rows = mask.view(groups, length, -1) if mask is not None else None
        return torch.cat([
            grouped_attention(q[:, :, start : start + block], k, v,
                              rows[:, start : start + block].reshape(-1, rows.shape[-1]) if rows is not None else None)
            for start in range(0, length, block)], dim=2)  # fmt: skip
    folded = q.reshape(batch, n_kv, groups * length, dim)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask)
    return out.view(batch, n_heads, length, dim)


def swiglu(x: torch.Tensor, w13, w2, b13=None, b2=None) -> torch.Tensor:
    """SwiGLU MLP with gate and up projections fused: w13 [2I, H], w2 [H, I]."""
    gate, up = linear(x, w13, b13).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w2, b2)



def weight_device(weight) -> torch.device:
    """The device a weight (tensor or quantized format) lives on: a store may hand back an
    expert held on the host for host compute, and the rows then go to it."""
    return weight.device
