"""`tierlm serve` over real sockets on a tiny model: batching, deadlines, queue, disconnects,
errors, auth, metrics and worker fault injection. The server runs on a thread of this process."""

from __future__ import annotations

import json
import re
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from tests.tiny import make_model, write_profile
from tierlm.profile import load_profile
from tierlm.runtime.sampling import SamplingParams, resolve_sampling
from tierlm.runtime.session import open_session
from tierlm.server.options import ServerOptions
from tierlm.server.run import BackgroundServer

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    make_model(root / "tiny-chat")
    profile = load_profile(str(write_profile(root / "serve.toml", context_length=256, batch_size=4)))
    return open_session(str(root / "tiny-chat"), profile, device="cpu", dtype="fp32")


@contextmanager
def running(session, **options):
    """A server with test hooks on, answering to the name `body` sends; yields (base url, client)."""
    options = {"debug_hooks": True, "aliases": ("tiny",), **options}
    with BackgroundServer(session, ServerOptions(**options)) as server:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            yield server.url, client


def body(content: str, **fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **fields}


def debug(client, action: str, seconds: float = 0.0) -> None:
    assert client.post("/debug/worker", json={"action": action, "seconds": seconds}).status_code == 200


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def health(client) -> dict:
    return client.get("/health").json()


def metric(client, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", client.get("/metrics").text, re.M)
    assert match, name
    return float(match.group(1))


def stream(url: str, payload: dict, path: str = CHAT) -> dict:
    """POST with stream=True; returns the joined text, finish reason, usage and raw events."""
    events = []
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", path, json={**payload, "stream": True}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    text = "".join(
        (c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text") or "")
        for c in chunks if c.get("choices")
    )
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return {"text": text, "reason": reasons[-1] if reasons else None, "usage": usage[-1] if usage else None,
            "events": events, "chunks": chunks}


def solo(session, prompt: list[int], params: SamplingParams):
    """(token ids, text, finish reason) of the request alone on the single-sequence engine.

    At EOS the engine drops text its stream decoder still holds; the server flushes it, as a
    full decode of the ids shows it.
    """
    engine = session.engine
    generation = engine.generate(prompt, params)
    text = generation.text()
    if generation.token_ids[-1] in engine.tokenizer.eos_token_ids:
        text = engine.tokenizer.decode(generation.token_ids[:-1], skip_special_tokens=True)
    return generation.token_ids, text, generation.stats.finish_reason


def chat_ids(session, content: str) -> list[int]:
    return session.engine.tokenizer.encode_chat([{"role": "user", "content": content}])


def test_concurrent_streams_are_batched_and_each_gets_its_solo_output(session):
    requests = [
        ("the quick brown fox", dict(temperature=0, max_tokens=20)),
        ("hello world, how are you?", dict(temperature=1.2, seed=11, max_tokens=24)),
        ("lazy dog", dict(temperature=0.9, top_p=0.8, seed=5, max_tokens=16)),
        ("jumps over the", dict(temperature=0, max_tokens=30, stop=["ump"])),
        ("how are you", dict(temperature=1.5, seed=2, max_tokens=18)),
        ("the dog", dict(temperature=0, max_tokens=12)),
    ]
    results: list[dict | None] = [None] * len(requests)
    with running(session) as (url, client):
        debug(client, "pause")  # hold admission so all six are queued, then start together
        threads = [
            threading.Thread(target=lambda i=i, r=r: results.__setitem__(
                i, stream(url, body(r[0], stream_options={"include_usage": True}, **r[1]))))
            for i, r in enumerate(requests)
        ]
        for thread in threads:
            thread.start()
        wait_for(lambda: health(client)["queue_depth"] == len(requests))
        debug(client, "resume")
        for thread in threads:
            thread.join(30)
        # All six at once: their pages fit the pool of the profile's 4 contexts (up to 16 run together).
        assert health(client)["peak_batch"] == len(requests) and health(client)["parallel"] == 16
        assert metric(client, "tierlm_batch_size_sum") > metric(client, "tierlm_batch_size_count")
    for (content, fields), result in zip(requests, results):
        prompt = chat_ids(session, content)
        # Fields a request omits take the model's defaults, as the server resolves them.
        params = resolve_sampling(session.generation_defaults, temperature=fields["temperature"],
                                  top_p=fields.get("top_p"), seed=fields.get("seed"),
                                  max_new_tokens=fields["max_tokens"], stop=tuple(fields.get("stop", ())))
        ids, text, reason = solo(session, prompt, params)
        assert (result["text"], result["reason"]) == (text, reason), content
        cached = result["usage"].pop("prompt_tokens_details")["cached_tokens"]
        assert result["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                                   "total_tokens": len(prompt) + len(ids)}
        assert 0 <= cached < len(prompt)  # a slot's earlier prompt may share the chat template's start
        assert result["events"][-1] == "[DONE]"
        assert result["chunks"][0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


LONG_RUNNER = "the quick brown fox"  # greedy on the tiny model: no EOS for well over 60 tokens


@pytest.mark.slow
def test_deadline_ends_with_partial_text_and_timeout_reason(session):
    prompt = chat_ids(session, LONG_RUNNER)
    ids, _, _ = solo(session, prompt, resolve_sampling(session.generation_defaults, temperature=0, max_new_tokens=80))
    assert len(ids) == 80
    with running(session) as (url, client):
        debug(client, "delay", 0.02)
        started = time.monotonic()
        reply = client.post(CHAT, json=body(LONG_RUNNER, temperature=0, max_tokens=200, timeout=0.6))
        assert time.monotonic() - started < 2.5  # not the handler's grace period: the worker ended it
        assert reply.status_code == 200
        data = reply.json()
        got = data["usage"]["completion_tokens"]
        assert data["choices"][0]["finish_reason"] == "timeout"
        assert 0 < got < 60
        tokenizer = session.engine.tokenizer
        assert data["choices"][0]["message"]["content"] == tokenizer.decode(ids[:got], skip_special_tokens=True)
        streamed = stream(url, body(LONG_RUNNER, temperature=0, max_tokens=200, timeout=0.4))
        assert streamed["reason"] == "timeout" and streamed["text"]
        # A deadline that passes while the request still waits for a slot.
        debug(client, "pause")
        started = time.monotonic()
        queued = client.post(CHAT, json=body("lazy dog", temperature=0, timeout=0.2))
        assert time.monotonic() - started < 1.5
        assert queued.json()["choices"][0]["finish_reason"] == "timeout"
        assert queued.json()["usage"]["completion_tokens"] == 0
        debug(client, "resume")
        assert metric(client, 'tierlm_requests_total{outcome="timeout"}') == 3
    # The server's default deadline applies when the request sets none.
    with running(session, default_timeout=0.3) as (url, client):
        debug(client, "delay", 0.02)
        reply = client.post(CHAT, json=body(LONG_RUNNER, temperature=0, max_tokens=200))
        assert reply.json()["choices"][0]["finish_reason"] == "timeout"


@pytest.mark.slow
def test_full_queue_gets_429_with_retry_after(session):
    with running(session, batch_size=1, max_queue=2) as (url, client):
        debug(client, "pause")
        replies = []
        threads = [threading.Thread(target=lambda: replies.append(
            httpx.post(url + CHAT, json=body("lazy dog", temperature=0, max_tokens=4), timeout=30)))
            for _ in range(2)]
        for thread in threads:
            thread.start()
        wait_for(lambda: health(client)["queue_depth"] == 2)
        refused = client.post(CHAT, json=body("lazy dog", max_tokens=4))
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        debug(client, "resume")
        for thread in threads:
            thread.join(30)
        assert [r.status_code for r in replies] == [200, 200]
        assert metric(client, 'tierlm_requests_total{outcome="rejected"}') == 1


@pytest.mark.slow
def test_client_disconnect_frees_its_slot_at_once(session):
    with running(session, batch_size=1) as (url, client):
        debug(client, "delay", 0.02)
        with httpx.Client(base_url=url, timeout=30) as leaving:
            with leaving.stream("POST", CHAT, json=body(LONG_RUNNER, temperature=0, stream=True)) as response:
                seen = 0
                for line in response.iter_lines():
                    seen += line.startswith("data: ")
                    if seen == 3:
                        break
            assert health(client)["active"] == 1
        left = time.monotonic()
        wait_for(lambda: health(client)["active"] == 0, timeout=2)
        assert time.monotonic() - left < 1.0  # not after the remaining ~230 tokens (~5 s)
        assert metric(client, 'tierlm_requests_total{outcome="cancelled"}') == 1
        # A non-streamed request whose client gives up.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + CHAT, json=body(LONG_RUNNER, temperature=0), timeout=0.3)
        wait_for(lambda: health(client)["active"] == 0, timeout=2)
        assert metric(client, 'tierlm_requests_total{outcome="cancelled"}') == 2
        debug(client, "delay", 0)
        reply = client.post(CHAT, json=body("lazy dog", temperature=0, max_tokens=5))
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1


ERRORS = [
    # (raw body or JSON, status, param, code)
    (b"{not json", 400, None, "invalid_json"),
    ([1, 2], 400, None, "invalid_type"),
    ({"model": "tiny"}, 400, "messages", "missing_required_parameter"),
    (body("hi", temperature="hot"), 400, "temperature", "invalid_type"),
    (body("hi", temperature=3), 400, "temperature", "invalid_value"),
    (body("hi", max_tokens=0), 400, "max_tokens", "invalid_value"),
    (body("hi", max_tokens=True), 400, "max_tokens", "invalid_type"),
    (body("hi", stream="yes"), 400, "stream", "invalid_type"),
    (body("hi", stream_options={"include_usage": True}), 400, "stream_options", None),
    (body("hi", n=2), 400, "n", "unsupported_parameter"),
    (body("hi", logprobs=True), 400, "logprobs", "unsupported_parameter"),
    (body("hi", tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", "unsupported_parameter"),
    (body("hi", frobnicate=1), 400, "frobnicate", "unrecognized_parameter"),
    (body("hi", stop=[1]), 400, "stop", "invalid_type"),
    (body("hi", seed=1.5), 400, "seed", "invalid_type"),
    (body("hi", timeout=-1), 400, "timeout", "invalid_value"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content", "unsupported_content"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "user", "content": "x"}] * 5}, 400, "messages", "too_many_messages"),
    (body("fox " * 300), 400, "messages", "context_length_exceeded"),
    (body("x" * 9000), 413, None, "request_too_large"),
]


@pytest.mark.slow
def test_bad_requests_get_4xx_with_openai_error_bodies(session):
    with running(session, max_body_bytes=8192, max_messages=4) as (url, client):
        for payload, status, param, code in ERRORS:
            content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            reply = client.post(CHAT, content=content, headers={"content-type": "application/json"})
            assert reply.status_code == status, (payload, reply.text)
            error = reply.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error"
            assert (error["param"], error["code"]) == (param, code), error
        for path, method, status in [("/v1/nothing", "GET", 404), (CHAT, "GET", 405), ("/v1/models/other", "GET", 404)]:
            reply = client.request(method, path)
            assert reply.status_code == status and reply.json()["error"]["message"]
        completion = client.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"]})
        assert completion.status_code == 400 and completion.json()["error"]["param"] == "prompt"
        completion = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 99999]})
        assert completion.status_code == 400 and "vocabulary" in completion.json()["error"]["message"]
        assert client.get("/health").json()["status"] == "ok"  # nothing above reached the worker


@pytest.mark.slow
def test_api_key_guards_every_route_but_health(session):
    with running(session, api_key="s3cret") as (url, client):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path in [("GET", "/v1/models"), ("POST", CHAT), ("GET", "/metrics"), ("POST", "/v1/completions")]:
                reply = client.request(method, path, headers=headers, json=body("hi"))
                assert reply.status_code == 401, (path, headers)
                assert reply.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/health").status_code == 200
        good = {"Authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=good).json()["data"][0]["id"] == "tiny-chat"
        reply = client.post(CHAT, headers=good, json=body("hi", temperature=0, max_tokens=3))
        assert reply.status_code == 200


def test_completions_plain_and_streamed_and_metrics(session):
    tokenizer = session.engine.tokenizer
    prompt = "the quick brown"
    ids, text, reason = solo(session, tokenizer.encode(prompt, add_special_tokens=True),
                             resolve_sampling(session.generation_defaults, temperature=0, max_new_tokens=10))
    with running(session) as (url, client):
        reply = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 10,
                                                     "temperature": 0}).json()
        assert reply["object"] == "text_completion"
        assert (reply["choices"][0]["text"], reply["choices"][0]["finish_reason"]) == (text, reason)
        assert reply["usage"]["completion_tokens"] == len(ids)
        by_ids = client.post("/v1/completions", json={"prompt": tokenizer.encode(prompt), "max_tokens": 10,
                                                      "temperature": 0}).json()
        assert by_ids["choices"][0]["text"] == text
        streamed = stream(url, {"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                "stream_options": {"include_usage": True}}, path="/v1/completions")
        assert (streamed["text"], streamed["reason"]) == (text, reason)
        assert streamed["usage"]["completion_tokens"] == len(ids)
        default = client.post("/v1/completions", json={"prompt": prompt, "temperature": 0}).json()
        assert default["usage"]["completion_tokens"] <= 16  # OpenAI's default max_tokens
        text_metrics = client.get("/metrics").text
    for name in ["tierlm_requests_total", "tierlm_time_to_first_token_seconds_bucket", "tierlm_batch_size_bucket",
                 "tierlm_decode_tokens_per_second", "tierlm_generated_tokens_total", "tierlm_queue_depth",
                 "tierlm_process_resident_bytes", 'tierlm_weight_bytes_held',
                 'tierlm_kv_cache_bytes{state="reserved"}', "tierlm_worker_healthy 1.0"]:
        assert name in text_metrics, name
    assert re.search(r'^tierlm_requests_total\{outcome="length"\} [1-9]', text_metrics, re.M)


@pytest.mark.slow
def test_worker_fault_injection_restarts_and_fails_in_flight_requests(session):
    with running(session, stall_timeout=0.6, restart_backoff=0.5) as (url, client):
        for fault, seconds, words in [("kill", 0, "died"), ("stall", 3.0, "stalled")]:
            debug(client, "delay", 0.02)
            result: dict = {}
            consumer = threading.Thread(
                target=lambda: result.update(stream(url, body(LONG_RUNNER, temperature=0, max_tokens=200))))
            consumer.start()
            wait_for(lambda: health(client)["active"] == 1)
            restarts = health(client)["worker"]["restarts"]
            debug(client, fault, seconds)
            statuses = set()

            def recovered():
                reply = client.get("/health")
                statuses.add(reply.status_code)
                return 503 in statuses and reply.status_code == 200

            wait_for(recovered, timeout=10)
            consumer.join(10)
            report = health(client)
            assert report["worker"]["restarts"] == restarts + 1
            assert words in report["worker"]["last_error"]
            error = json.loads(result["events"][-1])["error"]
            assert error["type"] == "server_error" and words in error["message"] and "retry" in error["message"]
            debug(client, "delay", 0)
            reply = client.post(CHAT, json=body("lazy dog", temperature=0, max_tokens=5))
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] is not None
        assert metric(client, "tierlm_worker_restarts_total") == 2
        assert metric(client, 'tierlm_requests_total{outcome="error"}') == 2
