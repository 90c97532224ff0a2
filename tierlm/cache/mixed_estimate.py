"""`mixed:SIZE`'s choice of int8 or int4 per weight with no weights at hand, estimated from the
shapes alone (`quant.mixed.GAUSSIAN_ERROR`): what a plan from config.json predicts and what a
synthetic artifact stores. A conversion measures the choice instead (cache/sensitivity.py).
Also the smallest artifact a mixed:SIZE can make of a model (`mixed_floor`), which a size below
is refused by before anything is read or calibrated (`check_mixed_size`).

No torch here: the planner (offload/sizes.py) predicts a mixed mode's sizes with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tierlm.cache.encodings import keeps_float, part_bytes
from tierlm.cache.manifest import BLOCK_ALIGN, PART_ALIGN
from tierlm.config import ModelConfig
from tierlm.errors import TierlmError
from tierlm.models import family_description
from tierlm.quant import mixed
from tierlm.quant.modes import QuantMode, mode_text, parse_quant_mode

_MIB = 2**20


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
    _refuse_below(mode, fixed + sum(min(c.sizes.values()) for c in weights), "this model")
    return mixed.allocate(weights, mode.target_bytes - fixed)


def aligned_bytes(shape, mode: QuantMode, name) -> int:
    """A tensor's stored bytes with each part rounded up to its alignment in a block: an upper
    bound on what it adds, so choices made with it fit their size target."""
    return sum(-(-n // PART_ALIGN) * PART_ALIGN for n in part_bytes(shape, mode, name))


def mixed_floor(config: ModelConfig) -> int:
    """The smallest artifact mixed:SIZE makes of the model `config` describes, as a conversion
    counts it (`aligned_bytes`, each block's alignment at most): every 2-D weight in its smallest
    option of `quant.mixed.OPTIONS`, the tensors that stay float as they are, a tied head once."""
    family = family_description(config)
    layout, shapes = family.checkpoint_layout(config), family.canonical_shapes(config)
    options = [parse_quant_mode(option) for option in mixed.OPTIONS]
    total, seen = BLOCK_ALIGN * len(layout), set()
    for entries in layout.values():
        for name, sources in entries.items():
            if sources in seen:
                continue  # a tied head: the embedding's tensor
            seen.add(sources)
            shape = shapes[name]
            if keeps_float(name, shape):
                total += aligned_bytes(shape, options[0], name)
            else:
                total += min(aligned_bytes(shape, option, None) for option in options)
    return total


def check_mixed_size(config: ModelConfig, mode: QuantMode, model: str) -> None:
    """Refuse a mixed:SIZE `mode` below `model`'s floor (`mixed_floor`) at once: no weight read,
    no calibration run. Any other mode passes."""
    if mode.mixed and mode.target_bytes is not None:
        _refuse_below(mode, mixed_floor(config), model)


def _refuse_below(mode: QuantMode, floor: int, model: str) -> None:
    """TierlmError in whole MiB (the floor rounded up) when `mode`'s size is below `floor` bytes."""
    if mode.target_bytes < floor:
        need = -(-floor // _MIB)
        raise TierlmError(f"{mode_text(mode)} is below {model}'s floor of {need} MiB (every weight at {mixed.OPTIONS[0]})",
                          f"ask for at least mixed:{need}MiB")  # fmt: skip
