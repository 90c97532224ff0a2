"""`chat --session NAME`: a saved conversation resumes with its KV rows, without prefilling them
again, and replies as one uninterrupted chat would; a session file that is truncated, damaged,
of another format or from other weights is refused with one line and never used; a temporary
left by a killed save is never read.

Each test gets a private cache (the saved sessions live in it) and a tiny random model; the CLI
runs in this process (tests/cli_runner.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cli_runner import run_tierlm
from tests.test_models_by_name import pin_bandwidths
from tests.tiny import make_model

GREEDY = ["-t", "0", "-n", "8", "--quant", "int8"]
FIRST = "hello\nhow are you\n"
MORE = "tell me more\n"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("session-models")
    make_model(folder / "a", seed=0)
    make_model(folder / "b", seed=1)  # the same shapes, other weights
    make_model(folder / "h32", seed=2, head_dim=32)  # heads a quantized KV cache can hold
    return {"a": folder / "a", "b": folder / "b", "h32": folder / "h32"}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    root.mkdir()
    monkeypatch.setenv("TIERLM_CACHE", str(root))
    pin_bandwidths()  # no test measures the machine
    return root


def chat(model: Path, stdin: str, *flags: str) -> subprocess.CompletedProcess:
    result = run_tierlm("chat", "--model", str(model), *GREEDY, *flags, stdin=stdin)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    return result


def replies(result) -> list[str]:
    """A piped chat's replies (a blank line between them), without /stats lines."""
    text = result.stdout.split("\nprofile ")[0]
    return text.rstrip("\n").split("\n\n")


def reused(result) -> tuple[int, int]:
    """(computed, reused) prompt tokens of the last reply, from /stats."""
    found = re.search(r"^prefill\s+(\d+) tokens \((\d+) reused from cache\)", result.stdout, re.M)
    return int(found[1]), int(found[2])


def session_lines(result, name: str = "s") -> list[str]:
    return [line for line in result.stderr.splitlines() if f"session {name}" in line]


def test_a_resumed_session_replies_as_one_uninterrupted_chat_without_prefilling_it(cache, models):
    first = chat(models["a"], FIRST, "--session", "s")
    assert session_lines(first) == [f"new session s (kept in {cache / 'sessions' / 's'})"]
    assert (cache / "sessions" / "s").is_file()

    resumed = chat(models["a"], MORE + "/stats\n", "--session", "s")
    lines = session_lines(resumed)
    assert len(lines) == 1 and lines[0].startswith("resumed session s: 4 messages, "), lines
    cached = int(lines[0].split(", ")[1].split()[0].replace(",", ""))
    whole = chat(models["a"], FIRST + MORE + "/stats\n")
    assert replies(resumed) == replies(whole)[-1:] and replies(whole)[-1].strip()
    # The earlier turns' tokens came from the file: only the new message was prefilled.
    computed, reused_tokens = reused(resumed)
    assert cached > 0 and reused_tokens == cached
    assert computed + reused_tokens == sum(reused(whole))  # the same prompt

    # Saved again after that reply: a third run resumes six messages.
    again = chat(models["a"], "/bye\n", "--session", "s")
    assert session_lines(again)[0].startswith("resumed session s: 6 messages, ")


@pytest.mark.parametrize("kv_cache", ["auto", "q8_0", "q4_0"])
def test_restored_rows_are_the_saved_ones_and_the_reply_token_for_token(cache, models, tmp_path, kv_cache):
    """In process: the restored KV rows are bitwise the saved ones, and greedy tokens equal the
    uninterrupted chat's."""
    from tierlm.runtime.chat import ChatSession
    from tierlm.runtime.engine import Engine
    from tierlm.runtime.loader import load_model
    from tierlm.runtime.sampling import SamplingParams
    from tierlm.runtime.saved_chat import SavedChat, model_identity
    from tierlm.runtime.tokenizer import Tokenizer

    loaded = load_model(models["h32"], device="cpu", dtype=torch.float32, quant="int8", kv_cache=kv_cache)
    tokenizer = Tokenizer.from_dir(models["h32"])
    params = SamplingParams(temperature=0.0, max_new_tokens=8)

    def turn(chat, text):
        generation = chat.send(text, params)
        generation.text()
        return generation

    whole = ChatSession(Engine(loaded, tokenizer), system="be brief")
    for text in ("hello", "how are you"):
        turn(whole, text)
    saved = SavedChat("s", tmp_path / "s", model_identity(loaded, whole.engine.cache))
    assert saved.save(whole) is None
    length = whole.engine.cache.offset
    rows = [part.clone() for part in whole.engine.cache.rows_of(0, length)]
    assert len(rows) == (4 if kv_cache.startswith("q") else 2)  # quantized: the scales too
    expected = turn(whole, "tell me more")

    resumed = ChatSession(Engine(loaded, tokenizer))
    line = SavedChat("s", tmp_path / "s", model_identity(loaded, resumed.engine.cache)).resume(resumed)
    assert line == f"resumed session s: 4 messages, {length:,} tokens cached"
    assert resumed.system == "be brief"  # the saved system prompt, as none was given
    for held, saved_part in zip(resumed.engine.cache.rows_of(0, length), rows, strict=True):
        assert torch.equal(held, saved_part)
    got = turn(resumed, "tell me more")
    assert got.token_ids == expected.token_ids and got.stats.reused_tokens == length > 0


def damaged_copies(good: bytes) -> dict[str, tuple[bytes, str]]:
    """name -> (the file's bytes, what the refusal says)."""
    payload_byte = len(good) - 100
    flipped = bytearray(good)
    flipped[payload_byte] ^= 0x01
    header_text = good.replace(b'"content": "hello"', b'"content": "jello"', 1)
    assert header_text != good
    version = good.replace(b'"format_version": 2', b'"format_version": 9', 1)
    assert version != good
    return {
        "truncated": (good[: len(good) // 2], f"it is truncated ({len(good) // 2:,} of {len(good):,} bytes)"),
        "flipped payload byte": (bytes(flipped), "it is damaged (checksum mismatch)"),
        "edited message": (header_text, "it is damaged (checksum mismatch)"),
        "other format": (version, "it has format version 9, this tierlm reads 2"),
        "not a session": (b"not a session file, just text", "it is not a tierlm prompt-cache file"),
    }


def test_a_damaged_session_is_refused_with_one_line_and_never_used(cache, models):
    chat(models["a"], FIRST, "--session", "s")
    path = cache / "sessions" / "s"
    good = path.read_bytes()
    fresh = replies(chat(models["a"], MORE))
    for case, (data, reason) in damaged_copies(good).items():
        path.write_bytes(data)
        result = chat(models["a"], MORE + "/stats\n", "--session", "s")
        assert session_lines(result) == [f"session s was not used: {reason}; starting it afresh"], case
        assert replies(result) == fresh and reused(result)[1] == 0, case  # nothing of it was used
        # The chat saved itself anew: whole, with this run's one exchange.
        again = chat(models["a"], "", "--session", "s")
        assert session_lines(again)[0].startswith("resumed session s: 2 messages"), case


def test_a_session_from_other_weights_keeps_its_messages_and_computes_them_afresh(cache, models):
    from tierlm.runtime.chat import ChatSession
    from tierlm.runtime.engine import Engine
    from tierlm.runtime.loader import load_model
    from tierlm.runtime.model_defaults import model_generation_defaults
    from tierlm.runtime.sampling import resolve_sampling
    from tierlm.runtime.tokenizer import Tokenizer

    first = chat(models["a"], FIRST, "--session", "s")
    other = chat(models["b"], MORE + "/stats\n", "--session", "s")
    line, = session_lines(other)
    assert re.fullmatch(r"session s was saved with another model \(weights artifact \S+, not artifact \S+\); "
                        r"its 4 messages are kept and computed afresh", line), line  # fmt: skip
    assert reused(other)[1] == 0
    # The reply is model b's to the whole conversation model a had: its messages were kept.
    loaded = load_model(models["b"], device="cpu", dtype=torch.float32, quant="int8")
    reference = ChatSession(Engine(loaded, Tokenizer.from_dir(models["b"])))
    a_replies = replies(first)
    reference.messages[:] = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": a_replies[0]},
                             {"role": "user", "content": "how are you"}, {"role": "assistant", "content": a_replies[1]}]
    params = resolve_sampling(model_generation_defaults(models["b"]), temperature=0, max_new_tokens=8)
    assert replies(other) == [reference.send("tell me more", params).text()]

    # The same model's weights as stored are another variant: refused too, the messages kept.
    as_stored = chat(models["b"], "/bye\n", "--session", "s", "--quant", "none")
    line, = session_lines(as_stored)
    assert "saved with another model (weights artifact" in line and "not checkpoint" in line


# Saves a session to argv[1] and is killed (SIGKILL) right after its first write.
KILLED_SAVE = """
import contextlib, os, signal, sys
from pathlib import Path
import torch
from tierlm.kv import prompt_cache

real = prompt_cache.atomic_file

class Dying:
    def __init__(self, handle):
        self.handle = handle
    def write(self, data):
        self.handle.write(data)
        self.handle.flush()
        os.kill(os.getpid(), signal.SIGKILL)

@contextlib.contextmanager
def dying(path):
    with real(path) as handle:
        yield Dying(handle)

prompt_cache.atomic_file = dying
rows = torch.ones(2, 2, 3, 16)
prompt_cache.save_prompt_cache(Path(sys.argv[1]), {}, {"messages": []}, [1, 2, 3], [rows, rows])
"""


def test_a_save_killed_midway_leaves_the_last_session_and_a_temporary_never_read(cache, models):
    chat(models["a"], FIRST, "--session", "s")
    folder = cache / "sessions"
    good = (folder / "s").read_bytes()
    killed = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(folder / "s")], capture_output=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    left = [p for p in folder.iterdir() if p.name != "s"]
    assert len(left) == 1 and left[0].name.startswith(".s.partial-") and left[0].stat().st_size > 0
    assert (folder / "s").read_bytes() == good  # the kill left the last save as it was
    orphan = folder / f".t.partial-{left[0].name.rsplit('-', 1)[1]}"
    orphan.write_bytes(good)  # whole, but never renamed: there is no session t

    resumed = chat(models["a"], MORE, "--session", "s")
    assert session_lines(resumed)[0].startswith("resumed session s: 4 messages")
    assert sorted(p.name for p in folder.iterdir()) == ["s"]  # the save swept what the dead process left
    new = chat(models["a"], "", "--session", "t")
    assert session_lines(new, "t") == [f"new session t (kept in {folder / 't'})"]


def test_bad_session_names_are_one_line_errors(cache, models):
    for name in ("../x", ".hidden", "a/b", ""):
        result = run_tierlm("chat", "--model", str(models["a"]), "--session", name, stdin="hi\n")
        assert result.returncode == 1 and "is not a session name" in result.stderr, (name, result.stderr)
        assert "Traceback" not in result.stderr and "loading weights" not in result.stderr


def test_cache_commands_leave_sessions_alone(cache, models):
    chat(models["a"], FIRST, "--session", "s")
    listed = run_tierlm("cache", "list")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr
    removed = run_tierlm("cache", "rm", "--all", "--yes")
    assert removed.returncode == 0, removed.stderr
    assert (cache / "sessions" / "s").is_file()  # a conversation is not a rebuildable entry
    assert session_lines(chat(models["a"], "", "--session", "s"))[0].startswith("resumed session s: 4 messages")


def test_a_session_longer_than_the_context_drops_its_oldest_exchanges_and_recomputes(cache, models, tmp_path):
    from tests.tiny import write_profile
    from tierlm.runtime.chat import ChatSession
    from tierlm.runtime.engine import Engine
    from tierlm.runtime.loader import load_model
    from tierlm.runtime.model_defaults import model_generation_defaults
    from tierlm.runtime.sampling import resolve_sampling
    from tierlm.runtime.tokenizer import Tokenizer

    said = ["hello", "how are you", "the quick brown fox"]
    first = chat(models["a"], "\n".join(said) + "\n/stats\n", "--session", "s")
    saved_tokens = int(re.search(r"^context\s+(\d+)/", first.stdout, re.M)[1])
    context = 64
    assert saved_tokens > context
    small = write_profile(tmp_path / "small.toml", context_length=context, batch_size=1)
    resumed = chat(models["a"], MORE, "--session", "s", "--profile", str(small))
    assert session_lines(resumed) == [f"resumed session s: 6 messages, {context} tokens cached"]
    assert "oldest messages dropped" in resumed.stderr

    # As a chat holding that conversation in a context of 64 replies.
    loaded = load_model(models["a"], device="cpu", dtype=torch.float32, quant="int8", context_length=context)
    reference = ChatSession(Engine(loaded, Tokenizer.from_dir(models["a"])))
    for user, assistant in zip(said, replies(first)):
        reference.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    params = resolve_sampling(model_generation_defaults(models["a"]), temperature=0, max_new_tokens=8)
    assert replies(resumed) == [reference.send("tell me more", params).text()]


def test_run_resumes_a_session_as_chat_does_and_refuses_one_with_a_prompt(cache, models):
    chat(models["a"], FIRST, "--session", "s")
    ran = run_tierlm("run", str(models["a"]), *GREEDY, "--session", "s", stdin=MORE)
    assert ran.returncode == 0 and session_lines(ran)[0].startswith("resumed session s: 4 messages"), ran.stderr
    prompt = run_tierlm("run", str(models["a"]), "hello", "--session", "s")
    assert prompt.returncode == 1 and "--session resumes a chat" in prompt.stderr
    assert "Traceback" not in prompt.stderr and "loading weights" not in prompt.stderr
