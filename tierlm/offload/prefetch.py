"""The prefetch ring: preallocated slots that reader threads fill ahead of compute.

Streamed blocks are used in a fixed cyclic order (the forward pass). While block i computes,
blocks i+1 … i+depth are being read into free slots by worker threads; releasing block i frees
its slot for the next one. Each slot has its own completion (a future), so compute waits only
for the block it needs — never for a global barrier.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch

Loader = Callable[[str, torch.Tensor], None]  # fills a slot buffer with the named block's bytes


class PrefetchRing:
    """`slots` uint8 buffers of `slot_bytes` on `device`, filled by `loader` in `order`."""

    def __init__(
        self,
        order: Sequence[str],
        loader: Loader,
        *,
        slots: int,
        slot_bytes: int,
        device="cpu",
        pin: bool = False,
        on_stall: Callable[[float], None] | None = None,
    ):
        if slots < 1:
            raise ValueError("a prefetch ring needs at least one slot")
        self.order = list(order)
        self.index = {name: i for i, name in enumerate(self.order)}
        self.loader = loader
        self.buffers = [
            torch.empty(slot_bytes, dtype=torch.uint8, device=device, pin_memory=pin) for _ in range(slots)
        ]
        self.free: deque[int] = deque(range(slots))
        self.pending: dict[str, tuple[int, Future]] = {}
        self.held: set[str] = set()  # acquired and not yet released
        self.on_stall = on_stall
        # Reads release the GIL, so up to `slots - 1` of them overlap with compute.
        self.pool = ThreadPoolExecutor(max_workers=max(slots - 1, 1), thread_name_prefix="tierlm-prefetch")

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def acquire(self, name: str) -> torch.Tensor:
        """The slot buffer holding block `name`, once its read has completed."""
        self._fill_from(self.index[name])
        if name not in self.pending:
            # The access order jumped (e.g. a forward pass was abandoned midway): drop reads
            # made for the old position and start over from this block.
            self._drain()
            self._fill_from(self.index[name])
        slot, future = self.pending[name]
        self.held.add(name)
        if not future.done():
            started = time.perf_counter()
            future.result()
            if self.on_stall:
                self.on_stall(time.perf_counter() - started)
        future.result()  # re-raises a read error in the compute thread
        return self.buffers[slot]

    def release(self, name: str) -> None:
        slot, _ = self.pending.pop(name)
        self.held.discard(name)
        self.free.append(slot)
        self._fill_from((self.index[name] + 1) % len(self.order))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _drain(self) -> None:
        for name in [n for n in self.pending if n not in self.held]:
            slot, future = self.pending.pop(name)
            future.cancel() or future.exception()  # wait for a running read; ignore its outcome
            self.free.append(slot)

    def _fill_from(self, start: int) -> None:
        """Start reads for the blocks from `start` onward (cyclically) while slots are free."""
        for step in range(len(self.order)):
            name = self.order[(start + step) % len(self.order)]
            if name in self.pending:
                continue
            if not self.free:
                return
            slot = self.free.popleft()
            self.pending[name] = (slot, self.pool.submit(self.loader, name, self.buffers[slot]))
