"""The paged KV cache (kv/paged.py) against contiguous caches: prompts prefilled into scattered
slots and decoded together give the logits each gets alone in a contiguous KVCache, on every
family (fused native step and eager torch path), with pages of 4 positions taken from a
shuffled pool so that no sequence's pages are adjacent; and store the same bytes as pages as
long as the context (one page per sequence: the old slot layout). Then the page tables' own
rules: shared pages are never written (copy on write), the pool gives every page back, and a
full pool fails before anything is written.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiers import quick
from tests.tiny import DECODE_CASES, MOE_CASES, checkpoint_maker, decode_slots, scatter_pages, scattered_slot_prompts
from tierlm.kv.cache import KVCache
from tierlm.kv.paged import PagedKVCache, PoolFull
from tierlm.models import fused_decode
from tierlm.runtime.loader import load_model

ATOL = 1e-4  # batched and alone: the same math, summed in other orders (observed ~1e-6)
STEPS = 6
PAGE = 4

CASES = {**DECODE_CASES, **MOE_CASES}
FAST = ["llama-mqa-bias-head-dim-32", "mistral-window-3", "mixtral"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_maker(tmp_path_factory, CASES)


def _loaded(checkpoint, case: str, **options):
    return load_model(checkpoint(case), device="cpu", dtype=torch.float32, context_length=64, quant="int8", **options)


def _paged(loaded, pages: int = 48, page_tokens: int = PAGE, **options) -> PagedKVCache:
    cache = PagedKVCache.for_model(loaded.config, loaded.max_len, 4, pages, page_tokens=page_tokens, **options)
    scatter_pages(cache)  # no sequence's pages adjacent or in order
    return cache


def _decode(loaded, cache, prompts, slots) -> torch.Tensor:
    return decode_slots(loaded, cache, prompts, slots, STEPS)


def _alone(loaded, prompts, tokens: torch.Tensor, **options) -> torch.Tensor:
    """Logits [steps + 1, rows, V] of each prompt alone in a contiguous KVCache, fed `tokens`
    [steps, rows] (the batched run's choices)."""
    out = []
    for row, prompt in enumerate(prompts):
        cache = KVCache.for_model(loaded.config, loaded.max_len, **options)
        logits = [loaded.model.forward(torch.tensor([prompt]), cache)[0, -1]]
        for step in range(tokens.shape[0]):
            logits.append(loaded.model.forward(torch.tensor([[int(tokens[step, row])]]), cache)[0, -1])
        out.append(torch.stack(logits))
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused", "eager"])
@pytest.mark.parametrize("case", quick(CASES, fast=FAST))
def test_paged_equals_contiguous_on_every_family(checkpoint, case, fused, monkeypatch):
    monkeypatch.setenv("TIERLM_FUSED", fused)
    if fused == "1" and fused_decode.native_library() is None:
        pytest.skip("no native library here (no C++ compiler)")
    loaded = _loaded(checkpoint, case)
    prompts, slots = scattered_slot_prompts(loaded.config.vocab_size)
    paged = _paged(loaded)
    actual = _decode(loaded, paged, prompts, slots)
    expected = _alone(loaded, prompts, actual.argmax(-1)[:-1])
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
    lengths = [len(p) + STEPS for p in prompts]
    assert [paged.lengths[s] for s in slots] == lengths
    assert paged.pool.used == sum(-(-n // PAGE) for n in lengths)  # pages taken as the sequences grew


@pytest.mark.parametrize("kv_format", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused", "eager"])
def test_paged_equals_contiguous_in_every_kv_format(checkpoint, kv_format, fused, monkeypatch):
    monkeypatch.setenv("TIERLM_FUSED", fused)
    loaded = _loaded(checkpoint, "llama-mqa-bias-head-dim-32")
    prompts, slots = scattered_slot_prompts(loaded.config.vocab_size)
    paged = _paged(loaded, kv_format=kv_format)
    actual = _decode(loaded, paged, prompts, slots)
    expected = _alone(loaded, prompts, actual.argmax(-1)[:-1], kv_format=kv_format)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
    whole = _paged(loaded, pages=4, page_tokens=64, kv_format=kv_format)  # one page per sequence
    _decode(loaded, whole, prompts, slots)
    for slot in slots:  # the same bytes were stored, code for code and scale for scale
        n = paged.lengths[slot]
        for held, reference in zip(paged.rows_of(slot, n), whole.rows_of(slot, n), strict=True):
            assert torch.equal(held, reference)


def test_shared_pages_are_never_written_by_sequences_diverging_after_them(checkpoint):
    """Slot 1 takes slot 0's first 10 positions (two full pages shared, the third copied), then
    both decode on with different tokens: slot 0's rows stay bit-identical, and each slot's
    logits equal a sequence computed alone in a contiguous cache."""
    loaded = _loaded(checkpoint, "llama-gqa")
    vocab = loaded.config.vocab_size
    gen = torch.Generator().manual_seed(7)
    prefix, tail_a, tail_b = (torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (10, 5, 3))
    cache = _paged(loaded)
    loaded.model.forward(torch.tensor([prefix + tail_a]), cache.slot(0))
    before = cache.rows_of(0, 15)
    cache.share_rows(0, 1, 10)
    assert cache.tables[1][:2] == cache.tables[0][:2] and cache.tables[1][2] != cache.tables[0][2]
    assert [cache.pool.holders[p] for p in cache.tables[0]] == [2, 2, 1, 1]
    logits_b = loaded.model.forward(torch.tensor([tail_b]), cache.slot(1))[0, -1]
    steps = [[int(logits_b.argmax())]]
    for token in range(4):  # slot 0 continues its own text, slot 1 the other
        steps.append(loaded.model.forward_batch(torch.tensor([[token], [steps[-1][0]]]), cache.batch([0, 1])))
        steps[-1] = [int(steps[-1][1].argmax())]
    for held, kept in zip(cache.rows_of(0, 15), before, strict=True):
        assert torch.equal(held, kept)  # the shared pages and slot 0's own were never touched by slot 1

    texts = [prefix + tail_a + [0, 1, 2, 3], prefix + tail_b + [s[0] for s in steps[:-1]]]
    for slot, ids in enumerate(texts):
        alone = KVCache.for_model(loaded.config, loaded.max_len)
        loaded.model.forward(torch.tensor([ids]), alone)
        assert cache.lengths[slot] == alone.offset == len(ids)
        for held, reference in zip(cache.rows_of(slot, len(ids)), alone.rows_of(0, len(ids)), strict=True):
            torch.testing.assert_close(held, reference, atol=ATOL, rtol=0)


def test_pages_go_back_to_the_pool_and_a_full_pool_fails_before_writing(checkpoint):
    loaded = _loaded(checkpoint, "llama-gqa")
    cache = _paged(loaded, pages=5)
    loaded.model.forward(torch.tensor([list(range(12))]), cache.slot(0))  # 3 pages
    cache.share_rows(0, 1, 8)  # 2 shared: no page taken
    assert cache.pool.used == 3
    loaded.model.forward(torch.tensor([list(range(8))]), cache.slot(2))  # 2 more: the pool is full
    assert cache.pool.free == 0
    before = [cache.rows_of(s, cache.lengths[s]) for s in (0, 1, 2)]
    with pytest.raises(PoolFull):
        cache.batch([0, 2])  # both need a fifth and sixth page
    assert cache.lengths == (12, 8, 8, 0)
    for slot, kept in zip((0, 1, 2), before):
        assert all(torch.equal(a, b) for a, b in zip(cache.rows_of(slot, cache.lengths[slot]), kept))
    cache.free(2)
    assert cache.pool.used == 3
    cache.set_length(0, 5)  # slot 0 keeps 2 pages: its third goes back; the shared two stay held by slot 1
    assert cache.pool.used == 2 and [cache.pool.holders[p] for p in cache.tables[0]] == [2, 2]
    cache.free(0)
    cache.free(1)
    assert cache.pool.used == 0 and cache.pool.free == 5


def test_rows_written_back_equal_the_rows_taken_out(checkpoint):
    """A spilled conversation's rows (`rows_of`) written into another slot (`write_rows`) read
    back the same, and decoding on from them equals decoding on from the original."""
    loaded = _loaded(checkpoint, "qwen3-qk-norm")
    cache = _paged(loaded, kv_format="q8_0")
    ids = list(range(3, 16))
    loaded.model.forward(torch.tensor([ids]), cache.slot(0))
    rows = cache.rows_of(0, 13)
    cache.write_rows(3, rows, 13)
    assert all(torch.equal(a, b) for a, b in zip(cache.rows_of(3, 13), rows))
    out = loaded.model.forward_batch(torch.tensor([[5], [5]]), cache.batch([0, 3]))
    torch.testing.assert_close(out[0], out[1], atol=0, rtol=0)


def test_the_pool_keeps_each_sequences_pages_in_runs():
    """A sequence's next page is the one after its last; a new sequence starts in the middle of
    the longest free run (the whole pool's start for the first), so sequences growing side by
    side each keep consecutive pages."""
    from tierlm.kv.paged import PagePool

    pool = PagePool(64)
    first = [pool.take()]
    second = [pool.take()]
    for _ in range(10):  # the two grow in turns
        first.append(pool.take(first[-1]))
        second.append(pool.take(second[-1]))
    assert first == list(range(0, 11)) and second == list(range(32, 43))
    third = pool.take()
    assert third == 11 + (32 - 11) // 2  # the middle of 11..31, the longest run left
    for page in first:
        pool.drop(page)
    assert pool.take() == 0 and pool.used == 11 + 1 + 1
