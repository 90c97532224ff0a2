"""GET /stats: what chat's `/stats` shows, as JSON for the chat page (static/chat.html).

Speed (the latest decode step and prefill chunk, and the planner's prediction), memory measured
against the budget the plan was made for, where the blocks were placed, the KV cache (with the
tokens each slot holds), the prefix reuse of ended requests (prompt tokens, those reused from a
slot, their ratio), context shifting (serve --context-shift), speculative decoding (serve --draft:
tokens drafted and accepted) and the requests in flight. Read
when asked; the counts are the metrics' (metrics.py).
"""

from __future__ import annotations

from tierlm.device.memory import read_memory
from tierlm.server.batch import sequences_at_once


def server_stats(state) -> dict:
    """The figures for one server (`app.state` of create_app)."""
    session, worker = state.session, state.worker
    loaded, profile = session.loaded, session.profile
    placement = loaded.placement
    memory = read_memory(loaded.device)
    kv = worker.kv_bytes()
    return {
        "model": state.model_id,
        "profile": {"name": profile.name, "summary": profile.summary()},
        "speed": {
            # Gauges the worker sets each step (metrics.py); 0 before the first reply.
            "decode_tokens_per_s": _sample(state.metrics, "tierlm_decode_tokens_per_second"),
            "prefill_tokens_per_s": _sample(state.metrics, "tierlm_prefill_tokens_per_second"),
            "predicted_decode_tokens_per_s": placement.predicted_decode_tokens_per_s if placement else None,
            "binding_limit": (placement.binding_limit or None) if placement else None,
        },
        "memory": {
            "resident_bytes": memory.rss,
            "peak_resident_bytes": memory.peak_rss,
            "ram_budget_bytes": _ram_budget(loaded.device, profile, placement),
            **_device_memory(loaded.device, memory, profile, placement),
        },
        "placement": _placement(placement),
        "kv_cache": None if kv is None else {"format": loaded.kv_format.name, "context": state.context,
                                             "reserved_bytes": kv[0], "used_bytes": kv[1],
                                             "slots": worker.slots_held() or [], "pages": worker.page_stats(),
                                             "spill": worker.spill_stats()},
        "prefix_reuse": _prefix_reuse(state.metrics),
        "context_shift": {
            "enabled": state.options.context_shift,
            "requests": int(_sample(state.metrics, "tierlm_context_shifted_requests_total")),
            "dropped_messages": int(_sample(state.metrics, "tierlm_context_shift_dropped_messages_total")),
        },
        "speculation": _speculation(state),
        "requests": {"active": worker.active, "queued": worker.queue_depth, "slots": state.slots,
                     "parallel": sequences_at_once(state.slots, state.options.parallel)},
    }


def _speculation(state) -> dict:
    """Speculative decoding: the server's default source, the tokens drafted and kept so far, and
    the streamed weight bytes read per generated token (None when nothing streams): what a pass
    that verifies several tokens at once saves."""
    drafted = int(_sample(state.metrics, "tierlm_draft_tokens_total"))
    accepted = int(_sample(state.metrics, "tierlm_draft_accepted_tokens_total"))
    generated = _sample(state.metrics, "tierlm_generated_tokens_total")
    ledger = state.session.loaded.store.stats()
    read = sum(dict(ledger.bytes_read).values()) if ledger.planned or ledger.bytes_read else None
    draft = state.options.draft
    return {"draft": draft.model or draft.kind, "draft_tokens": draft.tokens, "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "weight_bytes_read_per_token": read / generated if read is not None and generated else None}


def _sample(metrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


def _prefix_reuse(metrics) -> dict:
    """Prompt tokens of ended requests, those a slot held already (not prefilled), and their share
    (None before any prompt)."""
    prompt = int(_sample(metrics, "tierlm_prompt_tokens_total"))
    reused = int(_sample(metrics, "tierlm_prompt_tokens_cached_total"))
    return {"prompt_tokens": prompt, "reused_tokens": reused, "hit_rate": reused / prompt if prompt else None}


def _budgets(profile, placement) -> dict:
    """The budgets the plan was made within (capped at the process's real limits), else the profile's."""
    if placement is not None:
        return dict(placement.budgets)
    return {"device": profile.device_memory, "host": profile.host_memory}


def _ram_budget(device, profile, placement) -> int | None:
    """What resident memory may reach: on a CPU-only machine device and host are one RAM tier
    (both budgets when the host tier is emulated), beside an accelerator the host budget."""
    budgets = _budgets(profile, placement)
    if getattr(device, "type", "cpu") != "cpu":
        return budgets.get("host")
    charged_host = placement is not None and "host" in placement.charges
    return (budgets.get("device") or 0) + ((budgets.get("host") or 0) if charged_host else 0) or None


def _device_memory(device, memory, profile, placement) -> dict:
    if getattr(device, "type", "cpu") == "cpu":
        return {}
    return {"device_allocated_bytes": memory.device_allocated, "device_peak_bytes": memory.device_peak,
            "device_budget_bytes": _budgets(profile, placement).get("device")}


def _placement(placement) -> dict | None:
    """Blocks and weight bytes per tier, and the bytes planned against each tier's budget."""
    if placement is None:
        return None
    blocks: dict[str, int] = {}
    for block in placement.blocks:
        blocks[block.tier] = blocks.get(block.tier, 0) + 1
    return {
        "blocks": blocks,
        "weight_bytes": placement.block_bytes_by_tier(),
        "planned_bytes": {tier: placement.total(tier) for tier in placement.charges},
        "budget_bytes": dict(placement.budgets),
    }
