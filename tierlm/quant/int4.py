"""W4A16 weight-only INT4: packed nibbles with fp16 scales (and offsets) per group of columns.

A weight W [out, in] (in a multiple of 32) becomes unsigned nibbles u in [0, 15], two per byte,
and per group of `group_size` input columns (a multiple of 32; the last group of a row may be
shorter) an fp16 scale s and, in the asymmetric modes, an fp16 offset o:

    symmetric    W ~ (u - 8) * s                 (o = -8 s, implied: GGUF Q4_0's form)
    asymmetric   W ~ u * s + o                   (GGUF Q4_1's form, o = the group's low end)

Packing (the native kernels read it as is): each row is a run of 32-column chunks of 16 bytes;
byte j of chunk c holds column 32c + j in its low nibble and column 32c + 16 + j in its high
nibble (llama.cpp's Q4 order), so one 16-byte load widens to 32 consecutive columns.

The quantizer tries several grids per group and keeps the one that reconstructs it with the
least squared error, measured after the fp16 rounding of s and o: the even span (max - min) / 15
from the group's minimum (asymmetric), max|w| / 7 and the signed extreme / -8 (symmetric), and,
where the group already sits on a grid of at most 15 steps (a GGUF Q4_0 or Q4_1 block, d*j + m),
that grid itself, which it then reproduces exactly (`_grid_candidates`).

`Int4Weight` is what `models.base.linear` / `embed` receive in place of a float tensor, like
`Int8Weight`: `.linear(x, bias)` runs the kernel chosen for x's device, `.rows(ids)` dequantizes
only the embedding rows asked for.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tierlm.quant.grids import gcd_steps, sorted_rows
from tierlm.quant.kernel_api import group_count
from tierlm.quant.modes import int4_fits
from tierlm.quant.packed import PackedNibbles
# The packed layout and its reference dequantization, re-exported: part of this module's API.
from tierlm.quant.nibbles import CHUNK, ZERO_POINT, dequantize4, pack_nibbles, unpack_nibbles  # noqa: F401

_QUANTIZE_ROWS = 2048  # rows per step: bounds the candidates' fp32 temporaries
_FP16_MAX = 65504.0


class Int4Weight(PackedNibbles):
    """uint8 `packed` [out, in / 2] with fp16 `scales` [out, G] and, asymmetric, `offsets` [out, G].

    `dtype` is what `rows()` returns by default; `kernels` pins a `dispatch.KernelChoice` (None:
    the choice calibrated for x's device). Tensors are used as given (buffers mapped from an
    artifact are not copied).
    """

    def __init__(
        self,
        packed: torch.Tensor,
        scales: torch.Tensor,
        group_size: int,
        *,
        offsets: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        kernels=None,
    ):
        if packed.dtype != torch.uint8 or packed.dim() != 2:
            raise ValueError(f"packed must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
        out_features, in_features = packed.shape[0], 2 * packed.shape[1]
        check_int4_shape(in_features, group_size)
        want = (out_features, group_count(in_features, group_size))
        for what, part in (("scales", scales), ("offsets", offsets)):
            if part is not None and (tuple(part.shape) != want or part.dtype != torch.float16):
                raise ValueError(f"{what} must be float16 {want} for packed {tuple(packed.shape)}, group_size "
                                 f"{group_size}; got {part.dtype} {tuple(part.shape)}")  # fmt: skip
        self.packed = packed.contiguous()
        self.scales = scales.contiguous()
        self.offsets = None if offsets is None else offsets.contiguous()
        self.group_size = group_size
        self.dtype = dtype
        self.kernels = kernels

    # -- what the model and the store see ------------------------------------------------


    @property
    def nbytes(self) -> int:
        """Bytes held: packed nibbles plus fp16 scales (and offsets)."""
        extra = 0 if self.offsets is None else self.offsets.nbytes
        return self.packed.nbytes + self.scales.nbytes + extra

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Embedding lookup: ids (any shape) -> dequantized rows [*ids.shape, in] in `dtype`."""
        flat = ids.reshape(-1)
        offsets = None if self.offsets is None else self.offsets.index_select(0, flat)
        rows = dequantize4(self.packed.index_select(0, flat), self.scales.index_select(0, flat),
                           self.group_size, offsets)  # fmt: skip
        return rows.to(dtype or self.dtype).view(*ids.shape, rows.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float weight as fp32 [out, in] (the reference every kernel must match)."""
        return dequantize4(self.packed, self.scales, self.group_size, self.offsets)

    def to(self, device, dtype: torch.dtype | None = None) -> Int4Weight:
        """The same weight on `device` (rows() then in `dtype`); a pinned kernel choice is dropped."""
        offsets = None if self.offsets is None else self.offsets.to(device)
        return Int4Weight(self.packed.to(device), self.scales.to(device), self.group_size,
                          offsets=offsets, dtype=dtype or self.dtype)  # fmt: skip

    # -- serialization ----------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """{"packed": uint8 [out, in / 2], "scales": fp16 [out, G]} (+ "offsets") for a writer;
        the group size goes into the record's metadata."""
        parts = {"packed": self.packed, "scales": self.scales}
        if self.offsets is not None:
            parts["offsets"] = self.offsets
        return parts

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], group_size: int, *,
                     dtype: torch.dtype = torch.float32) -> Int4Weight:  # fmt: skip
        """Rebuild from `tensors()` output (e.g. views of a memory-mapped artifact), no copy."""
        return cls(tensors["packed"], tensors["scales"], group_size, offsets=tensors.get("offsets"), dtype=dtype)

    def __repr__(self) -> str:
        kind = f"group {self.group_size}" + (", asymmetric" if self.offsets is not None else "")
        return f"Int4Weight({list(self.shape)}, {kind}, device={self.device})"


def check_int4_shape(in_features: int, group_size: int) -> None:
    """ValueError unless rows of `in_features` columns can be packed in `group_size` groups."""
    if group_size < CHUNK or group_size % CHUNK:
        raise ValueError(f"int4 group_size must be a positive multiple of {CHUNK}, got {group_size}")
    if in_features < CHUNK or in_features % CHUNK:
        raise ValueError(f"int4 weights need a multiple of {CHUNK} input columns, got {in_features}")


# -- quantization -----------------------------------------------------------------------------


def quantize_int4(weight: torch.Tensor, group_size: int = 32, *, asymmetric: bool = False) -> Int4Weight:
    """INT4 of weight [out, in] per `group_size` columns: per group, the candidate grid with the
    least squared error (module docstring). Symmetric: u - 8 in [-8, 7] times s; asymmetric:
    u * s + o. A constant group reconstructs exactly. Non-finite weights, and weights whose
    scales overflow fp16, are refused (ValueError)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"expected a 2-D float weight [out, in], got {weight.dtype} {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    check_int4_shape(in_features, group_size)
    groups = group_count(in_features, group_size)
    pad = groups * group_size - in_features
    # The padding of a short last group must not count in the error the candidates compete on.
    real = None
    if pad:
        real = torch.ones(groups, group_size, device=weight.device)
        real[-1, group_size - pad:] = 0
    packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(out_features, groups, dtype=torch.float16, device=weight.device)
    offsets = torch.empty_like(scales) if asymmetric else None
    for start in range(0, out_features, _QUANTIZE_ROWS):
        stop = min(out_features, start + _QUANTIZE_ROWS)
        rows = weight[start:stop].float()
        if not torch.isfinite(rows).all():
            raise ValueError(f"weight rows {start}..{stop - 1} hold inf or NaN; cannot quantize")
        if pad:  # the short last group padded with its last value: its min, max and max|w| stay
            rows = torch.cat([rows, rows[:, -1:].expand(-1, pad)], dim=1)
        block = rows.unflatten(1, (groups, group_size))
        u, s, o = _best_grid(block, asymmetric, real)
        packed[start:stop] = pack_nibbles(u.flatten(1)[:, :in_features])
        scales[start:stop] = s
        if offsets is not None:
            offsets[start:stop] = o
    return Int4Weight(packed, scales, group_size, offsets=offsets)


def int4_on_source_grid(weight: torch.Tensor, *, asymmetric: bool) -> Int4Weight | None:
    """The int4-g32 (or -asym) weight that reproduces weight [out, in] exactly, or None where
    some group of 32 is on no such grid (a float weight, a GGUF Q5/Q8 one). Tries only the
    source-grid candidate, so it costs about a third of `quantize_int4`; the rows are tried a
    few at a time and the first miss ends it."""
    if weight.dim() != 2 or not int4_fits(tuple(weight.shape)):
        return None
    out_features, in_features = weight.shape
    groups = in_features // CHUNK
    packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
    scales = torch.empty(out_features, groups, dtype=torch.float16)
    offsets = torch.empty_like(scales) if asymmetric else None
    step = 64  # a first small batch of rows: a float weight is refused after it
    start = 0
    while start < out_features:
        stop = min(out_features, start + step)
        block = weight[start:stop].float().unflatten(1, (groups, CHUNK))
        low, high = block.amin(dim=-1), block.amax(dim=-1)
        grids = list(_grid_candidates(block, low, high, asymmetric))
        if not grids:
            return None
        s, o = grids[0]
        s16, o16 = _to_fp16(s), (_to_fp16(o) if asymmetric else None)
        u, error = _fit(block, s16, o16)
        if bool((error != 0).any()):
            return None
        packed[start:stop] = pack_nibbles(u.flatten(1))
        scales[start:stop] = s16
        if offsets is not None:
            offsets[start:stop] = o16
        start, step = stop, _QUANTIZE_ROWS
    return Int4Weight(packed, scales, CHUNK, offsets=offsets)


def _best_grid(block: torch.Tensor, asymmetric: bool, real: torch.Tensor | None = None):
    """Per group of block [R, G, g]: (u uint8 [R, G, g], s fp16 [R, G], o fp16 [R, G]) of the
    candidate with the least squared error over the `real` columns (mask [G, g]; None: all)."""
    best = None
    for s, o in _candidates(block, asymmetric):
        s, o = _to_fp16(s), (_to_fp16(o) if asymmetric else None)
        u, error = _fit(block, s, o, real)
        if best is None:
            best = [u, s, o, error]
            continue
        better = error < best[3]
        best[0] = torch.where(better[..., None], u, best[0])
        best[1] = torch.where(better, s, best[1])
        if asymmetric:
            best[2] = torch.where(better, o, best[2])
        best[3] = torch.minimum(error, best[3])
    u, s, o, _ = best
    return u, s, (o if asymmetric else None)


def _candidates(block: torch.Tensor, asymmetric: bool):
    """(s, o) fp32 [R, G] pairs to try; o is ignored (implied -8 s) when symmetric."""
    low, high = block.amin(dim=-1), block.amax(dim=-1)
    extreme = torch.where(high.abs() > low.abs(), high, low)
    sym8 = extreme / -ZERO_POINT  # Q4_0's choice: the extreme lands on -8, the sign follows
    sym7 = extreme.abs() / 7.0  # the extreme on +-7: both ends reachable
    for s in (sym8, sym7):
        yield s, s * -ZERO_POINT
    if asymmetric:
        yield (high - low) / 15.0, low
    yield from _grid_candidates(block, low, high, asymmetric)


def _grid_candidates(block, low, high, asymmetric):
    """Where a group sits on a grid of n <= 15 steps of d (GGUF's d*j + m): s = d with, symmetric,
    o = -8 d, or, asymmetric, o = the low end minus the fewest steps that make it an fp16 value
    (a Q4_1 block's m is one), within 16 levels, or else the high end plus steps with s = -d. Nothing where no group has 16 levels or fewer;
    a group off any grid gets s = 0, a candidate that loses to the plain ones."""
    flat = block.reshape(-1, block.shape[-1])
    gaps = sorted_rows(flat).diff(dim=-1)
    levels = (gaps > 0).sum(-1) + 1
    few = (levels <= 16).nonzero().squeeze(1)  # float groups have ~g distinct values: skipped
    if not few.numel():
        return
    span = (high - low).reshape(-1)
    steps = torch.zeros_like(span)
    # The smallest gap is the step where two neighbouring levels occur (nearly every source
    # group); the others take Euclid's algorithm on their gaps.
    smallest = torch.where(gaps[few] > 0, gaps[few], torch.full_like(gaps[few], torch.inf)).amin(-1)
    ratio = (flat[few] - low.reshape(-1)[few, None]) / smallest[:, None]
    whole = ((ratio - ratio.round()).abs() < 1e-3).all(-1) & smallest.isfinite()
    steps[few] = torch.where(whole, (span[few] / smallest).round(), torch.zeros_like(smallest))
    rest = few[~whole]
    if rest.numel():
        steps[rest] = gcd_steps(flat[rest], span[rest])
    steps = steps.view(low.shape)
    on_grid = (steps >= 1) & (steps <= 15)
    d = torch.where(on_grid, (high - low) / torch.where(on_grid, steps, torch.ones_like(steps)), torch.zeros_like(low))
    # A sparse group (two levels, 0 and 15) hides its step: the finest whole division of its
    # gaps whose step is an fp16 value (GGUF's d is one) is taken instead.
    for split in range(2, 16):
        finer = d / split
        take = on_grid & (steps * split <= 15) & (d.half().float() != d) & (finer.half().float() == finer)
        d, steps = torch.where(take, finer, d), torch.where(take, steps * split, steps)
    if not asymmetric:  # levels -8d..7d, or with s = -d 8d..-7d (a Q4_0 block's d < 0)
        d = torch.where(high > 7.5 * d, -d, d)
        yield d, d * -ZERO_POINT
        return
    # From the low end up (Q4_1's m), else from the high end down with a negative step (a Q4_0
    # block whose largest magnitude is positive: d < 0, levels 8|d| down to -7|d|, o = 8|d|).
    scale, offset, found = d.clone(), low.clone(), torch.zeros_like(on_grid)
    for end, sign in ((low, 1.0), (high, -1.0)):
        for k in range(16):
            candidate = end - sign * k * d
            take = on_grid & ~found & (steps + k <= 15) & (candidate.half().float() == candidate)
            offset = torch.where(take, candidate, offset)
            scale = torch.where(take, sign * d, scale)
            found |= take
    yield scale, offset


def _to_fp16(values: torch.Tensor) -> torch.Tensor:
    if values.abs().amax() > _FP16_MAX:
        raise ValueError("int4 scales or offsets overflow float16 (weights beyond +-65504 * 7)")
    return values.to(torch.float16)


def _fit(block, s16, o16, real=None):
    """Nibbles of block [R, G, g] on the grid s, o (fp16 [R, G]; o None: -8 s) and the squared
    error of their reconstruction as `dequantize4` forms it (over the `real` columns)."""
    s = s16.float()
    o = o16.float() if o16 is not None else s * -ZERO_POINT
    safe = torch.where(s == 0, torch.ones_like(s), s)
    u = (block - o[..., None]).div_(safe[..., None]).round_().clamp_(0, 15)
    u.masked_fill_((s == 0)[..., None], 0 if o16 is not None else ZERO_POINT)
    error = (u * s[..., None]).add_(o[..., None]).sub_(block).square_()
    return u.to(torch.uint8), (error if real is None else error.mul_(real)).sum(-1)
