"""INT8 kernels made of torch ops: they run wherever torch runs and need no build.

- `dequantize_into`: the reference dequantization, q * s broadcast per group (any device).
- `BlasKernel`: dequantize a block of weight rows into a small scratch buffer and hand it to
  the BLAS GEMM; the weight is never materialised in float as a whole. The right kernel for
  many activation rows (prefill), where the GEMM's reuse of each weight dominates.
- `TorchKernel`: dequantize to the activation dtype, then `F.linear`; for accelerators, where
  activations are bf16/fp16 and the device's GEMM is fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tierlm.quant import gguf_layouts
from tierlm.quant.nibbles import dequantize4


def dequantize_into(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    out: torch.Tensor,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [N, K] (float dtype) = qweight [N, K] int8 * scales [N, G] (+ offsets [N, G])
    broadcast per group.

    The product is formed in fp32 (then cast to out's dtype), as `Int8Weight.dequantize` does.
    Two passes (widen, then scale in place) measured ~1.4x faster than one mixed-dtype
    broadcast multiply; the widening is exact, so the result is the same.
    """
    out.copy_(qweight)
    _per_group(out, scales, group, torch.Tensor.mul_)
    if offsets is not None:
        _per_group(out, offsets, group, torch.Tensor.add_)
    return out


def _per_group(out: torch.Tensor, values: torch.Tensor, group: int, inplace) -> None:
    """inplace(out's columns, their group's value in values [N, G]) for out [N, K]."""
    k = out.shape[1]
    full = k // group
    split = full * group
    if full:
        # Whole groups as a [N, full, group] view, so each value broadcasts over its group.
        inplace(out[:, :split].unflatten(1, (full, group)), values[:, :full, None])
    if split < k:  # the short last group of every row
        inplace(out[:, split:], values[:, full:])


def offset_term(x: torch.Tensor, offsets: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] @ (offsets [N, G] broadcast per group).T -> [M, N]: what asymmetric weights'
    offsets add to a matmul, as x summed per group (the last group may be short) @ offsets.T."""
    k = x.shape[-1]
    full = k // group
    split = full * group
    sums = x[:, :split].unflatten(1, (full, group)).sum(-1)
    if split < k:
        sums = torch.cat([sums, x[:, split:].sum(-1, keepdim=True)], dim=1)
    return sums.to(offsets.dtype) @ offsets.T


class BlasKernel:
    """Block-wise dequantize into a scratch buffer of ~`block_bytes`, one GEMM per block.

    16 MiB blocks measured best for 128-row prefill on a 2-core Xeon: 1 MiB blocks were ~50%
    slower (each GEMM call repacks the activations), whole-weight buffers slower too (page
    faults on a fresh buffer of up to hundreds of MiB, and the memory budget pays for it).
    """

    def __init__(self, dequantize=dequantize_into, name="dequant-blas", block_bytes=16 << 20, dequantize4=None,
                 dequantize4k=None, dequantize6k=None, dequantize5=None, dequantize_iq4=None,
                 dequantize_words=None):  # fmt: skip
        self._dequantize = dequantize
        self._dequantize4 = dequantize4 or _dequantize4_into
        self._dequantize4k = dequantize4k or gguf_layouts.dequantize4k
        self._dequantize6k = dequantize6k or gguf_layouts.dequantize6k
        self._dequantize5 = dequantize5 or gguf_layouts.dequantize5
        self._dequantize_iq4 = dequantize_iq4 or gguf_layouts.dequantize_iq4
        self._dequantize_words = dequantize_words or _dequantize_weight_into
        self.name = name
        self.block_bytes = block_bytes

    def matmul(self, x, qweight, scales, group, bias=None, offsets=None):
        """x [M, K] fp32 @ (qweight [N, K] * scales [N, G] (+ offsets)).T (+ bias [N]) -> [M, N]."""
        def rows_into(start, stop, block):
            part = offsets[start:stop] if offsets is not None else None
            self._dequantize(qweight[start:stop], scales[start:stop], group, block, part)

        return self._blocked(x, qweight.shape[0], rows_into, bias)

    def matmul4(self, x, packed, scales, offsets, group, bias=None):
        """x [M, K] fp32 @ the INT4 weight (packed [N, K/2], fp16 scales/offsets [N, G]).T (+ bias)."""
        def rows_into(start, stop, block):
            part = offsets[start:stop] if offsets is not None else None
            self._dequantize4(packed[start:stop], scales[start:stop], part, group, block)

        return self._blocked(x, packed.shape[0], rows_into, bias)

    def matmul4k(self, x, packed, superblocks, bias=None):
        """x [M, K] fp32 @ the GGUF Q4_K weight (tierlm/quant/q4k.py).T (+ bias)."""
        def rows_into(start, stop, block):
            self._dequantize4k(packed[start:stop], superblocks[start:stop], block)

        return self._blocked(x, packed.shape[0], rows_into, bias)

    def matmul6k(self, x, packed, high, superblocks, bias=None):
        """x [M, K] fp32 @ the GGUF Q6_K weight (tierlm/quant/q6k.py).T (+ bias)."""
        def rows_into(start, stop, block):
            self._dequantize6k(packed[start:stop], high[start:stop], superblocks[start:stop], block)

        return self._blocked(x, packed.shape[0], rows_into, bias)

    def matmul5(self, x, codes, scales, offsets, superblocks, bias=None):
        """x [M, K] fp32 @ a GGUF 5-bit weight (tierlm/quant/q5.py).T (+ bias)."""
        def rows_into(start, stop, block):
            part = lambda t: t[start:stop] if t is not None else None  # noqa: E731
            self._dequantize5(codes[start:stop], part(scales), part(offsets), part(superblocks), block)

        return self._blocked(x, codes.shape[0], rows_into, bias)

    def matmul_iq4(self, x, packed, scales, superblocks, bias=None):
        """x [M, K] fp32 @ a GGUF IQ4_NL / IQ4_XS weight (tierlm/quant/iq4.py).T (+ bias)."""
        def rows_into(start, stop, block):
            part = lambda t: t[start:stop] if t is not None else None  # noqa: E731
            self._dequantize_iq4(packed[start:stop], part(scales), part(superblocks), block)

        return self._blocked(x, packed.shape[0], rows_into, bias)

    def matmul_words(self, x, weight, bias=None):
        """x [M, K] fp32 @ a weight that describes itself (`native_words()`, `row_slice`,
        `dequantize`: quant/low_bit_k.py).T (+ bias)."""
        def rows_into(start, stop, block):
            self._dequantize_words(weight.row_slice(start, stop), block)

        return self._blocked(x, weight.shape[0], rows_into, bias)

    def _blocked(self, x, n, rows_into, bias):
        """x [M, K] @ W.T for W [n, K] made a block of rows at a time by rows_into(start, stop, out)."""
        m, k = x.shape
        rows = min(n, max(16, self.block_bytes // (4 * k)))
        buffer = torch.empty(rows, k, dtype=torch.float32, device=x.device)
        if rows == n:
            rows_into(0, n, buffer)
            return F.linear(x, buffer, bias)
        # GEMM into the transposed output: each block's [rows, M] slice is contiguous.
        out_t = torch.empty(n, m, dtype=torch.float32, device=x.device)
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            block = buffer[: stop - start]
            rows_into(start, stop, block)
            torch.mm(block, x.t(), out=out_t[start:stop])
        out = out_t.t().contiguous()
        return out.add_(bias) if bias is not None else out


class TorchKernel:
    """Dequantize to x's dtype and call `F.linear`: any device, any float activation dtype."""

    name = "torch-dequant"

    def matmul(self, x, qweight, scales, group, bias=None, offsets=None):
        """x [M, K] (fp32/bf16/fp16) -> [M, N] in x's dtype."""
        if scales.shape[1] == 1 and offsets is None:
            # Per channel: int8 values are exact in bf16/fp16, so scale the output instead of
            # the weight (one [M, N] multiply rather than an [N, K] one).
            out = F.linear(x, qweight.to(x.dtype)) * scales[:, 0].to(x.dtype)
            return out.add_(bias.to(x.dtype)) if bias is not None else out
        weight = torch.empty(qweight.shape, dtype=x.dtype, device=x.device)
        return F.linear(x, dequantize_into(qweight, scales, group, weight, offsets), bias)

    def matmul4(self, x, packed, scales, offsets, group, bias=None):
        """The INT4 weight dequantized (in fp32, then x's dtype) and `F.linear`."""
        weight = _dequantize4_into(packed, scales, offsets, group).to(x.dtype)
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    def matmul4k(self, x, packed, superblocks, bias=None):
        """The Q4_K weight dequantized (in fp32, then x's dtype) and `F.linear`."""
        weight = gguf_layouts.dequantize4k(packed, superblocks).to(x.dtype)
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    def matmul5(self, x, codes, scales, offsets, superblocks, bias=None):
        """The 5-bit weight dequantized (in fp32, then x's dtype) and `F.linear`."""
        weight = gguf_layouts.dequantize5(codes, scales, offsets, superblocks).to(x.dtype)
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    def matmul_iq4(self, x, packed, scales, superblocks, bias=None):
        """The IQ4 weight dequantized (in fp32, then x's dtype) and `F.linear`."""
        weight = gguf_layouts.dequantize_iq4(packed, scales, superblocks).to(x.dtype)
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    def matmul_words(self, x, weight, bias=None):
        """The weight dequantized (in fp32, then x's dtype) and `F.linear`."""
        return F.linear(x, weight.dequantize().to(x.dtype), None if bias is None else bias.to(x.dtype))

    def matmul6k(self, x, packed, high, superblocks, bias=None):
        """The Q6_K weight dequantized (in fp32, then x's dtype) and `F.linear`."""
        weight = gguf_layouts.dequantize6k(packed, high, superblocks).to(x.dtype)
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def _dequantize_weight_into(weight, out):
    """The weight's own torch reference dequantization, copied into `out`."""
    return out.copy_(weight.dequantize())


def _dequantize4_into(packed, scales, offsets, group, out=None):
    """The torch INT4 dequantization (quant/int4.py's reference), into `out` if given."""
    return dequantize4(packed, scales, group, offsets, out=out)
