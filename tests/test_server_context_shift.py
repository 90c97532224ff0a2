"""`serve --context-shift` (a chat request that does not fit drops its oldest exchanges, as `chat`
does) and the prefix reuse figures of /stats and /metrics, through the real server on a tiny model
running on a thread of this process."""

from __future__ import annotations

import httpx
import pytest

from tests.test_server_api import metric, running, solo
from tests.test_server_backend import serve_tiny
from tests.tiny import make_model, write_profile
from tierlm.profile import load_profile
from tierlm.runtime.sampling import resolve_sampling
from tierlm.runtime.session import open_session

CHAT = "/v1/chat/completions"
DROPPED = "X-Tierlm-Messages-Dropped"
CONTEXT = 256
REPLY = 8  # max_tokens / num_predict of every request here
SYSTEM = {"role": "system", "content": "You answer in one short line."}


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    root = tmp_path_factory.mktemp("shift")
    make_model(root / "tiny-chat")
    profile = load_profile(str(write_profile(root / "serve.toml", context_length=CONTEXT, batch_size=2)))
    return open_session(str(root / "tiny-chat"), profile, device="cpu", dtype="fp32")


def conversation(exchanges: int) -> list[dict]:
    """The system message, `exchanges` user/assistant pairs of distinct text, and a last question."""
    messages = [SYSTEM]
    for n in range(exchanges):
        messages += [{"role": "user", "content": f"question {n}: " + "tell me about the colour blue " * 2},
                     {"role": "assistant", "content": f"answer {n}: " + "blue is the sky and the sea " * 2}]
    return messages + [{"role": "user", "content": "and which colour is grass?"}]


def shortened(session, messages: list[dict]) -> tuple[int, list[dict]]:
    """(how many messages go, what is left): the fewest whole exchanges after the system message
    whose dropping leaves room for REPLY tokens (the reference, counted here by hand)."""
    tokenizer = session.engine.tokenizer
    for dropped in range(0, len(messages) - 1, 2):
        kept = [messages[0], *messages[1 + dropped:]]
        if len(tokenizer.encode_chat(kept)) + REPLY <= CONTEXT:
            return dropped, kept
    raise AssertionError("even the last message alone does not fit")


def alone(session, messages: list[dict]) -> tuple[list[int], str]:
    """(prompt ids, the greedy reply): the engine's answer to `messages` alone, with the model's
    defaults for what the request leaves out, as the server resolves them."""
    prompt = session.engine.tokenizer.encode_chat(messages)
    params = resolve_sampling(session.generation_defaults, temperature=0, max_new_tokens=REPLY)
    return prompt, solo(session, prompt, params)[1]


def test_a_conversation_longer_than_the_context_is_refused_without_the_flag_and_shifted_with_it(session):
    messages = conversation(8)
    assert len(session.engine.tokenizer.encode_chat(messages)) > CONTEXT
    dropped, kept = shortened(session, messages)
    assert dropped >= 2 and kept[0] == SYSTEM
    prompt, expected = alone(session, kept)
    request = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": REPLY}

    with running(session) as (_, client):
        refused = client.post(CHAT, json=request)
        assert refused.status_code == 400 and DROPPED not in refused.headers
        assert refused.json()["error"]["code"] == "context_length_exceeded"

    with running(session, context_shift=True) as (_, client):
        reply = client.post(CHAT, json=request)
        assert reply.status_code == 200, reply.text
        assert int(reply.headers[DROPPED]) == dropped
        assert reply.json()["usage"]["prompt_tokens"] == len(prompt)  # the system message is in it
        assert reply.json()["choices"][0]["message"]["content"] == expected
        streamed = client.post(CHAT, json={**request, "stream": True})
        assert streamed.status_code == 200 and int(streamed.headers[DROPPED]) == dropped
        # A conversation that fits is left whole, and says so.
        short = client.post(CHAT, json={**request, "messages": conversation(1)})
        assert short.status_code == 200 and short.headers[DROPPED] == "0"
        assert metric(client, "tierlm_context_shifted_requests_total") == 2
        assert metric(client, "tierlm_context_shift_dropped_messages_total") == 2 * dropped
        shift = client.get("/stats").json()["context_shift"]
        assert shift == {"enabled": True, "requests": 2, "dropped_messages": 2 * dropped}


@pytest.mark.e2e
def test_serve_context_shift_flag_and_the_access_log_line(session):
    """`tierlm serve --context-shift` as a process: the flag reaches the server, and the access
    log's line of a shifted request says how many messages went."""
    messages = conversation(8)
    dropped, kept = shortened(session, messages)
    with serve_tiny(session, "--context-shift") as (url, lines):
        reply = httpx.post(url + CHAT, json={"messages": messages, "temperature": 0, "max_tokens": REPLY}, timeout=60)
        assert reply.status_code == 200 and int(reply.headers[DROPPED]) == dropped
    logged = [line for line in lines if f'"POST {CHAT}" 200' in line]
    prompt = len(session.engine.tokenizer.encode_chat(kept))
    assert len(logged) == 1 and f" prompt={prompt} completion=" in logged[0], "".join(lines)
    assert f" dropped={dropped} " in logged[0], logged[0]


def test_a_last_message_that_alone_does_not_fit_and_a_raw_prompt_are_still_refused(session):
    huge = "blue " * (2 * CONTEXT)
    request = {"model": "tiny", "messages": [SYSTEM, {"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"},
                                             {"role": "user", "content": huge}], "max_tokens": REPLY}
    with running(session) as (_, client):
        unshifted = client.post(CHAT, json=request).json()["error"]
    with running(session, context_shift=True) as (_, client):
        response = client.post(CHAT, json=request)
        assert response.status_code == 400
        refused = response.json()["error"]
        # The same one line as without the flag, for the shortest prompt it could send.
        assert refused["code"] == "context_length_exceeded" and refused["param"] == "messages"
        assert refused["message"].startswith("the prompt is ") and "shorten it" in refused["message"]
        assert refused["message"] != unshifted["message"]  # it counted the prompt without the dropped exchange
        raw = client.post("/v1/completions", json={"model": "tiny", "prompt": huge, "max_tokens": REPLY})
        assert raw.status_code == 400 and raw.json()["error"]["code"] == "context_length_exceeded"
        assert metric(client, "tierlm_context_shifted_requests_total") == 0


def test_ollama_chat_drops_the_same_exchanges(session):
    messages = conversation(8)
    dropped, kept = shortened(session, messages)
    prompt, expected = alone(session, kept)
    request = {"model": "tiny", "messages": messages, "stream": False,
               "options": {"temperature": 0, "num_predict": REPLY}}
    with running(session) as (_, client):
        refused = client.post("/api/chat", json=request)
        assert refused.status_code == 400 and "shorten it" in refused.json()["error"]
    with running(session, context_shift=True) as (_, client):
        reply = client.post("/api/chat", json=request)
        assert reply.status_code == 200, reply.text
        assert int(reply.headers[DROPPED]) == dropped
        assert reply.json()["prompt_eval_count"] == len(prompt)
        assert reply.json()["message"]["content"] == expected
        streamed = client.post("/api/chat", json={**request, "stream": True})
        assert streamed.status_code == 200 and int(streamed.headers[DROPPED]) == dropped


def test_stats_show_the_prefix_hit_rate_and_what_each_slot_holds(session):
    first = [SYSTEM, {"role": "user", "content": "name a colour"}]
    with running(session) as (_, client):
        before = client.get("/stats").json()
        assert before["prefix_reuse"] == {"prompt_tokens": 0, "reused_tokens": 0, "hit_rate": None}
        assert before["context_shift"]["enabled"] is False
        one = client.post(CHAT, json={"model": "tiny", "messages": first, "temperature": 0, "max_tokens": REPLY})
        text = one.json()["choices"][0]["message"]["content"]
        second = [*first, {"role": "assistant", "content": text}, {"role": "user", "content": "and another"}]
        two = client.post(CHAT, json={"model": "tiny", "messages": second, "temperature": 0, "max_tokens": REPLY})
        usages = [one.json()["usage"], two.json()["usage"]]
        reused = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages)
        prompts = sum(u["prompt_tokens"] for u in usages)
        assert reused > usages[0]["prompt_tokens"] // 2  # the second turn continued the first's slot

        stats = client.get("/stats").json()
        assert stats["prefix_reuse"] == {"prompt_tokens": prompts, "reused_tokens": reused,
                                         "hit_rate": pytest.approx(reused / prompts)}
        assert metric(client, "tierlm_prompt_tokens_cached_total") == reused
        assert metric(client, "tierlm_prompt_tokens_total") == prompts
        # One slot holds the conversation's prompt and reply (bar the last token, never fed); the other nothing.
        slots = stats["kv_cache"]["slots"]
        assert stats["kv_cache"]["format"] == "f32" and stats["kv_cache"]["context"] == CONTEXT
        assert stats["kv_cache"]["reserved_bytes"] == session.loaded.new_paged_cache(1, session.profile.batch_size).nbytes
        placement = session.loaded.placement  # idle conversations may take the room the plan leaves
        spill = stats["kv_cache"]["spill"]
        room = placement.budgets["device"] - placement.total("device")
        assert 0 < spill["capacity_bytes"] <= room and spill["capacity_bytes"] >= min(room, 256 << 20)
        assert spill["spilled"] == spill["restored"] == 0 == metric(client, "tierlm_kv_spilled_total")
        held = usages[1]["prompt_tokens"] + usages[1]["completion_tokens"] - 1
        assert sorted(s["tokens"] for s in slots if s["tokens"]) == [held] and not any(s["active"] for s in slots)
        readings = [metric(client, f'tierlm_slot_tokens_held{{slot="{n}"}}') for n in range(len(slots))]
        assert sorted(r for r in readings if r) == [held]
        pages = stats["kv_cache"]["pages"]  # the conversation's pages stay, kept for its next turn
        assert pages["used"] == pages["idle"] == -(-held // pages["page_tokens"]) and pages["running"] == 0
        assert pages["used"] + pages["free"] == pages["total"] == metric(client, 'tierlm_kv_pages{state="free"}') + pages["used"]
