"""The hot-expert cache: routed experts in fixed device slots, cold ones streamed through their own.

A mixture-of-experts layer's router picks a few experts per token, and real routing is skewed,
so the experts picked most often stay on the device while the rest are read when chosen:
- `cache_slots` device buffers hold cached experts (initially the hottest by the persisted
  routing counts, else the placement's resident ones);
- `stream_slots` device buffers receive misses, read on worker threads (one read per chosen
  expert, however many token rows chose it) and, where an accelerator exists, copied on a copy
  stream ordered by per-slot events, as in the prefetch ring;
- after use, a streamed expert is promoted when the policy says so by swapping the roles of its
  slot and the coldest cached one: no copy, the budget never moves;
- experts the placement computes on the host (accelerator with a host tier) are served from their
  host bytes on the CPU, and promoted by one copy into a free slot when they grow hot;
- speculative hints start reads for the next layer in idle stream slots only, after the running
  layer's own reads; that layer takes the slots back when it needs them, and the experts a hint
  or the running layer needs are never demoted, so a wrong guess costs bandwidth, never tokens.

Policies: "lfu" (aged routing counts, the default: expert traces reward frequency), "lru"
(every miss is promoted over the least recently used), "stream" (no cache: every chosen expert
is read each time; the comparison point). All bookkeeping runs on the compute thread; workers
only fill the buffer they were given.
"""

from __future__ import annotations

import queue
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from tierlm.blocks import expert_block, expert_of
from tierlm.offload.routing_counts import RoutingCounts

POLICIES = ("lfu", "lru", "stream")

# Puts an expert block's bytes in host memory: reads into `staging` and returns that slice, or
# returns a host tensor that already holds them (prefetch.BlockReader's contract).
Reader = Callable[[str, torch.Tensor], torch.Tensor]
# An expert block's tensors over a uint8 buffer holding its bytes, on that buffer's device.
Decoder = Callable[[str, torch.Tensor], dict]


@dataclass
class ExpertSlot:
    """One expert-sized device buffer; its role (cached or streaming) is the cache's bookkeeping."""

    buffer: torch.Tensor  # uint8 [slot_bytes] on the device
    ready: object  # event recorded on the copy stream once the expert's bytes are in `buffer`
    consumed: object  # event recorded on the compute stream after the last use of `buffer`
    block: str | None = None  # the expert it holds or is being filled with
    future: Future | None = None  # the fill in flight (None once waited for, or never filled)
    tensors: dict | None = None  # decoded views of `buffer`, made on first use after a fill
    hint_layer: int | None = None  # a speculative read for that layer, not yet claimed


@dataclass
class _Staging:
    """A host staging buffer for accelerator fills from disk, reusable once its copy completed."""

    buffer: torch.Tensor
    copied: object  # event recorded after the copy out of `buffer`


@dataclass
class ExpertBatch(Mapping):
    """One layer's chosen experts for one step: `batch[e]` is expert e's tensors.

    Iteration gives cached experts first, then host-computed ones, then streamed ones in the
    order their reads were started, so compute overlaps the reads still in flight. A streamed
    expert's slot may be reused once the next streamed expert is asked for: the model runs each
    chosen expert once, on all its rows, and keeps no tensor of the previous one.
    """

    cache: "ExpertCache"
    layer: int
    hits: dict[int, int] = field(default_factory=dict)  # expert -> cache slot
    host: list[int] = field(default_factory=list)
    misses: list[int] = field(default_factory=list)  # in start order; queued ones last
    claimed: dict[int, int] = field(default_factory=dict)  # miss -> stream slot it is read into
    handed: list[int] = field(default_factory=list)  # misses given to the model, slots not yet retired
    done: set[int] = field(default_factory=set)  # misses whose slots were retired

    def __getitem__(self, expert: int) -> dict:
        return self.cache.tensors_for(self, expert)

    def __iter__(self):
        return iter([*self.hits, *self.host, *self.misses])

    def __len__(self) -> int:
        return len(self.hits) + len(self.host) + len(self.misses)


class ExpertCache:
    """Routed experts of every sparse layer in `cache_slots` + `stream_slots` device buffers.

    Slot roles: cached (`cached`: block -> slot; `empty_cache`: cache slots holding nothing) or
    streaming (`streaming`: block -> slot being filled or holding a miss or a guess; `free`: idle).
    Promotion swaps one slot of each role, so both counts stay as planned.
    """

    def __init__(
        self,
        *,
        counts: RoutingCounts,
        reader: Reader,
        decode: Decoder,
        slot_bytes: int,
        cache_slots: int,
        stream_slots: int,
        backend,
        ledger,
        policy: str = "lfu",
        host_computed: Mapping[str, tuple[dict, torch.Tensor]] | None = None,
        start: Sequence[str] = (),
        staging_bytes: int = 0,
        opening_reader: Reader | None = None,
        kept: Iterable[str] = (),
    ):
        """`host_computed`: {expert block: (tensors on the CPU, its host bytes)} for experts the
        placement computes where they lie. `start`: experts to hold at open, hottest first (used
        while the counts hold no data). `staging_bytes`: the largest expert an accelerator reads
        from disk through host staging (0: none, or no accelerator). `opening_reader`: `reader` for
        the warm-up at open, whose reads are no token's traffic (default: `reader`). `kept`: experts
        never demoted once cached, having no way back within the budget (an accelerator whose plan
        reads no expert from disk has no staging for one)."""
        if policy not in POLICIES:
            raise ValueError(f"expert cache policy {policy!r}: expected one of {', '.join(POLICIES)}")
        self.counts = counts
        self.reader, self.decode = reader, decode
        self.backend, self.ledger = backend, ledger
        self.policy = policy
        self.host_computed = dict(host_computed or {})
        if policy == "stream":
            # No cache: its slots stream too, so the comparison runs within the same budget.
            stream_slots, cache_slots = stream_slots + cache_slots, 0
        self.slots = [self._new_slot(slot_bytes) for _ in range(cache_slots + stream_slots)]
        self.cached: dict[str, int] = {}
        self.by_layer: dict[int, set[int]] = {}  # layer -> its cached experts
        self.empty_cache = list(range(cache_slots))
        self.streaming: dict[str, int] = {}
        self.free = list(range(cache_slots, cache_slots + stream_slots))
        self.recency: OrderedDict[str, None] = OrderedDict()  # lru: least recent first
        self.hints: dict[int, set[int]] = {}  # layer -> guessed experts, until that layer runs
        self.guesses: list[str] = []  # guessed experts whose reads wait for the running layer's
        self.pinned: set[str] = set()  # cached experts the running or a hinted layer needs
        self.kept = frozenset(kept)
        self._coldest: dict[int, int | None] = {}  # lfu: layer -> its coldest cached expert (memo)
        total = len(counts.layers) * counts.experts
        self.streams = total > cache_slots + len(self.host_computed)  # can a chosen expert miss?
        if self.streams and stream_slots < 1:
            raise ValueError("experts that are not cached need at least one stream slot")
        self.copy_stream = backend.new_stream()
        self.staging: queue.SimpleQueue[_Staging] = queue.SimpleQueue()
        self.staging_bytes = staging_bytes if backend.accelerator else 0
        for _ in range(stream_slots if self.staging_bytes else 0):
            self.staging.put(_Staging(backend.empty_host(self.staging_bytes), backend.new_event()))
        self.staging_count = stream_slots if self.staging_bytes else 0
        # Reads release the GIL; a few in flight keep a disk queue busy without starving compute.
        self.pool = ThreadPoolExecutor(max_workers=max(1, min(stream_slots, 4)), thread_name_prefix="tierlm-experts")
        self._warm(start, opening_reader or reader)

    # -- what the store exposes ----------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Device slots plus host staging."""
        return sum(s.buffer.nbytes for s in self.slots) + self.staging_count * self.staging_bytes

    def open(self, layer: int, uses: Mapping[int, int]) -> ExpertBatch:
        """Layer `layer` chose expert e for `uses[e]` token rows: count, classify, start reads."""
        uses = {int(e): int(rows) for e, rows in uses.items()}
        self.counts.record(layer, uses)
        self._coldest.pop(layer, None)
        guessed = self.hints.pop(layer, None)
        if guessed is not None:
            self.ledger.record_speculation(len(guessed), len(guessed & uses.keys()))
        self.pinned = {b for b in self.pinned if expert_of(b)[0] != layer}
        batch = ExpertBatch(self, layer)
        queued = []
        for expert in sorted(uses):  # reads start in the order the model asks (ascending experts)
            block = expert_block(layer, expert)
            if block in self.cached:
                batch.hits[expert] = self.cached[block]
                self.pinned.add(block)
                if self.policy == "lru":
                    self.recency.move_to_end(block)
            elif block in self.host_computed:
                batch.host.append(expert)
            elif block in self.streaming:  # a guess that was right: its read is under way
                batch.claimed[expert] = self.streaming[block]
                self.slots[batch.claimed[expert]].hint_layer = None
            else:
                queued.append(expert)
        self.ledger.record_experts(layer, len(batch.hits), len(uses) - len(batch.hits))
        for index in [i for i in self.streaming.values() if self.slots[i].hint_layer == layer]:
            self._free_stream(index)  # wrong guesses for this layer: only their bytes were lost
        batch.misses = [*batch.claimed, *queued]
        for expert in queued:
            if not self._start_miss(batch, expert, steal=True):
                break
        self._start_guesses()
        return batch

    def tensors_for(self, batch: ExpertBatch, expert: int) -> dict:
        """Expert `expert`'s tensors for `batch`, waiting for its read if it is in flight."""
        if expert in batch.hits:
            slot = self.slots[batch.hits[expert]]
            self._wait(slot)
            return slot.tensors
        block = expert_block(batch.layer, expert)
        if expert in batch.host:
            tensors, host = self.host_computed[block]
            self.ledger.record_read("host", host.nbytes, 0.0)
            return tensors
        # The model runs each expert once: the streamed ones it ran before give their slots back.
        for done in [e for e in batch.handed if e != expert]:
            self._retire(batch, done)
        if expert not in batch.claimed and not self._start_miss(batch, expert, steal=True):
            self._requeue_one(batch, keep=expert)  # asked out of order with every slot taken
            self._start_miss(batch, expert, steal=True)
        for waiting in batch.misses:  # keep reads going in the slots given back
            if waiting not in batch.claimed and waiting not in batch.done and not self._start_miss(batch, waiting, steal=True):
                break
        slot = self.slots[batch.claimed[expert]]
        self._wait(slot)
        if expert not in batch.handed:
            batch.handed.append(expert)
        return slot.tensors

    def close(self, batch: ExpertBatch) -> None:
        """The layer's experts have run: promote or free the streamed ones, mark slots consumed."""
        stream = self.backend.current_stream()
        for index in batch.hits.values():
            self.slots[index].consumed.record(stream)
        for expert in [e for e in batch.claimed if e not in batch.handed]:
            self._free_stream(batch.claimed.pop(expert))  # never asked for (the layer failed)
        for expert in list(batch.handed):
            self._retire(batch, expert)
        for expert in batch.host:
            self._promote_host(batch.layer, expert)
        self.pinned -= {expert_block(batch.layer, e) for e in batch.hits}
        self._start_guesses()  # in the slots this layer gave back; what still waits would be late
        self.guesses.clear()

    def hint(self, layer: int, experts: Iterable[int]) -> None:
        """Guesses for `layer`: their reads start in idle stream slots, never taking a busy one,
        and only after the reads of the layer about to run (the model guesses just before it)."""
        guesses = {int(e) for e in experts}
        self.hints.setdefault(layer, set()).update(guesses)
        for expert in sorted(guesses):
            block = expert_block(layer, expert)
            if block in self.cached:
                self.pinned.add(block)  # the guessed layer will want it: not demoted meanwhile
            elif block not in self.host_computed and block not in self.streaming:
                self.guesses.append(block)

    def _start_guesses(self) -> None:
        """Read the waiting guesses into idle stream slots (reads are served first come, first served)."""
        while self.guesses and self.free:
            block = self.guesses.pop(0)
            layer = expert_of(block)[0]
            if block in self.cached or block in self.streaming or block in self.host_computed or layer not in self.hints:
                continue  # cached or read meanwhile, or its layer already ran
            index = self.free.pop()
            self._fill_async(block, index)
            self.streaming[block] = index
            self.slots[index].hint_layer = layer

    def peek(self, block: str) -> dict | None:
        """A cached expert's tensors if its bytes are in place now, else None."""
        index = self.cached.get(block)
        if index is None or (self.slots[index].future is not None and not self.slots[index].future.done()):
            return None
        self._wait(self.slots[index])
        return self.slots[index].tensors

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for slot in self.slots:  # no copy may still write a buffer that is about to be freed
            slot.ready.synchronize()

    # -- slots -----------------------------------------------------------------------------------

    def _new_slot(self, nbytes: int) -> ExpertSlot:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.backend.device)
        return ExpertSlot(buffer, self.backend.new_event(), self.backend.new_event())

    def _warm(self, start: Sequence[str], reader: Reader) -> None:
        """Fill the cache slots: kept experts (they have nowhere else to come from), then the
        hottest by the saved counts, else `start`."""
        layers, experts = self.counts.layers, range(self.counts.experts)
        counted = {(layer, e): self.counts.count(layer, e) for layer in layers for e in experts}
        if any(counted.values()):
            ranked = [expert_block(layer, e) for (layer, e), _ in sorted(counted.items(), key=lambda kv: -kv[1])]
        else:
            ranked = list(start)
        ranked = [*(b for b in start if b in self.kept), *(b for b in ranked if b not in self.kept)]
        chosen = ranked[: len(self.empty_cache)]
        for block in chosen:
            index = self.empty_cache.pop()
            self._fill_async(block, index, reader)
            self._cache_put(block, index)
        for block in reversed(chosen):  # lru: the hottest count as the most recent
            self.recency.move_to_end(block)
        for index in self.cached.values():  # loading, not a token's stall: waited for uncounted
            slot = self.slots[index]
            concurrent_wait(slot.future)
            slot.future.result()
            slot.future = None

    def _fill_async(self, block: str, index: int, reader: Reader | None = None) -> None:
        """Start filling slot `index` with `block` on a worker (after any fill still writing it)."""
        slot = self.slots[index]
        previous = slot.future
        if previous is not None:
            previous.cancel()
        slot.block, slot.tensors, slot.hint_layer = block, None, None
        slot.future = self.pool.submit(self._fill, block, slot, previous, reader or self.reader)

    def _fill(self, block: str, slot: ExpertSlot, previous: Future | None, reader: Reader) -> None:
        """Worker: the expert's bytes into `slot.buffer` (reader, then the copy on the copy stream)."""
        if previous is not None and not previous.cancelled():
            try:
                previous.result()  # a fill still writing this buffer finishes first
            except BaseException:  # noqa: BLE001 - its outcome no longer matters
                pass
        staging = self.staging.get() if self.staging_count else None
        try:
            if staging is not None:
                staging.copied.synchronize()  # the last copy out of this staging buffer is done
            host = reader(block, staging.buffer if staging is not None else slot.buffer)
            if host.data_ptr() != slot.buffer.data_ptr():
                started = time.perf_counter()
                self.copy_stream.wait_event(slot.consumed)
                self.backend.copy(slot.buffer[: host.numel()], host, self.copy_stream)
                from_disk = staging is not None and host.data_ptr() == staging.buffer.data_ptr()
                # Copy time (issue time where the copy is asynchronous); its bytes counted by the reader.
                self.ledger.record_read("disk" if from_disk else "host", 0, time.perf_counter() - started)
                if staging is not None:
                    staging.copied.record(self.copy_stream)
            slot.ready.record(self.copy_stream)
        finally:
            if staging is not None:
                self.staging.put(staging)

    def _wait(self, slot: ExpertSlot) -> None:
        """Until the slot's fill is in place (stall counted); device work is ordered after it."""
        if slot.future is not None:
            if not slot.future.done():
                started = time.perf_counter()
                concurrent_wait(slot.future)
                self.ledger.record_stall(time.perf_counter() - started)
            slot.future.result()  # re-raises a read error in the compute thread
            slot.future = None
        self.backend.current_stream().wait_event(slot.ready)
        if slot.tensors is None:
            slot.tensors = self.decode(slot.block, slot.buffer)

    def _free_stream(self, index: int) -> None:
        """Slot `index` back to idle streaming (a fill still in flight finishes before the next)."""
        slot = self.slots[index]
        if slot.block is not None and self.streaming.get(slot.block) == index:
            del self.streaming[slot.block]
        slot.block, slot.tensors, slot.hint_layer = None, None, None
        if slot.future is not None and slot.future.cancel():
            slot.future = None
        self.free.append(index)

    def _start_miss(self, batch: ExpertBatch, expert: int, *, steal: bool) -> bool:
        """Start reading a queued miss; `steal`: take a slot from a guess for another layer."""
        if not self.free and steal:
            guess = next((i for i in self.streaming.values() if self.slots[i].hint_layer is not None), None)
            if guess is not None:
                self._free_stream(guess)
        if not self.free:
            return False
        index = self.free.pop()
        block = expert_block(batch.layer, expert)
        self._fill_async(block, index)
        self.streaming[block] = index
        batch.claimed[expert] = index
        return True

    def _requeue_one(self, batch: ExpertBatch, keep: int) -> None:
        """Every stream slot holds a started, unused miss of this batch: drop one, read it later."""
        victim = next(e for e in reversed(list(batch.claimed)) if e != keep and e not in batch.handed)
        self._free_stream(batch.claimed.pop(victim))

    # -- promotion and demotion ------------------------------------------------------------------

    def _retire(self, batch: ExpertBatch, expert: int) -> None:
        """A streamed expert the model has run: promoted into the cache, or its slot freed."""
        batch.handed.remove(expert)
        batch.done.add(expert)
        index = batch.claimed.pop(expert)
        self.slots[index].consumed.record(self.backend.current_stream())
        block = expert_block(batch.layer, expert)
        leaving = self._make_room(block)
        if leaving is None:
            self._free_stream(index)
            return
        del self.streaming[block]  # swap roles: the streamed slot is the cache's now
        self._cache_put(block, index)
        self.free.append(leaving)

    def _promote_host(self, layer: int, expert: int) -> None:
        """A host-computed expert grown hot: one copy into an idle slot, which becomes cached."""
        block = expert_block(layer, expert)
        if block in self.cached or not self.free:
            return
        leaving = self._make_room(block)
        if leaving is None:
            return
        index = self.free.pop()
        self._fill_async(block, index)
        self._cache_put(block, index)
        self.free.append(leaving)

    def _make_room(self, block: str) -> int | None:
        """The slot that leaves the cache role for `block` (an empty one, or the demoted expert's),
        or None when `block` stays out: the policy keeps what is cached, or there is no cache."""
        if self.policy == "stream":
            return None
        if self.empty_cache:
            return self.empty_cache.pop()
        victim = self._victim(block)
        if victim is None:
            return None
        index = self._cache_take(victim)
        self.slots[index].block, self.slots[index].tensors = None, None
        return index

    def _victim(self, block: str) -> str | None:
        """The cached expert `block` replaces: lru the least recent, lfu the coldest if colder."""
        if self.policy == "lru":
            return next((b for b in self.recency if b not in self.pinned and b not in self.kept), None)
        layer, expert = expert_of(block)
        coldest, colder = None, self.counts.count(layer, expert)
        for other in self.by_layer:
            candidate = self._coldest_of(other)
            if candidate is not None and self.counts.count(other, candidate) < colder:
                coldest, colder = expert_block(other, candidate), self.counts.count(other, candidate)
        return coldest

    def _coldest_of(self, layer: int) -> int | None:
        """Layer's least counted cached expert that no running or hinted layer needs. Memoized:
        counts change only for the experts a layer picks, and picking drops that layer's memo."""
        memo = self._coldest.get(layer)
        if memo is not None and expert_block(layer, memo) not in self.pinned and memo in self.by_layer[layer]:
            return memo
        candidates = [e for e in self.by_layer[layer]
                      if expert_block(layer, e) not in self.pinned and expert_block(layer, e) not in self.kept]  # fmt: skip
        found = min(candidates, key=lambda e: (self.counts.count(layer, e), -e), default=None)
        self._coldest[layer] = found
        return found

    def _cache_put(self, block: str, index: int) -> None:
        layer, expert = expert_of(block)
        self.cached[block] = index
        self.by_layer.setdefault(layer, set()).add(expert)
        self._coldest.pop(layer, None)  # the newcomer may be the layer's coldest
        self.recency[block] = None
        self.recency.move_to_end(block)

    def _cache_take(self, block: str) -> int:
        layer, expert = expert_of(block)
        self.by_layer[layer].discard(expert)
        if not self.by_layer[layer]:
            del self.by_layer[layer]
        self.recency.pop(block, None)
        if self._coldest.get(layer) == expert:
            del self._coldest[layer]
        return self.cached.pop(block)


def concurrent_wait(future: Future) -> None:
    """Wait for a fill without raising (its error, if any, is raised by the caller's result())."""
    wait([future])
