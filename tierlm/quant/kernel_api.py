"""What a stored weight offers the model (`Weight`), what every INT8 matmul kernel offers, and the
one error a kernel that cannot load raises.

A kernel computes y = x @ (q * s).T on plain tensors, so the weight object, the calibration
and each implementation (native C++, numba, torch) stay independent of one another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class Weight(Protocol):
    """A stored 2-D weight that is not a plain tensor (quant/int8.py Int8Weight, quant/int4.py
    Int4Weight, store/variants.py RowSwitched, store/calibration.py's recorder): the model asks it
    for products and embedding rows (models/base.py `linear`, `embed`) and never for its bytes."""

    shape: torch.Size

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ weight[out, in].T (+ bias) -> [..., out]."""

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The rows `ids` of an embedding [V, H] -> [..., H]."""


class KernelUnavailable(RuntimeError):
    """A kernel cannot run here (missing compiler or package, failed build); try the next one."""


def group_count(in_features: int, group_size: int) -> int:
    """Scale groups per row: ceil(in / group); the last group of a row may be short."""
    return -(-in_features // group_size)


class Int8Kernel(Protocol):
    """y = x @ (qweight * scales).T (+ bias): W8A16 with fp32 accumulation."""

    name: str

    def matmul(
        self,
        x: torch.Tensor,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        group: int,
        bias: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, K] fp32, qweight [N, K] int8, scales [N, G] fp32 (or fp16 when there are no
        offsets: GGUF Q8_0's form), bias [N] -> [M, N] fp32.

        `group` is the number of input columns one scale covers (K for per-channel);
        G = ceil(K / group). `offsets` [N, G] fp32 (asymmetric weights) add to every weight of
        their group. Inputs are contiguous and on the kernel's device.
        """
        ...
