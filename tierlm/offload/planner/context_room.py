"""How much context a placement's budget holds at each KV cache format (`tierlm plan` shows it).

With the weights placed as they are, only the KV cache and the workspace grow with the context
(sizes.py: the cache per token, attention's score and mask rows, the rotary tables); everything
else the device tier is charged stays. The room per format is the longest context per sequence
(at the profile's batch) whose charges still fit the device budget, up to the model's maximum.
"""

from __future__ import annotations

from dataclasses import replace

from tierlm.kv.formats import FORMATS
from tierlm.offload.placement import DEVICE
from tierlm.offload.planner.context import _Context
from tierlm.offload.sizes import kv_cache_bytes, workspace_bytes


def context_room(ctx: _Context, device_charges: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """(format, tokens) for every KV format the model's heads can be held in: the most context
    per sequence the device budget holds beside `device_charges`' other items (0: not even 16
    tokens)."""
    budget = ctx.profile.device_memory
    fixed = sum(device_charges.values()) - device_charges["kv_cache"] - device_charges["workspace"]
    most = ctx.config.max_position_embeddings

    def fits(tokens: int, name: str) -> bool:
        profile = replace(ctx.profile, context_length=tokens, kv_cache=name, context_asked=None)
        grown = kv_cache_bytes(ctx.config, profile, ctx.accelerator, len(ctx.stage))
        grown += workspace_bytes(ctx.config, ctx.sizes, profile, ctx.accelerator, logits=ctx.samples)
        return fixed + grown <= budget

    room = []
    for name, held in FORMATS.items():
        if not held.unsupported(ctx.config.head_dim):
            room.append((name, longest_context(lambda tokens: fits(tokens, name), most)))
    return tuple(room)


def longest_context(fits, most: int) -> int:
    """The most tokens in [16, most] for which `fits(tokens)` holds (it holds for every shorter
    context when it holds for one), by bisection; 0 when not even 16 do."""
    if most < 16 or not fits(16):
        return 0
    low, high = 16, most
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low
