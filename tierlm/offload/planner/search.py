"""`plan`: every block of a model placed within a profile's budgets, or a refusal before
anything loads; `check_fits`: the same refusal without the cost model.

A pure function of (config, block sizes, profile, bandwidths): no I/O and no torch. The caller
measures the baseline, the bandwidths and the process's limits and passes them in, and the
profiles a refusal may suggest (`fallbacks`: runtime/loader.py's `shipped_fallbacks`).

The steps: the profile is capped at the process's real limits (limits.py); the dense blocks take
their tiers, the most resident first (tiers.py), then a mixture-of-experts model's routed
experts (experts.py) and the LoRA variants (variants.py); every tier's charges (charges.py) must
fit its budget; the cost model (cost.py) picks where host blocks compute and predicts the
speed. When nothing fits, refusal.py says why and what would.

A pipeline stage (`layers`, tierlm/stages.py; offload/stage_planner.py splits the model) is
planned like a model of its own blocks: `sizes` holds only them (an earlier stage has no norm or
head, a later one no embedding, so a middle stage may stream every layer), its KV cache and
per-layer dispatch are its own layers', the logits workspace is charged where logits are held
(the first stage samples, the last computes them) and the per-token overhead to the first stage.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from tierlm.blocks import EMBED, is_layer, layer_index
from tierlm.config import ModelConfig
from tierlm.device.memory import MemoryLimits
from tierlm.errors import TierlmError
from tierlm.offload.bandwidths import Bandwidths
from tierlm.offload.placement import DEVICE, HOST, BlockPlacement, Placement
from tierlm.offload.planner.charges import _all_streamed, _budgets, _charges, _owns, _streamed
from tierlm.offload.planner.context import _Context, _Split
from tierlm.offload.planner.cost import _step_time, _terms, figure_sources, step_seconds
from tierlm.offload.planner.experts import _expert_layers, _expert_note, _host_computes_experts
from tierlm.offload.planner.limits import _cap_notes, cap_profile
from tierlm.offload.planner.refusal import _limit_refusal, _refusal, _shortfall
from tierlm.offload.planner.tiers import _choose_compute, _fitting_tiers, _units
from tierlm.offload.planner.context import VariantCharge
from tierlm.offload.planner.context_room import context_room
from tierlm.offload.planner.variants import _place_variants
from tierlm.offload.sizes import PREFILL_CHUNK, BlockSizes, context_tokens, largest_mixed_size, sizes_from_config
from tierlm.profile import Profile
from tierlm.quant.mixed import mode_bytes, mode_counts
from tierlm.quant.modes import quant_text


def plan(
    config: ModelConfig,
    sizes: BlockSizes,
    profile: Profile,
    bandwidths: Bandwidths,
    *,
    accelerator: bool,
    baseline_bytes: int,
    fallbacks: Sequence[Profile] = (),
    limits: MemoryLimits | None = None,
    routing=None,
    variants: Sequence[VariantCharge] = (),
    layers: range | None = None,
) -> Placement:
    """Place every block of `sizes` within `profile`'s budgets, or refuse before anything loads.

    `baseline_bytes`: the process's RSS before weights (host RAM; on CPU-only the RAM tier).
    `fallbacks`: profiles a refusal may suggest, from the caller (the loader and `tierlm plan` pass
    the shipped ones: runtime/loader.py `shipped_fallbacks`); none given, no profile is suggested.
    `limits`: what the process really may use (device/memory.py `process_limits`); every budget
    is capped at them (see `cap_profile`) and the placement notes each cap.
    `routing`: a mixture-of-experts model's RoutingCounts (offload/routing_counts.py; sizes.py
    `expected_routing` reads them beside the artifact): the hottest experts become resident.
    None: every expert equally likely.
    `variants`: LoRA variants served beside the base, placed after it (variants.py).
    `layers`: a pipeline stage's decoder layers (tierlm/stages.py; None: the whole model):
    `sizes` then holds that stage's blocks (`BlockSizes.only`), and the KV cache, the logits and
    the per-layer dispatch cost are charged for that stage alone (see `_Context.stage`).
    Raises TierlmError naming the shortfall in GiB and the smallest profile / quant that fits;
    when only a real limit stops the profile from fitting, naming the limit and what is needed.
    """
    effective, caps = cap_profile(profile, limits, accelerator)
    stage = _stage_layers(config, sizes, layers)
    placement = _attempt(_Context(config, sizes, effective, bandwidths, accelerator, baseline_bytes, routing,
                                  variants=tuple(variants), layers=stage))  # fmt: skip
    if placement is None:
        check_fits(config, sizes, profile, accelerator=accelerator, baseline_bytes=baseline_bytes,
                   fallbacks=fallbacks, limits=limits, bandwidths=bandwidths, variants=variants,
                   layers=layers)  # fmt: skip
        raise AssertionError("check_fits accepted what _attempt refused")  # the two share _fitting_tiers
    return replace(placement, notes=_cap_notes(caps, profile, effective) + placement.notes)


def check_fits(
    config: ModelConfig,
    sizes: BlockSizes,
    profile: Profile,
    *,
    accelerator: bool,
    baseline_bytes: int,
    fallbacks: Sequence[Profile] = (),
    limits: MemoryLimits | None = None,
    bandwidths: Bandwidths | None = None,
    variants: Sequence[VariantCharge] = (),
    layers: range | None = None,
) -> None:
    """Raise the TierlmError `plan` raises when no placement fits; return when one does.

    Whether something fits does not depend on the bandwidths, so a caller can refuse before the
    machine is probed (the probe runs in a child, which a tight cgroup limit would kill).
    """
    effective, caps = cap_profile(profile, limits, accelerator)
    ctx = _Context(config, sizes, effective, bandwidths, accelerator, baseline_bytes, variants=tuple(variants),
                   layers=_stage_layers(config, sizes, layers))  # fmt: skip
    found = _fitting_tiers(ctx)
    if found is not None:
        tiers, split = found
        _place_variants(ctx, _charges(ctx, tiers, _all_streamed(tiers), split, host_compute=True))  # may refuse
        return
    own = replace(ctx, profile=profile)
    if caps and _fitting_tiers(own) is not None:  # the profile fits; the process's limits do not
        raise _limit_refusal(own, limits, caps, fallbacks)
    raise _refusal(own, _shortfall(own, _units(own)), fallbacks, limits)  # the profile's own numbers


def _stage_layers(config: ModelConfig, sizes: BlockSizes, layers: range | None) -> range | None:
    """`layers` checked against the model and against the decoder layers `sizes` holds."""
    if layers is None:
        return None
    total = config.num_hidden_layers
    if layers.step != 1 or not layers or layers.start < 0 or layers.stop > total:
        raise ValueError(f"a stage's layers are a non-empty range within 0-{total - 1}, not {layers}")
    held = {layer_index(name) for name in sizes.names if is_layer(name)}
    if held != set(layers):
        raise ValueError(f"sizes hold layers {sorted(held)[:3]}... but the stage runs {layers}: "
                         f"pass sizes.only(span.blocks(sizes.names))")  # fmt: skip
    return layers


def _attempt(ctx: _Context) -> Placement | None:
    """The placement with the most resident units (then the most host units) that fits, if any."""
    found = _fitting_tiers(ctx)
    if found is None:
        return None
    tiers, split = found
    split = replace(split, host_compute=_host_computes_experts(ctx, split))
    computes = _choose_compute(ctx, tiers, split)
    variants, charges = _place_variants(ctx, _charges(ctx, tiers, computes, split))
    return _placement(ctx, tiers, computes, split, charges, variants)


def _placement(ctx: _Context, tiers, computes, split: "_Split", charges, variants=()) -> Placement:
    sizes, experts = ctx.sizes, ctx.experts
    tiers, computes = dict(tiers), dict(computes)
    if experts is not None:
        for index, block in enumerate(experts.order):
            tiers[block] = split.tier(index)
            computes[block] = HOST if tiers[block] == HOST and split.host_compute else DEVICE
    # A tied head owns no bytes: its tier and compute follow the embedding it reads.
    blocks = tuple(
        BlockPlacement(name, tiers[name], sizes.nbytes[name] if _owns(sizes, name) else 0, computes[name])
        for name in sizes.names
    )
    streamed = _streamed({b: tiers[b] for b in ctx.dense}, computes)
    decode_terms = _terms(ctx, tiers, computes, split, ctx.profile.batch_size, prefill=False)
    decode_s, decode_limit = step_seconds(decode_terms, ctx.profile.prefetch_depth)
    # The same step with every sequence at the end of its context: the KV cache read grows with it.
    context = context_tokens(ctx.config, ctx.profile)
    full_s, _ = step_seconds(_terms(replace(ctx, kv_position=context), tiers, computes, split, ctx.profile.batch_size,
                                    prefill=False), ctx.profile.prefetch_depth)  # fmt: skip
    prefill_s, _ = _step_time(ctx, tiers, computes, split, prefill=True)
    chunk = min(PREFILL_CHUNK, context_tokens(ctx.config, ctx.profile))
    origin = "predicted from config.json" if sizes.source == "config" else "from the artifact manifest"
    notes = [f"weights {quant_text(sizes.quant)} ({origin})"]
    if not ctx.separate_host:
        notes.append("CPU-only: device and host are one RAM tier bounded by device_memory")
    elif not ctx.accelerator:
        notes.append("CPU-only with emulate_host_tier: host blocks are copied into the device tier's ring")
    if tiers.get(EMBED, DEVICE) != DEVICE:
        notes.append(f"embedding on {tiers[EMBED]}: rows fetched on demand through the device hot cache")
    notes.append(f"decode prediction: start of a conversation; at its end ({context:,} tokens) each step also reads "
                 "the KV cache")
    if experts is not None:
        notes.append(_expert_note(ctx, split))
    if variants:
        notes.append("LoRA variants beside the base: " + ", ".join(
            f"{v.name} {v.mode} {v.nbytes / 2**20:.2f} MiB on {v.tier}" for v in variants))
    return Placement(
        blocks=blocks,
        budgets=_budgets(ctx),
        charges=charges,
        ring_slots=ctx.profile.prefetch_depth + 1 if streamed else 0,
        ring_slot_bytes=max((sizes.bytes_used(b) for b in streamed), default=0),
        hot_cache_bytes=charges[DEVICE]["hot_cache"],
        predicted_prefill_tokens_per_s=chunk / prefill_s,
        predicted_decode_tokens_per_s=ctx.profile.batch_size / decode_s,
        predicted_decode_full_context_tokens_per_s=ctx.profile.batch_size / full_s,
        binding_limit=decode_limit,
        notes=tuple(notes),
        expert_slots=split.device,
        expert_stream_slots=experts.stream_slots if experts is not None and split.device < experts.count else 0,
        expert_slot_bytes=experts.slot_bytes if experts is not None else 0,
        expert_layers=_expert_layers(ctx, split),
        variants=tuple(variants),
        weight_modes=mode_counts(sizes.tensor_modes),
        weight_mode_bytes=mode_bytes(sizes.tensor_modes, sizes.tensor_bytes),
        decode_sources=figure_sources(ctx, {b: tiers[b] for b in ctx.dense}, decode_terms, decode_limit),
        context_room=context_room(ctx, dict(charges[DEVICE])),
        context_limit=ctx.config.max_position_embeddings,
    )


def resident_mixed_size(config: ModelConfig, profile: Profile, bandwidths: Bandwidths, *, accelerator: bool,
                        baseline_bytes: int, limits: MemoryLimits | None = None) -> int | None:  # fmt: skip
    """The largest mixed:SIZE (bytes, a whole MiB) whose predicted artifact `plan` keeps wholly on
    the device under `profile`; None where even every weight at the smallest int4 does not."""
    def resident(size: int) -> bool:
        try:
            sizes = sizes_from_config(config, f"mixed-{size}", accelerator=accelerator)
            placed = plan(config, sizes, profile, bandwidths, accelerator=accelerator,
                          baseline_bytes=baseline_bytes, limits=limits)  # fmt: skip
        except TierlmError:
            return False
        return placed.fully_resident

    return largest_mixed_size(config, resident, accelerator)
