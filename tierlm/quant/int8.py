"""W8A16 weight-only INT8: symmetric round-to-nearest quantization and the weight object.

A weight W [out, in] becomes int8 values q [out, in] and fp32 scales s, one per output row
(per channel) or one per group of `group_size` input columns:

    s = max|W| / 127 over the row (or group);  q = round(W / s);  W ~ q * s, |W - q*s| <= s/2

Asymmetric modes add a float offset o per row or group (a zero point): the 256 levels span
[min, max] of the group, q in [-128, 127],

    s = (max - min) / 255;  o = min + 128 s;  q = round((W - o) / s);  W ~ q * s + o

or, where it reconstructs the group better, its symmetric quantization with o = 0 (so a source
already on either grid, GGUF Q4_1 or Q8_0 with groups of 32, comes through exactly). Then
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

from tierlm.quant.dispatch import plan_for
from tierlm.quant.kernel_api import group_count
from tierlm.quant.torch_kernels import dequantize_into

# Rows quantized per step: bounds the fp32 temporaries for big matrices (a 150k-row embedding).
_QUANTIZE_ROWS = 4096


class Int8Weight:
    """int8 `qweight` [out, in] with `scales` [out] (per channel) or [out, G] (per group),
    and for asymmetric modes `offsets` of the scales' shape.

    `dtype` is what `rows()` returns by default (fp32 on CPUs, bf16/fp16 on accelerators).
    `plan` pins a `dispatch.KernelPlan`; None uses the plan calibrated for x's device.
    The tensors are used as given when contiguous, so buffers mapped from an artifact are not
    copied; only fp16 scales get an fp32 copy ([out, G], small) for the kernels.
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        group_size: int | None = None,
        *,
        offsets: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        plan=None,
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
        self.plan = plan
        # The kernels' view of the scales: fp32 [out, G] (G = 1 per channel).
        self.group = group
        self.scales_2d = scales.float().reshape(out_features, -1).contiguous()
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
        plan = self.plan or plan_for(x.device)
        return plan.linear(x, self, bias)

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

        A pinned plan is dropped: it belongs to the old device.
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
            q, scale, offsets[start:stop] = _closer_of_symmetric_and_affine(block, q, scale)
        qweight[start:stop] = q.flatten(1)[:, :in_features].to(torch.int8)
        scales[start:stop] = scale
    if group_size is None:
        # Per channel: [out], as `tensors()` stores it.
        scales = scales[:, 0].contiguous()
        offsets = None if offsets is None else offsets[:, 0].contiguous()
    return Int8Weight(qweight, scales, group_size, offsets=offsets)


def _closer_of_symmetric_and_affine(block, q_sym, scale_sym):
    """Per group, the affine (min..max over 256 levels) or the symmetric quantization, whichever
    reconstructs `block` [rows, G, group] with less squared error, as (q, scales, offsets).

    Usually affine wins (half the step or less); symmetric wins where the source already sits on
    a symmetric int8 grid (GGUF Q8_0), which it then reproduces exactly.
    """
    low = block.amin(dim=-1)
    scale = (block.amax(dim=-1) - low) / 255.0
    constant = scale == 0
    safe = torch.where(constant, torch.ones_like(scale), scale)
    q = torch.round((block - low[..., None]) / safe[..., None]).clamp_(0, 255) - 128
    q = torch.where(constant[..., None], torch.zeros_like(q), q)
    offset = torch.where(constant, low, low + 128 * scale)
    affine_error = (q * scale[..., None] + offset[..., None] - block).square().sum(-1)
    symmetric_error = (q_sym * scale_sym[..., None] - block).square().sum(-1)
    use_symmetric = symmetric_error <= affine_error
    return (
        torch.where(use_symmetric[..., None], q_sym, q),
        torch.where(use_symmetric, scale_sym, scale),
        torch.where(use_symmetric, torch.zeros_like(offset), offset),
    )
