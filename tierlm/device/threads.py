"""Compute threads that fit a machine other processes share.

torch's OpenMP threads (eager ops, BLAS GEMMs in prefill) meet at a barrier after every parallel
op, and libgomp's idle threads spin for milliseconds (its default GOMP_SPINCOUNT, 300000) before
they sleep. To the scheduler a spinning thread is CPU-bound like any busy process, so on a core
another process wants it loses whole time slices, and every following op waits for it: with 2
threads and one core busy, decode fell to a tenth of one thread's speed. A short spin count lets
idle threads sleep soon; a sleeper that wakes gets its core back at once.

Measured on the 2-core box (interleaved, embedded model int8, load average 8-10 from other work):
2-thread decode/prefill went from 0.35/2.5 tok/s (default spin) to 6.2/37 with 1000; with the
native kernels on tierlm's own pool (quant/csrc/pool.h: bounded spin, then a futex) and 1000, to
8.7/25 quiet and 20/43 with one core busy, against 5.8/17 and 4.2/11 on one thread. Adapting
torch's thread count per step (a governor that probes 1 thread) added nothing measurable on top.
"""

from __future__ import annotations

from typing import MutableMapping

# libgomp's spin count before an idle thread sleeps: tens of microseconds, what libgomp itself
# uses when threads outnumber CPUs; 10000 still halved 2-thread decode on a busy machine.
OPENMP_SPIN_COUNT = "1000"


def bound_openmp_spinning(environ: MutableMapping[str, str]) -> None:
    """Make OpenMP threads sleep soon when idle, unless the user set a wait policy or spin count.

    libgomp reads its environment once, when `import torch` loads it: tierlm/__init__ calls this
    first. A program that imports torch before tierlm keeps libgomp's default (set GOMP_SPINCOUNT
    itself)."""
    if "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)
