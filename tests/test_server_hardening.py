"""`tierlm serve` under hostile or unlucky conditions (issue 11): one failing sequence must not
take its batch down, no request shape may reach a 500, SIGTERM answers what is in flight before
the process exits, and a client that drops its connection costs one log line, not a traceback.

In-process servers (tests.test_server_api's `running`) for the batch and the bad-request
corpus; a real `tierlm serve` subprocess (tests.test_server_openai's `serve_process`) for
signals and logs."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import psutil
import pytest

from tests.test_server_api import (  # noqa: F401 (session: a fixture)
    CHAT,
    LONG_RUNNER,
    body,
    chat_ids,
    debug,
    health,
    metric,
    running,
    session,
    solo,
    stream,
    wait_for,
)
from tests.test_server_backend import access_lines, serve_tiny
from tests.tiers import quick
from tierlm.runtime.sampling import Sampler, SamplingParams
from tierlm.runtime.stopping import StopMatcher
from tierlm.server import batch as batch_module
from tierlm.server.options import ServerOptions
from tierlm.server.run import BackgroundServer

COMPLETIONS = "/v1/completions"
GREEDY = dict(temperature=0, repetition_penalty=1)  # explicit: the server's defaults must not matter

# -- one failing sequence ------------------------------------------------------------------------

FAIL_AT_ADMISSION, FAIL_WHILE_SAMPLING = 9001, 9002  # seeds (greedy ignores them) that mark a poison
POISON_STOP = "\u2620poison"  # a stop string that marks one; the tiny model never writes it
POISON_PREFILL = "poisoned prompt"


class FailingSampler(Sampler):
    """The runner's sampler, failing for the requests marked by seed."""

    def __init__(self, params):
        if params.seed == FAIL_AT_ADMISSION:
            raise RuntimeError("injected fault: admission")
        super().__init__(params)
        self.calls = 0

    def __call__(self, logits, seen=None):
        self.calls += 1
        if self.params.seed == FAIL_WHILE_SAMPLING and self.calls == 3:  # after two tokens went out
            raise RuntimeError("injected fault: sampling")
        return super().__call__(logits, seen)


class FailingStops(StopMatcher):
    """The runner's stop matcher, failing at the third token for requests with POISON_STOP."""

    def __init__(self, stops):
        super().__init__(stops)
        self.fed = 0

    def feed(self, delta):
        self.fed += 1
        if POISON_STOP in self.stops and self.fed == 3:
            raise RuntimeError("injected fault: stop matching")
        return super().feed(delta)


def fail_prefill_of(monkeypatch, session, content: str) -> None:
    """The single-sequence forward (a prefill) raises for this one prompt."""
    model = session.engine.loaded.model
    poisoned, real = chat_ids(session, content), model.forward

    def forward(ids, cache, **kwargs):
        if ids.shape[1] == len(poisoned) and ids[0].tolist() == poisoned:
            raise RuntimeError("injected fault: prefill")
        return real(ids, cache, **kwargs)

    monkeypatch.setattr(model, "forward", forward)


def run_together(url: str, client, requests: list[tuple[str, dict, bool]]) -> dict:
    """Queue every (name, payload, streamed) while the worker is paused, release them as one
    batch, and return each one's result: stream()'s dict, or the httpx response."""
    results: dict = {}

    def send(name, payload, streamed):
        results[name] = stream(url, payload) if streamed else httpx.post(url + CHAT, json=payload, timeout=120)

    threads = [threading.Thread(target=send, args=r) for r in requests]
    debug(client, "pause")
    for thread in threads:
        thread.start()
    wait_for(lambda: health(client)["queue_depth"] == len(requests), timeout=30)
    debug(client, "resume")
    for thread in threads:
        thread.join(120)
    return results


def streamed_error(result: dict) -> dict:
    """The error event a stream ended with (it must end with one)."""
    last = json.loads(result["events"][-1])
    assert "error" in last, result["events"][-3:]
    return last["error"]


@pytest.mark.slow
def test_a_failing_sequence_ends_alone_and_its_batch_goes_on(session, monkeypatch):
    healthy = {  # name: (content, sampling fields, streamed)
        "long-1": (LONG_RUNNER, GREEDY, True),
        "long-2": ("hello world, how are you?", GREEDY, True),
        "long-3": ("lazy dog", GREEDY, False),
        # Extreme but valid values: sampling is numerically safe, on the server's path too.
        "temperature-1e-300": ("the dog", dict(GREEDY, temperature=1e-300), False),
        "temperature-1e-45": ("how are you", dict(GREEDY, temperature=1e-45), True),
        "repetition-1e-300": ("once upon a time", dict(GREEDY, repetition_penalty=1e-300), False),
    }
    expected = {}
    for name, (content, fields, _) in healthy.items():
        params = SamplingParams(max_new_tokens=64, **fields)
        expected[name] = solo(session, chat_ids(session, content), params)
    assert all(len(expected[name][0]) == 64 for name in ("long-1", "long-2", "long-3"))  # in flight throughout
    poisoned = {  # name: (payload, streamed)
        "admission": (body("the dog", seed=FAIL_AT_ADMISSION, max_tokens=64, **GREEDY), False),
        "prefill": (body(POISON_PREFILL, max_tokens=64, **GREEDY), True),
        "sampling": (body("how are you", seed=FAIL_WHILE_SAMPLING, max_tokens=64, **GREEDY), True),
        "stop-matching": (body("lazy dog", stop=[POISON_STOP], max_tokens=64, **GREEDY), False),
    }
    monkeypatch.setattr(batch_module, "Sampler", FailingSampler)
    monkeypatch.setattr(batch_module, "StopMatcher", FailingStops)
    fail_prefill_of(monkeypatch, session, POISON_PREFILL)
    usage = dict(stream_options={"include_usage": True})
    requests = [(name, body(content, max_tokens=64, **fields, **(usage if streamed else {})), streamed)
                for name, (content, fields, streamed) in healthy.items()]
    requests += [(name, payload, streamed) for name, (payload, streamed) in poisoned.items()]
    with running(session, batch_size=len(requests)) as (url, client):
        results = run_together(url, client, requests)
        report = health(client)
        assert report["status"] == "ok" and report["worker"]["restarts"] == 0
        assert report["peak_batch"] >= len(healthy)  # the survivors did share decode steps
        assert metric(client, 'tierlm_requests_total{outcome="error"}') == len(poisoned)
        assert metric(client, 'tierlm_requests_total{outcome="invalid"}') == 0  # a 500 is no refusal
    for name, (ids, text, reason) in expected.items():
        result = results[name]
        if isinstance(result, httpx.Response):
            assert result.status_code == 200, (name, result.text)
            data = result.json()
            result = {"text": data["choices"][0]["message"]["content"],
                      "reason": data["choices"][0]["finish_reason"], "usage": data["usage"]}
        assert (result["text"], result["reason"]) == (text, reason), name
        assert result["usage"]["completion_tokens"] == len(ids), name
    for name, (_, streamed) in poisoned.items():
        result = results[name]
        if streamed:
            error = streamed_error(result)
            assert result["reason"] is None and "[DONE]" not in result["events"], name
        else:
            assert result.status_code == 500, (name, result.text)
            error = result.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "internal_error", (name, error)
        assert f"injected fault: {name.replace('-', ' ')}" in error["message"], (name, error)


@pytest.mark.slow
def test_a_failed_shared_forward_fails_the_batch_not_the_server(session, monkeypatch):
    model = session.engine.loaded.model
    real, calls = model.forward_batch, []

    def forward_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected fault: the shared forward")
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward_batch", forward_batch)
    prompt = chat_ids(session, "lazy dog")
    _, text, _ = solo(session, prompt, SamplingParams(max_new_tokens=5, **GREEDY))
    with running(session) as (url, client):
        payloads = [body(content, max_tokens=64, **GREEDY) for content in (LONG_RUNNER, "lazy dog")]
        results = run_together(url, client, [(f"r{i}", p, True) for i, p in enumerate(payloads)])
        for result in results.values():
            error = streamed_error(result)
            assert error["code"] == "worker_failed" and "injected fault: the shared forward" in error["message"]
        reply = client.post(CHAT, json=body("lazy dog", max_tokens=5, **GREEDY))
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == text
        assert health(client)["worker"]["restarts"] == 0


# -- request shapes: a corpus of bad requests ------------------------------------------------------


def deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def chat_raw(messages: bytes, extra: bytes = b"") -> bytes:
    return b'{"model": "tiny", "messages": ' + messages + extra + b"}"


def user(content) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}]}


def role(value) -> dict:
    return {"messages": [{"role": value, "content": "hi"}]}


def prompt(value, **fields) -> dict:
    return {"model": "tiny", "max_tokens": 2, "prompt": value, **fields}


def chunks(total: int, size: int = 1 << 20):
    """A body sent chunked (no Content-Length): the server can only count as it reads."""
    for _ in range(0, total, size):
        yield b" " * size


SURROGATE = b'"\\ud800"'  # JSON's escape for half of a UTF-16 pair: no character
SURROGATE_UTF8 = b'"\xed\xa0\x80"'  # the same half, encoded as (invalid) UTF-8 bytes

# (id, path, body: JSON value, raw bytes, or a callable giving chunks; status, param, code,
#  words the message must hold)
BAD_REQUESTS = [
    # JSON itself
    ("nested-100000-deep", CHAT, chat_raw(deep(100_000)), 400, None, "invalid_json", "deeper than"),
    ("nested-40-deep-in-ignored-field", CHAT, chat_raw(b"[]", b', "metadata": ' + deep(40)), 400, None,
     "invalid_json", "deeper than"),
    ("nan-literal", CHAT, chat_raw(b'[{"role": "user", "content": "hi"}]', b', "temperature": NaN'), 400, None,
     "invalid_json", "NaN"),
    ("infinity-literal", CHAT, chat_raw(b'[{"role": "user", "content": "hi"}]', b', "max_tokens": Infinity'), 400,
     None, "invalid_json", "Infinity"),
    ("integer-of-5000-digits", CHAT, chat_raw(b'[{"role": "user", "content": "hi"}]', b', "seed": ' + b"9" * 5000),
     400, None, "invalid_value", "5000 digits"),
    ("empty-body", CHAT, b"", 400, None, "invalid_json", "not valid JSON"),
    ("invalid-utf8", CHAT, b'{"messages": "\xff"}', 400, None, "invalid_json", "not valid JSON"),
    ("body-an-array", CHAT, [], 400, None, "invalid_type", "JSON object"),
    ("body-a-string", CHAT, "hi", 400, None, "invalid_type", "JSON object"),
    ("body-null", CHAT, None, 400, None, "invalid_type", "JSON object"),
    ("body-8MiB", CHAT, b" " * (8 << 20), 413, None, "request_too_large", "at most"),
    ("body-8MiB-chunked", CHAT, lambda: chunks(8 << 20), 413, None, "request_too_large", "limit"),
    # invalid Unicode, wherever it is
    ("surrogate-in-content", CHAT, chat_raw(b'[{"role": "user", "content": ' + SURROGATE + b"}]"), 400,
     "messages[0].content", "invalid_unicode", "invalid Unicode"),
    ("surrogate-as-utf8-bytes", CHAT, chat_raw(b'[{"role": "user", "content": ' + SURROGATE_UTF8 + b"}]"), 400,
     "messages[0].content", "invalid_unicode", "invalid Unicode"),
    ("surrogate-in-role", CHAT, chat_raw(b'[{"role": ' + SURROGATE + b', "content": "hi"}]'), 400,
     "messages[0].role", "invalid_unicode", "invalid Unicode"),
    ("surrogate-in-model", CHAT, b'{"model": ' + SURROGATE + b', "messages": []}', 400, "model",
     "invalid_unicode", "invalid Unicode"),
    ("surrogate-in-a-key", CHAT, b'{' + SURROGATE + b': 1, "messages": []}', 400, None, "invalid_unicode",
     "invalid Unicode"),
    ("surrogate-in-stop", CHAT, chat_raw(b'[{"role": "user", "content": "hi"}]', b', "stop": [' + SURROGATE + b"]"),
     400, "stop[0]", "invalid_unicode", "invalid Unicode"),
    ("surrogate-in-prompt", COMPLETIONS, b'{"prompt": ' + SURROGATE + b"}", 400, "prompt", "invalid_unicode",
     "invalid Unicode"),
    # messages
    ("messages-a-string", CHAT, {"messages": "hi"}, 400, "messages", "invalid_type", "array"),
    ("messages-an-object", CHAT, {"messages": {"role": "user", "content": "hi"}}, 400, "messages", "invalid_type",
     "array"),
    ("messages-empty", CHAT, {"messages": []}, 400, "messages", "invalid_type", "non-empty"),
    ("message-a-string", CHAT, {"messages": ["hi"]}, 400, "messages[0]", "invalid_type", "JSON object"),
    ("message-null", CHAT, {"messages": [None]}, 400, "messages[0]", "invalid_type", "JSON object"),
    ("role-an-array", CHAT, role(["user"]), 400, "messages[0].role", "invalid_type", "must be a string"),
    ("role-an-object", CHAT, role({"user": 1}), 400, "messages[0].role", "invalid_type", "not an object"),
    ("role-a-number", CHAT, role(1), 400, "messages[0].role", "invalid_type", "not an integer"),
    ("role-missing", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role", "invalid_type", "not null"),
    ("role-unknown", CHAT, role("tool"), 400, "messages[0].role", "invalid_value", "'tool'"),
    ("content-a-number", CHAT, user(5), 400, "messages[0].content", "invalid_type", "string or an array"),
    ("content-an-object", CHAT, user({"type": "text", "text": "hi"}), 400, "messages[0].content", "invalid_type",
     "string or an array"),
    ("content-strings-not-parts", CHAT, user(["hi"]), 400, "messages[0].content", "unsupported_content", "text parts"),
    ("content-part-text-a-number", CHAT, user([{"type": "text", "text": 5}]), 400, "messages[0].content",
     "unsupported_content", "text parts"),
    ("content-nested-parts", CHAT, user([[{"type": "text", "text": "hi"}]]), 400, "messages[0].content",
     "unsupported_content", "text parts"),
    ("message-tool-calls", CHAT, {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": 1}]}]},
     400, "messages[0].tool_calls", "unsupported_parameter", "not supported"),
    # generation parameters
    ("stop-numbers", CHAT, body("hi", stop=[1, 2]), 400, "stop", "invalid_type", "strings"),
    ("stop-nested", CHAT, body("hi", stop=[["a"]]), 400, "stop", "invalid_type", "strings"),
    ("stop-an-object", CHAT, body("hi", stop={"a": 1}), 400, "stop", "invalid_type", "strings"),
    ("stop-five", CHAT, body("hi", stop=list("abcde")), 400, "stop", "invalid_value", "at most 4"),
    ("n-2", CHAT, body("hi", n=2), 400, "n", "unsupported_parameter", "not supported"),
    ("n-a-string", CHAT, body("hi", n="1"), 400, "n", "unsupported_parameter", "not supported"),
    ("logit-bias", CHAT, body("hi", logit_bias={"5": -100}), 400, "logit_bias", "unsupported_parameter",
     "not supported"),
    ("top-logprobs", CHAT, body("hi", top_logprobs=2), 400, "top_logprobs", "unsupported_parameter", "not supported"),
    ("response-format-json", CHAT, body("hi", response_format={"type": "json_object"}), 400, "response_format",
     "unsupported_parameter", "not supported"),
    ("presence-penalty", CHAT, body("hi", presence_penalty=0.5), 400, "presence_penalty", "unsupported_parameter",
     "not supported"),
    ("stream-options-a-string", CHAT, body("hi", stream=True, stream_options="usage"), 400, "stream_options",
     "invalid_type", "JSON object"),
    ("stream-options-unknown-key", CHAT, body("hi", stream=True, stream_options={"x": 1}), 400, "stream_options",
     None, "unrecognized"),
    ("max-tokens-a-string", CHAT, body("hi", max_tokens="10"), 400, "max_tokens", "invalid_type", "integer"),
    ("max-tokens-negative", CHAT, body("hi", max_tokens=-5), 400, "max_tokens", "invalid_value", "at least 1"),
    ("max-tokens-10e30", CHAT, body("hi", max_tokens=10**30), 400, "max_tokens", "context_length_exceeded",
     "too large"),
    ("max-completion-tokens-zero", CHAT, body("hi", max_completion_tokens=0), 400, "max_completion_tokens",
     "invalid_value", "at least 1"),
    ("temperature-an-array", CHAT, body("hi", temperature=[1]), 400, "temperature", "invalid_type", "number"),
    ("temperature-negative", CHAT, body("hi", temperature=-1), 400, "temperature", "invalid_value", "between"),
    ("top-p-zero", CHAT, body("hi", top_p=0), 400, "top_p", "invalid_value", "greater than 0"),
    ("top-k-a-fraction", CHAT, body("hi", top_k=1.5), 400, "top_k", "invalid_type", "integer"),
    ("repetition-penalty-zero", CHAT, body("hi", repetition_penalty=0), 400, "repetition_penalty", "invalid_value",
     "greater than 0"),
    ("seed-2-to-the-64", CHAT, body("hi", seed=2**64), 400, "seed", "invalid_value", "between"),
    ("seed-a-boolean", CHAT, body("hi", seed=True), 400, "seed", "invalid_type", "integer"),
    ("timeout-a-string", CHAT, body("hi", timeout="5"), 400, "timeout", "invalid_type", "number"),
    ("model-a-number", CHAT, {**body("hi"), "model": 5}, 400, "model", "invalid_type", "string"),
    ("model-unknown", CHAT, {**body("hi"), "model": "gpt-5"}, 404, "model", "model_not_found", "does not exist"),
    # /v1/completions prompts
    ("prompt-missing", COMPLETIONS, {"model": "tiny"}, 400, "prompt", "missing_required_parameter", "required"),
    ("prompt-ids-booleans", COMPLETIONS, prompt([True, 1]), 400, "prompt", "invalid_type", "prompt[0] is true"),
    ("prompt-ids-negative", COMPLETIONS, prompt([5, -1]), 400, "prompt", "invalid_value", "prompt[1] is -1"),
    ("prompt-ids-past-vocabulary", COMPLETIONS, prompt([5, 10**6]), 400, "prompt", "invalid_value",
     "prompt[1] is token id 1000000, outside the vocabulary"),
    ("prompt-ids-fractions", COMPLETIONS, prompt([1.5]), 400, "prompt", "invalid_type", "prompt[0] is a number"),
    ("prompt-ids-mixed", COMPLETIONS, prompt([1, "a"]), 400, "prompt", "invalid_type", "prompt[1] is a string"),
    ("prompt-two-strings", COMPLETIONS, prompt(["a", "b"]), 400, "prompt", "unsupported_parameter",
     "only one prompt"),
    ("prompt-two-id-lists", COMPLETIONS, prompt([[1], [2]]), 400, "prompt", "unsupported_parameter",
     "only one prompt"),
    ("prompt-empty-array", COMPLETIONS, prompt([]), 400, "prompt", "invalid_type", "non-empty"),
    ("prompt-empty-ids", COMPLETIONS, prompt([[]]), 400, "prompt", "invalid_type", "non-empty"),
    ("prompt-empty-string", COMPLETIONS, prompt([""]), 400, "prompt", "invalid_value", "empty"),
    ("prompt-a-number", COMPLETIONS, prompt(5), 400, "prompt", "invalid_type", "non-empty string"),
    ("prompt-an-object", COMPLETIONS, prompt({"text": "hi"}), 400, "prompt", "invalid_type", "non-empty string"),
    ("completion-echo", COMPLETIONS, prompt("hi", echo=True), 400, "echo", "unsupported_parameter", "not supported"),
    ("completion-best-of", COMPLETIONS, prompt("hi", best_of=2), 400, "best_of", "unsupported_parameter",
     "not supported"),
    ("completion-max-completion-tokens", COMPLETIONS, prompt("hi", max_completion_tokens=2), 400,
     "max_completion_tokens", "unrecognized_parameter", "unrecognized"),
    # the test hook's own route (on in these servers)
    ("debug-body-an-array", "/debug/worker", [], 400, None, None, "action must be"),
    ("debug-negative-seconds", "/debug/worker", {"action": "stall", "seconds": -1}, 400, None, None,
     "action must be"),
]


@pytest.fixture(scope="module")
def served(session):
    with running(session) as server:
        yield server


def send(url: str, path: str, payload) -> httpx.Response:
    if callable(payload):
        content = payload()
    else:
        content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    # A connection of its own: a refused body may leave one closed.
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


# `make test-fast` sends one of each kind (a request each, ~0.1 s); `make test` sends them all.
QUICK_BAD = {"nested-100000-deep", "nan-literal", "invalid-utf8", "body-8MiB-chunked", "surrogate-as-utf8-bytes",
             "messages-empty", "role-unknown", "content-nested-parts", "stop-five", "logit-bias",
             "max-tokens-10e30", "seed-2-to-the-64", "prompt-ids-past-vocabulary", "completion-best-of",
             "debug-negative-seconds"}  # fmt: skip


@pytest.mark.parametrize("path, payload, status, param, code, words",
                         quick([case[1:] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS],
                               fast=[case[1:] for case in BAD_REQUESTS if case[0] in QUICK_BAD]))  # fmt: skip
def test_bad_requests_get_a_clear_4xx(served, path, payload, status, param, code, words):
    url, client = served
    reply = send(url, path, payload)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code), error
    assert words in error["message"], error
    assert health(client)["status"] == "ok" and health(client)["active"] == 0  # nothing reached the worker


# -- shutdown ------------------------------------------------------------------------------------


def server_pid() -> int:
    (child,) = [p for p in psutil.Process().children() if "serve" in p.cmdline()]
    return child.pid


def wait_for_exit(pid: int, timeout: float):
    """The child's exit (os.waitid's record), leaving it for its Popen to reap."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        if info is not None:
            return info
        time.sleep(0.05)
    raise AssertionError(f"the server did not exit within {timeout} s")


@pytest.mark.e2e
def test_sigterm_answers_requests_in_flight_then_exits(session):
    results: dict = {}
    long = body(LONG_RUNNER, max_tokens=200, **GREEDY)  # 200 steps of 50 ms: far past the shutdown
    with serve_tiny(session, "--alias", "tiny") as (url, lines):
        with httpx.Client(base_url=url, timeout=60) as client:
            debug(client, "delay", 0.05)
            threads = [
                threading.Thread(target=lambda: results.update(whole=httpx.post(url + CHAT, json=long, timeout=60))),
                threading.Thread(target=lambda: results.update(streamed=stream(url, long))),
            ]
            for thread in threads:
                thread.start()
            wait_for(lambda: health(client)["active"] == 2 and metric(client, "tierlm_generated_tokens_total") >= 10,
                     timeout=30)
        pid = server_pid()
        sent = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        for thread in threads:
            thread.join(30)
        answered = time.monotonic() - sent
        ended = wait_for_exit(pid, timeout=30)
        exited = time.monotonic() - sent
    whole = results["whole"]
    assert whole.status_code == 503, whole.text
    for error in (whole.json()["error"], streamed_error(results["streamed"])):
        assert error["code"] == "server_shutting_down" and "shutting down" in error["message"], error
        assert error["type"] == "server_error"
    assert results["streamed"]["text"] and results["streamed"]["reason"] is None  # cut short, said so
    assert answered < 5.0 and exited < 15.0, (answered, exited)  # not the ~10 s the requests wanted
    assert (ended.si_code, ended.si_status) == (os.CLD_KILLED, signal.SIGTERM)  # as uvicorn, after closing
    assert ("POST", CHAT, 503) in [entry[:3] for entry in access_lines(lines)]


def test_shutdown_refuses_new_requests_with_503(session):
    with BackgroundServer(session, ServerOptions(aliases=("tiny",))) as server:
        server.app.state.drain()  # what the signal's shutdown does first
        reply = httpx.post(server.url + CHAT, json=body("lazy dog", max_tokens=3), timeout=30)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "server_shutting_down"
        report = httpx.get(server.url + "/health", timeout=30)
        assert report.status_code == 503 and report.json()["status"] == "shutting_down"


# -- dropped connections -------------------------------------------------------------------------


def drop_mid_body(url: str) -> None:
    """Send headers promising 1000 bytes, then 10 of them, then vanish."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"messages")
        time.sleep(0.2)


@pytest.mark.e2e
def test_a_dropped_connection_costs_one_log_line_and_the_server_goes_on(session):
    with serve_tiny(session, "--alias", "tiny") as (url, lines):
        with httpx.Client(base_url=url, timeout=60) as client:
            debug(client, "delay", 0.02)
            with httpx.Client(base_url=url, timeout=60) as leaving:
                with leaving.stream("POST", CHAT, json=body(LONG_RUNNER, stream=True, max_tokens=200)) as response:
                    assert next(response.iter_lines()).startswith("data: ")
            drop_mid_body(url)
            assert client.get("/v1/models/x%0Aforged").status_code == 404  # a log line of its own?
            wait_for(lambda: health(client)["active"] == 0, timeout=10)
            debug(client, "delay", 0)
            reply = client.post(CHAT, json=body("lazy dog", max_tokens=3, **GREEDY))
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
            wait_for(lambda: sum(" 499 " in line for line in lines) == 1, timeout=10)
    text = "".join(lines)
    assert "Traceback" not in text and "Exception in ASGI" not in text, text
    after_start = lines[next(i for i, line in enumerate(lines) if "listening on" in line) + 1:]
    assert len(access_lines(after_start)) == len(after_start), text  # each request: its access line, no more
    assert any(r'"GET /v1/models/x\x0aforged' in line for line in after_start), text
    assert sorted(entry[2] for entry in access_lines(lines) if entry[1] == CHAT) == [200, 200, 499]
