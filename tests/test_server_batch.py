"""Batched decode over KV slots: each sequence gets what it gets decoded alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.tiny import make_model, paged_cache
from tierlm.kv.cache import KVCache
from tierlm.runtime.engine import Engine
from tierlm.runtime.loader import load_model
from tierlm.runtime.sampling import SamplingParams
from tierlm.runtime.tokenizer import Tokenizer
from tierlm.server.batch import BatchRunner
from tierlm.server.jobs import DONE, TEXT, Job

CASES = {
    "llama-gqa": dict(family="llama", heads=4, kv_heads=2),
    "qwen2-bias-tied": dict(family="qwen2", heads=4, kv_heads=2, tied=True),
    "mistral-window": dict(family="mistral", heads=4, kv_heads=1, sliding_window=6),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def loaded(request, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp(request.param)
    make_model(model_dir, with_tokenizer=False, **CASES[request.param])
    return load_model(model_dir, device="cpu", dtype=torch.float32, context_length=64)


def alone(loaded, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits behind each, one sequence through `forward`."""
    cache = loaded.new_cache()
    logits = loaded.model.forward(torch.tensor([prompt]), cache)[0, -1]
    tokens, rows = [], []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        rows.append(logits)
        logits = loaded.model.forward(torch.tensor([[tokens[-1]]]), cache)[0, -1]
    return tokens, rows


def test_batched_decode_matches_each_sequence_alone(loaded):
    """Sequences of different lengths in scattered slots, joining at different steps."""
    vocab = loaded.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 13, 2, 9)]
    steps = 12
    expected = [alone(loaded, p, steps) for p in prompts]
    cache = paged_cache(loaded.config, loaded.max_len, 5)
    # Never-written memory may hold anything: a batched step must not let it leak in.
    cache.keys.fill_(float("nan"))
    cache.values.fill_(float("nan"))
    slots = [4, 0, 2, 1]  # scattered: exercises the gathered (non-view) read
    joins = [0, 0, 3, 5]  # the step at which each sequence is prefilled and joins
    state: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for step in range(steps + max(joins)):
        for i, join in enumerate(joins):
            if step == join:
                logits = loaded.model.forward(torch.tensor([prompts[i]]), cache.slot(slots[i]))[0, -1]
                state[i] = (logits, [])
        running = [i for i in state if len(state[i][1]) < steps]
        if not running:
            break
        ids = []
        for i in running:
            logits, tokens = state[i]
            torch.testing.assert_close(logits, expected[i][1][len(tokens)], atol=1e-4, rtol=0)
            tokens.append(int(logits.argmax()))
            ids.append([tokens[-1]])
        out = loaded.model.forward_batch(torch.tensor(ids), cache.batch([slots[i] for i in running]))
        assert out.shape == (len(running), vocab)
        for row, i in zip(out, running):
            state[i] = (row, state[i][1])
    for i, (tokens, _) in enumerate(expected):
        assert state[i][1] == tokens, f"sequence {i}"
    assert cache.lengths[3] == 0  # the unused slot was never written
    assert cache.lengths[slots[0]] == len(prompts[0]) + steps


def test_slot_views_keep_the_kvcache_interface(loaded):
    cache = paged_cache(loaded.config, 16, 2)
    view = cache.slot(1)
    assert (view.offset, view.max_len) == (0, 16)
    loaded.model.forward(torch.tensor([[1, 2, 3]]), view)
    assert view.offset == 3 and cache.lengths == (0, 3)
    view.trim(1)
    assert cache.lengths == (0, 1)
    cache.free(1)
    assert cache.lengths == (0, 0) and cache.pool.used == 0
    loaded.model.forward(torch.tensor([list(range(16))]), cache.slot(0))
    with pytest.raises(ValueError, match="full"):
        cache.batch([0])


class ImmediateLoop:
    """Stands in for the handler's event loop: events land in the job's queue at once."""

    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


def drain(job: Job) -> tuple[str, str]:
    text, reason = [], None
    while not job._queue.empty():
        event = job._queue.get_nowait()
        if event.kind == TEXT:
            text.append(event.value)
        elif event.kind == DONE:
            reason = event.value
    return "".join(text), reason


def reference(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
    """What the single-sequence engine produces. At EOS the engine drops text its stream decoder
    still holds (an incomplete character); the server flushes it, as a full decode shows it."""
    generation = engine.generate(prompt, params)
    text = generation.text()
    ids = generation.token_ids
    if ids[-1] in engine.tokenizer.eos_token_ids:
        text = engine.tokenizer.decode(ids[:-1], skip_special_tokens=True)
    return ids, text, generation.stats.finish_reason


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("runner-model")
    make_model(model_dir)
    loaded = load_model(model_dir, device="cpu", dtype=torch.float32, context_length=128)
    return loaded, Tokenizer.from_dir(model_dir)


def _four_jobs(tokenizer):
    texts = ["the quick brown fox", "hello world, how are you?", "lazy dog", "jumps over the"]
    settings = [
        SamplingParams(temperature=0, max_new_tokens=20),
        SamplingParams(temperature=1.3, top_p=0.9, seed=7, max_new_tokens=25),
        SamplingParams(temperature=0.8, top_k=40, seed=1, max_new_tokens=12, stop=("ump",)),
        SamplingParams(temperature=0, repetition_penalty=1.3, max_new_tokens=30),
    ]
    return [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts], settings


def _run_all(runner, jobs) -> tuple[dict, list[int]]:
    """Admit `jobs` as room allows and step until all end: (each job's sequence, batch sizes)."""
    waiting, sequences, batches = list(jobs), {}, []
    while waiting or runner.active:
        while waiting and runner.has_room:
            job = waiting.pop(0)
            sequences[job] = runner.admit(job)
        batches.append(runner.step().batch)
    return sequences, batches


def test_runner_gives_each_job_what_the_engine_gives_it_alone(chat_model):
    loaded, tokenizer = chat_model
    engine = Engine(loaded, tokenizer)
    prompts, settings = _four_jobs(tokenizer)
    expected = [reference(engine, p, s) for p, s in zip(prompts, settings)]
    # Room for three whole contexts and three sequences at once: the 4th waits, nothing is preempted.
    runner = BatchRunner(loaded, tokenizer, contexts=3, parallel=3, slots=3)
    jobs = [Job(p, s, deadline=None, loop=ImmediateLoop()) for p, s in zip(prompts, settings)]
    sequences, batches = _run_all(runner, jobs)
    assert max(batches) == 3
    for job, (ids, text, reason) in zip(jobs, expected):
        assert sequences[job].token_ids == ids
        assert drain(job) == (text, reason)
        assert job.completion_tokens == len(ids)
    assert (runner.counts.preempted, runner.counts.reclaimed) == (0, 0)
    # Each slot keeps what its last sequence left (for a later prompt sharing its prefix).
    assert not runner.active and all(runner.cache.lengths) and runner.has_room


@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused", "eager"])
def test_sequences_preempted_for_pages_answer_as_computed_alone(chat_model, fused, monkeypatch):
    """A pool of one context (8 pages of 16) for four sequences of 40-70 positions, three at
    once: pages run out mid-decode, idle slots give theirs back and the youngest sequences are
    preempted and computed again, and every reply still equals the engine's alone. Eager, a
    step's rows are split so that rows x span stays within the pool's 128 positions."""
    monkeypatch.setenv("TIERLM_FUSED", fused)
    loaded, tokenizer = chat_model
    engine = Engine(loaded, tokenizer)
    prompts, settings = _four_jobs(tokenizer)
    expected = [reference(engine, p, s) for p, s in zip(prompts, settings)]
    runner = BatchRunner(loaded, tokenizer, contexts=1, parallel=3)
    assert runner.cache.pool.size == 8
    spans = []
    decode = runner._decode

    def recording(group):
        spans.append(len(group) * (max(runner.cache.lengths[s.slot] for s in group) + 1))
        decode(group)

    monkeypatch.setattr(runner, "_decode", recording)
    jobs = [Job(p, s, deadline=None, loop=ImmediateLoop()) for p, s in zip(prompts, settings)]
    sequences, batches = _run_all(runner, jobs)
    assert runner.counts.preempted >= 1 and max(batches) >= 2
    for job, (ids, text, reason) in zip(jobs, expected):
        assert sequences[job].token_ids == ids
        assert drain(job) == (text, reason)
    assert runner.cache.pool.used <= runner.cache.pool.size
    steps = sum(1 for n in batches if n)
    assert max(spans) <= 128 if fused == "0" else len(spans) == steps  # fused: one forward per step


def test_an_eager_step_is_split_so_rows_times_span_stays_within_the_pool(chat_model, monkeypatch):
    """Rows of 60, 20, 20 and 5 positions in a pool of 128: an eager step gathers every row over
    the longest row's span, so the 60 goes alone and the rest together (3 x 21 <= 128); the fused
    step reads pages in place and runs them all at once."""
    loaded, tokenizer = chat_model
    runner = BatchRunner(loaded, tokenizer, contexts=1, parallel=4)
    rows = [SimpleNamespace(slot=slot) for slot in range(4)]
    for row, length in zip(rows, (60, 20, 20, 5)):
        runner.cache._lengths[row.slot] = length
    monkeypatch.setenv("TIERLM_FUSED", "0")
    assert [[r.slot for r in group] for group in runner._decode_groups(rows)] == [[3, 1, 2], [0]]
    monkeypatch.setenv("TIERLM_FUSED", "1")
    assert runner._decode_groups(rows) == [rows]


def test_runner_deadline_keeps_text_so_far_and_frees_the_slot(chat_model):
    loaded, tokenizer = chat_model
    runner = BatchRunner(loaded, tokenizer, parallel=1, slots=1)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "the quick brown fox"}])
    job = Job(prompt, SamplingParams(temperature=0, max_new_tokens=50), deadline=None, loop=ImmediateLoop())
    seq = runner.admit(job)
    for _ in range(5):
        runner.step()
    runner.end(seq, "timeout")
    text, reason = drain(job)
    assert reason == "timeout" and job.completion_tokens == len(seq.token_ids) >= 4
    assert text == tokenizer.decode(seq.token_ids, skip_special_tokens=True)
    assert not runner.active and runner.has_room


def test_batched_decode_over_a_tiered_store_shares_each_streamed_block(tmp_path):
    """Blocks streamed from host RAM and disk: same tokens as resident, and one batched step
    reads each streamed block once for all its sequences."""
    from tierlm.cache.artifact import Artifact
    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.store.resident import load_resident_artifact
    from tierlm.models import read_config
    from tierlm.models.llama import LlamaModel
    from tierlm.offload.placement import DEVICE, DISK, HOST, BlockPlacement, Placement
    from tierlm.store.tiered import TieredStore

    make_model(tmp_path, layers=4, with_tokenizer=False)
    config = read_config(tmp_path)
    art = Artifact.open(ensure_artifact(ConversionRequest(tmp_path, (), "int8")))
    tiers = {"embed": HOST, "layers.0": HOST, "layers.1": DISK, "layers.3": DISK, "head": DISK}
    width = art.blocks["embed"].tensors["embed"].parts["qweight"].shape[1]
    blocks = tuple(BlockPlacement(name, tiers.get(name, DEVICE), art.blocks[name].nbytes) for name in art.blocks)
    layout = Placement(blocks, {}, {}, ring_slots=2, hot_cache_bytes=16 * width * 4)
    prompts, steps = [[5, 6, 7, 8, 100, 5], [9, 10, 11], [200, 3, 4, 5, 6, 7, 8, 9, 10]], 10

    def run(store, batched: bool) -> list[list[int]]:
        model = LlamaModel(config, store, 64, "cpu", torch.float32)
        if not batched:
            return [alone(SimpleNamespace(model=model, new_cache=lambda: KVCache.for_model(config, 64)), p, steps)[0]
                    for p in prompts]
        cache = paged_cache(config, 64, len(prompts))
        logits = [model.forward(torch.tensor([p]), cache.slot(i))[0, -1] for i, p in enumerate(prompts)]
        out: list[list[int]] = [[] for _ in prompts]
        for _ in range(steps):
            for tokens, row in zip(out, logits):
                tokens.append(int(row.argmax()))
            ids = torch.tensor([[tokens[-1]] for tokens in out])
            logits = list(model.forward_batch(ids, cache.batch(list(range(len(prompts))))))
        return out

    expected = run(load_resident_artifact(art.directory), batched=False)
    read = {}
    for batched in (False, True):
        store = TieredStore(art, layout)
        try:
            assert run(store, batched) == expected
            read[batched] = sum(store.ledger.bytes_read.values())
        finally:
            store.close()
    # Alone: 3 x (1 prefill + 10 steps) passes; batched: 3 prefills + 10 shared steps.
    assert read[True] < 0.6 * read[False]
