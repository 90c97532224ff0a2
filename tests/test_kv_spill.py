"""The host-RAM store of idle conversations' rows (kv/spill.py): what it keeps, finds and drops."""

from __future__ import annotations

import os
import weakref

import pytest
import torch

from tierlm.kv.spill import DiskSpill, SpillStore


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
    del first  # the variant's adapter is removed: its rows are dropped at the next put
    assert store.put([4, 5, 6], None, None, rows(3, 3.0)) and [e.ids for e in store.entries] == [[1, 2, 3], [4, 5, 6]]


IDENTITY = {"weights": "test", "kv_cache": "f32"}


def test_entries_past_host_ram_go_on_to_disk_and_come_back_checked(tmp_path):
    disk = DiskSpill(tmp_path / "spill", capacity=3 * nbytes(10), identity=IDENTITY)
    store = SpillStore(capacity=nbytes(10), disk=disk)
    for n in range(3):
        assert store.put([n] * 10, None, None, rows(10, float(n + 1)))
    assert [e.ids[0] for e in store.entries] == [2] and [e.ids[0] for e in disk.entries] == [0, 1]
    files = sorted(disk.folder.iterdir())
    assert len(files) == 2 and disk.nbytes == 2 * nbytes(10)
    entry, shared = store.best([0] * 12, None, None)
    assert shared == 10 and entry in disk.entries
    target = rows(10, 0.0)
    assert store.take(entry, target, 10)
    assert torch.equal(target[0], torch.full((2, 3, 10, 8), 1.0)) and torch.equal(target[1], torch.full((2, 3, 10, 8), -1.0))
    assert len(list(disk.folder.iterdir())) == 1 and store.restored == 1  # taken back: its file is gone
    # Rows too large for host RAM are written straight to disk.
    assert store.put([5] * 20, None, None, rows(20, 5.0)) and [5] * 20 in [e.ids for e in disk.entries]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_spill_file_that_reads_back_damaged_is_not_used(tmp_path, damage):
    disk = DiskSpill(tmp_path / "spill", capacity=4 * nbytes(10), identity=IDENTITY)
    store = SpillStore(capacity=0, disk=disk)
    assert store.put([3] * 10, None, None, rows(10, 3.0))
    (entry,) = disk.entries
    data = bytearray(entry.path.read_bytes())
    if damage == "flip":
        data[-100] ^= 1
        entry.path.write_bytes(bytes(data))
    elif damage == "truncate":
        entry.path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        entry.path.unlink()
    target = rows(10, 0.0)
    assert not store.take(entry, target, 10)
    assert torch.equal(target[0], torch.zeros(2, 3, 10, 8)) and disk.entries == [] and store.restored == 0
    assert disk.rejected == 1 and not list(disk.folder.iterdir())


def test_a_folder_left_by_a_gone_process_is_removed_and_ours_is_removed_at_close(tmp_path):
    root = tmp_path / "spill"
    (root / "999999999-12345").mkdir(parents=True)  # no such process
    (root / "999999999-12345" / "a.tlmkv").write_bytes(b"half written")
    (root / "unrelated").mkdir()
    disk = DiskSpill(root, capacity=nbytes(10), identity=IDENTITY)
    assert not (root / "999999999-12345").exists() and (root / "unrelated").exists()
    SpillStore(capacity=0, disk=disk).put([1] * 10, None, None, rows(10, 1.0))
    assert disk.folder.is_dir() and disk.folder.name.startswith(f"{os.getpid()}-")
    DiskSpill(root, capacity=nbytes(10), identity=IDENTITY)  # another server starting keeps a live one's
    assert disk.folder.is_dir()
    disk.close()
    assert not disk.folder.exists()
