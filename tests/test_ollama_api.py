"""The Ollama dialect of `tierlm serve`, spoken to by the real `ollama` Python client: chat (whole
and streamed), generate (templated and raw), list, show, ps, version; options reaching the
sampler; LoRA variants by name; Ollama-style errors; the API key.

The reference for every reply is the single-sequence engine run alone on the same prompt and
settings (as tests/test_server_api.py checks the OpenAI routes). The server runs on a thread of
this process (BackgroundServer: uvicorn on a real socket) over a tiny model.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

ollama = pytest.importorskip("ollama", reason="the `ollama` client is in the dev extra: pip install -e .[dev]")

from tests.test_lora_merge import save_adapter  # noqa: E402
from tests.tiny import make_model, write_profile  # noqa: E402
from tierlm.profile import load_profile  # noqa: E402
from tierlm.runtime.sampling import SamplingParams, resolve_sampling  # noqa: E402
from tierlm.runtime.session import open_session  # noqa: E402
from tierlm.server.ollama import OLLAMA_API_VERSION  # noqa: E402
from tierlm.server.options import ServerOptions  # noqa: E402
from tierlm.server.run import BackgroundServer  # noqa: E402

KEY = "ollama-key"
BASE, VARIANT = "tiny", "attn"
CONTEXT = 256
LONG_RUNNER = "the quick brown fox"  # greedy on the tiny model: no EOS for well over 60 tokens
SYSTEM = "You are terse."


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ollama-serve")


@pytest.fixture(scope="module")
def session(root):
    from peft import LoraConfig

    make_model(root / BASE, vocab=320)
    adapter = save_adapter(root / BASE, root / "adapter", LoraConfig(r=4, lora_alpha=8,
                                                                     target_modules=["q_proj", "v_proj"]), seed=7)
    profile = load_profile(str(write_profile(root / "serve.toml", context_length=CONTEXT, batch_size=4)))
    with open_session(str(root / BASE), profile, device="cpu", dtype="fp32",
                      variants={VARIANT: ((adapter, 1.0),)}) as opened:
        yield opened


@pytest.fixture(scope="module")
def server(session):
    options = ServerOptions(model_id=BASE, api_key=KEY)  # with the access log (on stderr)
    with BackgroundServer(session, options) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def solo(session, prompt: list[int], **settings) -> tuple[list[int], str, str]:
    """(token ids, text, finish reason) of the prompt alone on the single-sequence engine, with
    the options the server resolves (unset ones: the model's defaults)."""
    fixed = {key: settings.pop(key) for key in ("max_new_tokens", "seed", "stop") if key in settings}
    params = resolve_sampling(session.generation_defaults, **settings, **fixed)
    engine = session.engine
    generation = engine.generate(prompt, params)
    text = generation.text()
    if generation.token_ids[-1] in engine.tokenizer.eos_token_ids:  # the server flushes what the engine holds
        text = engine.tokenizer.decode(generation.token_ids[:-1], skip_special_tokens=True)
    return generation.token_ids, text, generation.stats.finish_reason


def chat_ids(session, messages) -> list[int]:
    return session.engine.tokenizer.encode_chat(messages)


def test_version_list_show_and_ps(client, session):
    # The Python client has no version() (Ollama's CLI and JS client do): its own transport, then.
    assert client._request_raw("GET", "/api/version").json()["version"] == OLLAMA_API_VERSION

    models = client.list().models
    assert [m.model for m in models] == [f"{BASE}:latest", f"{VARIANT}:latest"]
    base, variant = models
    assert base.details.family == "llama" and base.details.parent_model == ""
    assert variant.details.parent_model == f"{BASE}:latest"
    assert re.fullmatch(r"[0-9a-f]{64}", base.digest) and base.digest != variant.digest
    assert base.size == sum(session.loaded.sizes.nbytes.values()) > 0

    shown = client.show(BASE)
    assert shown.modelinfo["llama.context_length"] == CONTEXT
    assert shown.modelinfo["llama.block_count"] == session.loaded.config.num_hidden_layers
    assert shown.capabilities == ["completion"]
    assert client.show(f"{VARIANT}:latest").details.parent_model == f"{BASE}:latest"

    running = client.ps().models
    assert [m.model for m in running] == [f"{BASE}:latest", f"{VARIANT}:latest"]
    assert running[0].context_length == CONTEXT and running[0].size > base.size  # weights + KV cache
    assert running[0].size_vram == 0  # a CPU server holds nothing on an accelerator


def test_chat_greedy_matches_the_engine_with_counts(client, session):
    messages = [{"role": "system", "content": SYSTEM}, *user("hello world, how are you?")]
    prompt = chat_ids(session, messages)
    ids, text, reason = solo(session, prompt, temperature=0, max_new_tokens=24)
    reply = client.chat(model=BASE, messages=messages, options={"temperature": 0, "num_predict": 24})
    assert reply.message.role == "assistant"
    assert reply.message.content == text and text.strip()
    assert (reply.done, reply.done_reason) == (True, reason)
    assert (reply.prompt_eval_count, reply.eval_count) == (len(prompt), len(ids))
    assert reply.model == BASE
    assert reply.total_duration >= reply.prompt_eval_duration + reply.eval_duration > 0


def test_streamed_chat_equals_the_whole_reply(client):
    kwargs = dict(model=f"{BASE}:latest", messages=user("lazy dog"), options={"temperature": 0, "num_predict": 30})
    whole = client.chat(**kwargs)
    parts = list(client.chat(**kwargs, stream=True))
    assert len(parts) > 2
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].message.content == ""
    assert (parts[-1].done_reason, parts[-1].eval_count) == (whole.done_reason, whole.eval_count)


def test_generate_templated_raw_and_streamed(client, session):
    options = {"temperature": 0, "num_predict": 20}
    templated = client.generate(model=BASE, prompt="how are you", system=SYSTEM, options=options)
    prompt = chat_ids(session, [{"role": "system", "content": SYSTEM}, *user("how are you")])
    _, text, reason = solo(session, prompt, temperature=0, max_new_tokens=20)
    assert (templated.response, templated.done_reason, templated.prompt_eval_count) == (text, reason, len(prompt))

    raw = client.generate(model=BASE, prompt=LONG_RUNNER, raw=True, options=options)
    raw_ids = session.engine.tokenizer.encode(LONG_RUNNER, add_special_tokens=True)
    assert (raw.response, raw.prompt_eval_count) == (solo(session, raw_ids, temperature=0, max_new_tokens=20)[1],
                                                     len(raw_ids))
    streamed = list(client.generate(model=BASE, prompt=LONG_RUNNER, raw=True, options=options, stream=True))
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].done


def test_num_predict_bounds_the_reply(client, session):
    reply = client.chat(model=BASE, messages=user(LONG_RUNNER), options={"temperature": 0, "num_predict": 5})
    assert (reply.eval_count, reply.done_reason) == (5, "length")
    assert reply.message.content == solo(session, chat_ids(session, user(LONG_RUNNER)), temperature=0,
                                         max_new_tokens=5)[1]


def test_num_ctx_caps_the_budget_and_may_not_exceed_the_served_context(client, session):
    prompt = chat_ids(session, user(LONG_RUNNER))
    reply = client.chat(model=BASE, messages=user(LONG_RUNNER), options={"temperature": 0, "num_ctx": len(prompt) + 3})
    assert (reply.eval_count, reply.done_reason) == (3, "length")
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model=BASE, messages=user("hi"), options={"num_ctx": CONTEXT + 1})
    assert caught.value.status_code == 400 and f"num_ctx {CONTEXT + 1}" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model=BASE, messages=user("hi"), options={"num_ctx": len(prompt) + 3, "num_predict": 10})
    assert caught.value.status_code == 400 and "num_predict 10 does not fit" in caught.value.error


def test_seed_makes_a_sampled_reply_repeatable(client, session):
    options = {"temperature": 1, "seed": 1234, "num_predict": 24}
    first = client.chat(model=BASE, messages=user("hello world"), options=options)
    again = client.chat(model=BASE, messages=user("hello world"), options=options, stream=True)
    assert "".join(p.message.content for p in again) == first.message.content
    prompt = chat_ids(session, user("hello world"))
    assert first.message.content == solo(session, prompt, temperature=1.0, seed=1234, max_new_tokens=24)[1]
    other = client.chat(model=BASE, messages=user("hello world"), options={**options, "seed": 4321})
    assert other.message.content != first.message.content


def test_repeat_last_n_sets_the_window_the_penalty_covers(client, session):
    """Ollama's repeat_last_n: the last N tokens of prompt and reply, -1 all of them, 0 the penalty off."""
    prompt = chat_ids(session, user(LONG_RUNNER))
    replies = {}
    for last_n in (4, -1, 0):
        options = {"temperature": 0, "num_predict": 24, "repeat_penalty": 3, "repeat_last_n": last_n}
        replies[last_n] = client.chat(model=BASE, messages=user(LONG_RUNNER), options=options).message.content
        assert replies[last_n] == solo(session, prompt, temperature=0, repetition_penalty=3.0, repeat_last_n=last_n,
                                       max_new_tokens=24)[1]  # fmt: skip
    assert replies[0] == solo(session, prompt, temperature=0, repetition_penalty=1.0, max_new_tokens=24)[1]
    assert len(set(replies.values())) == 3  # each window changes the reply
    shown = client.show(BASE).parameters
    assert re.search(r"^repeat_last_n +64$", shown, re.M) and re.search(r"^repeat_penalty +1\.1$", shown, re.M)


def test_stop_ends_the_reply_before_the_stop_string(client, session):
    _, text, _ = solo(session, chat_ids(session, user(LONG_RUNNER)), temperature=0, max_new_tokens=40)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text  # a visible stretch of the greedy reply
    reply = client.chat(model=BASE, messages=user(LONG_RUNNER),
                        options={"temperature": 0, "num_predict": 40, "stop": [stop]})
    assert reply.message.content == text[:text.index(stop)]
    assert reply.done_reason == "stop"


@pytest.mark.slow
def test_a_variant_is_chosen_by_model(client, server):
    body = {"messages": user("hello world, how are"), "temperature": 0, "max_tokens": 12}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        openai = {name: http.post("/v1/chat/completions", json={**body, "model": name}).json()
                  ["choices"][0]["message"]["content"] for name in (BASE, VARIANT)}
    assert openai[BASE] != openai[VARIANT]  # the adapter changes the reply
    for name in (BASE, VARIANT, f"{VARIANT}:latest"):
        reply = client.chat(model=name, messages=user("hello world, how are"),
                            options={"temperature": 0, "num_predict": 12})
        assert reply.message.content == openai[name.removesuffix(":latest")]


def test_unknown_model_is_a_404(client):
    for call in (lambda: client.chat(model="llama3.2", messages=user("hi")), lambda: client.show("llama3.2"),
                 lambda: list(client.generate(model="llama3.2", prompt="hi", stream=True))):
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 404
        assert caught.value.error.startswith("model 'llama3.2' not found")
    with pytest.raises(ollama.ResponseError) as caught:  # what `ollama run` does next: tierlm says why not
        client.pull("llama3.2")
    assert caught.value.status_code == 404 and "does not download models" in caught.value.error


@pytest.mark.parametrize("field, value, says", [
    ("format", "json", "constrained decoding"),
    ("options", {"mirostat": 2}, "mirostat"),
    ("options", {"presence_penalty": 0.5}, "presence_penalty"),
    ("options", {"no_such_option": 1}, "unknown option"),
    ("tools", [{"type": "function", "function": {"name": "f"}}], "tool"),
    ("keep_alive", "five minutes", "not a duration"),
])
def test_what_would_change_the_output_unheeded_is_refused(client, field, value, says):
    kwargs = {"model": BASE, "messages": user("hi"), field: value}
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(**kwargs)
    assert caught.value.status_code == 400 and says in caught.value.error


def test_generate_refusals_and_load(client):
    for kwargs, says in ((dict(template="{{ .Prompt }}"), "template"), (dict(raw=True, system="x"), "raw"),
                         (dict(suffix="end"), "fill in the middle")):
        with pytest.raises(ollama.ResponseError) as caught:
            client.generate(model=BASE, prompt="hi", **kwargs)
        assert caught.value.status_code == 400 and says in caught.value.error
    loaded = client.generate(model=BASE, keep_alive="10m")  # an empty prompt only loads the model
    assert (loaded.done, loaded.done_reason, loaded.response) == (True, "load", "")
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model=BASE, keep_alive=0)  # `ollama stop`: tierlm does not unload while serving
    assert caught.value.status_code == 400 and "stop the server" in caught.value.error


def test_the_api_key_is_required(server, client):
    keyless = ollama.Client(host=server.url, timeout=60)
    for call in (keyless.list, lambda: list(keyless.chat(model=BASE, messages=user("hi"), stream=True))):
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 401 and "API key" in caught.value.error
    assert client.list().models  # the same server, with the key


@pytest.mark.slow
def test_requests_are_counted_in_metrics_and_logged(client, server, session, capsys):
    def requests(outcome: str) -> float:
        text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        return float(re.search(rf'^tierlm_requests_total{{outcome="{outcome}"}} (\S+)$', text, re.M).group(1))

    length, invalid = requests("length"), requests("invalid")
    reply = client.chat(model=BASE, messages=user(LONG_RUNNER), options={"temperature": 0, "num_predict": 4})
    with pytest.raises(ollama.ResponseError):
        client.chat(model=BASE, messages=user("hi"), format="json")
    assert (requests("length"), requests("invalid")) == (length + 1, invalid + 1)
    line = f'"POST /api/chat" 200 prompt={reply.prompt_eval_count} completion=4 '
    logged = ""
    deadline = time.monotonic() + 10
    while line not in logged and time.monotonic() < deadline:  # written as the response ends
        logged += capsys.readouterr().err
        time.sleep(0.05)
    assert line in logged and '"POST /api/chat" 400 prompt=- completion=- ' in logged


@pytest.mark.e2e
@pytest.mark.slow
def test_tierlm_serve_found_through_ollama_host(monkeypatch):
    """`tierlm serve` on the embedded model, found the way Ollama's tools find a server: OLLAMA_HOST
    (and OLLAMA_API_KEY, which the Python client sends as the bearer key)."""
    from tests.test_server_openai import serve_process
    from tierlm.weights.embedded import ensure_embedded_model

    ensure_embedded_model()  # import once, before the server (which shares the cache) starts
    with serve_process("--profile", "24gb", "--api-key", KEY) as (url, _):
        monkeypatch.setenv("OLLAMA_HOST", url)
        monkeypatch.setenv("OLLAMA_API_KEY", KEY)
        found = ollama.Client(timeout=120)
        name = ServerOptions().served_name(ensure_embedded_model())
        assert [m.model for m in found.list().models] == [name if ":" in name else f"{name}:latest"]
        messages = [{"role": "user", "content": "Name three primary colours."}]
        options = {"temperature": 0, "num_predict": 24}
        whole = found.chat(model=name, messages=messages, options=options)
        streamed = list(found.chat(model=name, messages=messages, options=options, stream=True))
        assert whole.message.content.strip() and 0 < whole.eval_count <= 24
        assert "".join(p.message.content for p in streamed) == whole.message.content
