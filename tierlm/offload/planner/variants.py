"""LoRA variants served beside the base, placed after the whole base (adding one never moves a
base block), hottest first (request counts, else the order given): resident while the device
holds it, else in host RAM (a separate host tier), else, merged, read from its variant artifact
per use (an unmerged variant's low-rank factors have no copy on disk: resident or host, or it is
refused: refusal.py `_variant_refusal`). What each costs the tiers is charges.py's "variants"
and "variant_stream".
"""

from __future__ import annotations

from typing import Mapping

from tierlm.offload.placement import DEVICE, DISK, HOST, VariantPlacement
from tierlm.offload.planner.charges import _fits
from tierlm.offload.planner.context import VariantCharge, _Context
from tierlm.offload.planner.refusal import _variant_refusal


def _place_variants(ctx: _Context, charges) -> tuple[tuple[VariantPlacement, ...], dict]:
    """Each variant's tier, hottest first (uses, then the order given), and `charges` (the base's)
    with the variants' added. A variant is resident while the device tier holds it, else in host
    RAM while a separate host tier holds it, else, merged and with disk_offload, read from disk per
    use; one held off the device costs the device a slot for its largest block. Base blocks never
    move for a variant. A TierlmError names the first variant that fits nowhere."""
    if not ctx.variants:
        return (), charges
    placed: dict[str, str] = {}
    for variant in sorted(ctx.variants, key=lambda v: -v.uses):
        options = [DEVICE] + ([HOST] if ctx.separate_host else []) + ([DISK] if variant.streams and ctx.profile.disk_offload else [])
        tier = next((t for t in options if _fits(ctx, _variant_charges(ctx, charges, {**placed, variant.name: t}))), None)
        if tier is None:
            raise _variant_refusal(ctx, variant, _variant_charges(ctx, charges, placed))
        placed[variant.name] = tier
    found = tuple(VariantPlacement(v.name, v.mode, v.nbytes, placed[v.name]) for v in ctx.variants)
    return found, _variant_charges(ctx, charges, placed)


def _variant_charges(ctx: _Context, charges, placed: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """`charges` plus the variants of `placed` {name: tier}: held bytes on their tier, and one
    slot (the largest block of any variant read per use) on the device; on an accelerator a
    disk variant's reads pass through a host slot too."""
    by_name = {v.name: v for v in ctx.variants}
    chosen = [(by_name[name], tier) for name, tier in placed.items()]
    out = {tier: dict(items) for tier, items in charges.items()}
    out[DEVICE]["variants"] = sum(v.nbytes for v, tier in chosen if tier == DEVICE)
    out[DEVICE]["variant_stream"] = max((v.slot_bytes for v, tier in chosen if tier != DEVICE), default=0)
    if HOST in out:
        out[HOST]["variants"] = sum(v.nbytes for v, tier in chosen if tier == HOST)
        disk = [v.slot_bytes for v, tier in chosen if tier == DISK]
        out[HOST]["variant_stream"] = max(disk, default=0) if ctx.accelerator else 0
    return out
