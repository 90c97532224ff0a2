"""The interactive chat loop: streaming replies, history, slash commands, line editing.

A user's mistake never ends the session: Ctrl-C stops a reply (the partial reply stays in the
history), a message too long for the context is refused with the history intact, and an unknown
/command lists the commands. Ctrl-C at an empty prompt, Ctrl-D, or /bye ends it.
"""

from __future__ import annotations

import os
import signal
import sys

HELP = """\
/reset              forget the conversation
/stats              speed and memory
/help, /?           this list
/bye, /exit, /quit  quit (also Ctrl-D, or Ctrl-C at an empty prompt)
\"\"\"                 on a line of its own, starts a multi-line message; another \"\"\" ends it
                    (a message beginning with "/" can be sent this way)
Ctrl-C              stops a reply; what was said so far stays in the conversation"""

EXIT_COMMANDS = ("/bye", "/exit", "/quit")
BLOCK = '"""'
HISTORY_LENGTH = 1000  # lines of input kept in the history file across sessions


def run_chat(session, params, system: str | None, saved_as: str | None = None) -> None:
    """Read user lines (from a terminal or piped stdin) and stream each reply to stdout.
    `saved_as`: the session name the conversation is resumed from and saved to (runtime/saved_chat.py)."""
    _own_ctrl_c()
    interactive = sys.stdin.isatty()
    history_file = _start_line_editing() if interactive else None
    try:
        _loop(session, params, system, interactive, saved_as)
    finally:
        if history_file is not None:
            _save_line_history(history_file)


def _own_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt whatever this process inherited: started with SIGINT ignored
    (nohup, a background shell, some launchers), Python installs no handler and Ctrl-C would do nothing."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _loop(session, params, system: str | None, interactive: bool, saved_as: str | None) -> None:
    from tierlm.runtime.chat import ChatSession

    chat = ChatSession(session.engine, system=system)
    last = None
    replied = False
    if interactive:
        print(f"tierlm chat · {_model_label(session)} · profile {session.profile.name} · "
              "/? lists commands, Ctrl-D quits", file=sys.stderr)
    saved = _resume(saved_as, session, chat)
    while True:
        line = _prompt(interactive)
        if line is None:
            break
        try:
            text = line.strip()
            if text.startswith("/"):
                if not _command(text, chat, session, last, interactive):
                    break
                continue
            if text.startswith(BLOCK):
                text = _read_block(text[len(BLOCK):], interactive)
            if text:
                if replied and not interactive:  # piped: a blank line between replies, as ollama run prints
                    sys.stdout.write("\n")
                last = _reply(chat, text, params) or last
                replied = True
                _save(saved, chat)  # after each reply: a crash loses at most the turn in flight
        except KeyboardInterrupt:  # a Ctrl-C outside a reply's own handling (e.g. during /stats)
            print("\n(interrupted)", file=sys.stderr)
    _save(saved, chat)


def _resume(name: str | None, session, chat):
    """The SavedChat for `--session name` with its conversation restored into `chat`; None without one."""
    if name is None:
        return None
    from tierlm.runtime.saved_chat import SavedChat

    saved = SavedChat.open(name, session)
    print(saved.resume(chat), file=sys.stderr)
    return saved


def _save(saved, chat) -> None:
    problem = saved.save(chat) if saved is not None else None
    if problem:
        print(f"({problem})", file=sys.stderr)


def _model_label(session) -> str:
    """The model as `tierlm list` names it, with how its weights are held: "smollm2 (mixed:source)"."""
    from tierlm.cache.catalog import model_name
    from tierlm.quant.modes import quant_text

    held = session.engine.loaded.weight_format
    return f"{model_name(session.model_dir)} ({quant_text(held)})" if held else model_name(session.model_dir)


def _command(text: str, chat, session, last, interactive: bool) -> bool:
    """Run a slash command; False means the session ends."""
    name = text.split()[0]
    if name in EXIT_COMMANDS:
        return False
    if name == "/reset":
        chat.reset()
        print("(conversation cleared)", file=sys.stderr)
    elif name == "/stats":
        print(format_stats(session, last), file=sys.stderr if interactive else sys.stdout)
        _check_probe(session, last)
    elif name in ("/help", "/?"):
        print(HELP, file=sys.stderr)
    else:
        # Not sent to the model: a mistyped command would only get a confused reply.
        print(f"unknown command {name}; the commands are:\n{HELP}", file=sys.stderr)
    return True


def _reply(chat, text: str, params):
    """Stream one reply to stdout; its stats, or None when the message was refused or never ran."""
    from tierlm.errors import TierlmError

    dropped = chat.dropped_messages
    generation = None
    try:
        with _ReplyInterrupt() as stop:
            generation = chat.send(text, params)
            stopped = _stream(generation, stop)
    except TierlmError as err:
        sys.stdout.flush()
        print(f"error: {err}", file=sys.stderr)
        return None
    except KeyboardInterrupt:
        # The second Ctrl-C of a reply cut a step short; closing the generation (in _stream)
        # has already brought the history and the KV cache into line.
        stopped = True
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stopped:
        print("(interrupted)", file=sys.stderr)
    if chat.dropped_messages > dropped:
        print(f"(context full: {chat.dropped_messages} oldest messages dropped)", file=sys.stderr)
    return generation.stats if generation is not None and generation.stats.finish_reason else None


def _stream(generation, stop) -> bool:
    """Write the reply as it comes; True when Ctrl-C cut it short."""
    try:
        if stop.requested:  # Ctrl-C while the prompt was being prepared: do not start
            return True
        for delta in generation:
            sys.stdout.write(delta)
            sys.stdout.flush()
            if stop.requested:
                return True
        return stop.requested
    finally:
        stop.hard = False  # closing must not be interrupted: it updates history and KV cache
        generation.deltas.close()


class _ReplyInterrupt:
    """SIGINT during a reply. The first asks the reply to stop after the current token, so no
    forward pass is cut in half; a second one (a step that takes long, such as the prefill of a
    long prompt) raises KeyboardInterrupt at once. Later ones are ignored."""

    def __init__(self):
        self.requested = False
        self.hard = True
        self._previous = None

    def __call__(self, signum, frame) -> None:
        if self.requested and self.hard:
            self.hard = False
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "_ReplyInterrupt":
        self._previous = signal.signal(signal.SIGINT, self)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


def _prompt(interactive: bool) -> str | None:
    """The next input line; "" after Ctrl-C cleared a typed line; None to end the session."""
    try:
        return _read_line(">>> ", interactive)
    except KeyboardInterrupt:
        # Like a shell: Ctrl-C drops a line being typed; at an empty prompt it quits.
        typed = _typed_text()
        print(file=sys.stderr)
        return "" if typed else None


def _read_block(first: str, interactive: bool) -> str:
    """A multi-line message: `first`, then lines up to one ending in \"\"\" (or the end of input).
    Ctrl-C inside the block discards it."""
    lines = []
    line = first
    try:
        while line is not None:
            if line.rstrip().endswith(BLOCK):
                lines.append(line.rstrip()[: -len(BLOCK)])
                break
            lines.append(line)
            line = _read_line("... ", interactive)
    except KeyboardInterrupt:
        print("\n(message discarded)", file=sys.stderr)
        return ""
    return "\n".join(lines).strip()


def _read_line(prompt: str, interactive: bool) -> str | None:
    """One line without its newline, or None at the end of input."""
    if interactive:
        try:
            return input(prompt)
        except EOFError:
            print(file=sys.stderr)  # the shell's prompt starts on a fresh line
            return None
    line = sys.stdin.readline()
    return line.rstrip("\n") if line else None


def _typed_text() -> str:
    """What was on the input line when Ctrl-C came (readline knows; without it, nothing)."""
    readline = sys.modules.get("readline")
    return readline.get_line_buffer() if readline is not None else ""


def _start_line_editing():
    """Arrow keys and a persistent input history through readline; its history file, or None."""
    try:
        import readline
    except ImportError:  # not built on every platform; input() then reads plain lines
        return None
    from tierlm.paths import cache_root

    path = cache_root() / "chat_history"
    readline.set_history_length(HISTORY_LENGTH)
    try:
        readline.read_history_file(path)
    except OSError:  # first session, or an unreadable file: start empty
        pass
    return path


def _save_line_history(path) -> None:
    """Write the input history beside the cache (a temporary name, then a rename)."""
    import readline

    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(tmp)
        os.replace(tmp, path)
    except OSError as err:  # losing the history must not turn a clean exit into an error
        print(f"(input history not saved: {err})", file=sys.stderr)
        tmp.unlink(missing_ok=True)


def _check_probe(session, stats) -> None:
    """The last reply is a measured decode: it corrects a cached probe that was far off (as `bench` does)."""
    from tierlm.probe.measured import note_measured_decode

    if stats is None or session.pipeline is not None:  # a pipeline's speed includes the other stages
        return
    if stats.verify_passes:  # tokens verified several a pass: not the plain decode speed the probe predicts
        return
    source = f"chat {_model_label(session)}, profile {session.profile.name}"
    run = note_measured_decode(session.engine.loaded, session.profile, stats.decode_tokens_per_s, stats.new_tokens - 1,
                               source, stats.prompt_tokens + stats.new_tokens // 2)  # fmt: skip
    if run is not None and run.get("corrected"):
        print(f"(the cached bandwidth probe predicted {run['predicted_tok_s']:.1f} tok/s; corrected "
              f"from this run's {run['measured_tok_s']:.1f} tok/s)", file=sys.stderr)


def format_stats(session, stats) -> str:
    from tierlm.device.memory import read_memory
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
        if engine.draft.enabled:  # speculative decoding (--draft, on by default)
            lines.append(f"drafts    {engine.draft.model or engine.draft.kind}: {stats.drafted} drafted, "
                         f"{stats.accepted} accepted in {stats.verify_passes} verification passes")  # fmt: skip
    lines += [
        f"context   {engine.cache.offset}/{engine.context_length} tokens, KV cache {engine.cache.format.name}: "
        f"{format_size(engine.cache.used_bytes)} used of {format_size(engine.cache.nbytes)} reserved",
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
    ledger = engine.loaded.store.stats()
    if ledger.planned:  # a tiered store; a resident one streams nothing and plans nothing
        per_forward = ", ".join(f"{tier} {format_size(int(n))}" for tier, n in ledger.bytes_per_forward().items())
        per_token = ", ".join(f"{tier} {format_size(int(n))}" for tier, n in ledger.bytes_per_token().items())
        lines.append(
            f"streaming {per_forward or 'nothing'} read per forward"
            + (f" ({per_token} per token)" if per_token else "")
            + f", stall {ledger.stall_s:.2f} s, "
            f"overlap {ledger.overlap:.0%}, "
            + (f"hot-row hit rate {ledger.hit_rate:.0%}" if ledger.hot_hits + ledger.hot_misses
               else "embedding resident (no hot-row lookups)")
        )
        experts = ledger.snapshot().get("experts")
        if experts:
            from tierlm.cli.bench import expected_expert_hit_rate, format_experts

            planned = expected_expert_hit_rate(placement) if placement is not None and placement.expert_layers else None
            lines += format_experts(experts, planned)
    return "\n".join(lines)
