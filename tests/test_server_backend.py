"""`tierlm serve` as a backend that runs all day: the access log (and --quiet), context limits
answered with a 400 at once, and model names (the served one, aliases, 404 for the rest).

The access log is read from a real `tierlm serve` subprocess on the tiny model; the rest runs
against a server on a thread of this process, spoken to by the `openai` client and httpx."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from tests.test_server_api import CHAT, body, debug, running, session  # noqa: F401 (session: a fixture)
from tests.test_server_openai import serve_process
from tierlm.server.options import ServerOptions

CONTEXT = 256  # test_server_api's profile
ACCESS = re.compile(r'^127\.0\.0\.1 "(GET|POST) (\S+)" (\d{3}) prompt=(\d+|-) completion=(\d+|-) (\d+\.\d\d)s$')
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


def serve_tiny(session, *args: str):
    """`tierlm serve` on the tiny model of `session` (its profile file lies beside it), test hooks on."""
    model_dir = session.model_dir
    return serve_process("--model", str(model_dir), "--profile", str(model_dir.parent / "serve.toml"),
                         "--device", "cpu", "--dtype", "fp32", *args, env={"TIERLM_SERVE_DEBUG_HOOKS": "1"},
                         start_timeout=120)


def access_lines(lines: list[str]) -> list[tuple]:
    """(method, path, status, prompt, completion, seconds) of each access-log line."""
    found = [ACCESS.match(line.rstrip("\n")) for line in lines]
    return [(m[1], m[2], int(m[3]), m[4], m[5], float(m[6])) for m in found if m]


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.mark.e2e
def test_access_log_has_one_line_per_request_with_tokens_and_duration(session):
    with serve_tiny(session, "--model-name", "tiny-served", "--alias", "gpt-4o-mini") as (url, lines):
        client = openai_client(url)
        whole = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, temperature=0, max_tokens=5)
        with httpx.Client(base_url=url) as http:
            debug(http, "delay", 0.05)  # so the stream's duration shows it was logged at its end, not start
        chunks = list(client.chat.completions.create(
            model="tiny-served", messages=MESSAGES, temperature=0, max_tokens=12, stream=True,
            stream_options={"include_usage": True}))
        streamed = chunks[-1].usage
        client.models.list()
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=5)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny-served", messages=MESSAGES, max_tokens=CONTEXT)
    prompt = str(whole.usage.prompt_tokens)
    got = access_lines(lines)
    assert sorted(entry[:5] for entry in got) == sorted([
        ("POST", CHAT, 200, prompt, str(whole.usage.completion_tokens)),
        ("POST", "/debug/worker", 200, "-", "-"),
        ("POST", CHAT, 200, prompt, str(streamed.completion_tokens)),
        ("GET", "/v1/models", 200, "-", "-"),
        ("POST", CHAT, 404, "-", "-"),
        ("POST", CHAT, 400, prompt, "-"),  # refused after tokenizing: the prompt's size is known
    ]), "".join(lines)
    assert streamed.completion_tokens == 12  # more than the first request's 5: its line is told apart
    # Logged at the stream's end, not its start: the delays of most of its 11 decode steps (how the first
    # ones overlap the prefill's step varies with the machine, so not all 11 are required).
    assert next(float(e[5]) for e in got if e[4] == "12") >= 9 * 0.05
    assert not any('HTTP/1.1"' in line for line in lines)  # uvicorn's own access log stays off


@pytest.mark.e2e
def test_quiet_turns_the_access_log_off(session):
    with serve_tiny(session, "--quiet") as (url, lines):
        name = ServerOptions().served_name(session.model_dir)
        reply = openai_client(url).chat.completions.create(model=name, messages=MESSAGES, temperature=0, max_tokens=3)
        assert httpx.get(url + "/v1/models").status_code == 200
    assert reply.usage.completion_tokens >= 1
    assert any("listening on" in line for line in lines)  # stderr was read: the lines would be there
    assert access_lines(lines) == [] and not any(" prompt=" in line for line in lines), "".join(lines)


def test_max_tokens_beyond_the_context_is_refused_at_once(session):
    prompt_tokens = len(session.engine.tokenizer.encode_chat(MESSAGES))
    room = CONTEXT - prompt_tokens
    with running(session) as (url, http):
        debug(http, "delay", 0.05)  # generating the room's worth would take seconds
        client = openai_client(url)
        for param in ("max_tokens", "max_completion_tokens"):
            started = time.monotonic()
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model="tiny", messages=MESSAGES, **{param: room + 1})
            assert time.monotonic() - started < 1.0
            error = refused.value.body
            assert (error["param"], error["code"], error["type"]) == (param, "context_length_exceeded",
                                                                      "invalid_request_error")
            for number in (room + 1, CONTEXT, prompt_tokens, room):
                assert str(number) in error["message"], error["message"]
        debug(http, "delay", 0)
        fits = http.post(CHAT, json=body(MESSAGES[0]["content"], temperature=0, max_tokens=room))
        assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] <= room
        too_long = http.post("/v1/completions", json={"prompt": [5] * CONTEXT, "max_tokens": 1})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        assert f"{CONTEXT} tokens" in too_long.json()["error"]["message"]


def test_omitted_max_tokens_runs_to_the_context_and_ends_with_length(session):
    near_the_end = [5, 9, 17] * 83  # 249 ids: room for 7 more
    with running(session) as (url, http):
        default = http.post("/v1/completions", json={"prompt": near_the_end, "temperature": 0}).json()
        asked = http.post("/v1/completions", json={"prompt": near_the_end, "temperature": 0, "max_tokens": 8})
    assert default["choices"][0]["finish_reason"] == "length"
    assert default["usage"]["completion_tokens"] == CONTEXT - len(near_the_end)  # not OpenAI's 16
    assert asked.status_code == 400 and asked.json()["error"]["param"] == "max_tokens"


@pytest.mark.slow
def test_model_names_served_aliased_absent_and_unknown(session):
    with running(session, model_id="tiny-served", aliases=("tiny", "gpt-4o-mini")) as (url, http):
        client = openai_client(url)
        assert [m.id for m in client.models.list().data] == ["tiny-served"]
        assert client.models.retrieve("gpt-4o-mini").id == "tiny-served"
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, temperature=0, max_tokens=3)
        assert reply.model == "tiny-served" and reply.usage.completion_tokens >= 1
        no_model = http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 3})
        assert no_model.status_code == 200 and no_model.json()["model"] == "tiny-served"
        for call in (lambda: client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=3),
                     lambda: client.completions.create(model="gpt-4", prompt="the quick", max_tokens=3),
                     lambda: client.models.retrieve("gpt-4")):
            with pytest.raises(openai.NotFoundError) as missing:
                call()
            error = missing.value.body
            assert (error["code"], error["type"]) == ("model_not_found", "invalid_request_error")
            assert "The model `gpt-4` does not exist" in error["message"]
    with running(session) as (url, http):  # no --model-name: the catalogue name
        names = [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert names == [ServerOptions().served_name(session.model_dir)]
