"""Pipeline stages: which contiguous range of layers each rank of a pipeline owns.

Rank 0 owns tokenization, sampling and the API, and its stage also embeds the tokens; the last
rank's stage ends with the final norm and the head. A one-stage pipeline is the whole model, so
the single-process forward is the one-stage case of the same path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tierlm.blocks import EMBED, HEAD, NORM, expert_of, is_expert, is_layer, layer_index
from tierlm.errors import TierlmError


@dataclass(frozen=True)
class StageSpan:
    """Rank `rank` of `world` runs layers [first, end)."""

    rank: int
    world: int
    first: int
    end: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1

    @property
    def layers(self) -> range:
        return range(self.first, self.end)

    def owns(self, block: str, tied: bool = False) -> bool:
        """Whether this stage holds `block`: the embedding on the first, norm and head on the last
        (a `tied` head reads the embedding, so then the last stage holds that too)."""
        if block == EMBED:
            return self.is_first or (tied and self.is_last)
        if block in (NORM, HEAD):
            return self.is_last
        if is_expert(block):
            return expert_of(block)[0] in self.layers
        if is_layer(block):
            return layer_index(block) in self.layers
        return True

    def blocks(self, names: Sequence[str], tied: bool = False) -> tuple[str, ...]:
        """The names among `names` (a BlockSizes' or a layout's) this stage holds, in order."""
        return tuple(name for name in names if self.owns(name, tied))

    def describe(self) -> str:
        roles = (["embedding"] if self.is_first else []) + [f"layers {self.first}-{self.end - 1}"]
        return f"stage {self.rank}: " + ", ".join(roles + (["norm + head"] if self.is_last else []))


def whole_model(layers: int) -> StageSpan:
    """The one-stage pipeline: a single process running every layer."""
    return StageSpan(0, 1, 0, layers)


def spans_from_counts(counts: Sequence[int]) -> list[StageSpan]:
    """Stages running counts[i] consecutive layers each, in rank order."""
    if not counts or any(count < 1 for count in counts):
        raise TierlmError(f"every stage needs at least one layer, not {list(counts)}",
                          "use fewer --stages than the model has layers")  # fmt: skip
    spans, first = [], 0
    for rank, count in enumerate(counts):
        spans.append(StageSpan(rank, len(counts), first, first + count))
        first += count
    return spans


def even_split(layers: int, stages: int) -> list[StageSpan]:
    """`layers` split into `stages` ranges whose sizes differ by at most one (earlier ranks larger)."""
    if stages < 1 or stages > layers:
        raise TierlmError(f"{stages} stages for a model of {layers} layers",
                          f"use between 1 and {layers} stages")  # fmt: skip
    share, extra = divmod(layers, stages)
    return spans_from_counts([share + (1 if rank < extra else 0) for rank in range(stages)])
