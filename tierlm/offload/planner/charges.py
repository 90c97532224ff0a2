"""What each tier is charged for a placement (`_charges`), all of which must fit its budget
(`_budgets`, `_fits`):

    device  resident weights, KV cache, workspace, staging ring (prefetch_depth + 1 slots x the
            largest streamed block), hot cache (embedding rows, when the embedding is not
            resident), headroom; on a CPU-only machine also the baseline, since device and host
            are one RAM tier there (no "host" entry then; `emulate_host_tier` keeps it separate);
            MoE: expert slots ("experts") and stream slots for cold experts ("expert_stream");
            LoRA variants served beside the base ("variants": the resident ones' own merged blocks
            or low-rank factors, store/variants.py; the base's blocks are charged once;
            "variant_stream": one slot, the largest block of a variant read per use; variants.py)
    host    baseline (RSS measured at start-up), host-tier weights, pinned staging for disk
            blocks (accelerator: the same slot count x the largest disk block), host workspace
            when blocks are computed on the CPU beside an accelerator, headroom; MoE on an
            accelerator: pinned stream slots for experts read from disk ("expert_stream");
            LoRA variants held in host RAM ("variants"), a slot for a disk variant's reads
            on an accelerator ("variant_stream")
    disk    cold blocks (no budget)

The byte formulas of the charges that are not weights are offload/sizes.py's.
"""

from __future__ import annotations

from typing import Mapping

from tierlm.blocks import EMBED
from tierlm.offload.placement import DEVICE, DISK, HOST
from tierlm.offload.planner.context import _Context, _Split
from tierlm.offload.sizes import BlockSizes, host_workspace_bytes, hot_cache_bytes, kv_cache_bytes, workspace_bytes


def _all_streamed(tiers: Mapping[str, str]) -> dict[str, str]:
    computes = {b: DEVICE for b in tiers}
    if tiers.get(EMBED, DEVICE) != DEVICE:
        computes[EMBED] = HOST
    return computes


def _streamed(tiers, computes) -> list[str]:
    """Dense blocks that pass through the ring: cold and computed on the device (never the
    embedding; routed experts have slots of their own)."""
    return [b for b in tiers if b != EMBED and tiers[b] != DEVICE and computes[b] == DEVICE]


def _charges(ctx: _Context, tiers, computes, split: "_Split", *, host_compute: bool = False) -> dict[str, dict[str, int]]:
    """Bytes per tier, itemised. `tiers`, `computes`: the dense blocks'; `split`: the experts'.
    `host_compute`: reserve the host workspace whenever a layer, the head or an expert lies in
    host RAM (the conservative charge used while searching)."""
    sizes, profile, experts = ctx.sizes, ctx.profile, ctx.experts
    # A tied head's bytes are the embedding's: count every source block once.
    def weights(tier):
        dense = sum(sizes.nbytes[b] for b in tiers if tiers[b] == tier and _owns(sizes, b))
        return dense + (split.bytes_on(tier, experts) if tier != DEVICE else 0)

    streamed = _streamed(tiers, computes)
    slots = profile.prefetch_depth + 1 if streamed else 0
    slot_bytes = max((sizes.bytes_used(b) for b in streamed), default=0)
    device = {
        "weights": weights(DEVICE),
        "kv_cache": kv_cache_bytes(ctx.config, profile, ctx.accelerator, len(ctx.stage)),
        "workspace": workspace_bytes(ctx.config, sizes, profile, ctx.accelerator, logits=ctx.samples),
        "staging": slots * slot_bytes,
        "hot_cache": hot_cache_bytes(ctx.config, sizes, ctx.accelerator) if tiers.get(EMBED, DEVICE) != DEVICE else 0,
        "headroom": profile.headroom,
    }
    if experts is not None:  # resident experts in their slots; cold ones read through the stream slots
        device["experts"] = split.device * experts.slot_bytes
        device["expert_stream"] = experts.stream_bytes if split.device < experts.count else 0
    disk = {"weights": weights(DISK)}
    if not ctx.separate_host:
        return {DEVICE: {"baseline": ctx.baseline, **device}, DISK: disk}
    disk_streamed = [b for b in streamed if tiers[b] == DISK]
    host_computed = [b for b in tiers if b != EMBED and tiers[b] == HOST
                     and (computes[b] == HOST or (host_compute and ctx.accelerator))]  # fmt: skip
    host_experts = split.host > 0 and ctx.accelerator and (split.host_compute or host_compute)
    host = {
        "baseline": ctx.baseline,
        "weights": weights(HOST),
        # Disk -> pinned host buffer -> device on accelerators; on CPU disk reads land in the ring.
        "staging": slots * max((sizes.bytes_used(b) for b in disk_streamed), default=0)
        if ctx.accelerator else 0,
        "workspace": host_workspace_bytes(ctx.config, profile) if host_computed or host_experts else 0,
        "headroom": profile.headroom,
    }
    if experts is not None:  # accelerators: disk experts pass through pinned host slots
        host["expert_stream"] = experts.stream_bytes if ctx.accelerator and split.on_disk(experts) else 0
    return {DEVICE: device, HOST: host, DISK: disk}


def _budgets(ctx: _Context) -> dict[str, int | None]:
    budgets: dict[str, int | None] = {DEVICE: ctx.profile.device_memory}
    if ctx.separate_host:
        budgets[HOST] = ctx.profile.host_memory
    budgets[DISK] = None
    return budgets


def _fits(ctx: _Context, charges, tiers: tuple[str, ...] = (DEVICE, HOST)) -> bool:
    budgets = _budgets(ctx)
    return all(budgets.get(tier) is None or sum(charges.get(tier, {}).values()) <= budgets[tier]
               for tier in tiers)  # fmt: skip


def _owns(sizes: BlockSizes, block: str) -> bool:
    """False for a block that stores no bytes of its own (a tied head)."""
    return sizes.source_block(block) == block
