"""What a model's weights are grouped into: blocks, each fetched from a weight store as one unit.

The block names live here and nowhere else: `embed`, one `layers.{i}` per decoder layer, the
final `norm`, `head` (the forward pass's order). A mixture-of-experts layer keeps its dense part
(norms, attention, router, shared expert) in `layers.{i}` and each routed expert in its own block
`experts.{i}.{e}`, stored right after its layer, so a store can hold, stream or cache one expert. The families, offload's sizes, planner and
tiered store, and the plan view name blocks through this module. (`embed`, `norm` and `head` are
also the canonical names of the one tensor each of those blocks holds.)

A family maps checkpoint tensors onto blocks with two shapes of mapping, named apart:
- `BlockLayout`: one block, canonical tensor name -> the checkpoint tensors it is built from (several
  are concatenated along the output dimension: fused q/k/v, fused gate/up);
- `CheckpointLayout`: the whole model, block name -> its BlockLayout.
"""

from __future__ import annotations

EMBED, NORM, HEAD = "embed", "norm", "head"
_LAYER_PREFIX = "layers."
_EXPERT_PREFIX = "experts."

BlockLayout = dict[str, tuple[str, ...]]
CheckpointLayout = dict[str, BlockLayout]


def layer_block(index: int) -> str:
    """The block of decoder layer `index`."""
    return f"{_LAYER_PREFIX}{index}"


def layer_index(block: str) -> int | None:
    """The decoder layer a block holds, None for embed, norm and head."""
    return int(block[len(_LAYER_PREFIX) :]) if is_layer(block) else None


def is_layer(block: str) -> bool:
    """Whether a block is a decoder layer's."""
    return block.startswith(_LAYER_PREFIX)


def expert_block(layer: int, expert: int) -> str:
    """The block of routed expert `expert` of decoder layer `layer`."""
    return f"{_EXPERT_PREFIX}{layer}.{expert}"


def expert_of(block: str) -> tuple[int, int] | None:
    """(layer, expert) of an expert block, None for every other block."""
    if not block.startswith(_EXPERT_PREFIX):
        return None
    layer, _, expert = block[len(_EXPERT_PREFIX) :].partition(".")
    return int(layer), int(expert)


def is_expert(block: str) -> bool:
    """Whether a block holds one routed expert of a mixture-of-experts layer."""
    return block.startswith(_EXPERT_PREFIX)
