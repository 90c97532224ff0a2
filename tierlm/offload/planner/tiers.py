"""The search's core: which tier each dense block takes, and where host blocks compute.

What becomes resident, in priority order (`_units`; a prefix of this list, the rest is cold):
    1. the final norm (always)       2. the head; tied, the embedding block (the head IS the
    embedding: read whole every token)  3. decoder layers 0, 1, ... (a fixed prefix: an LRU over
    cyclically read layers thrashes)  4. an untied embedding, last: it needs one row per token,
    so when cold it stays on host/disk and rows come through the device hot cache.
A cold head costs the device a ring of head-sized slots, more than keeping it, so in practice
it is resident whenever anything is. Fits are checked with every cold block counted as
streamed (the most any compute choice costs), then the cost model picks the compute
(`_choose_compute`). A mixture-of-experts model's routed experts come after every dense unit
(experts.py `_fill_experts`).

Where cold blocks go: CPU-only -> disk (or, with emulate_host_tier, the host tier while it fits,
streamed into the device tier through the ring); accelerator -> host RAM while it fits, else disk
(disk_offload). A host block on an accelerator is either computed by the CPU where it lies or
streamed to the device: the split is the one with the best predicted decode time at the
profile's batch size, streamed layers spread evenly among the host ones so prefetch can hide
their copies behind the CPU's work.
"""

from __future__ import annotations

from typing import Mapping

from tierlm.blocks import EMBED, HEAD, NORM, is_layer, layer_block
from tierlm.offload.placement import DEVICE, DISK, HOST
from tierlm.offload.planner.charges import _all_streamed, _charges, _fits
from tierlm.offload.planner.context import _Context, _Split, _Unit
from tierlm.offload.planner.cost import _step_time
from tierlm.offload.planner.experts import _fill_experts


def _units(ctx: _Context) -> list[_Unit]:
    """Residency priority: norm, head (tied: the embedding), layers in order, untied embedding;
    a pipeline stage's only those it holds (a middle stage: its layers alone)."""
    sizes, held = ctx.sizes, set(ctx.sizes.names)
    tied = sizes.source_block(HEAD) == EMBED
    units = [_Unit((NORM,), sizes.nbytes[NORM])] if NORM in held else []
    if HEAD in held:
        units.append(_Unit((EMBED, HEAD), sizes.nbytes[EMBED]) if tied else _Unit((HEAD,), sizes.nbytes[HEAD]))
    units += [_Unit((layer_block(i),), sizes.nbytes[layer_block(i)]) for i in ctx.stage]
    if not tied and EMBED in held:
        units.append(_Unit((EMBED,), sizes.nbytes[EMBED]))
    return units


def _least_resident(units: list[_Unit]) -> int:
    """Units that must stay resident: the final norm, where the stage has it (always resident);
    a middle stage may stream every layer."""
    return 1 if units[0].blocks == (NORM,) else 0


def _fitting_tiers(ctx: _Context) -> tuple[dict[str, str], "_Split"] | None:
    """Each dense block's tier, and the routed experts' split between the tiers, in the placement
    with the most resident units (then the most host units, then the most resident experts and
    host experts) that fits; None when nothing fits.

    Fits are checked with every cold block counted as streamed (the most a compute choice can
    cost), so the cost model runs once, on the placement that is kept. The device tier's charges
    then depend only on what is resident, the host tier's only on what is in host RAM. Experts
    come after every dense unit: a layer's dense part is read by every token, an expert by a few.
    """
    profile = ctx.profile
    units = _units(ctx)
    for resident in range(len(units), _least_resident(units) - 1, -1):
        cold = units[resident:]
        tiers = {b: DEVICE for u in units[:resident] for b in u.blocks}
        tiers.update({b: DISK for u in cold for b in u.blocks})
        if not _fits(ctx, _charges(ctx, tiers, _all_streamed(tiers), _Split(), host_compute=True), (DEVICE,)):
            continue
        if not ctx.separate_host:
            on_host_options: range | list[int] = [0]
        elif profile.disk_offload:
            on_host_options = range(len(cold), -1, -1)
        else:
            on_host_options = [len(cold)]
        for on_host in on_host_options:
            tiers.update({b: HOST if i < on_host else DISK for i, u in enumerate(cold) for b in u.blocks})
            if any(t == DISK for t in tiers.values()) and not profile.disk_offload:
                continue
            split = _fill_experts(ctx, tiers)
            if split is not None and _fits(ctx, _charges(ctx, tiers, _all_streamed(tiers), split, host_compute=True)):
                return tiers, split
    return None


def _choose_compute(ctx: _Context, tiers: Mapping[str, str], split: "_Split") -> dict[str, str]:
    """Where each dense block computes: on the device, except host blocks the cost model gives the CPU."""
    computes = _all_streamed(tiers)  # a cold embedding's rows are gathered where it lies
    if not ctx.accelerator:
        return computes  # CPU-only: one processor; emulated host blocks are streamed
    host_layers = [b for b in tiers if tiers[b] == HOST and is_layer(b)]
    head_options = (DEVICE, HOST) if tiers.get(HEAD) == HOST else (DEVICE,)
    best, best_time = computes, None
    for head in head_options:
        for streamed in range(len(host_layers) + 1):
            trial = dict(computes)
            if HEAD in tiers:  # a pipeline's earlier stages have no head
                trial[HEAD] = head
            for index, block in enumerate(host_layers):
                trial[block] = DEVICE if _spread(index, streamed, len(host_layers)) else HOST
            seconds = _step_time(ctx, tiers, trial, split, prefill=False)[0]
            if best_time is None or seconds < best_time * (1 - 1e-9):
                best, best_time = trial, seconds
    return best


def _spread(index: int, chosen: int, total: int) -> bool:
    """Whether item `index` of `total` is among `chosen` spread evenly (Bresenham)."""
    return (index + 1) * chosen // total > index * chosen // total
