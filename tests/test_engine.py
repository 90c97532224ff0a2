"""The generation engine and chat session on a tiny random model with a real tokenizer."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_model
from tierlm.errors import TierlmError
from tierlm.runtime.chat import ChatSession
from tierlm.runtime.engine import Engine
from tierlm.runtime.loader import load_model
from tierlm.runtime.sampling import SamplingParams
from tierlm.runtime.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("engine-model")
    reference = make_model(model_dir, vocab=320, layers=2)
    return model_dir, reference


def engine_for(model_dir, context_length=None) -> Engine:
    loaded = load_model(model_dir, device="cpu", dtype=torch.float32, context_length=context_length)
    return Engine(loaded, Tokenizer.from_dir(model_dir))


GREEDY = SamplingParams(temperature=0, max_new_tokens=24)


def test_greedy_generation_matches_transformers_and_streams_its_decode(tiny):
    model_dir, reference = tiny
    engine = engine_for(model_dir)
    prompt = engine.tokenizer.encode("the quick brown fox")
    generation = engine.generate(prompt, GREEDY)
    text = generation.text()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
            eos_token_id=sorted(engine.tokenizer.eos_token_ids),
        )[0, len(prompt) :].tolist()
    assert generation.token_ids == expected
    body = [t for t in generation.token_ids if t not in engine.tokenizer.eos_token_ids]
    assert text == engine.tokenizer.decode(body, skip_special_tokens=True)
    reason = "stop" if expected[-1] in engine.tokenizer.eos_token_ids else "length"
    assert generation.stats.finish_reason == reason
    assert generation.stats.new_tokens == len(expected)


def test_extended_prompt_reuses_cached_prefix_with_identical_output(tiny):
    model_dir, _ = tiny
    engine = engine_for(model_dir)
    first = engine.tokenizer.encode("hello world, how are")
    engine.generate(first, GREEDY).text()
    second = first + engine.tokenizer.encode(" you? the lazy dog")
    warm = engine.generate(second, GREEDY)
    warm.text()
    assert warm.stats.reused_tokens == len(first)
    cold = engine_for(model_dir).generate(second, GREEDY)
    cold.text()
    assert warm.token_ids == cold.token_ids
    # Same prompt again: everything but the last token is reused, output unchanged.
    again = engine.generate(second, GREEDY)
    again.text()
    assert again.stats.reused_tokens == len(second) - 1
    assert again.token_ids == cold.token_ids


def test_seeded_sampling_reproduces_and_seeds_differ(tiny):
    model_dir, _ = tiny
    engine = engine_for(model_dir)
    prompt = engine.tokenizer.encode("the lazy dog")
    outs = []
    for seed in (5, 5, 6):
        g = engine.generate(prompt, SamplingParams(temperature=1.5, max_new_tokens=16, seed=seed))
        g.text()
        outs.append(g.token_ids)
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]


def test_stop_string_ends_generation_and_is_not_emitted(tiny):
    model_dir, _ = tiny
    engine = engine_for(model_dir)
    prompt = engine.tokenizer.encode("the quick")
    free = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24))
    full = free.text()
    assert len(full) > 4, "the tiny model should say something"
    stop = full[2:4]
    stopped = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24, stop=(stop,)))
    assert stopped.text() == full[: full.index(stop)]
    assert stopped.stats.finish_reason == "stop"


def test_max_new_tokens_gives_length_finish(tiny):
    model_dir, _ = tiny
    engine = engine_for(model_dir)
    generation = engine.generate(engine.tokenizer.encode("fox"), SamplingParams(temperature=0, max_new_tokens=3))
    generation.text()
    if generation.token_ids[-1] not in engine.tokenizer.eos_token_ids:
        assert generation.stats.finish_reason == "length"
        assert len(generation.token_ids) == 3


def test_prompt_longer_than_context_is_refused(tiny):
    model_dir, _ = tiny
    engine = engine_for(model_dir, context_length=32)
    with pytest.raises(TierlmError, match="context"):
        engine.generate(list(range(3, 40)), GREEDY)


def test_generation_stops_when_the_context_is_full(tiny):
    model_dir, _ = tiny
    engine = engine_for(model_dir, context_length=32)
    generation = engine.generate(list(range(3, 28)), SamplingParams(temperature=1.0, max_new_tokens=100, seed=1))
    generation.text()
    assert engine.cache.offset <= 32
    if generation.stats.finish_reason == "length":
        assert len(generation.token_ids) <= 32 - 25 + 1


def test_chat_history_is_kept_and_truncated_oldest_first(tiny):
    model_dir, _ = tiny
    engine = engine_for(model_dir, context_length=96)
    chat = ChatSession(engine, system="be brief")
    params = SamplingParams(temperature=0, max_new_tokens=8)
    chat.send("hello world", params).text()
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    for turn in range(6):
        last = chat.send(f"the quick brown fox jumps {turn}", params)
        last.text()
    assert chat.dropped_messages > 0
    assert chat.messages[0]["role"] == "user"
    assert chat.messages[-2]["content"] == "the quick brown fox jumps 5"
    assert last.stats.prompt_tokens <= 96 - params.max_new_tokens
    assert engine.tokenizer.render_chat(chat._conversation()).startswith("<|im_start|>system\nbe brief")
    with pytest.raises(TierlmError, match="context"):
        chat.send("fox " * 200, params)
    assert chat.messages[-1]["role"] == "assistant", "a refused message does not enter the history"


def test_ignore_eos_decodes_exactly_max_new_tokens(tiny):
    model_dir, _ = tiny
    engine = engine_for(model_dir)
    prompt = engine.tokenizer.encode("the quick brown fox")
    first = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=1))
    first.text()
    # Make the greedy first token an end-of-sequence token: normally generation stops at once.
    engine.tokenizer.eos_token_ids = frozenset({first.token_ids[0]})
    engine.reset()
    stopped = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=6))
    stopped.text()
    assert stopped.token_ids == first.token_ids and stopped.stats.finish_reason == "stop"
    engine.reset()
    forced = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    forced.text()
    assert len(forced.token_ids) == 6 and forced.stats.finish_reason == "length"
    assert forced.token_ids[0] == first.token_ids[0]
