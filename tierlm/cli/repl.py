"""The interactive chat loop: streaming replies, history, and slash commands."""

from __future__ import annotations

import sys

HELP = "/reset  forget the conversation   /stats  speed and memory   /exit  quit"


def run_chat(session, params, system: str | None) -> None:
    """Read user lines (from a terminal or piped stdin) and stream each reply to stdout."""
    try:
        _loop(session, params, system)
    finally:
        session.engine.loaded.close()  # persists hot-row statistics for the next start


def _loop(session, params, system: str | None) -> None:
    from tierlm.runtime.chat import ChatSession

    chat = ChatSession(session.engine, system=system)
    interactive = sys.stdin.isatty()
    last = None
    if interactive:
        print(f"tierlm chat · {session.model_dir.name} · profile {session.profile.name} · {HELP}", file=sys.stderr)
    while True:
        try:
            line = input(">>> ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not interactive and line == "":
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            break
        if text == "/reset":
            chat.reset()
            print("(conversation cleared)", file=sys.stderr)
            continue
        if text == "/stats":
            print(format_stats(session, last), file=sys.stderr if interactive else sys.stdout)
            continue
        if text.startswith("/") and text.split()[0] in ("/help", "/?"):
            print(HELP, file=sys.stderr)
            continue
        generation = chat.send(text, params)
        for delta in generation:
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        last = generation.stats
        if chat.dropped_messages:
            print(f"(context full: {chat.dropped_messages} oldest messages dropped)", file=sys.stderr)


def format_stats(session, stats) -> str:
    from tierlm.device import read_memory
    from tierlm.profile import format_size

    engine = session.engine
    memory = read_memory(engine.loaded.device)
    lines = [f"profile   {session.profile.summary()}"]
    if stats is not None:
        lines += [
            f"reply     {stats.new_tokens} tokens, finish: {stats.finish_reason}",
            f"prefill   {stats.prompt_tokens - stats.reused_tokens} tokens "
            f"({stats.reused_tokens} reused from cache) at {stats.prefill_tokens_per_s:.1f} tok/s",
            f"decode    {stats.decode_tokens_per_s:.1f} tok/s, time to first token {stats.ttft_s * 1000:.0f} ms",
        ]
    lines += [
        f"context   {engine.cache.offset}/{engine.context_length} tokens, "
        f"KV cache {format_size(engine.cache.used_bytes)} used of {format_size(engine.cache.nbytes)} reserved",
        f"weights   {format_size(engine.loaded.store.nbytes())} resident on {engine.loaded.device}, "
        f"{engine.loaded.formats}",
        f"memory    RSS {format_size(memory.rss)}, peak {format_size(memory.peak_rss)}",
    ]
    placement = engine.loaded.placement
    if placement is not None:
        tiers = {}
        for block in placement.blocks:
            tiers[block.tier] = tiers.get(block.tier, 0) + 1
        lines.append(
            "placement " + ", ".join(f"{n} blocks on {tier}" for tier, n in tiers.items())
            + f"; predicted decode {placement.predicted_decode_tokens_per_s:.1f} tok/s"
            + (f" ({placement.binding_limit})" if placement.binding_limit else "")
        )
        planned = ", ".join(f"{tier} {format_size(placement.total(tier))}" for tier in placement.charges)
        lines.append(f"planned   {planned}")
    ledger = getattr(engine.loaded.store, "ledger", None)
    if ledger is not None:
        per_forward = ", ".join(f"{tier} {format_size(int(n))}" for tier, n in ledger.bytes_per_forward().items())
        lines.append(
            f"streaming {per_forward or 'nothing'} read per forward, stall {ledger.stall_s:.2f} s, "
            f"overlap {ledger.overlap:.0%}, "
            + (f"hot-row hit rate {ledger.hit_rate:.0%}" if ledger.hot_hits + ledger.hot_misses
               else "embedding resident (no hot-row lookups)")
        )
    return "\n".join(lines)
