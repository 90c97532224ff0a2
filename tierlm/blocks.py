"""What a model's weights are grouped into: blocks, each fetched from a weight store as one unit.

The block names live here and nowhere else: `embed`, one `layers.{i}` per decoder layer, the
final `norm`, `head` (the forward pass's order). The families, offload's sizes, planner and
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
