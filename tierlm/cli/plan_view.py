"""`tierlm plan`: the placement a load would make, drawn.

What the plan is comes from runtime/planning.py, which runs the loader's own steps without torch;
this module only draws it. Variants (`--lora NAME=DIR`) are placed by runtime/plan_variants.py,
imported only when asked for: it loads torch.
"""

from __future__ import annotations

import time
from pathlib import Path

from tierlm.blocks import EMBED, HEAD, is_expert, is_layer, layer_index
from tierlm.errors import TierlmError
from tierlm.lora.spec import split_variant_specs
from tierlm.offload.placement import DEVICE, DISK
from tierlm.offload.sizes import mixed_size_text
from tierlm.profile import format_size, load_profile
from tierlm.quant.modes import quant_text
from tierlm.runtime.planning import plan_model, plan_stages
from tierlm.runtime.source import is_artifact

MiB = 2**20


def plan_for(model_dir: Path, profile, quant: str | None = None, device: str | None = None, loras=()):
    """(Placement, header lines) for `model_dir` under `profile`, as `tierlm plan` prints them:
    runtime/planning.py `plan_model` plans (it says what `loras` may be), this draws."""
    return _plan_and_header(model_dir, profile, quant, device, loras)[1:]


def plan_with_speculation(model_dir: Path, profile, quant, device, loras, draft):
    """(Placement, header lines, speculation) as `plan_for`, with what `draft` (a DraftSettings)
    is predicted to do under the placement (`speculation`)."""
    plan, placement, header = _plan_and_header(model_dir, profile, quant, device, loras)
    return placement, header, speculation(plan, model_dir, draft)


def _plan_and_header(model_dir: Path, profile, quant, device, loras):
    _check_artifact(model_dir)
    plan = plan_model(model_dir, profile, quant, device, loras, _variant_placer(loras, profile))
    config, baseline, budget = plan.source.config, plan.budget.baseline, plan.budget
    header = [
        f"model    {model_dir} ({config.model_type}, {config.num_hidden_layers} layers{_moe_text(config)})",
        f"profile  {profile.summary()}",
        f"quant    {_quant_line(plan.planned.sizes.quant, quant, profile.quant)}",
        f"device   {budget.device}; baseline {_mib(baseline.charged)} charged ({_mib(baseline.measured)} RSS with the "
        f"runtime loaded: torch, tokenizer, kernels)",
        limits_line(budget.limits),
        *probe_lines(plan.probe, plan.probe_path.stem),
        *(f"lora     {path}{'' if weight == 1.0 else f' x{weight:g}'} merged into the base" for path, weight in plan.source.adapters),
        *(f"variant  {name}: {why}" for name, why in plan.variant_whys.items()),
    ]
    return plan, plan.placement, header


def speculation(plan, model_dir: Path, draft) -> dict | None:
    """What `draft` (a DraftSettings) is predicted to do under the load `plan`: the model's measured
    acceptance for that drafter (runtime/acceptance.py) and the decode speed it gives, a pass of k
    drafts priced by the cost model as a decode step of k + 1 rows (weights read once, compute
    k + 1 times); None when drafts are off. A draft model's own steps are not priced."""
    from tierlm.offload.planner.cost import decode_terms, step_seconds
    from tierlm.offload.sizes import expected_routing
    from tierlm.probe.machine import load_bandwidths
    from tierlm.runtime.acceptance import PRIOR, read_acceptance, speculative_rate

    if not draft.enabled:
        return None
    placement, budget, config, sizes = plan.placement, plan.budget, plan.source.config, plan.planned.sizes
    bandwidths = budget.bandwidths or load_bandwidths(budget.device, threads=budget.threads)
    routing = expected_routing(config, sizes)  # read once: a pass of every length is priced with it

    def pass_seconds(rows: int) -> float:
        terms = decode_terms(config, sizes, budget.profile, bandwidths, placement, accelerator=budget.device.type != "cpu",
                             batch=rows, routing=routing)  # fmt: skip
        return step_seconds(terms, budget.profile.prefetch_depth)[0]

    measured = read_acceptance(model_dir, draft.model or "lookup")
    out = {"drafter": draft.model or "ngram", "acceptance": measured.rate if measured else PRIOR,
           "measured_passes": measured.passes if measured else 0,
           "coverage": measured.coverage if measured else None}  # fmt: skip
    if not draft.uses_model:
        # Scaled to the plan's own decode figure, which the cost model's step matches.
        scale = 1.0 / (placement.predicted_decode_tokens_per_s * pass_seconds(1))
        drafts, rate = speculative_rate(lambda k: scale * pass_seconds(k + 1), measured, draft.tokens)
        out |= {"drafts_per_pass": drafts, "predicted_decode_tokens_per_s": rate}
    return out


def speculation_lines(predicted: dict | None, plain_tps: float) -> list[str]:
    if predicted is None:
        return []
    seen = (f"measured over {predicted['measured_passes']:.0f} passes, drafts found at "
            f"{predicted['coverage']:.0%} of steps" if predicted["measured_passes"] else "none measured yet: assumed")
    line = f"drafts   {predicted['drafter']}: acceptance {predicted['acceptance']:.2f} ({seen})"
    if "predicted_decode_tokens_per_s" not in predicted:
        return [line, "         a draft model's own steps are not predicted: `tierlm bench --draft` measures them"]
    rate = predicted["predicted_decode_tokens_per_s"]
    return [line, f"         decode {rate:.2f} tokens/s (predicted, {rate / plain_tps:.2f}x) drafting up to "
                  f"{predicted['drafts_per_pass']} a pass"]


def _variant_placer(loras, profile):
    """runtime/plan_variants.py `place_variants` when `loras` name variants (NAME=DIR), else None:
    it loads torch, which runs at the profile's threads (a command's), as `serve` runs with them."""
    if not split_variant_specs(loras)[1]:
        return None
    from tierlm.device.cpu import apply_threads
    from tierlm.runtime.plan_variants import place_variants

    if profile.threads:
        apply_threads(profile.threads)
    return place_variants


def _check_artifact(model_dir: Path) -> None:
    """An artifact directory opened as a load opens it (its weights file and layout checked), so a
    damaged one is refused as loading it would be; this loads torch, as artifacts' stores do."""
    if is_artifact(model_dir):
        from tierlm.runtime.loader import checked_quant

        checked_quant(model_dir)


def _moe_text(config) -> str:
    moe = getattr(config, "moe", None)
    if moe is None:
        return ""
    return f"; {len(moe.sparse_layers)} sparse: {moe.experts} routed experts, top-{moe.top_k}"


def limits_line(limits) -> str:
    """The plan header's line on the limits the process really has (device/memory.py)."""

    found = [f"RAM {format_size(limits.ram)} ({limits.ram_source})"] if limits.ram is not None else []
    if limits.device_free is not None:
        found.append(f"device {format_size(limits.device_free)} free")
    return f"limits   {'; '.join(found) if found else 'none (no cgroup memory limit, RLIMIT_AS unlimited)'}"


def render_plan(placement, header: list[str]) -> str:
    return "\n".join([*header, "", describe(placement)])


def placement_rows(placement) -> list[tuple[str, str, int]]:
    """(blocks, where, bytes), consecutive layers on the same tier grouped as `layers.0-27`;
    routed experts are shown per layer range by `expert_rows` instead."""

    rows: list[tuple[str, str, int]] = []
    run: list = []  # BlockPlacements

    def where(blocks: list) -> str:
        first = blocks[0]
        if first.name == EMBED and first.tier != DEVICE:
            return f"{first.tier}, rows on demand"
        if first.tier == DEVICE:
            return "device, resident"
        on_cpu = sum(1 for b in blocks if not b.streamed)
        if on_cpu == len(blocks):
            return f"{first.tier}, computed on CPU"
        if on_cpu == 0:
            return f"{first.tier}, streamed"
        return f"{first.tier}, {on_cpu} on CPU + {len(blocks) - on_cpu} streamed"

    def flush():
        if run:
            first, last = run[0].name, layer_index(run[-1].name)
            name = first if len(run) == 1 else f"{first}-{last}"
            rows.append((name, where(run), sum(b.nbytes for b in run)))
            run.clear()

    for b in placement.blocks:
        if is_expert(b.name):
            continue
        if is_layer(b.name):
            if run and run[-1].tier != b.tier:
                flush()
            run.append(b)
            continue
        flush()
        tied = b.name == HEAD and b.nbytes == 0
        rows.append(("head (tied: = embed)" if tied else b.name, where([b]), b.nbytes))
    flush()
    return rows


def expert_rows(placement) -> list[dict]:
    """A mixture-of-experts plan per layer range: consecutive sparse layers with the same
    resident count, hit rate (to 0.1%), expert bytes per token per tier (to 0.1 MiB) and
    CPU-computed count grouped as one row {"layers": "0-18", "resident", "experts", "hit_rate",
    "bytes_per_token": {tier: bytes}, "host_computed"}."""
    rows: list[dict] = []
    for x in placement.expert_layers:
        shown = (x.resident, x.experts, round(x.hit_rate, 3), x.host_computed,
                 tuple(round(v / MiB, 1) for v in x.bytes_per_token.values()))  # fmt: skip
        last = rows[-1] if rows else None
        if last is not None and last["key"] == shown and last["last"] == x.layer - 1:
            last["last"] = x.layer
            continue
        rows.append({"key": shown, "first": x.layer, "last": x.layer, "resident": x.resident, "experts": x.experts,
                     "hit_rate": x.hit_rate, "bytes_per_token": dict(x.bytes_per_token),
                     "host_computed": x.host_computed})  # fmt: skip
    for row in rows:
        first, last = row.pop("first"), row.pop("last")
        row.pop("key")
        row["layers"] = str(first) if first == last else f"{first}-{last}"
    return rows


def _expert_lines(placement) -> list[str]:
    """The experts table of `describe`: per layer range, resident / E, hit rate, bytes per token."""

    rows = expert_rows(placement)
    if not rows:
        return []
    tiers = [t for t in rows[0]["bytes_per_token"] if t in placement.budgets]  # CPU-only: no host tier
    def per_tier(values) -> str:
        return " ".join(f"{format_size(int(values[t])):>10}" for t in tiers)

    lines = [f"{'experts of layers':18} {'resident':>9} {'hit rate':>9}  bytes/token "
             + " ".join(f"{t:>10}" for t in tiers)]  # fmt: skip
    for row in rows:
        cpu = f"  ({row['host_computed']} on host: CPU-computed)" if row["host_computed"] else ""
        lines.append(f"{row['layers']:18} {row['resident']:>4}/{row['experts']:<4} {row['hit_rate'] * 100:>8.1f}%"
                     f"{'':13}{per_tier(row['bytes_per_token'])}{cpu}")  # fmt: skip
    total = {t: sum(x.bytes_per_token[t] for x in placement.expert_layers) for t in tiers}
    lines.append(f"{'all layers':51}{per_tier(total)}")
    lines.append(f"slots    {placement.expert_slots} resident x {format_size(placement.expert_slot_bytes)}, "
                 f"{placement.expert_stream_slots} stream slots for cold experts")  # fmt: skip
    return ["", *lines]


def _variant_lines(placement) -> list[str]:
    """The LoRA variants of `describe`: each one's mode, bytes and where it lies."""

    if not placement.variants:
        return []
    where = {DEVICE: "device, resident", DISK: "disk, read per use"}
    lines = ["", f"{'variant':22} {'mode':9} {'tier':22} {'bytes':>10}"]
    lines += [f"{v.name:22} {v.mode:9} {where.get(v.tier, f'{v.tier}, copied per use'):22} {format_size(v.nbytes):>10}"
              for v in placement.variants]  # fmt: skip
    return lines


def _context_lines(placement) -> list[str]:
    """What the device budget holds beside these weights: tokens of context per KV cache format."""
    if not placement.context_room:
        return []
    def text(name: str, tokens: int) -> str:
        return f"{name} {tokens:,}{' (all)' if tokens == placement.context_limit else ''}" if tokens else f"{name} none"

    shown = " · ".join(text(name, tokens) for name, tokens in placement.context_room)
    return ["", f"context  tokens per sequence the budget holds beside these weights, by --kv-cache (the model "
                f"holds {placement.context_limit:,}):", f"         {shown}"]  # fmt: skip


def describe(placement) -> str:
    """The human-readable plan: blocks, per-tier totals against budgets (itemised), speeds."""

    lines = [f"{'block':22} {'tier':32} {'bytes':>10}"]
    lines += [f"{name:22} {where:32} {format_size(n):>10}" for name, where, n in placement_rows(placement)]
    lines += _expert_lines(placement)
    lines += _variant_lines(placement)
    if placement.weight_modes:
        stored = dict(placement.weight_mode_bytes)
        lines.append("weights  " + ", ".join(f"{mode} x {count}" + (f" ({format_size(stored[mode])})" if mode in stored else "")
                                             for mode, count in placement.weight_modes))  # fmt: skip
    lines.append("")
    for tier, items in placement.charges.items():
        budget = placement.budgets.get(tier)
        shown = format_size(budget) if budget is not None else "unbounded"
        lines.append(f"{tier:6} {format_size(placement.total(tier)):>10} of {shown}")
        lines += [f"         {k:13} {format_size(v):>10}" for k, v in items.items() if v]
    lines += _context_lines(placement)
    lines.append("")
    if placement.ring_slots:
        lines.append(f"ring     {placement.ring_slots} slots x {format_size(placement.ring_slot_bytes)}")
    lines.append(f"prefill  {placement.predicted_prefill_tokens_per_s:.1f} tokens/s (predicted)")
    lines.append(f"decode   {placement.predicted_decode_tokens_per_s:.2f} tokens/s (predicted), "
                 f"bound by {placement.binding_limit}; {placement.predicted_decode_full_context_tokens_per_s:.2f} "
                 "at the end of the context")  # fmt: skip
    lines += [f"{'from' if i == 0 else '':8} {text}" for i, text in enumerate(source_texts(placement.decode_sources))]
    if placement.resident_mixed_bytes:

        lines.append(f"fits     every block on the device with --quant mixed:{mixed_size_text(placement.resident_mixed_bytes)}")
    lines += [f"note     {note}" for note in placement.notes]
    return "\n".join(lines)


def source_texts(sources) -> list[str]:
    """Each figure behind a prediction with the measurement it comes from: "RAM 11.20 GB/s
    measured by bench m, profile 4gb on 2026-12-01 14:02 (resident)", or "... probed (streamed)"."""
    texts = []
    for f in sources:
        value = f"{f.value * 1e3:.3f} ms" if f.name.endswith("_s") and not f.name.endswith("per_s") else f"{f.value / 1e9:.2f} GB/s"
        origin = (f"measured by {f.source} on {time.strftime('%Y-%m-%d %H:%M', time.localtime(f.at))}"
                  if f.source else "probed")  # fmt: skip
        texts.append(f"{f.label} {value} {origin} ({f.path})")
    return texts


def probe_lines(record, name: str, now: float | None = None) -> list[str]:
    """The plan header's lines on the probe behind its prediction."""
    last = last_run_text(record, now)
    return [f"probe    {probe_age_text(record, now)} ({name})", *([last] if last else [])]


def probe_age_text(record, now: float | None = None) -> str:
    """How old a probe is and what last corrected it: "3 days old; corrected 2 h ago from ..."."""
    now = time.time() if now is None else now
    text = f"{format_age(now - record.probed_at)} old"
    if record.corrections:
        newest = record.corrections[-1]
        path = f" ({newest['path']})" if newest.get("path") else ""
        text += f"; corrected {format_age(now - newest['at'])} ago from {newest['source']}{path}"
    return text


def last_run_text(record, now: float | None = None) -> str | None:
    """How far the last measured run was from its prediction; None before any."""
    now = time.time() if now is None else now
    run = record.last_run
    if not run:
        return None
    ratio = run["measured_tok_s"] / run["predicted_tok_s"]
    return (f"last measured run: {run['measured_tok_s']:.3g} tok/s, {ratio:.2f}x the prediction, "
            f"{format_age(now - run['at'])} ago ({run['source']})")  # fmt: skip


def format_age(seconds: float) -> str:
    """3 days, 2 h, 5 min, 40 s."""
    seconds = max(seconds, 0.0)
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {'day' if unit == 'days' and count == 1 else unit}"
    return f"{int(seconds)} s"


def _quant_line(chosen: str, asked: str | None, profiles: str) -> str:
    chosen, profiles = quant_text(chosen), quant_text(profiles)
    requested = quant_text(asked or profiles)
    shown = chosen if requested == chosen else f"{requested} → {chosen}"  # "auto → int8-g32-asym"
    if asked is None:
        return f"{shown} (the profile's)"
    return f"{shown} (--quant {asked}; the profile's is {profiles})"


def _mib(nbytes: int) -> str:
    return f"{nbytes / MiB:.0f} MiB"


# -- `tierlm plan --stages N`: the split over pipeline stages ------------------------------------


def stage_profiles(names: str, stages: int | None) -> list:
    """One Profile per stage from `--profile a[,b,...]` and `--stages N` (a list alone: one
    stage per name; one name: every stage)."""

    listed = [load_profile(name.strip()) for name in names.split(",")]
    count = stages or len(listed)
    if len(listed) not in (1, count):
        raise TierlmError(f"--profile lists {len(listed)} profiles for {count} stages",
                          "give one profile for every stage, or one for all")  # fmt: skip
    return listed * count if len(listed) == 1 else listed


def stage_plan_for(model_dir: Path, profiles: list, link, quant: str | None = None, device: str | None = None):
    """(StagePlan, header lines) for `model_dir` split over one stage per profile: runtime/planning.py
    `plan_stages` plans, this draws. `link`: offload/stage_planner.Link."""
    _check_artifact(model_dir)
    plan = plan_stages(model_dir, profiles, link, quant, device)
    config, budget, planned = plan.source.config, plan.budget, plan.planned
    names = ",".join(dict.fromkeys(p.name for p in profiles))
    header = [
        f"model    {model_dir} ({config.model_type}, {config.num_hidden_layers} layers{_moe_text(config)})",
        f"stages   {len(profiles)}, profile {names}; quant {quant_text(planned.stages[0].sizes.quant)}",
        f"device   {budget.device} on every rank; baseline {_mib(budget.baseline.charged)} charged per rank",
        limits_line(budget.limits),
        *probe_lines(plan.probe, plan.probe_path.stem),
        f"link     {link_text(planned.link)}",
    ]
    return planned, header


def link_text(link, now: float | None = None) -> str:
    """"1.68 GB/s, latency 82 us (measured between two local gloo processes, 3 min old)"."""
    age = f", {format_age((time.time() if now is None else now) - link.probed_at)} old" if link.probed_at else ""
    return f"{link.bytes_per_s / 1e9:.2f} GB/s, latency {link.latency_s * 1e6:.0f} us ({link.source}{age})"


def render_stage_plan(planned, header: list[str]) -> str:
    """Per stage: its layers, profile, bytes per tier against the budgets, predicted step and
    where its blocks live; then the transfers and the pipeline's predicted speed."""

    lines = [*header, "", f"{'rank':4} {'layers':8} {'profile':8} {'device':>22} {'host':>22} {'disk':>10} {'step':>10}"]

    def tier(placement, name: str) -> str:
        if name not in placement.charges:
            return "-"
        budget = placement.budgets.get(name)
        used = format_size(placement.total(name))
        return used if budget is None else f"{used} of {format_size(budget)}"

    for stage in planned.stages:
        span, placement = stage.span, stage.placement
        layers = f"{span.first}-{span.end - 1}"
        lines.append(f"{span.rank:<4} {layers:8} {stage.profile.name:8} {tier(placement, 'device'):>22} "
                     f"{tier(placement, 'host'):>22} {tier(placement, 'disk'):>10} {stage.step_seconds * 1e3:>7.2f} ms")  # fmt: skip
        where = "; ".join(f"{name} {place}" for name, place, _ in placement_rows(placement))
        lines.append(f"{'':4} {where}{_stage_experts(placement)}, bound by {placement.binding_limit}")
    world, batch = len(planned.stages), planned.batch
    handover, back = planned.transfer_seconds()
    lines.append("")
    if world > 1:
        where = "the boundary" if world == 2 else f"each of {world - 1} boundaries"
        lines.append(f"hand-over {format_size(planned.handover_bytes())} of hidden state per token at {where}: "
                     f"{handover * 1e3:.3f} ms each")  # fmt: skip
        lines.append(f"return    {format_size(planned.return_bytes())} of logits to rank 0 per token: {back * 1e3:.3f} ms")
    stages_s = sum(planned.stage_seconds(1))
    transfers = (world - 1) * handover + back
    bottleneck = planned.bottleneck
    lines.append(f"decode    {planned.tokens_per_s():.2f} tokens/s (predicted, batch 1): stages {stages_s * 1e3:.1f} ms "
                 f"+ transfers {transfers * 1e3:.2f} ms per token; slowest stage: rank {bottleneck.span.rank} "
                 f"({bottleneck.step_seconds * 1e3:.2f} ms)")  # fmt: skip
    if batch > 1:
        groups = min(batch, world)
        lines.append(f"batch {batch:<3} {planned.tokens_per_s(batch):.2f} tokens/s as one group, "
                     f"{planned.tokens_per_s(batch, groups):.2f} in {groups} micro-batches (predicted)")  # fmt: skip
    lines.append("note     batch 1 runs the stages one after another: a pipeline holds a model no single stage "
                 "could, it does not make one sequence faster")  # fmt: skip
    lines.append("note     each rank is planned as if on a machine like this one (its own memory, disk and probe)")
    return "\n".join(lines)


def _stage_experts(placement) -> str:
    """A mixture-of-experts stage's routed experts in one phrase: resident of all, expected hit rate."""
    layers = placement.expert_layers
    if not layers:
        return ""
    resident, total = sum(x.resident for x in layers), sum(x.experts for x in layers)
    hit = sum(x.hit_rate for x in layers) / len(layers)
    return f"; experts {resident}/{total} resident ({hit * 100:.0f}% of picks expected)"
