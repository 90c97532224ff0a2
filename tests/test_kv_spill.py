"""The host-RAM store of idle conversations' rows (kv/spill.py): what it keeps, finds and drops."""

from __future__ import annotations

import weakref

import torch

from tierlm.kv.spill import SpillStore


def rows(length: int, fill: float) -> list[torch.Tensor]:
    """A slot's rows as `rows_of` gives them: [layers, kv_heads, length, width] per part."""
    return [torch.full((2, 3, length, 8), fill), torch.full((2, 3, length, 8), -fill)]


def nbytes(length: int) -> int:
    return sum(r.numel() * r.element_size() for r in rows(length, 0.0))


def test_the_longest_prefix_comes_back_whole_and_leaves_the_store():
    store = SpillStore(capacity=10 * nbytes(10))
    store.put(list(range(10)), None, None, rows(10, 1.0))
    store.put([7, 7, 7], None, None, rows(3, 2.0))
    entry, shared = store.best([0, 1, 2, 3, 9], None, None)
    assert shared == 4 and entry.ids == list(range(10))
    target = rows(4, 0.0)
    store.take(entry, target, 4)
    assert torch.equal(target[0], torch.full((2, 3, 4, 8), 1.0)) and torch.equal(target[1], torch.full((2, 3, 4, 8), -1.0))
    assert [e.ids for e in store.entries] == [[7, 7, 7]] and store.restored == 1


def test_the_least_recently_used_entries_make_room_and_an_oversized_one_is_not_kept():
    store = SpillStore(capacity=2 * nbytes(10))
    for n in range(3):
        assert store.put([n] * 10, None, None, rows(10, float(n)))
    assert [e.ids[0] for e in store.entries] == [1, 2] and store.dropped == 1
    assert store.nbytes <= store.capacity
    assert not store.put([9] * 30, None, None, rows(30, 9.0))  # larger than the whole store
    assert not SpillStore(capacity=0).put([1], None, None, rows(1, 1.0))


def test_a_continued_conversation_supersedes_its_shorter_copy_and_a_copy_of_a_copy_is_not_kept_twice():
    store = SpillStore(capacity=10 * nbytes(20))
    store.put([1, 2, 3], None, None, rows(3, 1.0))
    store.put([1, 2, 3, 4, 5], None, None, rows(5, 2.0))
    assert [e.ids for e in store.entries] == [[1, 2, 3, 4, 5]]
    store.put([1, 2], None, None, rows(2, 3.0))  # already held, as part of a longer one
    assert [e.ids for e in store.entries] == [[1, 2, 3, 4, 5]] and store.spilled == 2


def test_rows_of_another_variant_or_of_a_replaced_overlay_never_match():
    class Overlay:
        pass

    first, second = Overlay(), Overlay()
    store = SpillStore(capacity=10 * nbytes(10))
    store.put([1, 2, 3], "v", weakref.ref(first), rows(3, 1.0))
    assert store.best([1, 2, 3], None, None) == (None, 0)
    assert store.best([1, 2, 3], "v", second) == (None, 0)  # "v" was replaced by another adapter
    assert store.best([1, 2, 3], "v", first)[1] == 3
    assert store.put([1, 2, 3], None, None, rows(3, 2.0)) and len(store.entries) == 2  # the base's own copy
