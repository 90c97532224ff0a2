"""The prefetch ring: preallocated slots that reader threads fill ahead of compute.

Streamed blocks are used in a fixed cyclic order (the forward pass). While block i computes,
blocks i+1 … i+depth are being brought into free slots by worker threads; releasing block i
frees its slot for the next one. Filling a slot has two steps:

1. the reader puts the block's bytes in host memory (a disk read into the slot's staging
   buffer, or a host-tier copy that is already there);
2. on an accelerator, the bytes go host -> device on a separate copy stream, and the slot's
   `ready` event is recorded after the copy.

Compute waits only for the block it needs: the worker's future (the bytes are in host memory
and the copy is enqueued), then `compute_stream.wait_event(slot.ready)`, which orders the
device work without blocking the host. Reuse is ordered by events too: a copy into a slot
waits for its `consumed` event (recorded on the compute stream at release), and the staging
buffer is overwritten only after the slot's previous copy has completed. Never a global
synchronize. On the CPU the device memory is the host's: the reader reads straight into the
slot and the stream/event calls complete immediately.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

# Puts the named block's bytes in host memory: reads into `staging` and returns that slice, or
# returns a host tensor that already holds them.
BlockReader = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Slot:
    """One ring buffer, its host staging buffer (the buffer itself on the CPU) and its events."""

    buffer: torch.Tensor  # where compute reads the block: device memory on accelerators
    staging: torch.Tensor  # where disk reads land before the copy; `buffer` when they are one memory
    ready: object  # event: recorded on the copy stream once the block is in `buffer`
    consumed: object  # event: recorded on the compute stream when compute released the slot


class PrefetchRing:
    """`slots` uint8 buffers of `slot_bytes` on `backend.device`, filled by `reader` in `order`.

    `backend` is a tierlm.device.backend.DeviceBackend (or an object with the same methods, as the
    tests inject). `staging_bytes`: the largest block the reader reads into a staging buffer;
    0 when every streamed block already lies in host memory, so no staging is allocated.
    """

    def __init__(
        self,
        order: Sequence[str],
        reader: BlockReader,
        *,
        slots: int,
        slot_bytes: int,
        backend,
        staging_bytes: int | None = None,
        on_stall: Callable[[float], None] | None = None,
        on_upload: Callable[[str, int, float], None] | None = None,
    ):
        if slots < 1:
            raise ValueError("a prefetch ring needs at least one slot")
        self.order = list(order)
        self.index = {name: i for i, name in enumerate(self.order)}
        self.reader = reader
        self.backend = backend
        staging_bytes = slot_bytes if staging_bytes is None else staging_bytes
        self.slots = []
        for _ in range(slots):
            buffer = torch.empty(slot_bytes, dtype=torch.uint8, device=backend.device)
            if backend.accelerator:
                staging = backend.empty_host(staging_bytes)
            else:
                staging = buffer
            self.slots.append(Slot(buffer, staging, backend.new_event(), backend.new_event()))
        self.copy_stream = backend.new_stream()
        self.free: deque[int] = deque(range(slots))
        self.pending: dict[str, tuple[int, Future]] = {}
        self.held: set[str] = set()  # acquired and not yet released
        self.on_stall = on_stall
        self.on_upload = on_upload
        # Reads release the GIL, so up to `slots - 1` of them overlap with compute.
        self.pool = ThreadPoolExecutor(max_workers=max(slots - 1, 1), thread_name_prefix="tierlm-prefetch")

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [slot.buffer for slot in self.slots]

    @property
    def nbytes(self) -> int:
        """Ring memory: device slots plus host staging where it is separate."""
        return sum(s.buffer.nbytes + (s.staging.nbytes if s.staging is not s.buffer else 0) for s in self.slots)

    def acquire(self, name: str) -> torch.Tensor:
        """The slot buffer holding block `name`; device work queued after this call sees its bytes."""
        self._fill_from(self.index[name])
        if name not in self.pending:
            # The access order jumped (e.g. a forward pass was abandoned midway): drop reads
            # made for the old position and start over from this block.
            self._drain()
            self._fill_from(self.index[name])
        index, future = self.pending[name]
        self.held.add(name)
        if not future.done():
            started = time.perf_counter()
            future.result()
            if self.on_stall:
                self.on_stall(time.perf_counter() - started)
        future.result()  # re-raises a read error in the compute thread
        slot = self.slots[index]
        self.backend.current_stream().wait_event(slot.ready)
        return slot.buffer

    def release(self, name: str) -> None:
        index, _ = self.pending.pop(name)
        self.held.discard(name)
        # Device work reading the slot may still be queued: the next copy into it waits for this.
        self.slots[index].consumed.record(self.backend.current_stream())
        self.free.append(index)
        self._fill_from((self.index[name] + 1) % len(self.order))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for slot in self.slots:  # no copy may still write a buffer that is about to be freed
            slot.ready.synchronize()

    def _fill(self, name: str, slot: Slot) -> None:
        """Worker thread: bring block `name` into `slot` (reader, then the copy on the copy stream)."""
        if slot.staging is not slot.buffer:
            slot.ready.synchronize()  # the previous copy out of this staging buffer has finished
        host = self.reader(name, slot.staging)
        if host.data_ptr() != slot.buffer.data_ptr():
            started = time.perf_counter()
            self.copy_stream.wait_event(slot.consumed)
            self.backend.copy(slot.buffer[: host.numel()], host, self.copy_stream)
            if self.on_upload:
                self.on_upload(name, host.numel(), time.perf_counter() - started)
        slot.ready.record(self.copy_stream)

    def _drain(self) -> None:
        for name in [n for n in self.pending if n not in self.held]:
            index, future = self.pending.pop(name)
            future.cancel() or future.exception()  # wait for a running read; ignore its outcome
            self.free.append(index)

    def _fill_from(self, start: int) -> None:
        """Start reads for the blocks from `start` onward (cyclically) while slots are free."""
        for step in range(len(self.order)):
            name = self.order[(start + step) % len(self.order)]
            if name in self.pending:
                continue
            if not self.free:
                return
            index = self.free.popleft()
            self.pending[name] = (index, self.pool.submit(self._fill, name, self.slots[index]))
