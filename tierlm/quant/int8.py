"""W8A16 weight-only INT8: symmetric round-to-nearest quantization and the weight object.

A weight W [out, in] becomes int8 values q [out, in] and fp32 scales s, one per output row
(per channel) or one per group of `group_size` input columns:

    s = max|W| / 127 over the row (or group);  q = round(W / s);  W ~ q * s, |W - q*s| <= s/2

Asymmetric modes add a float offset o per row or group (a zero point): the 256 levels span
[min, max] of the group, q in [-128, 127],

    s = (max - min) / 255;  o = min + 128 s;  q = round((W - o) / s);  W ~ q * s + o

or, where it reconstructs the group better, its symmetric quantization with o = 0; and where a
group already sits on a coarser grid of step d (a GGUF Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 block of
32 values d*j (+ m)), a grid through all its levels, s = d / k, k a power of two with
k * (max - min) / d <= 255, which reproduces it exactly (`_onto_source_grids`). Then
x @ W.T = x @ (q*s).T + (x summed per group) @ o.T: the kernels add the second term (the
native one inside its loop, a G-long dot per output).

Groups run along the input dim. When `in` is not a multiple of `group_size`, the last group of
each row is simply shorter (scales are [out, ceil(in / group_size)]): every layer of every model
can be grouped, e.g. SmolLM2's in=576 with groups of 128 gives 4 full groups and one of 64.

`Int8Weight` is what `models.base.linear` / `models.base.embed` receive in place of a float
tensor: `.linear(x, bias)` runs the kernel chosen for x's device (see `dispatch`), `.rows(ids)`
dequantizes only the embedding rows asked for.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tierlm.quant.dispatch import kernel_choice
from tierlm.quant.grids import gcd_steps, sorted_rows
from tierlm.quant.kernel_api import group_count
from tierlm.quant.modes import Q8_0_GROUP
from tierlm.quant.torch_kernels import dequantize_into

# Rows quantized per step: bounds the fp32 temporaries for big matrices (a 150k-row embedding).
_QUANTIZE_ROWS = 4096
_FP16_MAX = 65504.0


class Int8Weight:
    """int8 `qweight` [out, in] with `scales` [out] (per channel) or [out, G] (per group),
    and for asymmetric modes `offsets` of the scales' shape.

    `dtype` is what `rows()` returns by default (fp32 on CPUs, bf16/fp16 on accelerators).
    `kernels` pins a `dispatch.KernelChoice`; None uses the choice calibrated for x's device.
    The tensors are used as given when contiguous, so buffers mapped from an artifact are not
    copied; only fp16 scales with offsets get an fp32 copy ([out, G]) for the kernels.
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        group_size: int | None = None,
        *,
        offsets: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        kernels=None,
    ):
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(
                f"qweight must be a 2-D int8 tensor, got {qweight.dtype} {tuple(qweight.shape)}"
            )
        out_features, in_features = qweight.shape
        group, groups = _groups(in_features, group_size)
        want = (out_features,) if group_size is None else (out_features, groups)
        if tuple(scales.shape) != want or not scales.is_floating_point():
            raise ValueError(
                f"scales must be float {want} for qweight {tuple(qweight.shape)}, group_size "
                f"{group_size}; got {scales.dtype} {tuple(scales.shape)}"
            )
        if offsets is not None and (offsets.shape != scales.shape or not offsets.is_floating_point()):
            raise ValueError(
                f"offsets must be float {tuple(scales.shape)} like the scales, got "
                f"{offsets.dtype} {tuple(offsets.shape)}"
            )
        self.qweight = qweight.contiguous()
        self.scales = scales
        self.offsets = offsets
        self.group_size = group_size
        self.dtype = dtype
        self.kernels = kernels
        # The kernels' view of the scales: [out, G] (G = 1 per channel), fp32, or fp16 as stored
        # when symmetric (GGUF Q8_0's form: every kernel widens them as it reads).
        self.group = group
        kept = scales.dtype == torch.float16 and offsets is None
        self.scales_2d = (scales if kept else scales.float()).reshape(out_features, -1).contiguous()
        self.offsets_2d = (
            None if offsets is None else offsets.float().reshape(out_features, -1).contiguous()
        )

    # -- what the model and the store see ------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        """Bytes held: int8 values plus scales (and offsets) as stored."""
        extra = 0 if self.offsets is None else self.offsets.nbytes
        return self.qweight.nbytes + self.scales.nbytes + extra

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ W.T (+ bias [out]) -> [..., out] in x's dtype, with W = dequantize()."""
        kernels = self.kernels or kernel_choice(x.device)
        return kernels.linear(x, self, bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Embedding lookup: ids [B, T] (any shape) -> dequantized rows [B, T, in] in `dtype`."""
        flat = ids.reshape(-1)
        q = self.qweight.index_select(0, flat)
        s = self.scales_2d.index_select(0, flat)
        out = torch.empty(q.shape, dtype=dtype or self.dtype, device=q.device)
        o = self.offsets_2d.index_select(0, flat) if self.offsets_2d is not None else None
        dequantize_into(q, s, self.group, out, o)
        return out.view(*ids.shape, q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float weight q * s (+ o) as fp32 [out, in] (the reference every kernel must match)."""
        out = torch.empty(self.qweight.shape, dtype=torch.float32, device=self.device)
        return dequantize_into(self.qweight, self.scales_2d, self.group, out, self.offsets_2d)

    def to(self, device, dtype: torch.dtype | None = None) -> Int8Weight:
        """The same weight on `device` (rows() then in `dtype`, default unchanged).

        A pinned kernel choice is dropped: it belongs to the old device.
        """
        offsets = None if self.offsets is None else self.offsets.to(device)
        return Int8Weight(
            self.qweight.to(device), self.scales.to(device), self.group_size,
            offsets=offsets, dtype=dtype or self.dtype,
        )  # fmt: skip

    # -- serialization ----------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """{"qweight": int8 [out, in], "scales": fp32/fp16 [out] or [out, G]} (+ "offsets",
        same shape, when asymmetric) for a writer.

        The group size is not among them: it belongs to the quant mode (`int8-g128`), and the
        reader passes it back to `from_tensors`.
        """
        parts = {"qweight": self.qweight, "scales": self.scales}
        if self.offsets is not None:
            parts["offsets"] = self.offsets
        return parts

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor],
        group_size: int | None = None,
        *,
        dtype: torch.dtype = torch.float32,
    ) -> Int8Weight:
        """Rebuild from `tensors()` output (e.g. tensors over a memory-mapped artifact), no copy.

        `group_size` as in the quant mode: None for per channel (scales [out]).
        """
        return cls(
            tensors["qweight"], tensors["scales"], group_size,
            offsets=tensors.get("offsets"), dtype=dtype,
        )  # fmt: skip

    def __repr__(self) -> str:
        kind = "per-channel" if self.group_size is None else f"group {self.group_size}"
        kind += ", asymmetric" if self.offsets is not None else ""
        return f"Int8Weight({list(self.shape)}, {kind}, device={self.device})"


def _groups(in_features: int, group_size: int | None) -> tuple[int, int]:
    """(columns per scale, scales per row): the whole row per channel, else `group_size`."""
    group = in_features if group_size is None else group_size
    if group < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")
    return group, group_count(in_features, group)


def quantize_int8(
    weight: torch.Tensor, group_size: int | None = None, *, asymmetric: bool = False
) -> Int8Weight:
    """Round-to-nearest INT8 of weight [out, in], per channel or per `group_size` columns.

    Symmetric: scales are fp32 max|w| / 127, q in [-127, 127]; an all-zero row or group gets
    scale 0 and q = 0, so it dequantizes to exact zeros. Asymmetric: see the module docstring;
    a constant group gets scale 0 and its value as offset. Either way |W - W~| <= s/2.
    Non-finite weights are refused (ValueError).
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"expected a 2-D float weight [out, in], got {weight.dtype} {tuple(weight.shape)}"
        )
    out_features, in_features = weight.shape
    group, groups = _groups(in_features, group_size)
    pad = groups * group - in_features
    qweight = torch.empty(out_features, in_features, dtype=torch.int8, device=weight.device)
    scales = torch.empty(out_features, groups, dtype=torch.float32, device=weight.device)
    offsets = torch.empty_like(scales) if asymmetric else None
    for start in range(0, out_features, _QUANTIZE_ROWS):
        stop = min(out_features, start + _QUANTIZE_ROWS)
        rows = weight[start:stop].float()
        if pad:
            # Fill the short last group with a copy of its last value: that changes neither its
            # max|w| nor its min and max, so its scale is that of its real values.
            rows = torch.cat([rows, rows[:, -1:].expand(-1, pad)], dim=1)
        block = rows.unflatten(1, (groups, group))
        scale = block.abs().amax(dim=-1) / 127.0  # [rows, G]
        if not torch.isfinite(scale).all():
            raise ValueError(f"weight rows {start}..{stop - 1} hold inf or NaN; cannot quantize")
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(block / safe[..., None]).clamp_(-127, 127)
        if asymmetric:
            q, scale, offsets[start:stop] = _closest_of_candidates(block, q, scale)
        qweight[start:stop] = q.flatten(1)[:, :in_features].to(torch.int8)
        scales[start:stop] = scale
    if group_size is None:
        # Per channel: [out], as `tensors()` stores it.
        scales = scales[:, 0].contiguous()
        offsets = None if offsets is None else offsets[:, 0].contiguous()
    return Int8Weight(qweight, scales, group_size, offsets=offsets)


def quantize_q8_0(weight: torch.Tensor) -> Int8Weight:
    """GGUF's Q8_0 of weight [out, in]: per 32 input columns d = max|w| / 127, codes
    roundf(w / d) (halves away from zero, as llama.cpp's reference `quantize_row_q8_0` and the
    `gguf` package round, multiplying by 1 / d in fp32) and d stored as fp16. A short last
    group (in not a multiple of 32) is quantized on its own. ValueError for inf/NaN weights or
    a scale beyond fp16's range."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"expected a 2-D float weight [out, in], got {weight.dtype} {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    group, groups = _groups(in_features, Q8_0_GROUP)
    pad = groups * group - in_features
    qweight = torch.empty(out_features, in_features, dtype=torch.int8, device=weight.device)
    scales = torch.empty(out_features, groups, dtype=torch.float16, device=weight.device)
    for start in range(0, out_features, _QUANTIZE_ROWS):
        stop = min(out_features, start + _QUANTIZE_ROWS)
        rows = weight[start:stop].float()
        if pad:  # padded with zeros: they change no group's max|w|
            rows = torch.nn.functional.pad(rows, (0, pad))
        block = rows.unflatten(1, (groups, group))
        d = block.abs().amax(dim=-1, keepdim=True) / 127
        if not torch.isfinite(d).all() or (d > _FP16_MAX).any():
            raise ValueError(f"weight rows {start}..{stop - 1} hold inf, NaN or values beyond fp16 "
                             f"scales' range; cannot quantize to q8_0")  # fmt: skip
        inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = _roundf(block * inverse)
        qweight[start:stop] = q.flatten(1)[:, :in_features].to(torch.int8)
        scales[start:stop] = d.squeeze(-1).to(torch.float16)
    return Int8Weight(qweight, scales, Q8_0_GROUP)


def q8_0_on_source_grid(weight: torch.Tensor) -> Int8Weight | None:
    """`quantize_q8_0(weight)` where it reproduces every value exactly (a GGUF Q8_0 source, whose
    values are d * q with d fp16 and max|q| = 127 in every group: max|w| / 127 is d again), else None."""
    try:
        quantized = quantize_q8_0(weight)
    except ValueError:
        return None
    return quantized if torch.equal(quantized.dequantize(), weight.float()) else None


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero; torch.round rounds them to even), exactly."""
    a = x.abs()
    floored = a.floor()
    return torch.sign(x) * (floored + (2 * (a - floored)).floor())


def _closest_of_candidates(block, q_sym, scale_sym):
    """Per group of `block` [rows, G, group], the affine (min..max over 256 levels) or the
    symmetric quantization, whichever reconstructs it with less squared error, or else the
    source-grid one where the group sits on a grid that it reproduces (near) exactly and with
    still less error; as (q, scales, offsets).

    Usually affine wins (half the step or less). Symmetric wins where the source already sits on
    a symmetric int8 grid (GGUF Q8_0), which it then reproduces exactly; the source grid wins
    where the group sits on a coarser grid (GGUF Q4_0, Q4_1, Q5_0, Q5_1: `_onto_source_grids`),
    which it reproduces exactly too. A float group never sits on one: its quantization is the
    affine or symmetric one, as it was before the source grid was added.
    """
    low, high = block.amin(dim=-1), block.amax(dim=-1)
    scale = (high - low) / 255.0
    constant = scale == 0
    safe = torch.where(constant, torch.ones_like(scale), scale)
    q = (block - low[..., None]).div_(safe[..., None]).round_().clamp_(0, 255).sub_(128)
    q.masked_fill_(constant[..., None], 0)
    offset = torch.where(constant, low, low + 128 * scale)
    affine_error = _squared_error(q, scale, offset, block)
    symmetric_error = (q_sym * scale_sym[..., None]).sub_(block).square_().sum(-1)
    use_symmetric = symmetric_error <= affine_error
    q = torch.where(use_symmetric[..., None], q_sym, q)
    scale = torch.where(use_symmetric, scale_sym, scale)
    offset = torch.where(use_symmetric, torch.zeros_like(offset), offset)
    error = torch.minimum(symmetric_error, affine_error)
    return _onto_source_grids(block, low, high, error, q, scale, offset)


def _squared_error(q, scale, offset, block):
    """Sum over the last dim of (q * s + o - block)^2, the reconstruction formed as dequantize
    forms it (q * s, then + o)."""
    return (q * scale[..., None]).add_(offset[..., None]).sub_(block).square_().sum(-1)


# k for a source grid of n steps: the largest power of two with k * n <= 255, so the int8 step
# d / k is exact in fp32 and every source level is an int8 level.
_SUBSTEPS = torch.tensor([0] + [1 << (255 // n).bit_length() - 1 for n in range(1, 256)])
# How far (root mean square, in int8 steps) a group may sit from the source grid found for it.
_ON_GRID = 1e-3


def _onto_source_grids(block, low, high, error, q, scale, offset):
    """(q, scale, offset) with each group of `block` [rows, G, group] that sits on a grid of at
    most 255 steps moved onto an int8 grid through all its levels, where that reproduces the
    group (near) exactly (`_on_grid`) with strictly less squared error than `error` [rows, G]
    (the current choice's; a group it already reproduces exactly is left alone).

    A GGUF 4/5/8-bit group holds values d*j (+ m), j whole: its step d is the smallest gap
    between its sorted distinct values where two neighbouring levels occur (all but sparse
    groups), and n = round(span / d) steps span it, so d = span / n. Where that grid misses
    the group (or only nearly fits it: n = 3 for levels -8, -5, 0 makes d / 3 the step, which
    fp32 rounds), its smallest gap spans several steps: `grids.gcd_steps` looks for them. A float
    group's smallest gap is far below span / 255, so few float groups get past the step count;
    for a source on a grid nearly all do, and the groups are then worked on in place rather than
    gathered.
    """
    shapes = q.shape, scale.shape
    group = block.shape[-1]
    flat, low, span = block.reshape(-1, group), low.reshape(-1), (high - low).reshape(-1)
    q, error = q.reshape(-1, group), error.reshape(-1)
    scale, offset = scale.reshape(-1), offset.reshape(-1)
    todo = (error > 0).nonzero().squeeze(1)
    if 2 * todo.numel() > error.numel():
        todo = None  # most groups: all of them, in place
    flat, low, span, error = (t if todo is None else t[todo] for t in (flat, low, span, error))
    # The smallest positive gap, on the gaps' bits (>= 0 floats order as their int32 bits):
    # bits - 1 wraps a zero gap's 0 to -1, which the mask turns into the largest int32.
    bits = sorted_rows(flat).diff(dim=-1).view(torch.int32).sub_(1).bitwise_and_(0x7FFFFFFF)
    gap = bits.amin(dim=-1).clamp_(max=0x7F7FFFFF).add_(1).view(torch.float32)  # inf: no gap
    steps = torch.round(span / gap)  # 0 where the group is constant
    gridded = (steps >= 1) & (steps <= 255) & (error > 0)
    if todo is None and 2 * int(gridded.sum()) > gridded.numel():  # a source on a grid
        q_grid, scale_grid, offset_grid, grid_error = _on_grid(
            flat, low, span, torch.where(gridded, steps, torch.ones_like(steps))
        )
        better = gridded & (grid_error < error)
        q = torch.where(better[:, None], q_grid, q)
        scale = torch.where(better, scale_grid, scale)
        offset = torch.where(better, offset_grid, offset)
        error = torch.where(better, grid_error, error)
        missed = (gridded & (grid_error > 0)).nonzero().squeeze(1)
    else:
        picked = gridded.nonzero().squeeze(1)
        grids = _on_grid(flat[picked], low[picked], span[picked], steps[picked])
        missed = _take(picked, grids, error, todo, q, scale, offset)
    if missed.numel():
        steps = gcd_steps(flat[missed], span[missed])
        found = (steps >= 1) & (steps <= 255)
        missed = missed[found]
        grids = _on_grid(flat[missed], low[missed], span[missed], steps[found])
        _take(missed, grids, error, todo, q, scale, offset)
    return q.view(shapes[0]), scale.view(shapes[1]), offset.view(shapes[1])


def _take(picked, grids, error, todo, q, scale, offset):
    """Where `grids` (`_on_grid` of the groups `picked`) beat `error`, their q, scale and offset
    go into q [n, group], scale [n], offset [n] (at todo[picked] when `todo` is not None), and
    their error into `error`; returns those of `picked` that were not reproduced exactly."""
    q_grid, scale_grid, offset_grid, grid_error = grids
    better = grid_error < error[picked]
    error[picked[better]] = grid_error[better]
    taken = picked[better] if todo is None else todo[picked[better]]
    q[taken], scale[taken], offset[taken] = q_grid[better], scale_grid[better], offset_grid[better]
    return picked[grid_error > 0]


def _on_grid(flat, low, span, steps):
    """Groups flat [n, group] spanning `span` [n] from `low` [n] in `steps` [n] whole source steps,
    as (q, scales, offsets, squared errors) on the int8 grid of step d / k, d = span / steps,
    k = _SUBSTEPS[steps] (a power of two, so the step is exact in fp32).

    The group's min gets the int8 level nearest min / step that leaves room for the steps * k
    int8 steps above it: zero stays at q = 0 where it fits (Q4_0, Q5_0, Q8_0), so q * step is the
    source value itself; else the offset is a whole number of steps from the min, also exact in
    fp32 for fp16 d and m (Q4_1, Q5_1). The error is inf where the grid does not reproduce the
    group to within _ON_GRID of its step (root mean square; fp32 rounding of d*j + m stays far
    below it), so a float group that merely shows few distinct values keeps its affine grid, and
    where the step underflows to 0.
    """
    substeps = _SUBSTEPS.to(flat.device)[steps.long()].to(flat.dtype)
    scale = span / steps / substeps
    underflow = scale == 0
    safe = torch.where(underflow, torch.ones_like(scale), scale)
    q_low = torch.minimum(torch.round(low / safe).clamp_(min=-128), 127 - steps * substeps)
    offset = low - q_low * safe
    q = (flat - offset[:, None]).div_(safe[:, None]).round_().clamp_(-128, 127)
    error = _squared_error(q, safe, offset, flat)
    off_grid = underflow | (error > flat.shape[1] * (_ON_GRID * safe).square())
    return q, scale, offset, error.masked_fill_(off_grid, torch.inf)
