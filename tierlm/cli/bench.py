"""`tierlm bench`: measured prefill/decode speed and memory of a model under a profile.

The prompt is a fixed public text (the Python docs' topic pages shipped with CPython, so
every machine measures the same tokens), cut to `--prompt-tokens`. After one short untimed
run (a process's one-time costs), each run starts from an empty KV cache and decodes greedily for `--tokens` tokens without stopping at EOS, so runs are
alike; the median run is reported beside the planner's prediction, the memory the profile
allows, what the process measured, and the memory manager's ledger when blocks stream.
The measured decode speed is also checked against the cached probe's prediction, which it
corrects when the two disagree beyond noise (probe/measured.py).
"""

from __future__ import annotations

import statistics


def prompt_ids(tokenizer, count: int) -> list[int]:
    """`count` tokens of real English text, the same on every machine."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for key in sorted(topics):
        ids += tokenizer.encode(topics[key])
        if len(ids) >= count:
            return ids[:count]
    return (ids * (count // max(len(ids), 1) + 1))[:count]


def run_bench(session, prompt_tokens: int, new_tokens: int, runs: int) -> dict:
    """Time `runs` greedy generations; return the figures `format_bench` prints."""
    from tierlm.device.memory import read_memory
    from tierlm.errors import TierlmError
    from tierlm.probe.measured import note_measured_decode
    from tierlm.runtime.sampling import SamplingParams

    engine = session.engine
    if prompt_tokens + new_tokens > engine.context_length:
        raise TierlmError(
            f"{prompt_tokens} prompt + {new_tokens} new tokens exceed the context of "
            f"{engine.context_length}",
            "lower --prompt-tokens/--tokens, or raise --context",
        )
    ids = prompt_ids(engine.tokenizer, prompt_tokens)
    # EOS ignored, no stop strings: every run decodes exactly `new_tokens` tokens.
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    # One short untimed generation first, as llama-bench warms up: a process's first call pays once
    # for kernel calibration, the thread pool's start and the fused step's words (3x a 128-token prefill).
    engine.reset()
    for _ in engine.generate(ids[:16], SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)):
        pass
    ledger = session.loaded.store.stats()
    read_before = sum(ledger.bytes_read.values())
    samples = []
    for _ in range(runs):
        engine.reset()  # no KV prefix reuse: each run prefills the whole prompt
        generation = engine.generate(ids, params)
        for _ in generation:
            pass
        samples.append(generation.stats)
    loaded = session.loaded
    memory = read_memory(loaded.device)
    result = {
        "model": str(session.model_dir),
        "profile": session.profile.name,
        "quant": session.profile.quant_label,  # "auto → int8-g32-asym": what the weights are
        "threads": session.profile.threads,
        "device": str(loaded.device),
        "context": engine.context_length,
        "kv_cache": engine.cache.format.name,
        "kv_cache_bytes": engine.cache.nbytes,  # reserved for the whole context (touched as it fills)
        "runs": runs,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "prefill_tokens_per_s": statistics.median(s.prefill_tokens_per_s for s in samples),
        "decode_tokens_per_s": statistics.median(s.decode_tokens_per_s for s in samples),
        "ttft_s": statistics.median(s.ttft_s for s in samples),
        "load_s": session.load_s,
        "budget_bytes": session.profile.device_memory,
        "rss_bytes": memory.rss,
        "peak_rss_bytes": memory.peak_rss,
        "device_peak_bytes": memory.device_peak,
    }
    if engine.draft.enabled:  # speculative decoding (--draft): what the timed runs drafted and kept
        result["draft"] = {"source": engine.draft.model or engine.draft.kind, "tokens": engine.draft.tokens,
                           "drafted": sum(s.drafted for s in samples), "accepted": sum(s.accepted for s in samples),
                           "verify_passes": sum(s.verify_passes for s in samples)}  # fmt: skip
        if ledger.planned:  # streamed weights: what a generated token cost in reads, prefill's included
            generated = sum(s.new_tokens for s in samples)
            result["draft"]["bytes_read_per_token"] = (sum(ledger.bytes_read.values()) - read_before) / generated
    placement = loaded.placement
    if placement is not None:
        result["placement"] = [{"name": b.name, "tier": b.tier, "compute": b.compute} for b in placement.blocks]
        result["placement_bytes"] = placement.block_bytes_by_tier()
        result["charges"] = {tier: dict(items) for tier, items in placement.charges.items()}
        result["predicted_decode_tokens_per_s"] = placement.predicted_decode_tokens_per_s
        # How far the cost model was off, for `--json` readers as well as the text.
        result["decode_vs_predicted"] = result["decode_tokens_per_s"] / placement.predicted_decode_tokens_per_s
        result["predicted_prefill_tokens_per_s"] = placement.predicted_prefill_tokens_per_s
        result["binding_limit"] = placement.binding_limit
        if placement.expert_layers:
            result["predicted_expert_hit_rate"] = expected_expert_hit_rate(placement)
    if ledger.planned:  # a tiered store; a resident one streams nothing and plans nothing
        result["ledger"] = ledger.snapshot(loaded.device)
    if session.pipeline is not None:  # the other stages' time is in this speed: it says nothing of the probe
        result["stages"] = session.pipeline.describe()
        return result
    if engine.draft.enabled:  # tokens verified several a pass: not the plain decode speed the probe predicts
        return result
    source = f"bench {session.model_dir.name}, profile {session.profile.name}"
    # Decode steps attend over the prompt and half the reply on average: the KV read is predicted too.
    result["probe_check"] = note_measured_decode(
        loaded, session.profile, result["decode_tokens_per_s"], new_tokens - 1, source, prompt_tokens + new_tokens // 2
    )
    return result


def format_bench(result: dict) -> str:
    from tierlm.profile import format_size

    lines = [
        f"model     {result['model']} on {result['device']}, profile {result['profile']}, "
        f"quant {result['quant']}, {result['threads']} threads",
        f"runs      {result['runs']} x ({result['prompt_tokens']} prompt + {result['new_tokens']} new "
        f"tokens), greedy, median run (after a short warm-up run)",
        *([f"context   {result['context']:,} tokens, KV cache {result['kv_cache']} "
           f"({format_size(result['kv_cache_bytes'])} for all of them)"] if "context" in result else []),
        f"prefill   {result['prefill_tokens_per_s']:.1f} tok/s, time to first token "
        f"{result['ttft_s'] * 1000:.0f} ms",
        f"decode    {result['decode_tokens_per_s']:.2f} tok/s",
    ]
    draft = result.get("draft")
    if draft:
        kept = f" ({draft['accepted'] / draft['drafted']:.0%})" if draft["drafted"] else ""
        lines.append(f"drafts    {draft['source']}, up to {draft['tokens']} a pass: {draft['drafted']} drafted, "
                     f"{draft['accepted']} accepted{kept} in {draft['verify_passes']} verification passes"
                     + (f"; {format_size(draft['bytes_read_per_token'])} of weights read per generated token"
                        if "bytes_read_per_token" in draft else ""))  # fmt: skip
    if "predicted_decode_tokens_per_s" in result:
        ratio = result["decode_vs_predicted"]
        lines.append(
            f"predicted decode {result['predicted_decode_tokens_per_s']:.2f} tok/s "
            f"(measured {ratio:.0%} of it), prefill {result['predicted_prefill_tokens_per_s']:.1f} tok/s"
            + (f"; bound by {result['binding_limit']}" if result.get("binding_limit") else "")
        )
        lines.append("placement " + ", ".join(
            f"{tier} {format_size(n)}" for tier, n in result["placement_bytes"].items()
        ))  # fmt: skip
    within = "within" if result["peak_rss_bytes"] <= result["budget_bytes"] else "OVER"
    lines.append(
        f"memory    peak RSS {format_size(result['peak_rss_bytes'])} ({within} the profile's "
        f"{format_size(result['budget_bytes'])}), load {result['load_s']:.1f} s"
    )
    lines += [f"stages    {line}" for line in result.get("stages") or ()]
    check = result.get("probe_check")
    if check:
        path = check["path"]
        verdict = (f"the cached probe's {path} figures were corrected from this run" if check["corrected"]
                   else "within noise of the probe's prediction")  # fmt: skip
        at = f", {check['position']:,} positions" if check.get("position") else ""
        lines.append(f"probe     at batch 1{at} it predicted {check['predicted_tok_s']:.2f} tok/s ({path}); measured "
                     f"{check['measured_tok_s'] / check['predicted_tok_s']:.2f}x that: {verdict}")  # fmt: skip
    ledger = result.get("ledger")
    if ledger:
        read = ", ".join(f"{tier} {format_size(int(n))}" for tier, n in ledger["bytes_read_per_forward"].items())
        per_token = ", ".join(f"{tier} {format_size(int(n))}" for tier, n in ledger["bytes_read_per_token"].items())
        lines.append(
            f"streaming {read or 'nothing'} read per forward"
            + (f" ({per_token} per token)" if per_token else "")
            + f", stall {ledger['stall_s']:.2f} s, "
            f"overlap {ledger['overlap']:.0%}, "
            + (f"hot-row hit rate {ledger['hot_cache_hit_rate']:.0%}" if ledger["hot_cache_lookups"]
               else "embedding resident (no hot-row lookups)")
        )
        if "experts" in ledger:
            lines += format_experts(ledger["experts"], result.get("predicted_expert_hit_rate"))
    return "\n".join(lines)


def expected_expert_hit_rate(placement) -> float:
    """The plan's expected share of chosen experts found resident, all sparse layers together
    (each token chooses top-k experts in every sparse layer, so the layers weigh alike)."""
    layers = placement.expert_layers
    return sum(x.hit_rate for x in layers) / len(layers)


def format_experts(experts: dict, predicted_hit_rate: float | None = None) -> list[str]:
    """An MoE model's expert cache as bench and chat's /stats print it: the hit rate overall
    (beside the plan's expectation when there is a plan), speculation, then the hit rate of each
    sparse layer (wrapped, as a 48-layer model has 48)."""
    import textwrap

    guesses = experts["speculative_guesses"]
    speculation = (f"speculative prefetch {experts['speculative_accuracy']:.0%} right of {guesses} guesses"
                   if guesses else "no speculative prefetch")  # fmt: skip
    lookups = experts["hits"] + experts["misses"]
    per_layer = "  ".join(f"{layer}:{rate:.0%}" for layer, rate in experts["per_layer"].items())
    return [
        f"experts   hit rate {experts['hit_rate']:.0%} of {lookups} chosen"
        + (f" (planned {predicted_hit_rate:.0%})" if predicted_hit_rate is not None else "") + f", {speculation}",
        *textwrap.wrap(per_layer, width=100, initial_indent="per layer ", subsequent_indent=" " * 10),
    ]
