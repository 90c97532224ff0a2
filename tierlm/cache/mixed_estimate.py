"""`mixed:SIZE`'s choice of int8 or int4 per weight with no weights at hand, estimated from the
shapes alone (`quant.mixed.GAUSSIAN_ERROR`): what a plan from config.json predicts and what a
synthetic artifact stores. A conversion measures the choice instead (cache/sensitivity.py).

No torch here: the planner (offload/sizes.py) predicts a mixed mode's sizes with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tierlm.cache.encodings import keeps_float
from tierlm.quant import mixed
from tierlm.quant.modes import QuantMode, parse_quant_mode


def estimated_modes(blocks: Mapping[str, Mapping[str, tuple[int, ...]]], mode: QuantMode,
                    part_bytes: Callable, block_padding: int = 0) -> dict[str, str]:  # fmt: skip
    """"block/tensor" -> mode for mixed:SIZE with no weights at hand (a plan from config.json, a
    synthetic artifact): damage estimated per element (`quant.mixed.GAUSSIAN_ERROR`).
    `blocks`: block -> {tensor: shape}; `part_bytes(shape, mode, name) -> int` as in
    sensitivity.py `choose_modes`; `block_padding` the most a block's alignment adds."""
    weights, fixed = [], block_padding * len(blocks)
    for block, tensors in blocks.items():
        for name, shape in tensors.items():
            if keeps_float(name, shape):
                fixed += part_bytes(shape, mode, name)
            else:
                weights.append(mixed.estimated_candidate(f"{block}/{name}", shape, lambda s, m: part_bytes(s, parse_quant_mode(m), None)))
    return mixed.allocate(weights, mode.target_bytes - fixed)
