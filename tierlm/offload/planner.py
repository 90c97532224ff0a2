"""The planner: a pure function of (config, block sizes, profile, bandwidths) to a Placement.

No I/O and no torch: the caller measures the baseline, the bandwidths and the process's limits
and passes them in, and the profiles a refusal may suggest (`fallbacks`: runtime/loader.py's
`shipped_fallbacks`). Presentation lives elsewhere: `placement_to_dict` beside Placement, the
human text in cli/plan_view.py.

What each tier is charged (`Placement.charges`), all of which must fit its budget:

    device  resident weights, KV cache, workspace, staging ring (prefetch_depth + 1 slots x the
            largest streamed block), hot cache (embedding rows, when the embedding is not
            resident), headroom; on a CPU-only machine also the baseline, since device and host
            are one RAM tier there (no "host" entry then; `emulate_host_tier` keeps it separate);
            MoE: expert slots ("experts") and stream slots for cold experts ("expert_stream");
            LoRA variants served beside the base ("variants": the resident ones' own merged blocks
            or low-rank factors, store/variants.py; the base's blocks are charged once;
            "variant_stream": one slot, the largest block of a variant read per use)
    host    baseline (RSS measured at start-up), host-tier weights, pinned staging for disk
            blocks (accelerator: the same slot count x the largest disk block), host workspace
            when blocks are computed on the CPU beside an accelerator, headroom; MoE on an
            accelerator: pinned stream slots for experts read from disk ("expert_stream");
            LoRA variants held in host RAM ("variants"), a slot for a disk variant's reads
            on an accelerator ("variant_stream")
    disk    cold blocks (no budget)

What becomes resident, in priority order (a prefix of this list; the rest is cold):
    1. the final norm (always)       2. the head; tied, the embedding block (the head IS the
    embedding: read whole every token)  3. decoder layers 0, 1, ... (a fixed prefix: an LRU over
    cyclically read layers thrashes)  4. an untied embedding, last: it needs one row per token,
    so when cold it stays on host/disk and rows come through the device hot cache.
Then, for a mixture-of-experts model, the routed experts (`experts.{layer}.{expert}`) fill what
the device has left, hottest first (persisted routing counts; uniform before the first run:
spread evenly over the layers): they are charged as `expert_slots` slots ("experts") plus
`expert_stream_slots` slots for reading cold ones ("expert_stream", top_k per layer in flight,
twice that with prefetch so the next layer's reads overlap this one's compute). The rest go to
host RAM while it fits (a separate host tier), else disk.
LoRA variants come after the whole base (adding one never moves a base block), hottest first
(request counts, else the order given): resident while the device holds it, else in host RAM
(a separate host tier), else, merged, read from its variant artifact per use (an unmerged
variant's low-rank factors have no copy on disk: resident or host, or it is refused).
A cold head costs the device a ring of head-sized slots, more than keeping it, so in practice
it is resident whenever anything is. Fits are checked with every cold block counted as
streamed (the most any compute choice costs), then the cost model picks the compute.

Where cold blocks go: CPU-only -> disk (or, with emulate_host_tier, the host tier while it fits,
streamed into the device tier through the ring); accelerator -> host RAM while it fits, else disk
(disk_offload). A host block on an accelerator is either computed by the CPU where it lies or
streamed to the device: the split is the one with the best predicted decode time at the
profile's batch size, streamed layers spread evenly among the host ones so prefetch can hide
their copies behind the CPU's work.

Cost model (seconds per decode step of `batch_size` tokens; per 512-token chunk for prefill):
    device    sum over device-computed blocks of max(bytes / device_bytes_per_s + rows x
              (1 - hidden / 4096) x per_row_s, 2 x params x tokens / device_flops), rows =
              params / hidden (short rows stream slower than the probe's 4096-wide ones)
    host      the same for CPU-computed blocks with host_bytes_per_s / host_flops
    dispatch  layers x per_block_overhead_s + per_token_overhead_s, both measured by the probe
              on the real decode path (+1 per_block per CPU-computed layer: the hand-over)
    link      bytes crossing host -> device per step / link_bytes_per_s
    disk      bytes read from disk per step / disk_bytes_per_s
    experts   (mixture-of-experts) each routed expert e of a sparse layer, chosen by a token with
              p = min(1, top_k x share_e) (share: routing counts, uniform without), is used in a
              step of t tokens with u = 1 - (1 - p)^t (top_k x share_e at t = 1) and multiplies
              t x p rows: u x its bytes at the computing tier's rate (flops likewise), plus
              u x bytes over the link / from disk when it is cold (host RAM, or disk)
    step = max(device + host + dispatch, link, disk) with prefetch_depth >= 1, else the sum.
Cold experts in host RAM beside an accelerator are computed by the CPU where they lie when a
host matmul of their bytes beats copying them over the link (`host_computes_expert`, Fiddler's
rule; the runtime's expert cache applies the same one), and streamed otherwise.
The binding limit is the largest channel (link or disk when one dominates, else the largest
compute term). Decode reads a resident embedding's rows only and the head once per step;
prefill computes the head for one token (last-position logits). KV-cache reads are left out:
the prediction is for the start of a conversation.

A pipeline stage (`layers`, tierlm/stages.py; offload/stage_planner.py splits the model) is
planned like a model of its own blocks: `sizes` holds only them (an earlier stage has no norm or
head, a later one no embedding, so a middle stage may stream every layer), its KV cache and
per-layer dispatch are its own layers', the logits workspace is charged where logits are held
(the first stage samples, the last computes them) and the per-token overhead to the first stage.

Real limits: a profile is a promise about the process, so its budgets are first capped at what
the process really has (`limits`: the cgroup memory limit, RLIMIT_AS, free accelerator memory,
read by the caller with device/memory.py `process_limits`; `cap_profile`). Within the cap the
plan streams what no longer fits and says so in a note; when even that cannot hold the model,
the refusal names the limit, what the profile allows and the least limit that would do.

Measured runs check the model: `decode_terms` + `step_seconds` predict an existing placement's
decode step, and `implied_bandwidths` gives the figures under which it would take what was
measured (the probe's cache is corrected with them when the two disagree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Mapping, Sequence

from tierlm.blocks import EMBED, HEAD, NORM, expert_of, is_expert, is_layer, layer_block, layer_index
from tierlm.cache.artifact import BLOCK_ALIGN
from tierlm.config import ModelConfig
from tierlm.device.memory import MemoryLimits
from tierlm.errors import TierlmError
from tierlm.offload.placement import DEVICE, DISK, HOST, BlockPlacement, ExpertLayer, Placement, VariantPlacement
from tierlm.offload.bandwidths import MATRIX, Bandwidths
from tierlm.offload.sizes import (
    PREFILL_CHUNK,
    BlockSizes,
    context_tokens,
    host_workspace_bytes,
    hot_cache_bytes,
    kv_cache_bytes,
    sizes_from_config,
    workspace_bytes,
)
from tierlm.profile import Profile
from tierlm.quant.mixed import mode_counts

LIMITS = ("device bandwidth", "host bandwidth", "dispatch overhead", "link", "disk")
GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class VariantCharge:
    """A LoRA variant served beside the base: its mode (merged or unmerged), the bytes it adds when
    held, `largest`: the bytes of its largest block, read per use into one slot when it is not held
    (0: `nbytes`), and `uses`: requests that named it (hotter variants are placed first)."""

    name: str
    mode: str
    nbytes: int
    largest: int = 0
    uses: int = 0

    @property
    def slot_bytes(self) -> int:
        return self.largest or self.nbytes

    @property
    def streams(self) -> bool:
        """Whether it can be read from disk per use: a merged variant has its artifact there."""
        return self.mode == "merged"


@dataclass(frozen=True)
class _Unit:
    """Blocks that become resident or cold together (a tied embedding and its head alias)."""

    blocks: tuple[str, ...]
    nbytes: int


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
    `variants`: LoRA variants served beside the base, placed after it (see the module docstring).
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


# -- real limits -----------------------------------------------------------------------------

RAM, DEVICE_MEMORY = "RAM", "device memory"


@dataclass(frozen=True)
class Cap:
    """A resource the profile grants more of than the process really has."""

    resource: str  # RAM or DEVICE_MEMORY
    allowed: int  # what the profile lets it hold
    limit: int  # what the process may really use
    source: str  # where the limit comes from: "cgroup memory limit", "RLIMIT_AS", ...


def cap_profile(profile: Profile, limits: MemoryLimits | None, accelerator: bool) -> tuple[Profile, tuple[Cap, ...]]:
    """(`profile` with its budgets lowered to `limits`, the caps applied; none: `profile` as is).

    RAM bounds the host tier (with an accelerator) or both RAM tiers (CPU-only; with
    emulate_host_tier the two are scaled alike so that together they fit); free accelerator
    memory bounds the device tier. The headroom is a share of the device tier's budget (the RAM
    tier's on CPU-only) and shrinks with it, else a small limit would be all headroom.
    """
    allowed = _allowances(profile, accelerator)
    caps = tuple(
        Cap(resource, allowed[resource], limit, source)
        for resource, (limit, source) in _limit_values(limits, accelerator).items()
        if limit < allowed[resource]
    )
    if not caps:
        return profile, caps
    by_resource = {cap.resource: cap for cap in caps}
    device, host = by_resource.get(DEVICE_MEMORY if accelerator else RAM), by_resource.get(RAM)
    lowered = replace(profile, device_memory=_lowered(profile.device_memory, device),
                      host_memory=_lowered(profile.host_memory, host), headroom=_lowered(profile.headroom, device))  # fmt: skip
    return lowered, caps


def _lowered(nbytes: int, cap: Cap | None) -> int:
    """`nbytes` lowered as `cap` lowers its resource (integer arithmetic: a lone budget becomes
    the limit exactly)."""
    return nbytes if cap is None else nbytes * cap.limit // cap.allowed


def _allowances(profile: Profile, accelerator: bool) -> dict[str, int]:
    """What the profile lets each real resource hold (CPU-only: both tiers are RAM)."""
    if accelerator:
        return {DEVICE_MEMORY: profile.device_memory, RAM: profile.host_memory}
    return {RAM: profile.device_memory + (profile.host_memory if profile.emulate_host_tier else 0)}


def _limit_values(limits: MemoryLimits | None, accelerator: bool) -> dict[str, tuple[int, str]]:
    found: dict[str, tuple[int, str]] = {}
    if limits is not None and limits.ram is not None:
        found[RAM] = (limits.ram, limits.ram_source or "memory limit")
    if limits is not None and accelerator and limits.device_free is not None:
        found[DEVICE_MEMORY] = (limits.device_free, "free accelerator memory")
    return found


def _cap_notes(caps: tuple[Cap, ...], profile: Profile, effective: Profile) -> tuple[str, ...]:
    notes = [f"{cap.resource} budget capped at the {cap.source} {_size(cap.limit)} "
             f"(profile {profile.name!r} allows {_size(cap.allowed)})" for cap in caps]  # fmt: skip
    if effective.headroom != profile.headroom:
        notes.append(f"headroom scaled with the budget: {_size(effective.headroom)} (the profile's {_size(profile.headroom)})")
    return tuple(notes)


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


def _size(nbytes: int, *, up: bool = False) -> str:
    """250 MiB, 3.25 GiB: as a person would write a limit; `up`: rounded up (an "at least")."""
    unit, scale, places = ("GiB", GiB, 2) if nbytes >= GiB else ("MiB", 2**20, 0)
    value = nbytes / scale
    if up:
        value = math.ceil(value * 10**places - 1e-9) / 10**places
    text = f"{value:.{places}f}"
    return (text.rstrip("0").rstrip(".") if places else text) + f" {unit}"


# -- the search ------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class _Context:
    config: ModelConfig
    sizes: BlockSizes
    profile: Profile
    bandwidths: Bandwidths | None  # None: fits only (no cost model), see check_fits
    accelerator: bool
    baseline: int
    routing: object = None  # RoutingCounts of an MoE model (None: uniform)
    shares: Mapping[str, float] | None = field(default=None, compare=False)  # per expert, instead of routing
    placed: Mapping[str, str] | None = field(default=None, compare=False)  # an existing placement's expert tiers
    variants: tuple[VariantCharge, ...] = ()  # LoRA variants, placed after the base (_place_variants)
    layers: range | None = None  # a pipeline stage's decoder layers (None: the whole model)

    @property
    def stage(self) -> range:
        """The decoder layers this process runs."""
        return range(self.config.num_hidden_layers) if self.layers is None else self.layers

    @property
    def samples(self) -> bool:
        """Whether this process holds a step's logits: the first stage samples (rank 0 owns the
        API) and the last computes them; a middle stage only passes hidden states on."""
        return self.stage.start == 0 or self.stage.stop == self.config.num_hidden_layers

    @property
    def separate_host(self) -> bool:
        return self.accelerator or self.profile.emulate_host_tier

    @cached_property
    def dense(self) -> tuple[str, ...]:
        """Every block but the routed experts, in execution order."""
        return tuple(name for name in self.sizes.names if not is_expert(name))

    @cached_property
    def experts(self) -> "_Experts | None":
        return _experts(self)

    @cached_property
    def memo(self) -> dict:
        """Expert terms by (split, tokens): the compute search prices one split many times."""
        return {}


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


def _all_streamed(tiers: Mapping[str, str]) -> dict[str, str]:
    computes = {b: DEVICE for b in tiers}
    if tiers.get(EMBED, DEVICE) != DEVICE:
        computes[EMBED] = HOST
    return computes


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


# -- LoRA variants beside the base ------------------------------------------------------------------


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
    decode_s, decode_limit = _step_time(ctx, tiers, computes, split, prefill=False)
    prefill_s, _ = _step_time(ctx, tiers, computes, split, prefill=True)
    chunk = min(PREFILL_CHUNK, context_tokens(ctx.config, ctx.profile))
    origin = "predicted from config.json" if sizes.source == "config" else "from the artifact manifest"
    notes = [f"weights {sizes.quant} ({origin})"]
    if not ctx.separate_host:
        notes.append("CPU-only: device and host are one RAM tier bounded by device_memory")
    elif not ctx.accelerator:
        notes.append("CPU-only with emulate_host_tier: host blocks are copied into the device tier's ring")
    if tiers.get(EMBED, DEVICE) != DEVICE:
        notes.append(f"embedding on {tiers[EMBED]}: rows fetched on demand through the device hot cache")
    notes.append("decode prediction: start of a conversation (KV-cache reads not counted)")
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
        binding_limit=decode_limit,
        notes=tuple(notes),
        expert_slots=split.device,
        expert_stream_slots=experts.stream_slots if experts is not None and split.device < experts.count else 0,
        expert_slot_bytes=experts.slot_bytes if experts is not None else 0,
        expert_layers=_expert_layers(ctx, split),
        variants=tuple(variants),
        weight_modes=mode_counts(sizes.tensor_modes),
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


def largest_mixed_size(config: ModelConfig, works, accelerator: bool) -> int | None:
    """The largest mixed:SIZE in whole MiB, between every weight at int4-g128 and twice int8,
    for which works(size) holds (it must hold for every smaller size); None where none does."""
    smallest = sizes_from_config(config, "int4-g128", accelerator=accelerator)
    low = (smallest.total + BLOCK_ALIGN * len(smallest.names)) // MiB + 1
    high = 2 * sizes_from_config(config, "int8", accelerator=accelerator).total // MiB

    def holds(size_mib: int) -> bool:
        try:
            return works(size_mib * MiB)
        except TierlmError:  # a size the allocation cannot reach
            return False

    if not holds(low):
        return None
    while high - low > 1:  # holds(low)
        mid = (low + high) // 2
        low, high = (mid, high) if holds(mid) else (low, mid)
    return low * MiB


def mixed_size_text(nbytes: int) -> str:
    """A mixed:SIZE as a person writes it, rounded down so it stays within `nbytes`: 4.10GiB."""
    return f"{math.floor(nbytes / GiB * 100) / 100:.2f}GiB" if nbytes >= GiB else f"{nbytes // MiB}MiB"


# -- routed experts (mixture-of-experts models) -------------------------------------------------


@dataclass(frozen=True)
class _Experts:
    """An MoE model's routed experts as the planner places them.

    `order`: every expert block in the order they fill the device, then host RAM: hottest first
    (expected share of its layer's picks), ties by expert then layer, so that uniform counts
    spread the resident experts evenly over the layers. `share[block]`: that expected share.
    `layers`: sparse layer -> its expert blocks by index. Slots are sized for the largest expert.
    """

    order: tuple[str, ...]
    share: Mapping[str, float]
    layers: Mapping[int, tuple[str, ...]]
    top_k: int
    slot_bytes: int
    stream_slots: int
    prefix: tuple[int, ...]  # prefix[n]: stored bytes of the first n experts of `order`

    @property
    def count(self) -> int:
        return len(self.order)

    @property
    def stream_bytes(self) -> int:
        return self.stream_slots * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.prefix[-1]


@dataclass(frozen=True)
class _Split:
    """Where the experts lie: the first `device` of `_Experts.order` resident, the next `host`
    in host RAM (computed there when `host_compute`), the rest on disk."""

    device: int = 0
    host: int = 0
    host_compute: bool = False

    def tier(self, index: int) -> str:
        return DEVICE if index < self.device else HOST if index < self.device + self.host else DISK

    def bytes_on(self, tier: str, experts: _Experts | None) -> int:
        if experts is None:
            return 0
        prefix, end = experts.prefix, experts.count
        device, host = min(self.device, end), min(self.device + self.host, end)
        return {DEVICE: prefix[device], HOST: prefix[host] - prefix[device], DISK: prefix[end] - prefix[host]}[tier]

    def on_disk(self, experts: _Experts) -> bool:
        return self.device + self.host < experts.count


def _experts(ctx: _Context) -> _Experts | None:
    """The routed experts of `ctx.sizes` (None for a dense model), with their expected shares."""
    layers: dict[int, dict[int, str]] = {}
    for name in ctx.sizes.names:
        where = expert_of(name)
        if where is not None:
            layers.setdefault(where[0], {})[where[1]] = name
    if not layers:
        return None
    share: dict[str, float] = {}
    for layer, blocks in layers.items():
        count = len(blocks)
        routing = ctx.routing
        known = routing is not None and routing.experts == count and layer in routing.layers
        shares = routing.share(layer) if known else [1.0 / count] * count
        for expert, block in blocks.items():
            share[block] = ctx.shares.get(block, 0.0) if ctx.shares is not None else shares[expert]
    rank = {DEVICE: 0, HOST: 1, DISK: 2}
    placed = ctx.placed or {}

    def key(block: str):
        layer, expert = expert_of(block)
        return rank.get(placed.get(block), 0), -share[block], expert, layer

    order = tuple(sorted(share, key=key))
    prefix = [0]
    for block in order:
        prefix.append(prefix[-1] + ctx.sizes.nbytes[block])
    moe = getattr(ctx.config, "moe", None)
    top_k = moe.top_k if moe is not None else 1
    # top_k misses of one layer in flight, and with prefetch the next layer's reads beside them.
    stream_slots = top_k * (2 if ctx.profile.prefetch_depth >= 1 else 1)
    return _Experts(
        order=order,
        share=share,
        layers={layer: tuple(blocks[e] for e in sorted(blocks)) for layer, blocks in sorted(layers.items())},
        top_k=top_k,
        slot_bytes=max(ctx.sizes.nbytes[b] for b in order),
        stream_slots=stream_slots,
        prefix=tuple(prefix),
    )


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
    return host_computes_expert(ctx.bandwidths, ctx.sizes.bytes_used(block), ctx.sizes.params[block])


def _expert_terms(ctx: _Context, split: _Split, tokens: int) -> dict[str, float]:
    """Seconds each limit spends on the routed experts in one step of `tokens` tokens (module doc)."""
    key = (split, tokens)
    if key in ctx.memo:
        return ctx.memo[key]
    bw, sizes, experts = ctx.bandwidths, ctx.sizes, ctx.experts
    terms = dict.fromkeys(LIMITS, 0.0)
    for index, block in enumerate(experts.order):
        tier = split.tier(index)
        picked = min(1.0, experts.top_k * experts.share[block])
        used = 1.0 - (1.0 - picked) ** tokens
        if used <= 0.0:
            continue
        read = used * sizes.bytes_used(block)
        flops = 2.0 * sizes.params[block] * tokens * picked
        on_host = tier == HOST and split.host_compute
        if on_host:
            terms["host bandwidth"] += max(read / _rate(bw.host_bytes_per_s), flops / _rate(bw.host_flops))
        else:
            terms["device bandwidth"] += max(read / _rate(bw.device_bytes_per_s) + used * _row_seconds(ctx, block, bw),
                                             flops / _rate(bw.device_flops))  # fmt: skip
        if tier == DISK:
            terms["disk"] += read / _rate(bw.disk_bytes_per_s)
        if tier != DEVICE and not on_host and (ctx.accelerator or tier == HOST):
            terms["link"] += read / _rate(bw.link_bytes_per_s)
    ctx.memo[key] = terms
    return terms


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


def _split_of(ctx: _Context, placement: Placement) -> _Split:
    """An existing placement's expert split (the order of `ctx.experts` puts its tiers first)."""
    placed = [b for b in placement.blocks if is_expert(b.name)]
    device = sum(1 for b in placed if b.tier == DEVICE)
    host = sum(1 for b in placed if b.tier == HOST)
    return _Split(device, host, any(b.tier == HOST and b.compute == HOST for b in placed))


def _planned_shares(placement: Placement) -> dict[str, float] | None:
    """Per expert block, a share that reproduces each layer's planned hit rate: the hit rate
    spread evenly over its resident experts, the rest over its cold ones."""
    layers = {x.layer: x for x in placement.expert_layers}
    if not layers:
        return None
    shares = {}
    for b in placement.blocks:
        where = expert_of(b.name)
        if where is None or where[0] not in layers:
            continue
        plan = layers[where[0]]
        cold = plan.experts - plan.resident
        shares[b.name] = plan.hit_rate / plan.resident if b.tier == DEVICE else (1.0 - plan.hit_rate) / max(cold, 1)
    return shares



# -- the cost model --------------------------------------------------------------------------


def _step_time(ctx: _Context, tiers, computes, split: "_Split", *, prefill: bool) -> tuple[float, str]:
    """(seconds for one decode step, or one prefill chunk; the binding limit) — see module doc."""
    chunk = min(PREFILL_CHUNK, context_tokens(ctx.config, ctx.profile))
    tokens = chunk if prefill else ctx.profile.batch_size
    return step_seconds(_terms(ctx, tiers, computes, split, tokens, prefill), ctx.profile.prefetch_depth)


def _terms(ctx: _Context, tiers, computes, split: "_Split", tokens: int, prefill: bool) -> dict[str, float]:
    """Seconds each limit (LIMITS) costs one step of `tokens` tokens."""
    bw, sizes = ctx.bandwidths, ctx.sizes
    terms = dict.fromkeys(LIMITS, 0.0)
    if ctx.experts is not None:
        for limit, seconds in _expert_terms(ctx, split, tokens).items():
            terms[limit] += seconds
    for block in ctx.dense:
        if block == EMBED:
            read = tokens * sizes.row_bytes  # one row per token
            flops = 0.0
        else:
            read = sizes.bytes_used(block)
            # Prefill computes the head for the last position only.
            flops = 2.0 * sizes.params[block] * (1 if prefill and block == HEAD else tokens)
        if computes[block] == HOST:
            terms["host bandwidth"] += max(read / _rate(bw.host_bytes_per_s), flops / _rate(bw.host_flops))
            if is_layer(block) and ctx.accelerator:
                terms["dispatch overhead"] += bw.per_block_overhead_s
        else:
            terms["device bandwidth"] += max(
                read / _rate(bw.device_bytes_per_s) + _row_seconds(ctx, block, bw), flops / _rate(bw.device_flops)
            )
        if block == EMBED or tiers[block] == DEVICE or computes[block] == HOST:
            continue
        if tiers[block] == DISK:
            terms["disk"] += read / _rate(bw.disk_bytes_per_s)
        # Accelerators: host and disk blocks cross the link; CPU emulation: host blocks are copied.
        if ctx.accelerator or tiers[block] == HOST:
            terms["link"] += read / _rate(bw.link_bytes_per_s)
    # Measured fixed costs (runtime/measure_machine.decode_overheads): what dominates a small model's step.
    # A pipeline's per-token cost (sampling, detokenizing, the API) is its first stage's.
    per_token = bw.per_token_overhead_s if ctx.stage.start == 0 else 0.0
    terms["dispatch overhead"] += len(ctx.stage) * bw.per_block_overhead_s + per_token
    return terms


def _row_seconds(ctx: _Context, block: str, bw: Bandwidths) -> float:
    """What `block`'s rows cost beyond its bytes (Bandwidths.per_row_s), its rows counted as if
    hidden_size wide; an embedding is read by rows, not multiplied."""
    if block == EMBED:
        return 0.0
    width = ctx.config.hidden_size
    rows = ctx.sizes.params[block] / width
    return rows * max(1.0 - width / MATRIX, 0.0) * bw.per_row_s


def step_seconds(terms: Mapping[str, float], prefetch_depth: int) -> tuple[float, str]:
    """(seconds of a step, the binding limit) from its terms: with prefetch, transfers overlap
    compute (the largest channel binds); without, everything adds up."""
    compute = terms["device bandwidth"] + terms["host bandwidth"] + terms["dispatch overhead"]
    if prefetch_depth >= 1:
        seconds = max(compute, terms["link"], terms["disk"])
        transfer = max(("link", "disk"), key=terms.get)
        limit = transfer if terms[transfer] > compute else max(LIMITS[:3], key=terms.get)
    else:
        seconds = sum(terms.values())
        limit = max(LIMITS, key=terms.get)
    return max(seconds, 1e-12), limit


def decode_terms(
    config: ModelConfig,
    sizes: BlockSizes,
    profile: Profile,
    bandwidths: Bandwidths,
    placement: Placement,
    *,
    accelerator: bool,
    batch: int = 1,
    routing=None,
    layers: range | None = None,
) -> dict[str, float]:
    """The cost model's terms (seconds per limit) for one decode step of `batch` sequences of an
    existing placement: what a measured run of it is compared with (`step_seconds` combines them).
    An MoE model's experts are used as `routing` expects, or, without it, as the placement
    expected (each layer's planned hit rate spread evenly over its resident and cold experts).
    `layers`: a pipeline stage's, as `plan` was given them."""
    dense = [b for b in placement.blocks if not is_expert(b.name)]
    tiers = {b.name: b.tier for b in dense}
    computes = {b.name: b.compute for b in dense}
    shares = None if routing is not None else _planned_shares(placement)
    placed = {b.name: b.tier for b in placement.blocks if is_expert(b.name)}
    ctx = _Context(config, sizes, profile, bandwidths, accelerator, 0, routing, shares, placed, layers=layers)
    split = _split_of(ctx, placement)
    return _terms(ctx, tiers, computes, split, batch, prefill=False)


# What each limit's time is made of. A CPU-only machine's compute terms are one processor's.
_FIGURES = {
    "device bandwidth": ("device_bytes_per_s", "device_flops", "per_row_s"),
    "host bandwidth": ("host_bytes_per_s", "host_flops"),
    "dispatch overhead": ("per_block_overhead_s", "per_token_overhead_s"),
    "link": ("link_bytes_per_s",),
    "disk": ("disk_bytes_per_s",),
}


_TIMES = ("per_block_overhead_s", "per_token_overhead_s", "per_row_s")  # seconds, not rates


def implied_bandwidths(
    bandwidths: Bandwidths, terms: Mapping[str, float], measured_s: float, *, accelerator: bool, prefetch_depth: int
) -> Bandwidths:
    """The bandwidths under which a step with these `terms` takes `measured_s`, as measured.

    With prefetch the channels (compute, link, disk) overlap: each one predicted slower than the
    measured step, and the binding one, is rescaled to take exactly the measured time; a
    transfer's rate becomes its bytes per step over that time. Within compute, a CPU-only
    machine's figures all scale alike (one processor, and a probe slowed by a busy machine is
    slowed throughout); on an accelerator the binding processor is fitted alone. Without
    prefetch the terms add up: the binding one is fitted, the others kept.
    """
    compute = LIMITS[:3]
    _, limit = step_seconds(terms, prefetch_depth)
    if prefetch_depth < 1:
        return _fit(bandwidths, terms, (limit,), [k for k in LIMITS if k != limit], measured_s)
    fitted = bandwidths
    for channel in (compute, ("link",), ("disk",)):
        seconds = sum(terms[k] for k in channel)
        if seconds <= 0 or (seconds <= measured_s and limit not in channel):
            continue  # it could have taken that long: nothing says it is off
        if channel == compute and accelerator and limit in compute:
            fitted = _fit(fitted, terms, (limit,), [k for k in compute if k != limit], measured_s)
        else:
            fitted = _scaled(fitted, channel, seconds / measured_s)
    return fitted


def _fit(bandwidths: Bandwidths, terms, scaled, kept, measured_s: float) -> Bandwidths:
    """Scale the `scaled` terms' figures so that they plus the `kept` terms take `measured_s`;
    when the kept terms alone (nearly) exceed it they are off too, and everything scales alike."""
    left = measured_s - sum(terms[k] for k in kept)
    share = sum(terms[k] for k in scaled)
    if left < 0.25 * measured_s or share <= 0:
        return _scaled(bandwidths, (*scaled, *kept), sum(terms[k] for k in (*scaled, *kept)) / measured_s)
    return _scaled(bandwidths, scaled, share / left)


def _scaled(bandwidths: Bandwidths, limits, factor: float) -> Bandwidths:
    """The figures behind `limits` made `factor` times faster (rates up, per-layer time down)."""
    changes = {}
    for figure in {f for name in limits for f in _FIGURES[name]}:
        value = getattr(bandwidths, figure)
        changes[figure] = value / factor if figure in _TIMES else value * factor
    return replace(bandwidths, **changes)


def _rate(value: float) -> float:
    return max(value, 1e-9)


# -- refusals --------------------------------------------------------------------------------


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


def _owns(sizes: BlockSizes, block: str) -> bool:
    """False for a block that stores no bytes of its own (a tied head)."""
    return sizes.source_block(block) == block


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
    hints = []
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
