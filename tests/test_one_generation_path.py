"""One generation path (STYLE rule 9): the CLI engine and the server's batch runner end every
sequence with the same text and finish reason, because one `SequenceState` decides for both.

The runner once ignored `SamplingParams.ignore_eos`; the ignore_eos case guards that drift."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_server_batch import ImmediateLoop, drain
from tests.tiny import make_model
from tierlm.runtime.engine import Engine
from tierlm.runtime.loader import load_model
from tierlm.runtime.sampling import SamplingParams
from tierlm.runtime.tokenizer import Tokenizer
from tierlm.server.batch import BatchRunner
from tierlm.server.jobs import Job

CONTEXT = 48
GREEDY = dict(temperature=0, repetition_penalty=1.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny model, with an extra EOS id it reaches greedily after the 'world' prompt (a random
    model never picks the template's EOS), so natural EOS endings can be tested.

    Returns (loaded, tokenizer, the 'world' prompt, the index of its natural EOS token)."""
    model_dir = tmp_path_factory.mktemp("one-path")
    make_model(model_dir)
    loaded = load_model(model_dir, device="cpu", dtype=torch.float32, context_length=CONTEXT)
    plain = Tokenizer.from_dir(model_dir)
    prompt = plain.encode_chat([{"role": "user", "content": "world"}])
    tokens = Engine(loaded, plain).generate(prompt, SamplingParams(max_new_tokens=20, **GREEDY))
    tokens.text()
    ids = tokens.token_ids
    at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, ids[at]]}))
    tokenizer = Tokenizer.from_dir(model_dir)
    assert ids[at] in tokenizer.eos_token_ids
    return loaded, tokenizer, prompt, at


def cases(tokenizer, world: list[int], eos_at: int, engine: Engine) -> dict[str, tuple[list[int], SamplingParams]]:
    chat = lambda text: tokenizer.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    fox = chat("fox")
    deltas = list(engine.generate(fox, SamplingParams(max_new_tokens=30, **GREEDY)))
    # A stop string across a token boundary: the end of one delta and the start of the next,
    # where it first occurs.
    full, spanning = "".join(deltas), None
    for i in range(len(deltas) - 1):
        candidate, boundary = deltas[i][-2:] + deltas[i + 1][:2], len("".join(deltas[: i + 1]))
        at = full.find(candidate)
        if "\ufffd" not in candidate and at < boundary < at + len(candidate):
            spanning = candidate
            break
    assert spanning is not None, deltas
    # A stop string whose start ends the text at the token limit: held back, then released.
    short = list(engine.generate(fox, SamplingParams(max_new_tokens=6, **GREEDY)))
    held = "".join(short)[-1] + "\u2620"
    near_full = torch.randint(3, 300, (CONTEXT - 3,), generator=torch.Generator().manual_seed(5)).tolist()
    return {
        "greedy": (fox, SamplingParams(max_new_tokens=20, **GREEDY)),
        "natural-eos": (world, SamplingParams(max_new_tokens=eos_at + 10, **GREEDY)),
        "ignore-eos": (world, SamplingParams(max_new_tokens=eos_at + 10, ignore_eos=True, **GREEDY)),
        "stop-spanning": (fox, SamplingParams(max_new_tokens=30, stop=("never there", spanning), **GREEDY)),
        "stop-held-at-limit": (fox, SamplingParams(max_new_tokens=6, stop=(held,), **GREEDY)),
        "max-new-tokens-1": (world, SamplingParams(max_new_tokens=1, **GREEDY)),
        "context-nearly-full": (near_full, SamplingParams(max_new_tokens=20, **GREEDY)),
        "seeded-penalty": (chat("lazy dog"), SamplingParams(temperature=0.9, top_k=50, seed=3,
                                                            repetition_penalty=1.3, max_new_tokens=15)),
    }


def test_engine_and_batch_runner_end_every_sequence_alike(model):
    loaded, tokenizer, world, eos_at = model
    engine = Engine(loaded, tokenizer)
    settings = cases(tokenizer, world, eos_at, engine)
    expected = {}
    for name, (prompt, params) in settings.items():
        generation = engine.generate(prompt, params)
        expected[name] = (generation.text(), generation.stats.finish_reason, list(generation.token_ids))

    # The cases exercise what they are named for.
    assert expected["natural-eos"][1] == "stop" and len(expected["natural-eos"][2]) == eos_at + 1
    assert expected["ignore-eos"][1] == "length" and len(expected["ignore-eos"][2]) == eos_at + 10
    assert expected["ignore-eos"][0].startswith(expected["natural-eos"][0])
    assert expected["stop-spanning"][1] == "stop"
    assert expected["stop-held-at-limit"][1] == "length"
    assert expected["stop-held-at-limit"][0] == expected["greedy"][0][: len(expected["stop-held-at-limit"][0])]
    assert len(expected["max-new-tokens-1"][2]) == 1 and expected["max-new-tokens-1"][1] == "length"
    assert len(expected["context-nearly-full"][2]) == 4 and expected["context-nearly-full"][1] == "length"

    runner = BatchRunner(loaded, tokenizer, contexts=len(settings), parallel=len(settings), slots=len(settings))
    jobs = {name: Job(prompt, params, deadline=None, loop=ImmediateLoop())
            for name, (prompt, params) in settings.items()}
    sequences = {name: runner.admit(job) for name, job in jobs.items()}
    while runner.active:
        runner.step()
    for name, job in jobs.items():
        text, reason, ids = expected[name]
        assert drain(job) == (text, reason), name
        assert sequences[name].token_ids == ids, name
        assert job.completion_tokens == len(ids), name
    # Every slot is free again; each keeps what its sequence left, for a prompt sharing its prefix.
    assert runner.has_room and not runner.active and all(runner.cache.lengths)
