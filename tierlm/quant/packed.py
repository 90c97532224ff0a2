"""What stored weights share: `PartsWeight` (quant/q5.py, low_bit_k.py) their device, bytes,
`linear` through the kernel chosen for x's device and embedding rows from their parts; and
`PackedNibbles` (quant/int4.py, q4k.py, q6k.py, iq4.py) the logical shape of packed nibbles."""

from __future__ import annotations

import torch

from tierlm.quant.dispatch import kernel_choice


class PartsWeight:
    """Mixin: `tensors()` (its parts, rows first), `from_tensors(parts)`, `dequantize()`, `dtype`
    and `kernels` (None: calibrated)."""

    kernels = None

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors().values())).device

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.tensors().values())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ W.T (+ bias [out]) -> [..., out] in x's dtype, with W = dequantize()."""
        kernels = self.kernels or kernel_choice(x.device)
        return kernels.linear(x, self, bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Embedding lookup: ids (any shape) -> dequantized rows [*ids.shape, in] in `dtype`."""
        flat = ids.reshape(-1)
        picked = type(self).from_tensors({name: part.index_select(0, flat) for name, part in self.tensors().items()})
        rows = picked.dequantize()
        return rows.to(dtype or self.dtype).view(*ids.shape, rows.shape[1])


class PackedNibbles:
    """Mixin: `packed` uint8 [out, in / 2] (two values a byte), `kernels` (None: calibrated)."""

    packed: torch.Tensor
    kernels = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], 2 * self.packed.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ W.T (+ bias [out]) -> [..., out] in x's dtype, with W = dequantize()."""
        kernels = self.kernels or kernel_choice(x.device)
        return kernels.linear(x, self, bias)
