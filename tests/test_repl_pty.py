"""`tierlm chat` survives its user's mistakes: Ctrl-C stops a reply, an over-long message is
refused, an unknown /command is answered with the list, a \"\"\" block is one message.

The REPL runs as a child on a pseudo-terminal whose controlling terminal it is, so Ctrl-C is
the byte \\x03 turned into SIGINT by the terminal driver, as at a real keyboard. Each child
loads the embedded SmolLM2-135M; every wait has a deadline so a hang fails instead of blocking.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.tiny import make_model
from tierlm.runtime.chat import ChatSession
from tierlm.runtime.engine import Engine
from tierlm.runtime.loader import load_model
from tierlm.runtime.sampling import SamplingParams
from tierlm.runtime.tokenizer import Tokenizer

STARTUP_S = 300  # loading the model on a busy 2-core machine
REPLY_S = 180
# Become the session leader's controlling terminal (stdin is the pty), then run tierlm.
ACQUIRE_TTY = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable] + sys.argv[1:])"
)
ESCAPES = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|[=>])|\r")


class Terminal:
    """A `tierlm chat` child on a pseudo-terminal: type into it, wait for what it prints."""

    def __init__(self, *args: str, sigint: signal.Handlers = signal.SIG_DFL):
        """`sigint`: the SIGINT disposition the child inherits (SIG_IGN, as from nohup or a
        background shell); the default one whatever this test process was started with."""
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ACQUIRE_TTY, "-m", "tierlm", "chat", "--profile", "4gb", "-t", "0", *args],
            stdin=slave, stdout=slave, stderr=slave, start_new_session=True, env=os.environ.copy(),
            preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
        )
        os.close(slave)
        self.raw = b""
        self.seen = 0  # how much of the transcript earlier expect() calls consumed

    @property
    def transcript(self) -> str:
        return ESCAPES.sub("", self.raw.decode("utf-8", "replace"))

    def _pump(self, timeout: float) -> bool:
        """Read what the child printed within `timeout`; False once the terminal is closed."""
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            chunk = os.read(self.master, 65536)
        except OSError:  # EIO: the child has exited and the pty is gone
            return False
        self.raw += chunk
        return bool(chunk)

    def expect(self, pattern: str, timeout: float = REPLY_S) -> re.Match:
        """Wait for `pattern` (a regex) after what earlier calls matched; fail at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.compile(pattern, re.S).search(self.transcript, self.seen)
            if match:
                self.seen = match.end()
                return match
            if time.monotonic() > deadline or not self._pump(0.2):
                pytest.fail(f"no {pattern!r} within {timeout} s; transcript:\n{self.transcript}")

    def type(self, text: str) -> None:
        """Type `text`, a little at a time, reading the echo so neither side's buffer fills."""
        data = text.encode()
        for start in range(0, len(data), 256):
            os.write(self.master, data[start : start + 256])
            self._pump(0.01)

    def closed_within(self, seconds: float) -> bool:
        """Whether the child closed the terminal (exited) within `seconds`, reading what it prints."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not self._pump(0.2):
                return True
        return False

    def exit_status(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while self._pump(0.2) and time.monotonic() < deadline:
            pass
        return self.proc.wait(max(deadline - time.monotonic(), 1))

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only this child
            self.proc.wait()
        os.close(self.master)


@pytest.fixture
def terminal():
    started: list[Terminal] = []

    def start(*args: str, **options) -> Terminal:
        started.append(Terminal(*args, **options))
        return started[-1]

    yield start
    for term in started:
        term.close()


# -- ChatSession and the reply loop in-process, on a tiny random model --------------------------

SYSTEM = "be brief"
LONG = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("repl-model")
    make_model(model_dir, vocab=320, layers=2)
    return model_dir


def engine_for(model_dir) -> Engine:
    return Engine(load_model(model_dir, device="cpu", dtype=torch.float32), Tokenizer.from_dir(model_dir))


def assert_cache_is_a_prefix_of_history(chat: ChatSession) -> None:
    """The invariant chat.py keeps: the KV cache holds the first tokens of the history as the
    next prompt will render it, and the engine's record of them matches the cache."""
    engine = chat.engine
    history = engine.tokenizer.encode_chat(chat._conversation(), add_generation_prompt=False)
    assert engine.cache.offset == len(engine.cached_ids)
    assert engine.cached_ids == history[: len(engine.cached_ids)]


def assert_next_turn_matches_a_fresh_engine(chat: ChatSession, model_dir, text: str) -> None:
    """The proof that the cache agrees with the history: continuing from it gives the reply a
    fresh engine gives to the same conversation."""
    conversation = chat._conversation() + [{"role": "user", "content": text}]
    fresh = engine_for(model_dir)
    expected = fresh.generate(fresh.tokenizer.encode_chat(conversation), SHORT).text()
    generation = chat.send(text, SHORT)
    assert generation.text() == expected
    assert generation.stats.reused_tokens > 0


def test_a_stopped_reply_joins_the_history_and_the_cache_agrees(tiny_dir):
    chat = ChatSession(engine_for(tiny_dir), system=SYSTEM)
    generation = chat.send("hello world", LONG)
    shown = [next(generation.deltas) for _ in range(5)]
    generation.deltas.close()  # what the REPL does on Ctrl-C
    assert generation.stats.finish_reason == "interrupted"
    assert len(generation.token_ids) < LONG.max_new_tokens
    assert chat.messages == [{"role": "user", "content": "hello world"},
                             {"role": "assistant", "content": "".join(shown)}]
    assert_cache_is_a_prefix_of_history(chat)
    assert len(chat.engine.cached_ids) >= generation.stats.prompt_tokens  # the prompt stays reusable
    assert_next_turn_matches_a_fresh_engine(chat, tiny_dir, "and then?")


def test_an_interrupt_between_a_forward_pass_and_its_record_is_repaired(tiny_dir, monkeypatch):
    chat = ChatSession(engine_for(tiny_dir), system=SYSTEM)
    chat.send("hello world", SHORT).text()
    engine = chat.engine
    forward = engine.model.forward
    calls = []

    def forward_then_interrupt(*args, **kwargs):
        logits = forward(*args, **kwargs)  # the cache has advanced ...
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt  # ... but the engine never records these ids
        return logits

    monkeypatch.setattr(engine.model, "forward", forward_then_interrupt)
    generation = chat.send("tell me more", LONG)
    with pytest.raises(KeyboardInterrupt):
        generation.text()
    monkeypatch.setattr(engine.model, "forward", forward)
    assert generation.stats.finish_reason == "interrupted"
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 2
    assert_cache_is_a_prefix_of_history(chat)
    assert_next_turn_matches_a_fresh_engine(chat, tiny_dir, "and then?")


def test_a_reply_stopped_before_any_text_leaves_the_history_as_it_was(tiny_dir, monkeypatch):
    chat = ChatSession(engine_for(tiny_dir), system=SYSTEM)
    chat.send("hello world", SHORT).text()
    before = [dict(m) for m in chat.messages]
    chat.send("never started", LONG).deltas.close()
    assert chat.messages == before
    engine = chat.engine

    def interrupted_prefill(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.model, "forward", interrupted_prefill)
    with pytest.raises(KeyboardInterrupt):
        chat.send("cut during prefill", LONG).text()
    monkeypatch.undo()
    assert chat.messages == before
    assert_cache_is_a_prefix_of_history(chat)
    assert_next_turn_matches_a_fresh_engine(chat, tiny_dir, "and then?")


def test_ctrl_c_in_the_reply_loop_stops_after_a_token_and_twice_at_once(tiny_dir, monkeypatch, capsys):
    """Real SIGINTs to this process, arriving inside forward passes: one stops the reply at the
    next token, a second one (a long prefill) cuts it at once; the session goes on either way."""
    from tierlm.cli import repl

    chat = ChatSession(engine_for(tiny_dir), system=SYSTEM)
    engine = chat.engine
    forward = engine.model.forward
    plan = {3: 1}  # forward call number -> how many Ctrl-Cs arrive during it
    calls = []

    def forward_with_ctrl_c(*args, **kwargs):
        calls.append(1)
        for _ in range(plan.get(len(calls), 0)):
            os.kill(os.getpid(), signal.SIGINT)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", forward_with_ctrl_c)
    stats = repl._reply(chat, "hello world", LONG)
    out, err = capsys.readouterr()
    assert "(interrupted)" in err
    # It stops at the first text after the Ctrl-C (a token can hold back a partial character).
    assert stats.finish_reason == "interrupted" and stats.new_tokens < 10
    assert chat.messages[-1] == {"role": "assistant", "content": out.removesuffix("\n")}
    assert_cache_is_a_prefix_of_history(chat)

    before = [dict(m) for m in chat.messages]
    calls.clear()
    plan = {1: 2}
    stats = repl._reply(chat, "a long prompt", LONG)
    assert stats.finish_reason == "interrupted" and stats.new_tokens == 0  # cut in its prefill
    assert "(interrupted)" in capsys.readouterr().err
    assert chat.messages == before
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    monkeypatch.setattr(engine.model, "forward", forward)
    assert_cache_is_a_prefix_of_history(chat)
    assert_next_turn_matches_a_fresh_engine(chat, tiny_dir, "and then?")


# -- the REPL on a terminal, with the embedded model --------------------------------------------

OVERLONG = "word " * 1100  # about 1130 tokens with the template; the 4gb profile's context is 1024


def stats_after(term: Terminal) -> str:
    term.type("/stats\r")
    return term.expect(r"/stats\n(.*?)>>> ").group(1)


@pytest.mark.e2e
@pytest.mark.slow
def test_ctrl_c_stops_a_reply_and_an_overlong_message_is_refused_and_the_chat_goes_on(terminal):
    term = terminal("-n", "200")
    term.expect(">>> ", STARTUP_S)
    term.type("Write a long story about a dragon who learns to fly.\r")
    term.expect(r"fly\.\n\s*\S{3}")  # the reply has begun
    term.type("\x03")  # the terminal driver turns it into SIGINT
    term.expect(r"\(interrupted\)\n>>> ")
    stats = stats_after(term)
    first = re.search(r"reply\s+(\d+) tokens, finish: interrupted\nprefill\s+(\d+) tokens", stats)
    assert first and int(first.group(1)) < 200, stats

    term.type(OVERLONG + "\r")
    term.expect(r"error: the message is \d+ tokens with the chat template, but the context holds 1024.*?>>> ")

    term.type("What is the capital of France?\r")
    answer = term.expect(r"France\?\n(.*?)\n>>> ").group(1)
    assert answer.strip() and "(interrupted)" not in answer and "error" not in answer
    stats = stats_after(term)
    second = re.search(r"finish: (stop|length)\nprefill\s+\d+ tokens \((\d+) reused from cache\)", stats)
    # The second prompt began with the whole first turn, found in the KV cache: the history is
    # intact after both the interrupt and the refusal.
    assert second and int(second.group(2)) >= int(first.group(2)), stats

    term.type("/bye\r")
    assert term.exit_status() == 0
    assert "Traceback" not in term.transcript


@pytest.mark.e2e
@pytest.mark.slow
def test_unknown_commands_are_not_sent_and_a_block_is_one_message(terminal):
    from tierlm.weights.embedded import ensure_embedded_model

    term = terminal("-n", "8")
    # The banner names the model as `tierlm list` does, with its weights as --quant spells them.
    term.expect(r"tierlm chat · smollm2 \((mixed:source|int8[\w-]*|int4[\w-]*)\) · profile 4gb", STARTUP_S)
    term.expect(">>> ", STARTUP_S)
    term.type("/frobnicate the model\r")
    term.expect(r"unknown command /frobnicate.*?/reset.*?/stats.*?/bye.*?\"\"\".*?>>> ")
    stats = stats_after(term)
    assert re.search(r"context\s+0/1024 tokens", stats) and "reply " not in stats, stats  # no model call

    term.type('"""\r')
    term.expect(r"\.\.\. ")
    term.type("Say hi\r")
    term.expect(r"\.\.\. ")  # still in the block: no reply yet
    term.type("to Ada\r")
    term.expect(r"\.\.\. ")
    term.type('"""\r')
    term.expect(r'"""\n.*?>>> ')
    stats = stats_after(term)
    tokenizer = Tokenizer.from_dir(ensure_embedded_model())
    block_prompt = tokenizer.encode_chat([{"role": "user", "content": "Say hi\nto Ada"}])
    assert f"prefill   {len(block_prompt)} tokens (0 reused from cache)" in stats, stats

    term.type("half a line")
    term.expect("half a line")  # read by readline (the driver would discard unread typing on ^C)
    term.type("\x03")  # Ctrl-C drops a line being typed; the session goes on
    term.expect(r"\n>>> ")
    term.type("\x04")  # Ctrl-D at the prompt
    assert term.exit_status() == 0
    assert "Traceback" not in term.transcript


@pytest.mark.e2e
@pytest.mark.slow
def test_ctrl_c_at_an_empty_prompt_quits_and_input_history_persists(terminal, tierlm_cache):
    history = tierlm_cache / "chat_history"
    history.write_text("an earlier message\n")
    term = terminal("-n", "4")
    term.expect(">>> ", STARTUP_S)
    term.type("/help\r")
    term.expect(r"this list.*?>>> ")
    term.type("\x1b[A")  # up arrow: the line just entered
    term.expect(r"/help")
    term.type("\x1b[A")  # and the one from an earlier session
    term.expect(r"an earlier message")
    term.type("\x03")  # clears the recalled line
    term.expect(r">>> ")
    assert term.proc.poll() is None
    term.type("\x03")  # at an empty prompt: quit
    assert term.exit_status() == 0
    assert history.read_text().splitlines() == ["an earlier message", "/help"]


@pytest.mark.e2e
@pytest.mark.slow
def test_ctrl_c_works_when_the_chat_inherits_sigint_ignored(terminal):
    """Started from nohup or a background shell (SIGINT ignored), Ctrl-C still ends the chat."""
    term = terminal("-n", "4", sigint=signal.SIG_IGN)
    term.expect(">>> ", STARTUP_S)
    term.type("\x03")  # at an empty prompt: quit
    if not term.closed_within(10):
        # CPython's readline notices a SIGINT only when its wait for input (select) is interrupted;
        # one that lands just before that wait goes unseen until the next key. A user presses again.
        term.type("\x03")
    assert term.exit_status() == 0


@pytest.mark.e2e
@pytest.mark.slow
def test_piped_chat_refuses_an_overlong_line_and_answers_the_next():
    result = subprocess.run(
        [sys.executable, "-m", "tierlm", "chat", "--profile", "4gb", "-t", "0", "-n", "20"],
        input=f"Say hi\n{OVERLONG}\nSay bye\n", capture_output=True, text=True, timeout=STARTUP_S,
    )
    assert result.returncode == 0, result.stderr
    assert "error: the message is" in result.stderr and "Traceback" not in result.stderr
    replies = [line for line in result.stdout.split("\n") if line.strip()]
    assert len(replies) >= 2, result.stdout  # "Say bye" was answered too
