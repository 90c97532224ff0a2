"""What a model's weights are grouped into: blocks, each fetched from a weight store as one unit.

A family maps checkpoint tensors onto blocks with two shapes of mapping, named apart:
- `BlockLayout`: one block, canonical tensor name -> the checkpoint tensors it is built from (several
  are concatenated along the output dimension: fused q/k/v, fused gate/up);
- `CheckpointLayout`: the whole model, block name -> its BlockLayout.
"""

from __future__ import annotations

BlockLayout = dict[str, tuple[str, ...]]
CheckpointLayout = dict[str, BlockLayout]
