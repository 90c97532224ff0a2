"""Weight stores: the forward pass borrows a block's tensors and hands them back.

The contract is `acquire(block) -> {name: tensor or Weight}` followed by `release(block)`; a
`Weight` is a stored matrix that computes its own products (INT8, INT4, a LoRA variant's rows). The stores
themselves live in tierlm/store/: a resident store keeps everything in memory, a tiered store
implements the same two calls by fetching blocks from host RAM or disk, so model code never changes.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence, Union

import torch

from tierlm.blocks import expert_block
from tierlm.quant.kernel_api import Weight
from tierlm.weights.ledger import Ledger


# What a block holds under each tensor name.
Tensors = Mapping[str, Union[torch.Tensor, Weight]]


class WeightStore:
    """Base class: subclasses implement acquire/release; `block()` pairs them."""

    # Whether `hint_experts` is worth the model's guessing (a store that streams experts says True).
    speculates: bool = False

    def acquire(self, block: str) -> Tensors:
        raise NotImplementedError

    def release(self, block: str) -> None:
        raise NotImplementedError

    @contextmanager
    def block(self, name: str) -> Iterator[Tensors]:
        tensors = self.acquire(name)
        try:
            yield tensors
        finally:
            self.release(name)

    @contextmanager
    def experts(self, layer: int, uses: Mapping[int, int]) -> Iterator[Mapping[int, Tensors]]:
        """The tensors of each chosen expert of `layer` ({expert: rows that chose it}), held together
        while the layer computes. Tensors may live on another device (host compute): the model moves
        the rows there and the result back (models/base.weight_device)."""
        got: dict[int, Tensors] = {}
        try:
            for expert in uses:
                got[expert] = self.acquire(expert_block(layer, expert))
            yield got
        finally:
            for expert in got:
                self.release(expert_block(layer, expert))

    def peek(self, block: str) -> Tensors | None:
        """A block's tensors if they are resident now, without acquiring it; None otherwise."""
        return None

    def resident_block(self, block: str) -> Tensors | None:
        """What `acquire(block)` would return, when acquiring it reads nothing and needs no
        release (the fused decode step runs such layers in one native call); else None."""
        return None

    def hint_experts(self, layer: int, experts: Sequence[int]) -> None:
        """Speculation: `layer` will probably choose `experts`; a streaming store starts reading them."""

    def block_names(self) -> list[str]:
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of weights this store holds in memory."""
        raise NotImplementedError

    def note_forward(self, tokens: int) -> None:
        """A forward over `tokens` token positions begins; a streaming store counts it (its
        ledger's traffic per forward and per token), a resident one has nothing to count."""

    def stats(self):
        """The store's streaming figures (weights/ledger.Ledger): planned bytes per tier, bytes
        read, prefetch stall, hot-row hits. A resident store streams nothing: an empty ledger,
        every figure zero and nothing planned."""
        return Ledger()

    def close(self) -> None:
        """Release threads and files; a resident store holds none."""
