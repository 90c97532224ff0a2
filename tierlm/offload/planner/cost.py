"""The cost model: what a placement's decode step (and prefill chunk) is predicted to take, which
limit binds it, and the bandwidths under which it takes what a run measured.

Seconds per decode step of `batch_size` tokens; per 512-token chunk for prefill:
    device    sum over device-computed blocks of max(bytes / device_bytes_per_s + rows x
              (1 - hidden / 4096) x per_row_s, 2 x params x tokens / device_flops), rows =
              params / hidden (short rows stream slower than the probe's 4096-wide ones);
              the bytes of each stored format count divided by its rate relative to int8's
              (Bandwidths.format_factors, timed by the probe on CPUs)
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
host matmul of their bytes beats copying them over the link (experts.py `host_computes_expert`).
The binding limit is the largest channel (link or disk when one dominates, else the largest
compute term). Decode reads a resident embedding's rows only and the head once per step;
prefill computes the head for one token (last-position logits). KV-cache reads are left out:
the prediction is for the start of a conversation. A pipeline stage's per-layer dispatch is its
own layers', and the per-token overhead is charged to the first stage.

Every step is predicted with the probe's figures corrected for its path only (offload/bandwidths.py
`decode_path`: resident, streamed, MoE), and the placement names each figure's source
(`figure_sources`). Measured runs check the model: `decode_terms` + `step_seconds` predict an
existing placement's decode step, and `implied_bandwidths` gives the figures under which it would
take what was measured (the probe's cache then corrects that path: probe/measured.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from tierlm.blocks import EMBED, HEAD, expert_of, is_expert, is_layer
from tierlm.config import ModelConfig
from tierlm.offload.bandwidths import MATRIX, MOE, Bandwidths, decode_path
from tierlm.offload.placement import DEVICE, DISK, HOST, FigureSource, Placement
from tierlm.offload.planner.context import _Context, _Split
from tierlm.offload.sizes import PREFILL_CHUNK, BlockSizes, context_tokens, kv_token_bytes
from tierlm.profile import Profile


LIMITS = ("device bandwidth", "host bandwidth", "dispatch overhead", "link", "disk")


def _step_time(ctx: _Context, tiers, computes, split: "_Split", *, prefill: bool) -> tuple[float, str]:
    """(seconds for one decode step, or one prefill chunk; the binding limit) — see module doc."""
    chunk = min(PREFILL_CHUNK, context_tokens(ctx.config, ctx.profile))
    tokens = chunk if prefill else ctx.profile.batch_size
    return step_seconds(_terms(ctx, tiers, computes, split, tokens, prefill), ctx.profile.prefetch_depth)


def _terms(ctx: _Context, tiers, computes, split: "_Split", tokens: int, prefill: bool) -> dict[str, float]:
    """Seconds each limit (LIMITS) costs one step of `tokens` tokens."""
    bw, sizes = _figures(ctx, tiers), ctx.sizes
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
        priced = read if block == EMBED else _priced_bytes(ctx, block, read, bw)
        if computes[block] == HOST:
            terms["host bandwidth"] += max(priced / _rate(bw.host_bytes_per_s), flops / _rate(bw.host_flops))
            if is_layer(block) and ctx.accelerator:
                terms["dispatch overhead"] += bw.per_block_overhead_s
        else:
            terms["device bandwidth"] += max(
                priced / _rate(bw.device_bytes_per_s) + _row_seconds(ctx, block, bw), flops / _rate(bw.device_flops)
            )
        if block == EMBED or tiers[block] == DEVICE or computes[block] == HOST:
            continue
        if tiers[block] == DISK:
            terms["disk"] += read / _rate(bw.disk_bytes_per_s)
        # Accelerators: host and disk blocks cross the link; CPU emulation: host blocks are copied.
        if ctx.accelerator or tiers[block] == HOST:
            terms["link"] += read / _rate(bw.link_bytes_per_s)
    if not prefill and ctx.kv_position:  # each sequence reads its keys and values once a step
        kv = tokens * ctx.kv_position * kv_token_bytes(ctx.config, ctx.profile.kv_cache, ctx.accelerator, len(ctx.stage))
        terms["device bandwidth"] += kv / _rate(bw.device_bytes_per_s)
    # Measured fixed costs (runtime/measure_machine.decode_overheads): what dominates a small model's step.
    # A pipeline's per-token cost (sampling, detokenizing, the API) is its first stage's.
    per_token = bw.per_token_overhead_s if ctx.stage.start == 0 else 0.0
    terms["dispatch overhead"] += len(ctx.stage) * bw.per_block_overhead_s + per_token
    return terms


def _expert_terms(ctx: _Context, split: _Split, tokens: int) -> dict[str, float]:
    """Seconds each limit spends on the routed experts in one step of `tokens` tokens (module doc)."""
    key = (split, tokens)
    if key in ctx.memo:
        return ctx.memo[key]
    bw, sizes, experts = ctx.bandwidths.for_path(MOE), ctx.sizes, ctx.experts
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
        priced = _priced_bytes(ctx, block, read, bw)
        if on_host:
            terms["host bandwidth"] += max(priced / _rate(bw.host_bytes_per_s), flops / _rate(bw.host_flops))
        else:
            terms["device bandwidth"] += max(priced / _rate(bw.device_bytes_per_s) + used * _row_seconds(ctx, block, bw),
                                             flops / _rate(bw.device_flops))  # fmt: skip
        if tier == DISK:
            terms["disk"] += read / _rate(bw.disk_bytes_per_s)
        if tier != DEVICE and not on_host and (ctx.accelerator or tier == HOST):
            terms["link"] += read / _rate(bw.link_bytes_per_s)
    ctx.memo[key] = terms
    return terms


def _priced_bytes(ctx: _Context, block: str, read: float, bw: Bandwidths) -> float:
    """`read` bytes of `block` as int8 bytes taking the same time: each stored format's share
    divided by its measured rate relative to int8's (Bandwidths.format_factors), so a Q6_K
    block that widens at half int8's rate costs twice its bytes."""
    if not bw.format_factors:
        return read
    source = ctx.sizes.source_block(block)
    stored = ctx.sizes.nbytes.get(source, 0)
    formats = ctx.sizes.format_bytes(source)
    if not stored or not formats:
        return read
    extra = sum(nbytes * (1.0 / bw.format_factor(mode) - 1.0) for mode, nbytes in formats)
    return read * (1.0 + extra / stored)


def _figures(ctx: _Context, tiers: Mapping[str, str]) -> Bandwidths:
    """The figures a step over dense blocks on `tiers` is predicted with: its path's."""
    return ctx.bandwidths.for_path(decode_path(tiers.values(), ctx.experts is not None))


def placement_path(placement: Placement) -> str:
    """The decode path of an existing placement (offload/bandwidths.py `decode_path`)."""
    dense = [b.tier for b in placement.blocks if not is_expert(b.name)]
    return decode_path(dense, len(dense) < len(placement.blocks))


# The figure each limit's time is chiefly made of, and what a person calls it.
_MAIN_FIGURE = {"device bandwidth": "device_bytes_per_s", "host bandwidth": "host_bytes_per_s",
                "dispatch overhead": "per_block_overhead_s", "link": "link_bytes_per_s", "disk": "disk_bytes_per_s"}  # fmt: skip


def figure_sources(ctx: _Context, tiers: Mapping[str, str], terms: Mapping[str, float], limit: str) -> tuple[FigureSource, ...]:
    """The figures a decode prediction rests on (those of the limits that take time in it, the
    binding one first), each with the measurement it comes from: the probe's, or the measured
    run that corrected it for this path."""
    path = decode_path(tiers.values(), ctx.experts is not None)
    figures, correction = ctx.bandwidths.for_path(path), ctx.bandwidths.correction(path)
    # CPU-only, the host term is a cold embedding's rows, gathered where they lie.
    names = {"device_bytes_per_s": "device" if ctx.accelerator else "RAM",
             "host_bytes_per_s": "host RAM (CPU)" if ctx.accelerator else "embedding rows",
             "per_block_overhead_s": "per layer", "link_bytes_per_s": "link", "disk_bytes_per_s": "disk"}  # fmt: skip
    sources = []
    for name in sorted((k for k in LIMITS if terms[k] > 0), key=lambda k: k != limit):
        figure = _MAIN_FIGURE[name]
        by = correction if correction is not None and correction.factor(figure) is not None else None
        sources.append(FigureSource(names[figure], figure, getattr(figures, figure), path,
                                    by.source if by else None, by.at if by else None))  # fmt: skip
    return tuple(sources)


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
    position: int = 0,
) -> dict[str, float]:
    """The cost model's terms (seconds per limit) for one decode step of `batch` sequences of an
    existing placement: what a measured run of it is compared with (`step_seconds` combines them).
    `position`: how many positions each sequence's step attends over (its KV cache read).
    An MoE model's experts are used as `routing` expects, or, without it, as the placement
    expected (each layer's planned hit rate spread evenly over its resident and cold experts).
    `layers`: a pipeline stage's, as `plan` was given them."""
    dense = [b for b in placement.blocks if not is_expert(b.name)]
    tiers = {b.name: b.tier for b in dense}
    computes = {b.name: b.compute for b in dense}
    shares = None if routing is not None else _planned_shares(placement)
    placed = {b.name: b.tier for b in placement.blocks if is_expert(b.name)}
    ctx = _Context(config, sizes, profile, bandwidths, accelerator, 0, routing, shares, placed, layers=layers,
                   kv_position=position)  # fmt: skip
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

    A step slower than predicted that read bytes from a colder tier (disk, over the link, or host
    RAM computed by the CPU beside an accelerator) was slowed by that tier: the binding one of
    them, else the one taking the largest share of the step, is fitted alone, and the figures of
    the tier the resident blocks are read from are kept.

    Otherwise, with prefetch the channels (compute, link, disk) overlap: each one predicted slower
    than the measured step, and the binding one, is rescaled to take exactly the measured time; a
    transfer's rate becomes its bytes per step over that time. Within compute, a CPU-only
    machine's figures all scale alike (one processor, and a probe slowed by a busy machine is
    slowed throughout); on an accelerator the binding processor is fitted alone. Without
    prefetch the terms add up: the binding one is fitted, the others kept.
    """
    compute = LIMITS[:3]
    predicted, limit = step_seconds(terms, prefetch_depth)
    cold = [k for k in ("disk", "link", *(("host bandwidth",) if accelerator else ())) if terms[k] > 0]
    if measured_s > predicted and cold:
        return _blamed(bandwidths, terms, limit if limit in cold else max(cold, key=terms.get), measured_s, prefetch_depth)
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


def _blamed(bandwidths: Bandwidths, terms, blamed: str, measured_s: float, prefetch_depth: int) -> Bandwidths:
    """`blamed`'s figures slowed so that the step takes `measured_s` (longer than predicted), the
    others kept: a transfer overlapped by prefetch takes the whole step; otherwise the blamed term
    adds up with those it shares the step with (compute with prefetch, everything without)."""
    if prefetch_depth >= 1 and blamed in ("link", "disk"):
        return _scaled(bandwidths, (blamed,), terms[blamed] / measured_s)
    shared = LIMITS[:3] if prefetch_depth >= 1 else LIMITS
    left = measured_s - sum(terms[k] for k in shared if k != blamed)  # > terms[blamed]: the step was slower
    return _scaled(bandwidths, (blamed,), terms[blamed] / left)


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
