"""`tierlm serve` in a subprocess on the embedded model, spoken to by the real `openai` client."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from tierlm.profile import load_profile
from tierlm.runtime.sampling import resolve_sampling
from tierlm.runtime.session import open_session
from tierlm.server.options import ServerOptions
from tierlm.weights.embedded import ensure_embedded_model

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # tierlm serve as a process

KEY = "test-key"
ALIAS = "gpt-4o-mini"  # what desktop clients tend to send by default
MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three primary colours."},
]


@contextmanager
def serve_process(*args: str, env: dict | None = None, start_timeout: float = 180):
    """`tierlm serve --port 0 ARGS` in a subprocess; yields (url, lines): `lines` fills with its
    stderr, and holds all of it once the block has ended (the server stopped, its pipe drained)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tierlm", "serve", "--port", "0", *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})},
    )
    lines: list[str] = []
    announced = threading.Event()

    def read_stderr():  # keep draining, so the server never blocks on a full pipe
        for line in process.stderr:
            lines.append(line)
            if "listening on" in line:
                announced.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + start_timeout
        while not announced.wait(0.2):
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines)
        yield re.search(r"listening on (http://127\.0\.0\.1:\d+)", "".join(lines)).group(1), lines
    finally:
        process.terminate()
        status = process.wait(30)
        reader.join(10)
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught.
    assert status in (0, -signal.SIGTERM), "".join(lines)
    assert "Traceback" not in "".join(lines), "".join(lines)


@pytest.fixture(scope="module")
def server_url():
    ensure_embedded_model()  # import once, before the server (which shares the cache) starts
    with serve_process("--profile", "24gb", "--batch-size", "2", "--api-key", KEY, "--alias", ALIAS) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server_url):
    from openai import OpenAI

    return OpenAI(base_url=server_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected():
    """The reply the single-sequence engine gives alone (greedy), with its token counts."""
    session = open_session(None, load_profile("24gb"))
    engine = session.engine
    prompt = engine.tokenizer.encode_chat(MESSAGES)
    # temperature 0 with the model's other defaults, as the server resolves a request's.
    generation = engine.generate(prompt, resolve_sampling(session.generation_defaults, temperature=0, max_new_tokens=32))
    text = generation.text()
    return {"text": text, "prompt_tokens": len(prompt), "completion_tokens": len(generation.token_ids),
            "finish_reason": generation.stats.finish_reason}


def test_list_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [ServerOptions().served_name(ensure_embedded_model())]
    assert "smollm2" in models[0].id.lower()
    assert models[0].owned_by == "tierlm"


def test_chat_completion_greedy_matches_the_engine_with_usage(client, expected):
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=32)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected["text"] and expected["text"].strip()
    assert choice.finish_reason == expected["finish_reason"]
    assert reply.usage.prompt_tokens == expected["prompt_tokens"]
    assert reply.usage.completion_tokens == expected["completion_tokens"]
    assert reply.usage.total_tokens == expected["prompt_tokens"] + expected["completion_tokens"]
    assert reply.model == model


def test_streamed_chat_completion_with_usage(client, expected):
    stream = client.chat.completions.create(
        model=ALIAS, messages=MESSAGES, temperature=0, max_completion_tokens=32, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected["finish_reason"]
    assert chunks[-1].choices == []
    assert {c.model for c in chunks} == {client.models.list().data[0].id}  # the alias answered as the model
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        expected["prompt_tokens"], expected["completion_tokens"])


def test_a_conversations_next_turn_reuses_its_cached_prefix(client, expected):
    """A chat client resends the whole conversation each turn: the server prefills only the new
    turn (usage.prompt_tokens_details.cached_tokens), and the reply is the engine's from scratch."""
    model = client.models.list().data[0].id
    history = [*MESSAGES, {"role": "assistant", "content": expected["text"]},
               {"role": "user", "content": "And one more colour?"}]  # fmt: skip
    client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=32)
    reply = client.chat.completions.create(model=model, messages=history, temperature=0, max_tokens=24)
    session = open_session(None, load_profile("24gb"))
    prompt = session.engine.tokenizer.encode_chat(history)
    alone = session.engine.generate(prompt, resolve_sampling(session.generation_defaults, temperature=0,
                                                             max_new_tokens=24)).text()  # fmt: skip
    assert reply.choices[0].message.content == alone and alone.strip()
    assert reply.usage.prompt_tokens == len(prompt)
    assert expected["prompt_tokens"] <= reply.usage.prompt_tokens_details.cached_tokens < len(prompt)


def test_wrong_key_is_refused(server_url):
    import openai

    bad = openai.OpenAI(base_url=server_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
