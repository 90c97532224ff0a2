"""A server slot keeps its keys and values after its request ends, and the next request sharing a
prefix with them prefills only the rest (issue 25's first step: a chat client resends the whole
conversation every turn). Reuse is exact: every reply equals the one computed from scratch."""

from __future__ import annotations

import pytest
import torch

from tests.test_server_batch import ImmediateLoop, drain, reference
from tests.tiny import make_model
from tierlm.kv.spill import DiskSpill
from tierlm.runtime.engine import Engine
from tierlm.runtime.saved_chat import model_identity
from tierlm.runtime.loader import load_model
from tierlm.runtime.sampling import SamplingParams
from tierlm.runtime.tokenizer import Tokenizer
from tierlm.server.batch import BatchRunner
from tierlm.server.jobs import Job

GREEDY = SamplingParams(temperature=0, max_new_tokens=12)
FAMILIES = {
    "llama": dict(family="llama"),
    "mistral-window": dict(family="mistral", heads=4, kv_heads=1, sliding_window=6),  # reuse past the window
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp(request.param)
    make_model(model_dir, **FAMILIES[request.param])
    loaded = load_model(model_dir, device="cpu", dtype=torch.float32, context_length=256)
    return loaded, Tokenizer.from_dir(model_dir)


def run(runner: BatchRunner, *jobs: Job) -> None:
    waiting = list(jobs)
    while waiting or runner.active:
        while waiting and runner.has_room:
            runner.admit(waiting.pop(0))
        runner.step()


def fresh(model, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], str, str]:
    loaded, tokenizer = model
    return reference(Engine(loaded, tokenizer), prompt, params)


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def job(prompt: list[int], params: SamplingParams = GREEDY) -> Job:
    return Job(prompt, params, deadline=None, loop=ImmediateLoop())


def turns(tokenizer, *said: str, replies: list[str]) -> list[int]:
    """The prompt of a conversation where the user said `said` and the assistant `replies`."""
    messages = []
    for index, text in enumerate(said):
        messages.append({"role": "user", "content": text})
        if index < len(replies):
            messages.append({"role": "assistant", "content": replies[index]})
    return tokenizer.encode_chat(messages)


def test_a_later_turn_prefills_only_what_is_new_and_answers_as_from_scratch(model):
    loaded, tokenizer = model
    runner = BatchRunner(loaded, tokenizer, parallel=1, slots=1)
    first_prompt = turns(tokenizer, "the quick brown fox", replies=[])
    first = job(first_prompt)
    run(runner, first)
    reply, _ = drain(first)
    assert first.cached_tokens == 0 and reply == fresh(model, first_prompt)[1]

    second_prompt = turns(tokenizer, "the quick brown fox", "and then?", replies=[reply])
    second = job(second_prompt)
    run(runner, second)
    ids, text, reason = fresh(model, second_prompt)
    assert drain(second) == (text, reason)
    # Everything the slot held that the new prompt starts with was reused: at least the first prompt.
    assert len(first_prompt) <= second.cached_tokens < len(second_prompt), (second.cached_tokens, len(first_prompt))


def test_the_same_prompt_again_reuses_all_but_its_last_token(model):
    loaded, tokenizer = model
    runner = BatchRunner(loaded, tokenizer, contexts=2, parallel=2, slots=2)
    prompt = turns(tokenizer, "hello world, how are you?", replies=[])
    sampled = SamplingParams(temperature=1.1, top_p=0.9, seed=3, max_new_tokens=10)
    expected = fresh(model, prompt, sampled)
    for attempt in range(3):
        again = job(prompt, sampled)
        run(runner, again)
        assert drain(again) == expected[1:], attempt
        assert again.cached_tokens == (0 if attempt == 0 else len(prompt) - 1)


def test_interleaved_conversations_each_keep_their_own_slot(model):
    loaded, tokenizer = model
    runner = BatchRunner(loaded, tokenizer, contexts=2, parallel=2, slots=2)
    said = {"a": ["the quick brown fox"], "b": ["lazy dog sleeps"]}
    replies: dict[str, list[str]] = {"a": [], "b": []}
    previous: dict[str, list[int]] = {}
    for turn in range(3):
        for name in ("a", "b"):
            prompt = turns(tokenizer, *said[name], replies=replies[name])
            asked = job(prompt)
            run(runner, asked)
            text, _ = drain(asked)
            assert text == fresh(model, prompt)[1], (name, turn)
            if turn:  # the other conversation ran in between, in the other slot
                assert asked.cached_tokens >= len(previous[name]), (name, turn, asked.cached_tokens)
            previous[name] = prompt
            replies[name].append(text)
            said[name].append(f"tell me more ({turn})")


def test_two_prompts_sharing_a_system_message_run_together_exactly(model):
    loaded, tokenizer = model
    runner = BatchRunner(loaded, tokenizer, contexts=2, parallel=2, slots=2)
    system = {"role": "system", "content": "You answer briefly and politely, always."}
    prompts = [tokenizer.encode_chat([system, {"role": "user", "content": text}]) for text in ("hi there", "bye now")]
    run(runner, job(prompts[0]))  # leaves the system prompt's keys and values in a slot
    together = [job(p) for p in prompts[::-1]]
    run(runner, *together)
    for asked, prompt in zip(together, prompts[::-1]):
        assert drain(asked)[0] == fresh(model, prompt)[1]
    assert max(asked.cached_tokens for asked in together) >= shared(*prompts)


def test_a_sequence_that_failed_leaves_nothing_to_reuse(model, monkeypatch):
    loaded, tokenizer = model
    runner = BatchRunner(loaded, tokenizer, parallel=1, slots=1)
    prompt = turns(tokenizer, "the quick brown fox", replies=[])
    broken = job(prompt)
    seq = runner.admit(broken)
    monkeypatch.setattr(seq.state, "sample", lambda logits: (_ for _ in ()).throw(RuntimeError("injected")))
    while runner.active:
        runner.step()
    assert broken.error and "injected" in broken.error
    assert runner.cache.lengths == (0,)
    monkeypatch.undo()
    after = job(prompt)
    run(runner, after)
    assert after.cached_tokens == 0 and drain(after)[0] == fresh(model, prompt)[1]


SHARED_SYSTEM = "You are a careful assistant. Answer in one short line."


def test_a_new_conversation_copies_a_shared_system_prompt_from_another_slot(model):
    """Two conversations with one system prompt: the second takes its own slot and copies the
    first one's rows of the common prefix instead of computing them, while the first still runs,
    and answers as computed from scratch."""
    loaded, tokenizer = model
    runner = BatchRunner(loaded, tokenizer, contexts=2, parallel=2, slots=2)

    def prompt(question: str) -> list[int]:
        return tokenizer.encode_chat([{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": question}])

    first_prompt, second_prompt = prompt("name a colour"), prompt("and a number?")
    common = shared(first_prompt, second_prompt)
    assert common >= 32
    first = job(first_prompt, SamplingParams(temperature=0, max_new_tokens=20))
    runner.admit(first)
    while runner.active[0].prefilling or runner.active[0].pending is None:
        runner.step()  # the first has prefilled; it is decoding when the second arrives
    second = job(second_prompt)
    seq = runner.admit(second)
    assert seq.slot != runner.active[0].slot and second.cached_tokens == common
    run(runner)
    assert drain(second)[0] == fresh(model, second_prompt)[1]
    assert drain(first)[0] == fresh(model, first_prompt, SamplingParams(temperature=0, max_new_tokens=20))[1]


def test_a_prefix_is_copied_only_from_a_slot_of_the_same_variant_and_not_for_a_few_tokens(model):
    loaded, tokenizer = model
    runner = BatchRunner(loaded, tokenizer, contexts=2, parallel=2, slots=2)
    base = tokenizer.encode_chat([{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": "hi"}])
    run(runner, job(base))
    other = Job(base, GREEDY, deadline=None, loop=ImmediateLoop(), variant="v")
    assert runner._copy_prefix(other, 1, 0) == 0  # the held rows are the base's
    short = tokenizer.encode_chat([{"role": "user", "content": "hello there"}])
    assert shared(short, base) < 16 and runner._copy_prefix(job(short), 1, 0) == 0


@pytest.mark.parametrize("where", ["host-ram", "disk", "nowhere"])
def test_a_conversation_whose_slot_was_taken_comes_back_from_host_ram_or_disk(model, where, tmp_path):
    """One slot, two conversations taking turns (a chat app's second chat, or the title it asks
    for): the first's rows are copied out when the second takes the slot (to host RAM, or to disk
    when RAM has no room) and back when it returns, so its next turn prefills only what is new,
    and answers as computed from scratch. With nowhere to keep them it computes its history again."""
    loaded, tokenizer = model
    disk = DiskSpill(tmp_path / "spill", 64 << 20, model_identity(loaded, loaded.new_cache())) if where == "disk" else None
    runner = BatchRunner(loaded, tokenizer, parallel=1, slots=1, spill_bytes=64 << 20 if where == "host-ram" else 0, spill_disk=disk)
    first = turns(tokenizer, "the quick brown fox", replies=[])
    one = job(first)
    run(runner, one)
    reply = drain(one)[0]
    held = list(runner._held[0].ids)  # the prompt and the reply's tokens fed back
    run(runner, job(turns(tokenizer, "write a title for a chat about foxes", replies=[])))
    again = turns(tokenizer, "the quick brown fox", "and then?", replies=[reply])
    back = job(again)
    run(runner, back)
    if where != "nowhere":
        # All the rows that still match the new prompt (a random model's reply may tokenize back otherwise).
        assert back.cached_tokens == shared(again, held) >= len(first)
        assert (runner.spill.spilled, runner.spill.restored) == (2, 1)
    else:
        assert back.cached_tokens < 16 and runner.spill.spilled == 0
    assert drain(back)[0] == fresh(model, again)[1]


def test_a_failing_spill_or_restore_costs_a_recomputation_never_the_request(model, monkeypatch):
    loaded, tokenizer = model
    runner = BatchRunner(loaded, tokenizer, parallel=1, slots=1, spill_bytes=64 << 20)
    run(runner, job(turns(tokenizer, "the quick brown fox", replies=[])))

    def broken(*_):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(runner.spill, "put", broken)
    other = turns(tokenizer, "write a title for a chat about foxes", replies=[])
    taken = job(other)
    run(runner, taken)  # the first conversation's copy is lost; this request is not
    assert drain(taken)[0] == fresh(model, other)[1]
    monkeypatch.setattr(runner, "_copy_prefix", broken)
    again = job(other)
    run(runner, again)
    assert again.cached_tokens == 0 and drain(again)[0] == fresh(model, other)[1]


def test_an_idle_conversation_whose_pages_are_taken_is_spilled_and_comes_back(model):
    """A pool of one context (256 positions) and two page tables: a second long conversation
    needs the pages the first one's idle slot keeps, so they are copied to host RAM and given
    back; when the first conversation returns its rows come back from RAM, and it answers as
    computed from scratch."""
    loaded, tokenizer = model
    runner = BatchRunner(loaded, tokenizer, contexts=1, parallel=1, slots=2, spill_bytes=64 << 20)
    story = "the quick brown fox jumps over the lazy dog " * 14
    first = turns(tokenizer, story, replies=[])
    one = job(first)
    run(runner, one)
    reply = drain(one)[0]
    held = list(runner._held[runner.cache.lengths.index(max(runner.cache.lengths))].ids)
    run(runner, job(turns(tokenizer, "write a title for this: " + story, replies=[])))
    assert runner.counts.reclaimed == 1 and runner.spill.spilled == 1
    assert runner.cache.pool.used <= runner.cache.pool.size
    again = turns(tokenizer, story, "and then?", replies=[reply])
    back = job(again)
    run(runner, back)
    assert back.cached_tokens == shared(again, held) >= len(first) and runner.spill.restored == 1
    assert drain(back)[0] == fresh(model, again)[1]
