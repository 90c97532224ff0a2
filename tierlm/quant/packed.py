"""What the weights stored as packed nibbles share (quant/int4.py, q4k.py, q6k.py): their logical
shape from the packed bytes, their device, and `linear` through the kernel chosen for x's device."""

from __future__ import annotations

import torch

from tierlm.quant.dispatch import kernel_choice


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
