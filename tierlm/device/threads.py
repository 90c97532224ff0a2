"""Compute threads that fit a machine other processes share.

torch's OpenMP threads (eager ops, BLAS, the INT8 kernels' callers) meet at a barrier after every
parallel op. When one of them is descheduled because another process wants its core, every op
waits out a scheduler time slice: measured on 2 cores with one busy, 2 threads decoded at a tenth
of one thread's speed. Two remedies, both measured (see the report of issue 13):

- `bound_openmp_spinning`: libgomp's idle threads spin for up to milliseconds by default, so they
  look CPU-bound to the scheduler and lose their core to the busy process for whole slices. A
  short spin count makes them sleep soon, and a sleeper that wakes gets the core back at once.
  libgomp reads it once, when torch loads it: tierlm/__init__ calls this before torch is imported.
- `ThreadGovernor`: per step, the thread count that measures faster, the chosen one or 1 (a
  step is timed per token; the other count is probed now and then, more rarely while it loses).

The native pool (quant/csrc/pool.h) has its own per-call backoff; it follows torch's count.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, MutableMapping

# libgomp's spin count before an idle thread sleeps: its default, 300000, spins for milliseconds;
# 1000 (tens of microseconds, what libgomp itself uses when threads outnumber CPUs) measured best.
OPENMP_SPIN_COUNT = "1000"
# Steps between probes of the other thread count: the first gap, and the cap it doubles to while
# probes lose. Each probe runs PROBE_STEPS steps; the first is dropped (the team changes size).
PROBE_GAP_MIN = 16
PROBE_GAP_MAX = 1024
PROBE_STEPS = 4
SWITCH_GAIN = 0.9  # the other count must be 10% faster per token to take over
STALL = 3.0  # a step this many times its count's mean per token probes at once


def bound_openmp_spinning(environ: MutableMapping[str, str]) -> None:
    """Make OpenMP threads sleep soon when idle, unless the user set a wait policy or spin count.

    Call before torch is imported (libgomp reads its environment once, when it is loaded)."""
    if "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)


@dataclass
class _Arms:
    """One kind of step's state: the count in use, each count's mean seconds per token, and the
    probe schedule."""

    current: int
    mean: dict[int, float] = field(default_factory=dict)
    until_probe: int = PROBE_GAP_MIN
    gap: int = PROBE_GAP_MIN
    probe: list[float] = field(default_factory=list)  # seconds per token of the running probe


class ThreadGovernor:
    """torch's intra-op thread count per step: `threads` (the chosen count) or 1, whichever
    measures faster per token for that kind of step ("decode", "prefill": chosen apart, since a
    GEMM scales with threads where a GEMV may not).

    Use around each forward: `with governor.step("decode", tokens):`. With threads == 1 it does
    nothing.
    `set_threads` and `clock` are for tests (default: torch.set_num_threads, perf_counter)."""

    def __init__(
        self,
        threads: int,
        set_threads: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.threads = max(1, threads)
        self._set_threads = set_threads
        self._clock = clock
        self._applied = self.threads
        self._arms: dict[str, _Arms] = {}

    @contextmanager
    def step(self, kind: str, tokens: int) -> Iterator[int]:
        """Run one forward of `tokens` tokens under the count chosen for `kind`; yields it."""
        if self.threads == 1:
            yield 1
            return
        arms = self._arms.setdefault(kind, _Arms(self.threads))
        count = self._other(arms.current) if arms.probe or arms.until_probe <= 0 else arms.current
        if count != self._applied:
            self._set_threads(count)
            self._applied = count
        began = self._clock()
        yield count
        self._record(arms, count, (self._clock() - began) / max(1, tokens))

    def counts(self) -> dict[str, int]:
        """The count each kind of step uses now (for stats and tests)."""
        return {kind: arms.current for kind, arms in self._arms.items()}

    def _other(self, count: int) -> int:
        return 1 if count == self.threads else self.threads

    def _record(self, arms: _Arms, count: int, per_token: float) -> None:
        if count != arms.current:  # a probe step
            arms.probe.append(per_token)
            if len(arms.probe) < PROBE_STEPS:
                return
            probed = sorted(arms.probe[1:])[len(arms.probe[1:]) // 2]
            arms.probe = []
            current = arms.mean.get(arms.current)
            if current is None or probed < SWITCH_GAIN * current:
                arms.mean[count] = probed
                arms.current, arms.gap = count, PROBE_GAP_MIN
            else:
                arms.gap = min(PROBE_GAP_MAX, arms.gap * 2)
            arms.until_probe = arms.gap
            return
        mean = arms.mean.get(count)
        arms.mean[count] = per_token if mean is None else mean + 0.25 * (per_token - mean)
        arms.until_probe -= 1
        if mean is not None and per_token > STALL * mean:  # a descheduled thread: try the other now
            arms.until_probe = 0
