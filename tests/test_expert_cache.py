"""The expert cache on its own: every lookup hands back the bytes of the expert asked for, whatever
the policy, the hints (right, wrong, stale), the order of asking or the number of misses; LFU keeps
the frequently picked experts, LRU the recent ones; counts and the ledger move as they should.

Experts here are byte patterns: the reader fills a slot with the expert's own code, and the
decoder reads it back, so a slot reused too early or filled with the wrong expert shows up as a
wrong code. The recording backend from test_copy_stream defers copies until an event forces
them, so a missing wait on a slot's `ready` event shows up the same way.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.test_copy_stream import FakeBackend
from tests.tiers import quick
from tierlm.blocks import expert_block, expert_of
from tierlm.device.backend import DeviceBackend
from tierlm.store.expert_cache import ExpertCache
from tierlm.offload.routing_counts import RoutingCounts

LAYERS, EXPERTS, SLOT = (0, 1, 2), 8, 64


def code(block: str) -> int:
    layer, expert = expert_of(block)
    return 1 + layer * EXPERTS + expert


class FakeLedger:
    def __init__(self):
        self.lock = threading.Lock()
        self.read: dict[str, int] = {}
        self.stall_s = 0.0
        self.experts: dict[int, list[int]] = {}
        self.guessed = self.right = 0

    def record_read(self, tier, nbytes, seconds):
        with self.lock:
            self.read[tier] = self.read.get(tier, 0) + nbytes

    def record_stall(self, seconds):
        self.stall_s += seconds

    def record_experts(self, layer, hits, misses):
        counts = self.experts.setdefault(layer, [0, 0])
        counts[0] += hits
        counts[1] += misses

    def record_speculation(self, guessed, right):
        self.guessed += guessed
        self.right += right


class Disk:
    """The store's reader: writes the expert's code into the staging slice (a disk read)."""

    def __init__(self, ledger, delay_s: float = 0.0, host=None):
        self.ledger, self.delay_s, self.host = ledger, delay_s, host or {}
        self.reads: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, block: str, staging: torch.Tensor) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        if block in self.host:  # host-tier bytes are copied from where they lie
            self.ledger.record_read("host", SLOT, 0.0)
            return self.host[block][1]
        with self.lock:
            self.reads.append(block)
        staging[:SLOT].fill_(code(block))
        self.ledger.record_read("disk", SLOT, 0.0)
        return staging[:SLOT]


def decode(block: str, buffer: torch.Tensor) -> dict:
    return {"w": buffer[:SLOT]}


def make_cache(*, policy="lfu", cache_slots=6, stream_slots=3, backend=None, delay_s=0.0, counts=None,
               start=(), host_computed=None):  # fmt: skip
    ledger = FakeLedger()
    disk = Disk(ledger, delay_s, host_computed)
    cache = ExpertCache(
        counts=counts or RoutingCounts(LAYERS, EXPERTS),
        reader=disk,
        decode=decode,
        slot_bytes=SLOT,
        cache_slots=cache_slots,
        stream_slots=stream_slots,
        backend=backend or DeviceBackend(torch.device("cpu")),
        ledger=ledger,
        policy=policy,
        host_computed=host_computed,
        start=start,
        staging_bytes=SLOT,
    )
    return cache, ledger, disk


def run_layer(cache: ExpertCache, layer: int, uses: dict[int, int], order=None) -> dict[int, int]:
    """Ask for every chosen expert as the model does (each once, in the batch's order), and
    return the code each one's bytes held when it was used."""
    seen = {}
    batch = cache.open(layer, uses)
    try:
        for expert in order if order is not None else batch:
            seen[expert] = int(batch[expert]["w"][0])  # "compute" with the bytes now
    finally:
        cache.close(batch)
    return seen


def expected(layer: int, uses) -> dict[int, int]:
    return {e: code(expert_block(layer, e)) for e in uses}


BACKENDS = {"cpu": lambda: DeviceBackend(torch.device("cpu")), "deferred-copies": FakeBackend}


def zipf_trace(steps: int, seed: int = 0, top_k: int = 2):
    """Per step, per layer: top_k distinct experts drawn with Zipf-like weights (expert 0 hottest)."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.tensor([1.0 / (rank + 1) ** 1.2 for rank in range(EXPERTS)])
    for _ in range(steps):
        for layer in LAYERS:
            chosen = torch.multinomial(weights, top_k, generator=generator).tolist()
            yield layer, {e: 1 for e in chosen}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("policy", quick(["lfu", "lru", "stream"], fast=["lfu"]))
def test_every_lookup_gets_its_own_expert_bytes(policy, backend):
    cache, ledger, disk = make_cache(policy=policy, backend=BACKENDS[backend](), delay_s=0.001)
    try:
        picks = 0
        for step, (layer, uses) in enumerate(zipf_trace(30)):
            assert run_layer(cache, layer, uses) == expected(layer, uses)
            picks += len(uses)
            if step % 3 == 0:  # guesses for the next layer, right or wrong, change no bytes
                cache.hint((layer + 1) % len(LAYERS), [step % EXPERTS, 0])
        hits = sum(h for h, _ in ledger.experts.values())
        assert hits + sum(m for _, m in ledger.experts.values()) == picks
        if policy == "stream":
            assert hits == 0 and not cache.cached
        else:
            assert hits > 0 and len(cache.cached) == 6
        assert len(cache.free) + len(cache.streaming) == len(cache.slots) - len(cache.cached) - len(cache.empty_cache)
    finally:
        cache.shutdown()


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_more_misses_than_stream_slots_and_out_of_order_asks(backend):
    cache, ledger, disk = make_cache(policy="stream", cache_slots=0, stream_slots=2, backend=BACKENDS[backend](), delay_s=0.002)
    try:
        uses = {e: 1 for e in range(EXPERTS)}
        assert run_layer(cache, 1, uses) == expected(1, uses)
        assert run_layer(cache, 2, uses, order=list(reversed(range(EXPERTS)))) == expected(2, uses)
        assert sorted(disk.reads[-EXPERTS:]) != [] and len(cache.free) == 2 and not cache.streaming
    finally:
        cache.shutdown()


def test_one_read_per_chosen_expert_whatever_its_rows():
    cache, ledger, disk = make_cache(policy="stream", cache_slots=0, stream_slots=4)
    try:
        run_layer(cache, 0, {3: 17, 5: 1})
        assert sorted(disk.reads) == [expert_block(0, 3), expert_block(0, 5)]
        assert cache.counts.count(0, 3) == pytest.approx(17, rel=0.01)
    finally:
        cache.shutdown()


def test_lfu_keeps_the_frequent_experts_where_lru_follows_recency():
    """A frequent pair (0, 1) every step plus a scan of one-off experts: LFU keeps the pair,
    LRU lets the scan push it out."""
    trace = []
    for step in range(24):
        trace.append({0: 1, 1: 1})
        trace.append({2 + step % 6: 1, 7: 1} if step % 2 else {2 + step % 6: 1})
    rates = {}
    for policy in ("lfu", "lru"):
        cache, ledger, _ = make_cache(policy=policy, cache_slots=2, stream_slots=2)
        try:
            for uses in trace:
                assert run_layer(cache, 0, uses) == expected(0, uses)
            hits, misses = ledger.experts[0]
            rates[policy] = hits / (hits + misses)
            if policy == "lfu":
                assert set(cache.cached) == {expert_block(0, 0), expert_block(0, 1)}
        finally:
            cache.shutdown()
    assert rates["lfu"] > rates["lru"]


def test_saved_counts_fill_the_cache_with_the_hottest(tmp_path):
    counts = RoutingCounts(LAYERS, EXPERTS)
    counts.record(2, {5: 40, 6: 30})
    counts.record(0, {1: 20})
    counts.save(tmp_path / "c.json")
    loaded = RoutingCounts.load(tmp_path / "c.json", LAYERS, EXPERTS)
    cache, ledger, disk = make_cache(cache_slots=3, counts=loaded, start=[expert_block(1, 1)])
    try:
        assert set(cache.cached) == {expert_block(2, 5), expert_block(2, 6), expert_block(0, 1)}
        assert run_layer(cache, 2, {5: 1, 6: 1}) == expected(2, {5: 1, 6: 1})
        assert ledger.experts[2] == [2, 0]
    finally:
        cache.shutdown()
    cold, _, _ = make_cache(cache_slots=2, start=[expert_block(1, 1), expert_block(1, 2)])
    try:
        assert set(cold.cached) == {expert_block(1, 1), expert_block(1, 2)}, "no counts: the placement's"
    finally:
        cold.shutdown()


def test_guesses_start_reads_and_are_scored():
    cache, ledger, disk = make_cache(policy="stream", cache_slots=0, stream_slots=4, delay_s=0.01)
    try:
        cache.hint(1, [2, 3])  # the model guesses layer 1's experts just before layer 0 runs
        batch = cache.open(0, {1: 1})
        assert list(cache.streaming) == [expert_block(0, 1), expert_block(1, 2), expert_block(1, 3)], \
            "the running layer's read first, then the guesses"
        assert int(batch[1]["w"][0]) == code(expert_block(0, 1))
        cache.close(batch)
        assert run_layer(cache, 1, {2: 1, 4: 1}) == expected(1, {2: 1, 4: 1})
        assert (ledger.guessed, ledger.right) == (2, 1)
        time.sleep(0.05)
        # The right guess was not read twice; the wrong one (3) was read, or cancelled before its read
        # began when layer 1 took the slot back (a busy machine), and either way its slot came back.
        reads = sorted(disk.reads)
        assert [r for r in reads if r != expert_block(1, 3)] == [expert_block(0, 1), expert_block(1, 2), expert_block(1, 4)]
        assert reads.count(expert_block(1, 3)) <= 1
        assert not cache.streaming and len(cache.free) == 4
    finally:
        cache.shutdown()


def test_a_guess_never_takes_a_slot_the_running_layer_needs():
    """Guesses for layer 2 fill every stream slot before layer 1 runs: layer 1 takes them back."""
    cache, ledger, disk = make_cache(cache_slots=1, stream_slots=2, delay_s=0.005, start=[expert_block(0, 0)])
    try:
        cache.hint(2, [0, 1])
        assert run_layer(cache, 0, {0: 1}) == expected(0, {0: 1})  # a hit: the guesses get both slots
        assert not cache.free and {expert_block(2, 0), expert_block(2, 1)} == set(cache.streaming)
        uses = {4: 1, 5: 1, 6: 1}
        assert run_layer(cache, 1, uses) == expected(1, uses)
        assert run_layer(cache, 2, {0: 1, 7: 1}) == expected(2, {0: 1, 7: 1})
    finally:
        cache.shutdown()


def test_hinted_cached_experts_are_not_demoted_before_their_layer_runs():
    cache, ledger, disk = make_cache(policy="lru", cache_slots=1, stream_slots=2, start=[expert_block(1, 0)])
    try:
        cache.hint(1, [0])
        run_layer(cache, 0, {3: 1})  # LRU would promote 0.3 over 1.0, but 1.0 is wanted next
        assert expert_block(1, 0) in cache.cached
        run_layer(cache, 1, {0: 1})
        assert ledger.experts[1] == [1, 0]
    finally:
        cache.shutdown()


def test_host_computed_experts_are_served_where_they_lie_and_promoted_when_hot():
    host = {expert_block(0, e): ({"w": torch.full((SLOT,), code(expert_block(0, e)), dtype=torch.uint8)},
                                 torch.full((SLOT,), code(expert_block(0, e)), dtype=torch.uint8)) for e in range(EXPERTS)}  # fmt: skip
    cache, ledger, disk = make_cache(cache_slots=1, stream_slots=2, host_computed=host, backend=FakeBackend())
    try:
        assert run_layer(cache, 0, {2: 3}) == expected(0, {2: 3})
        assert ledger.read.get("host") == 2 * SLOT and not disk.reads  # computed there, then promoted
        assert expert_block(0, 2) in cache.cached, "hot and room: copied into a device slot"
        assert run_layer(cache, 0, {2: 1}) == expected(0, {2: 1})
        assert ledger.experts[0] == [1, 1] and ledger.read["host"] == 2 * SLOT and not disk.reads
    finally:
        cache.shutdown()


def test_a_read_error_reaches_the_layer_that_needs_the_expert():
    cache, ledger, disk = make_cache(policy="stream", cache_slots=0, stream_slots=2)

    def failing(block, staging):
        raise OSError("disk gone")

    cache.reader = failing
    try:
        with pytest.raises(OSError):
            run_layer(cache, 0, {1: 1})
        cache.hint(1, [1])  # a failed guess costs nothing: its slot comes back
        cache.reader = Disk(ledger)
        assert run_layer(cache, 1, {2: 1}) == expected(1, {2: 1})
    finally:
        cache.shutdown()


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="lfu, lru, stream"):
        make_cache(policy="mru")


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_kept_experts_are_never_demoted(policy):
    """No way back within the budget (no staging planned for disk reads): they stay cached."""
    cache, ledger, disk = make_cache(policy=policy, cache_slots=2, stream_slots=2,
                                     start=[expert_block(0, 0), expert_block(0, 1)])  # fmt: skip
    cache.kept = frozenset({expert_block(0, 0)})
    try:
        for step in range(6):
            uses = {2 + step % 3: 3}
            assert run_layer(cache, 0, uses) == expected(0, uses)
        assert expert_block(0, 0) in cache.cached and expert_block(0, 1) not in cache.cached
    finally:
        cache.shutdown()


def test_lfu_never_leaves_out_a_miss_hotter_than_a_cached_expert():
    """After each layer, every streamed expert left out is no hotter than the coldest cached one
    that could have made room (all but the layer's own hits): the coldest is found exactly, across
    layers, through the per-layer memo."""
    cache, ledger, disk = make_cache(cache_slots=7, stream_slots=2)
    generator = torch.Generator().manual_seed(3)
    try:
        for step in range(60):
            layer = int(torch.randint(0, len(LAYERS), (1,), generator=generator))
            chosen = torch.randperm(EXPERTS, generator=generator)[: 1 + step % 3].tolist()
            uses = {e: int(torch.randint(1, 6, (1,), generator=generator)) for e in chosen}
            hits = {e for e in uses if expert_block(layer, e) in cache.cached}
            assert run_layer(cache, layer, uses) == expected(layer, uses)
            left_out = [e for e in uses if e not in hits and expert_block(layer, e) not in cache.cached]
            movable = [expert_of(b) for b in cache.cached if not (expert_of(b)[0] == layer and expert_of(b)[1] in hits)]
            coldest = min(cache.counts.count(*where) for where in movable)
            for e in left_out:
                assert cache.counts.count(layer, e) <= coldest + 1e-9, (step, layer, e)
    finally:
        cache.shutdown()


def test_lru_starts_with_the_hottest_as_the_most_recent(tmp_path):
    counts = RoutingCounts(LAYERS, EXPERTS)
    counts.record(0, {1: 9, 2: 5, 3: 1})
    cache, ledger, disk = make_cache(policy="lru", cache_slots=3, stream_slots=1, counts=counts)
    try:
        run_layer(cache, 1, {0: 1})  # one miss: the least recent, the coldest of the three, goes
        assert set(cache.cached) == {expert_block(0, 1), expert_block(0, 2), expert_block(1, 0)}
    finally:
        cache.shutdown()
