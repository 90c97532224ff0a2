"""The refusals: why no placement fits, with the numbers, and what would.

`_refusal`: the profile's own budgets cannot hold the model (`_shortfall` says by how much and
where), with the smallest weight format and shipped profile that fit. `_limit_refusal`: the
profile would hold it but the process's real limits (limits.py) do not: which limit, what the
profile allows and the least limit that would do. `_variant_refusal`: a LoRA variant fits
nowhere beside the base.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from tierlm.device.memory import MemoryLimits
from tierlm.errors import TierlmError
from tierlm.kv.formats import FORMATS, kv_format
from tierlm.offload.placement import DEVICE, DISK, HOST
from tierlm.offload.planner.charges import _all_streamed, _budgets, _charges, _owns
from tierlm.offload.planner.context import VariantCharge, _Context, _Split, _Unit
from tierlm.offload.planner.context_room import longest_context
from tierlm.offload.planner.limits import GiB, RAM, Cap, _size, cap_profile
from tierlm.offload.planner.tiers import _choose_compute, _fitting_tiers, _least_resident
from tierlm.offload.sizes import largest_mixed_size, mixed_size_text, sizes_from_config
from tierlm.profile import Profile



def _shortfall(ctx: _Context, units: list[_Unit]) -> str:
    """Why no placement fits, with the numbers: the weights (disk_offload false), else the device
    tier's least possible charge, else the host tier's."""
    profile = ctx.profile
    least = _least_resident(units)
    tiers = {b: DEVICE for u in units[:least] for b in u.blocks}
    cold_tier = DISK if profile.disk_offload else (HOST if ctx.separate_host else DEVICE)
    tiers.update({b: cold_tier for u in units[least:] for b in u.blocks})
    count = ctx.experts.count if ctx.experts is not None else 0
    split = {DEVICE: _Split(device=count), HOST: _Split(host=count), DISK: _Split()}[cold_tier]
    if cold_tier == DEVICE:
        charges = _charges(ctx, tiers, {b: DEVICE for b in tiers}, split)
    elif ctx.bandwidths is None:  # no cost model yet: the most any compute choice costs
        charges = _charges(ctx, tiers, _all_streamed(tiers), split, host_compute=True)
    else:
        charges = _charges(ctx, tiers, _choose_compute(ctx, tiers, split), split)
    device_total = sum(charges[DEVICE].values())
    if not profile.disk_offload:
        weights = sum(u.nbytes for u in units) + (ctx.experts.total_bytes if ctx.experts is not None else 0)
        fixed = {k: v for k, v in charges[DEVICE].items() if k not in ("weights", "staging", "experts")}
        grant = profile.device_memory - sum(fixed.values())
        where = "device"
        if ctx.separate_host:
            host_fixed = {k: v for k, v in charges[HOST].items() if k not in ("weights", "staging")}
            grant += profile.host_memory - sum(host_fixed.values())
            where = "device + host"
        short = weights - max(grant, 0)
        if short > 0:
            return (f"its {ctx.sizes.quant} weights ({_gib(weights)}) need {_gib(short)} more than "
                    f"the {where} memory left after fixed charges ({_gib(max(grant, 0))}), and "
                    f"disk_offload is false")  # fmt: skip
    # The device tier's least charge over every resident prefix (a resident head can cost less
    # than the ring slot it would need when streamed).
    for resident in range(least + 1, len(units) + 1):
        trial = {b: DEVICE for u in units[:resident] for b in u.blocks}
        trial.update({b: DISK for u in units[resident:] for b in u.blocks})
        trial_charges = _charges(ctx, trial, _all_streamed(trial), _Split(), host_compute=True)
        if sum(trial_charges[DEVICE].values()) < device_total:
            charges, device_total, least = trial_charges, sum(trial_charges[DEVICE].values()), resident
    if device_total > profile.device_memory:
        items = ", ".join(f"{k} {_gib(v)}" for k, v in charges[DEVICE].items() if v >= 2**20)
        kept = ", ".join(b for u in units[:least] for b in u.blocks if _owns(ctx.sizes, b)) or "nothing"
        return (f"even in its smallest placement (resident: {kept}; the rest streamed) the device "
                f"tier needs {_gib(device_total)} ({items}) "
                f"against a budget of {_gib(profile.device_memory)}: short by "
                f"{_gib(device_total - profile.device_memory)}")  # fmt: skip
    if ctx.separate_host and HOST in charges:
        host_total = sum(charges[HOST].values())
        if host_total > profile.host_memory:
            items = ", ".join(f"{k} {_gib(v)}" for k, v in charges[HOST].items() if v >= 2**20)
            return (f"even with every block cold, the host tier needs {_gib(host_total)} ({items}) "
                    f"against a budget of {_gib(profile.host_memory)}: short by "
                    f"{_gib(host_total - profile.host_memory)}")  # fmt: skip
    return "no placement fits the budgets"


def _refusal(ctx: _Context, shortfall: str, fallbacks, limits) -> TierlmError:
    """The refusal, naming the shortfall and the smallest profile and/or quant mode that fits
    (under the process's real `limits`)."""
    config, sizes, profile, accelerator = ctx.config, ctx.sizes, ctx.profile, ctx.accelerator

    def fits(candidate: Profile, quant: str) -> bool:
        same = quant == sizes.quant
        candidate_sizes = sizes if same else sizes_from_config(config, quant, accelerator=accelerator).only(sizes.names)
        capped = cap_profile(candidate, limits, accelerator)[0]
        return _fitting_tiers(replace(ctx, sizes=candidate_sizes, profile=capped)) is not None

    ordered = _ordered_fallbacks(fallbacks)
    hints = _context_hints(ctx) if profile.context_asked else []
    if profile.context_asked:  # a shipped profile is suggested for the context asked, in its KV format
        ordered = [replace(p, context_length=profile.context_length, context_asked=profile.context_asked,
                           kv_cache=profile.kv_cache) for p in ordered]  # fmt: skip
    # Smaller weight formats, best quality first: fp32 -> bf16 -> int8.
    smaller = {"fp32": ["bf16", "int8"], "bf16": ["int8"], "fp16": ["int8"]}.get(sizes.quant, [])
    quant_fit = next((q for q in smaller if fits(profile, q)), None)
    if quant_fit is not None:
        hints.append(f"--quant {quant_fit} fits profile {profile.name!r}")
    elif not sizes.quant.startswith(("int4", "mixed")) and ctx.layers is None:
        mixed_fit = largest_mixed_size(config, lambda size: fits(profile, f"mixed-{size}"), accelerator)
        if mixed_fit is not None:
            hints.append(f"fits with --quant mixed:{mixed_size_text(mixed_fit)}")
    for quant in [sizes.quant, *smaller]:
        other = next((p for p in ordered if p != profile and fits(p, quant)), None)
        if other is not None:
            hints.append(f"the smallest shipped profile that fits it: --profile {other.name} --quant {quant}")
            break
    hint = "; ".join(hints) if hints else "no shipped profile or quant mode fits it on this machine"
    model = _model_text(ctx)
    return TierlmError(f"the model ({model}) does not fit profile {profile.name!r}: {shortfall}", hint)


def _context_hints(ctx: _Context) -> list[str]:
    """The longest `--context` that fits the profile in its KV format, and in the smaller
    quantized formats when they hold more (the pool too small for the context asked)."""

    def longest(name: str) -> int:
        def fits(tokens: int) -> bool:
            shorter = replace(ctx.profile, context_length=tokens, context_asked=None, kv_cache=name)
            return _fitting_tiers(replace(ctx, profile=shorter)) is not None

        return longest_context(fits, ctx.profile.context_length - 1)  # the context asked does not fit

    held = kv_format(ctx.profile.kv_cache, ctx.accelerator)
    hints = []
    own = longest(ctx.profile.kv_cache)
    if own:
        hints.append(f"--context {own} fits it (KV cache {held.name})")
    for name in ("q8_0", "q4_0"):
        smaller = FORMATS[name]
        if smaller.bits_per_value() < held.bits_per_value() and not smaller.unsupported(ctx.config.head_dim):
            tokens = longest(name)
            if tokens > own:
                hints.append(f"--kv-cache {name} holds --context {tokens}")
                break
    return hints


def _model_text(ctx: _Context) -> str:
    """"80 layers, int8", or for a pipeline stage "layers 20-39 of 80, int8"."""
    layers = ctx.layers
    count = ctx.config.num_hidden_layers
    whole = layers is None or len(layers) == count
    span = f"{count} layers" if whole else f"layers {layers.start}-{layers.stop - 1} of {count}"
    return f"{span}, {ctx.sizes.quant}"


def _ordered_fallbacks(fallbacks: Sequence[Profile] | None) -> list[Profile]:
    """The caller's `fallbacks` (none: no profile to suggest), smallest first."""
    return sorted(fallbacks or (), key=lambda p: (p.device_memory, p.host_memory))


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"


def _limit_refusal(ctx: _Context, limits: MemoryLimits, caps: tuple[Cap, ...], fallbacks) -> TierlmError:
    """The profile fits but the process's real limits do not hold it: say which limit, what the
    profile allows, and the least limit under which this model would run."""
    needs = [(cap, _least_limit(ctx, limits, cap)) for cap in caps]
    short = [(cap, need) for cap, need in needs if need is not None and need > cap.limit]
    short = short or [(cap, cap.allowed) for cap in caps]
    said = "; ".join(f"profile {ctx.profile.name!r} allows {_size(cap.allowed)} of {cap.resource} but this "
                     f"process is limited to {_size(cap.limit)} ({cap.source})" for cap, _ in short)  # fmt: skip
    needed = " and ".join(f"{_size(need, up=True)} of {cap.resource}" for cap, need in short)
    model = _model_text(ctx)
    raise_it = " and ".join(
        f"raise the {cap.source} to at least {_size(need, up=True)}" if cap.resource == RAM
        else f"free accelerator memory until {_size(need, up=True)} is free"
        for cap, need in short
    )  # fmt: skip
    other = _smallest_fitting(ctx, limits, fallbacks)
    hint = f"try --profile {other.name}, or {raise_it}" if other else raise_it
    return TierlmError(f"{said}; the model ({model}) needs at least {needed}", hint)


def _least_limit(ctx: _Context, limits: MemoryLimits, cap: Cap) -> int | None:
    """The least limit on `cap.resource` (to 1 MiB, up to what the profile allows) under which
    the profile, capped as `cap_profile` caps it, holds the model; the other limits are kept,
    or lifted when they alone already stop it. None when no such limit exists."""
    for others in (limits, MemoryLimits()):
        def fits(limit: int, others=others) -> bool:
            trial = _with_limit(others, cap.resource, limit)
            return _fitting_tiers(replace(ctx, profile=cap_profile(ctx.profile, trial, ctx.accelerator)[0])) is not None

        if not fits(cap.allowed):
            continue
        low, high = 0, cap.allowed  # low fails (or is nothing), high fits
        while high - low > 2**20:
            middle = (low + high) // 2
            low, high = (low, middle) if fits(middle) else (middle, high)
        return high
    return None


def _with_limit(limits: MemoryLimits, resource: str, value: int) -> MemoryLimits:
    if resource == RAM:
        return replace(limits, ram=value, ram_source=limits.ram_source or "memory limit")
    return replace(limits, device_free=value)


def _smallest_fitting(ctx: _Context, limits: MemoryLimits, fallbacks) -> Profile | None:
    """The smallest other profile that holds the model under the process's limits."""
    for candidate in _ordered_fallbacks(fallbacks):
        if candidate.name == ctx.profile.name:
            continue
        capped = cap_profile(candidate, limits, ctx.accelerator)[0]
        if _fitting_tiers(replace(ctx, profile=capped)) is not None:
            return candidate
    return None


def _variant_refusal(ctx: _Context, variant: VariantCharge, charges) -> TierlmError:
    left = {tier: budget - sum(charges[tier].values()) for tier, budget in _budgets(ctx).items() if budget is not None}
    room = ", ".join(f"the {tier} tier {_size(max(n, 0))}" for tier, n in left.items())
    if variant.streams and ctx.profile.disk_offload:
        how = f"nor the {_size(variant.slot_bytes, up=True)} slot reading it from disk per use needs"
    elif variant.streams:
        how = "and the profile's disk_offload is false, so it cannot be read from disk per use"
    else:
        how = "and an unmerged variant's low-rank factors have no copy on disk to read per use"
    hint = "serve fewer variants at once (DELETE /v1/adapters/NAME frees one) or use a larger --profile"
    return TierlmError(
        f"LoRA variant {variant.name!r} ({variant.mode}, {_size(variant.nbytes, up=True)}) does not fit beside the base "
        f"and the variants placed before it: {room} left holds neither it {how}", hint)  # fmt: skip
