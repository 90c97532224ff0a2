"""A mixture-of-experts model's routed experts (`experts.{layer}.{expert}`), placed after every
dense block: they fill what the device has left, hottest first (persisted routing counts;
uniform before the first run: spread evenly over the layers), charged as `expert_slots` slots
("experts") plus `expert_stream_slots` slots for reading cold ones ("expert_stream", top_k per
layer in flight, twice that with prefetch so the next layer's reads overlap this one's
compute). The rest go to host RAM while it fits (a separate host tier), else disk.

Cold experts in host RAM beside an accelerator are computed by the CPU where they lie when a
host matmul of their bytes beats copying them over the link (`host_computes_expert`, Fiddler's
rule; the runtime's expert cache applies the same one), and streamed otherwise. Their order and
split are context.py's `_Experts` and `_Split`; what they cost a step is cost.py's.
"""

from __future__ import annotations

from typing import Mapping

from tierlm.offload.bandwidths import MOE, Bandwidths
from tierlm.offload.placement import DEVICE, DISK, HOST, ExpertLayer
from tierlm.offload.planner.charges import _all_streamed, _budgets, _charges
from tierlm.offload.planner.context import _Context, _Split
from tierlm.offload.planner.cost import _rate


def _fill_experts(ctx: _Context, tiers: Mapping[str, str]) -> _Split | None:
    """The experts' split once the dense blocks are placed as `tiers`: as many resident as the
    device tier has room for, then as many in host RAM as fit there (a separate host tier), the
    rest on disk; None when some would need disk and disk_offload is false."""
    experts = ctx.experts
    if experts is None:
        return _Split()
    computes, budgets, count, slot = _all_streamed(tiers), _budgets(ctx), experts.count, experts.slot_bytes
    device_left = budgets[DEVICE] - sum(_charges(ctx, tiers, computes, _Split(), host_compute=True)[DEVICE].values())
    if device_left < 0:
        return None
    # Resident all, the stream slots are not needed either.
    device = count if count * slot <= device_left + experts.stream_bytes else min(count, device_left // slot)
    rest = count - device
    host = 0
    if rest and ctx.separate_host:
        def host_total(on_host: int) -> int:
            return sum(_charges(ctx, tiers, computes, _Split(device, on_host), host_compute=True)[HOST].values())

        if host_total(rest) <= budgets[HOST]:
            host = rest
        else:
            # One expert on host puts every fixed host charge in place (workspace, pinned stream slots).
            host_left = budgets[HOST] - (host_total(1) - experts.prefix[device + 1] + experts.prefix[device])
            host = max(0, min(rest - 1, host_left // slot))
            while host and host_total(host) > budgets[HOST]:
                host -= 1
    if device + host < count and not ctx.profile.disk_offload:
        return None
    return _Split(device, host)


def host_computes_expert(bandwidths: Bandwidths, nbytes: int, params: int, rows: int = 1) -> bool:
    """Fiddler's rule for a cold expert in host RAM beside an accelerator: compute it on the CPU
    where it lies when that beats copying its bytes over the link and computing it on the device
    (`rows`: token rows that chose it). The planner and the runtime's expert cache both use it."""
    bw = bandwidths
    flops = 2.0 * params * rows
    on_host = max(nbytes / _rate(bw.host_bytes_per_s), flops / _rate(bw.host_flops))
    moved = nbytes / _rate(bw.link_bytes_per_s) + max(nbytes / _rate(bw.device_bytes_per_s), flops / _rate(bw.device_flops))
    return on_host < moved


def _host_computes_experts(ctx: _Context, split: _Split) -> bool:
    experts = ctx.experts
    if experts is None or not split.host or not ctx.accelerator or ctx.bandwidths is None:
        return False
    block = experts.order[split.device]
    return host_computes_expert(ctx.bandwidths.for_path(MOE), ctx.sizes.bytes_used(block), ctx.sizes.params[block])


def _expert_layers(ctx: _Context, split: _Split) -> tuple[ExpertLayer, ...]:
    """Per sparse layer: resident experts, expected hit rate (their shares summed), and the
    expected expert bytes one token reads from each tier (top_k x share x bytes, summed)."""
    experts = ctx.experts
    if experts is None:
        return ()
    tier_of = {block: split.tier(index) for index, block in enumerate(experts.order)}
    out = []
    for layer, blocks in experts.layers.items():
        per_tier = dict.fromkeys((DEVICE, HOST, DISK), 0.0)
        for block in blocks:
            per_tier[tier_of[block]] += min(1.0, experts.top_k * experts.share[block]) * ctx.sizes.bytes_used(block)
        resident = [b for b in blocks if tier_of[b] == DEVICE]
        host_computed = sum(1 for b in blocks if tier_of[b] == HOST) if split.host_compute else 0
        out.append(ExpertLayer(layer, len(blocks), len(resident), sum(experts.share[b] for b in resident),
                               per_tier, host_computed))  # fmt: skip
    return tuple(out)


def _expert_note(ctx: _Context, split: _Split) -> str:
    experts, routing = ctx.experts, ctx.routing
    counted = routing is not None and any(routing.count(layer, e) > 0 for layer in routing.layers
                                          for e in range(routing.experts))  # fmt: skip
    basis = "hottest by the saved routing counts" if counted else "no routing counts yet: spread evenly"
    text = f"experts: {split.device} of {experts.count} resident ({basis})"
    if split.device < experts.count:
        text += f"; cold ones read through {experts.stream_slots} stream slots"
        if split.host_compute:
            text += ", those in host RAM computed on the CPU (a host matmul beats the link)"
    return text
