"""The accelerator copy path on a CPU machine: a recording device backend drives the real ring.

The fake's copy stream *defers* its copies until an event recorded after them is waited on or
synchronized, as a GPU would run them later. So a missing `compute_stream.wait_event` leaves a
slot with stale bytes and the tokens change; the log then checks the ordering itself.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.test_offload import LAYOUTS, greedy, placement
from tests.tiny import make_model
from tierlm.cache.artifact import Artifact
from tierlm.cache.convert import ConversionRequest, ensure_artifact
from tierlm.store.resident import load_resident_artifact
from tierlm.models import read_config
from tierlm.device.backend import DeviceBackend, DeviceMemory
from tierlm.store.tiered import TieredStore


class FakeStream:
    """Eager (compute: work runs as issued) or deferred (copy: work runs when an event forces it)."""

    def __init__(self, name: str, log: "FakeBackend", deferred: bool):
        self.name, self.log, self.deferred = name, log, deferred
        self.queue: list = []
        self.issued = self.done = 0
        self.lock = threading.RLock()

    def enqueue(self, op) -> None:
        with self.lock:
            self.issued += 1
            self.queue.append(op)
            if not self.deferred:
                self.run_until(self.issued)

    def run_until(self, mark: int) -> None:
        with self.lock:
            while self.done < mark:
                self.queue.pop(0)()
                self.done += 1

    def wait_event(self, event: "FakeEvent") -> None:
        self.log.add("wait", self.name, event.id)
        if not self.deferred:
            event.complete()  # eager work issued after this call must see the event's work done


class FakeEvent:
    def __init__(self, event_id: int, log: "FakeBackend"):
        self.id, self.log = event_id, log
        self.stream: FakeStream | None = None
        self.mark = 0

    def record(self, stream: FakeStream) -> None:
        with stream.lock:
            self.stream, self.mark = stream, stream.issued
            self.log.add("record", self.id, stream.name)

    def complete(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.mark)

    def synchronize(self) -> None:
        self.log.add("sync", self.id)
        self.complete()

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.mark


class FakeBackend:
    """DeviceBackend's interface on the CPU, with an asynchronous copy stream and a call log."""

    accelerator = streams = pinned = True

    def __init__(self):
        self.device = torch.device("cpu")
        self.entries: list[tuple] = []
        self.lock = threading.Lock()
        self.compute = FakeStream("compute", self, deferred=False)
        self.copy_streams: list[FakeStream] = []
        self.events: list[FakeEvent] = []

    def add(self, *entry) -> None:
        with self.lock:
            self.entries.append(entry)

    def new_stream(self) -> FakeStream:
        stream = FakeStream(f"copy{len(self.copy_streams)}", self, deferred=True)
        self.copy_streams.append(stream)
        return stream

    def current_stream(self) -> FakeStream:
        return self.compute

    def new_event(self) -> FakeEvent:
        self.events.append(FakeEvent(len(self.events), self))
        return self.events[-1]

    def copy(self, dst, src, stream: FakeStream) -> None:
        self.add("copy", stream.name, dst.data_ptr())
        stream.enqueue(lambda: dst.copy_(src))  # reads `src` when it runs, as a DMA engine would

    def empty_host(self, nbytes: int) -> torch.Tensor:
        self.add("pin", nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def memory(self) -> DeviceMemory:
        return DeviceMemory(0, 0, 0, 0)

    def synchronize(self) -> None:
        self.add("global-sync")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("copy-stream")
    make_model(model_dir, layers=4, with_tokenizer=False)
    return read_config(model_dir), Artifact.open(ensure_artifact(ConversionRequest(model_dir, (), "int8")))


@pytest.fixture(scope="module")
def expected(artifact):
    config, art = artifact
    return greedy(config, load_resident_artifact(art.directory), steps=8)


def check_ordering(entries: list[tuple], ring) -> dict[str, int]:
    """Replays the log: every compute wait follows the ready record of the slot's latest copy; a
    slot is copied into again only after compute's release event was recorded and waited on by
    the copy stream, and after its previous copy completed (staging reuse). Returns counts."""
    slot_of_ready = {s.ready.id: i for i, s in enumerate(ring.slots)}
    slot_of_consumed = {s.consumed.id: i for i, s in enumerate(ring.slots)}
    slot_of_buffer = {s.buffer.data_ptr(): i for i, s in enumerate(ring.slots)}
    copied, ready_recorded, synced, released, copy_waited = set(), set(), set(), set(), set()
    counts = {"copy": 0, "compute-wait": 0}
    for entry in entries:
        kind = entry[0]
        assert kind != "global-sync", "the ring must never synchronize the whole device"
        if kind == "copy":
            slot = slot_of_buffer[entry[2]]
            if slot in copied:
                assert slot in synced, f"slot {slot}: staging overwritten before its previous copy completed"
                assert slot in released and slot in copy_waited, \
                    f"slot {slot}: copied into before the copy stream waited for compute's release"
            copied.add(slot)
            for seen in (ready_recorded, synced, released, copy_waited):
                seen.discard(slot)
            counts["copy"] += 1
        elif kind == "record" and entry[1] in slot_of_ready:
            assert entry[2].startswith("copy"), "ready events belong to the copy stream"
            ready_recorded.add(slot_of_ready[entry[1]])
        elif kind == "record" and entry[1] in slot_of_consumed:
            assert entry[2] == "compute"
            released.add(slot_of_consumed[entry[1]])
        elif kind == "sync" and entry[1] in slot_of_ready:
            synced.add(slot_of_ready[entry[1]])
        elif kind == "wait" and entry[1] == "compute":
            slot = slot_of_ready[entry[2]]
            assert slot in ready_recorded or slot not in copied, f"slot {slot}: compute waited before the copy's event"
            counts["compute-wait"] += 1
        elif kind == "wait":
            slot = slot_of_consumed[entry[2]]
            if slot in released:
                copy_waited.add(slot)
    return counts


@pytest.mark.parametrize("layout", ["three-tiers", "all-disk"])
@pytest.mark.parametrize("slots", [1, 2])
def test_async_copies_are_ordered_by_events_and_tokens_match(artifact, expected, layout, slots):
    config, art = artifact
    backend = FakeBackend()
    store = TieredStore(art, placement(art, LAYOUTS[layout], slots=slots), backend=backend)
    try:
        assert greedy(config, store, steps=8) == expected
        counts = check_ordering(list(backend.entries), store.ring)
        streamed = len(store.ring.order)
        assert counts["copy"] >= 9 * streamed, "every streamed block went through the copy stream"
        assert counts["compute-wait"] >= 9 * streamed
        pins = [e[1] for e in backend.entries if e[0] == "pin"]
        # Staging for disk reads is pinned per slot; host-tier blocks are pinned where they lie.
        assert len(pins) == slots + len(store.host_bytes)
        assert all(not t.is_pinned() for t in store.host_bytes.values())  # the fake pins nothing real
    finally:
        store.close()


def test_missing_compute_wait_is_caught(artifact, expected, monkeypatch):
    """The fake has teeth: a ring that skips the compute-side wait reads stale slots."""
    config, art = artifact
    backend = FakeBackend()
    monkeypatch.setattr(FakeStream, "wait_event", lambda self, event: None)
    store = TieredStore(art, placement(art, LAYOUTS["all-disk"], slots=2), backend=backend)
    try:
        try:
            tokens = greedy(config, store, steps=8)
        except (RuntimeError, ValueError):
            return  # garbage bytes may not even decode
        assert tokens != expected
    finally:
        store.close()


class CpuStandIns(DeviceBackend):
    """The real DeviceBackend copy path (separate staging, `with stream`, non-blocking copy)
    with torch.cpu's Stream/Event, which exist for device-agnostic code and complete at once."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.accelerator = self.streams = True

    def new_stream(self):
        return torch.cpu.Stream()

    def current_stream(self):
        return torch.cpu.current_stream()

    def new_event(self):
        return torch.cpu.Event()


def test_real_backend_copy_path_with_torch_cpu_stream_and_event(artifact, expected):
    config, art = artifact
    store = TieredStore(art, placement(art, LAYOUTS["three-tiers"], slots=2), backend=CpuStandIns())
    try:
        assert store.ring.slots[0].staging is not store.ring.slots[0].buffer
        assert greedy(config, store, steps=8) == expected
    finally:
        store.close()


def test_generic_torch_stream_and_event_on_cpu(artifact, expected):
    """torch.Stream/torch.Event are what DeviceBackend uses on cuda/npu; try them on the CPU."""
    backend = DeviceBackend(torch.device("cpu"))
    backend.accelerator = backend.streams = True  # take the accelerator path: torch.Stream/torch.Event
    try:
        backend.new_event().record(backend.new_stream())
    except RuntimeError as err:
        pytest.skip(f"torch {torch.__version__} on the CPU: torch.Event cannot record ({err}); "
                    "the copy-stream path is covered by torch.cpu's stand-ins and the recording fake")  # fmt: skip
    config, art = artifact
    store = TieredStore(art, placement(art, LAYOUTS["three-tiers"], slots=2), backend=backend)
    try:
        assert greedy(config, store, steps=8) == expected
    finally:
        store.close()


def test_cpu_backend_has_no_staging_and_no_pinning():
    backend = DeviceBackend(torch.device("cpu"))
    assert not backend.accelerator and not backend.pinned and not backend.streams
    assert not backend.empty_host(16).is_pinned()
    event = backend.new_event()
    event.record(backend.new_stream())
    backend.current_stream().wait_event(event)
    event.synchronize()
    stats = backend.memory()
    assert stats.total > stats.free > 0 and stats.peak >= stats.allocated > 0
