"""Threads on a shared machine: the native pool (tierlm/quant/csrc/pool.h) runs every index
exactly once; a helper late with its chunk starts a backoff to the caller alone; a busy-looping
sibling process on one of our CPUs corrupts nothing (a GEMV, and the fused decode against the
eager reference); `import tierlm` bounds OpenMP's spinning before torch loads libgomp.

The pool itself is driven through a small test kernel compiled with pool.cpp (the sources the
kernels' library builds from); the fused decode goes through the real library."""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

CSRC = Path(__file__).resolve().parents[1] / "tierlm" / "quant" / "csrc"

# visit: out[i] += 1 for every index handed out; gemv: y[N] = w[N, K] (int8) @ x[K]; late:
# visit, where each chunk sleeps caller_us on the calling thread and helper_us on a helper (a
# helper descheduled while it holds a chunk, made deterministic).
KERNEL = r"""
#include <chrono>
#include <thread>
#include "pool.h"
extern "C" {
int pool_test_late(int64_t n, int threads, int caller_us, int helper_us, int32_t* out) {
  const std::thread::id caller = std::this_thread::get_id();
  tl::parallel_for(n, 1, threads, [&](int64_t b, int64_t e) {
    const bool on_caller = std::this_thread::get_id() == caller;
    std::this_thread::sleep_for(std::chrono::microseconds(on_caller ? caller_us : helper_us));
    for (int64_t i = b; i < e; ++i) __atomic_fetch_add(&out[i], 1, __ATOMIC_RELAXED);
  });
  return 0;
}
int pool_test_visit(int64_t n, int64_t grain, int threads, int32_t* out) {
  tl::parallel_for(n, grain, threads, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) __atomic_fetch_add(&out[i], 1, __ATOMIC_RELAXED);
  });
  return 0;
}
int pool_test_gemv(const int8_t* w, const float* x, float* y, int64_t N, int64_t K, int64_t grain,
                   int threads) {
  tl::parallel_for(N, grain, threads, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += float(w[n * K + k]) * x[k];
      y[n] = acc;
    }
  });
  return 0;
}
}
"""

STATS = ("calls", "reduced", "late", "wait_s", "threads", "helpers", "backoff_s", "sleeps",
         "helper_chunks", "chunks")  # fmt: skip


def _controls(lib: ctypes.CDLL) -> ctypes.CDLL:
    """lib with the pool's exported controls typed (the test kernel's or the real library's)."""
    lib.tierlm_pool_configure.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.tierlm_pool_stats.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def _stats(lib: ctypes.CDLL) -> dict[str, float]:
    out = (ctypes.c_double * len(STATS))()
    lib.tierlm_pool_stats(out, len(STATS))
    return dict(zip(STATS, out))


def build_pool_test_library(compiler: str, folder: Path) -> Path:
    """The test kernel and pool.cpp compiled into `folder` under a name keyed on the sources, the
    flags and the compiler (as the kernels' library is), built once: write, then rename."""
    import hashlib

    flags = ["-O2", "-std=c++17", "-shared", "-fPIC", "-pthread", f"-I{CSRC}"]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    sources = [KERNEL] + [(CSRC / name).read_text() for name in sorted(os.listdir(CSRC)) if name.endswith((".cpp", ".h"))]
    key = hashlib.sha256("\0".join([*sources, " ".join(flags), compiler, version]).encode()).hexdigest()[:16]
    library = folder / f"pooltest-{key}.so"
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        build = Path(tempfile.mkdtemp(dir=folder, prefix=".build-"))
        try:
            (build / "kernel.cpp").write_text(KERNEL)
            subprocess.run([compiler, *flags, str(CSRC / "pool.cpp"), str(build / "kernel.cpp"), "-o",
                            str(build / library.name)], check=True, capture_output=True, timeout=600)  # fmt: skip
            os.replace(build / library.name, library)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    return library


@pytest.fixture(scope="module")
def pool() -> ctypes.CDLL:
    from tierlm.paths import kernels_root

    compiler = next(filter(None, (shutil.which(c) for c in (os.environ.get("CXX") or "c++", "g++"))), None)
    assert compiler, "the pool's tests need a C++ compiler (as the native kernels do)"
    library = build_pool_test_library(compiler, kernels_root())
    # Backoff 0.2-0.8 s (the pool reads these once, when first used): long enough that "the
    # next call" is inside the backoff even on a loaded machine.
    os.environ.update(TIERLM_POOL_BACKOFF_MIN_US="200000", TIERLM_POOL_BACKOFF_MAX_US="800000")
    try:
        lib = _controls(ctypes.CDLL(str(library)))
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.pool_test_visit.argtypes = [i64, i64, c_int, ptr]
        lib.pool_test_gemv.argtypes = [ptr, ptr, ptr, i64, i64, i64, c_int]
        lib.pool_test_late.argtypes = [i64, c_int, c_int, c_int, ptr]
        lib.tierlm_pool_configure(0, 1)  # creates the pool, which reads them
        return lib
    finally:
        del os.environ["TIERLM_POOL_BACKOFF_MIN_US"], os.environ["TIERLM_POOL_BACKOFF_MAX_US"]


def test_every_index_runs_exactly_once(pool):
    rng = random.Random(13)
    pool.tierlm_pool_configure(0, 1)
    for _ in range(2000):
        n = rng.choice([0, 1, 2, 3, 7, 63, 64, 65, 1000, 4097])
        grain = rng.choice([1, 2, 5, 16, 64, 1000, 10**6])
        threads = rng.choice([1, 2, 3, 4, 8])
        out = np.zeros(n + 1, np.int32)  # one guard element past the end
        pool.pool_test_visit(n, grain, threads, out.ctypes.data)
        assert (out[:n] == 1).all() and out[n] == 0, (n, grain, threads)
    stats = _stats(pool)
    assert stats["calls"] > 0 and stats["helpers"] >= 1  # the parallel path ran, not just inline
    assert stats["chunks"] >= stats["helper_chunks"] > 0


def test_a_capped_pool_runs_on_the_caller_alone(pool):
    pool.tierlm_pool_configure(1, 1)
    out = np.zeros(10_000, np.int32)
    pool.pool_test_visit(10_000, 10, 4, out.ctypes.data)
    assert (out == 1).all()
    assert pool.tierlm_pool_threads() == 1 and _stats(pool)["calls"] == 0
    pool.tierlm_pool_configure(0, 1)


LATE_US = 300_000


def _late(pool: ctypes.CDLL, helper_us: int, chunks: int = 200) -> None:
    """A call whose helper holds each chunk `helper_us`; the caller needs ~chunks / 10 ms. Calls
    meant to find the helper late give it 2000 chunks and hold the helper's chunk LATE_US, longer
    than the caller's whole ~200 ms: the helper has ~200 ms to wake and take a chunk (a loaded
    machine may not run it within 20 ms), and the caller then always waits for it (with shorter
    holds the helper takes several chunks and the last may end just as the caller does)."""
    out = np.zeros(chunks, np.int32)
    pool.pool_test_late(chunks, 2, 100, helper_us, out.ctypes.data)
    assert (out == 1).all()


@pytest.mark.slow
def test_a_late_helper_starts_a_backoff_that_doubles_and_recovers(pool):
    _late(pool, helper_us=0, chunks=2000)  # helpers started and awake, as after any earlier call
    pool.tierlm_pool_configure(0, 1)
    _late(pool, helper_us=LATE_US, chunks=2000)  # the helper holds its chunk: the caller waits for it
    first = _stats(pool)
    assert first["late"] == 1 and first["backoff_s"] == pytest.approx(0.2) and first["helper_chunks"] >= 1
    assert pool.tierlm_pool_threads() == 1
    _late(pool, helper_us=LATE_US, chunks=2000)  # inside the backoff: the caller runs every chunk itself
    second = _stats(pool)
    assert second["reduced"] == 1 and second["late"] == 1 and second["helper_chunks"] == first["helper_chunks"]
    time.sleep(0.25)
    _late(pool, helper_us=LATE_US, chunks=2000)  # the probe after the backoff finds the helper late again
    third = _stats(pool)
    assert third["late"] == 2 and third["backoff_s"] == pytest.approx(0.4)
    time.sleep(0.45)
    for _ in range(64):  # on time again: the backoff halves
        _late(pool, helper_us=0)
    assert _stats(pool)["backoff_s"] == pytest.approx(0.2) and pool.tierlm_pool_threads() == 2


@pytest.mark.slow
def test_without_adaptive_mode_a_late_helper_changes_nothing(pool):
    _late(pool, helper_us=0, chunks=2000)  # helpers started and awake, as after any earlier call
    pool.tierlm_pool_configure(0, 0)
    _late(pool, helper_us=LATE_US, chunks=2000)
    _late(pool, helper_us=LATE_US, chunks=2000)
    stats = _stats(pool)
    assert stats["late"] == 2 and stats["reduced"] == 0 and stats["helper_chunks"] >= 2
    pool.tierlm_pool_configure(0, 1)


def _busy_sibling(cpu: int) -> subprocess.Popen:
    sibling = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(sibling.pid, {cpu})
    return sibling


@pytest.mark.e2e
def test_a_busy_sibling_does_not_corrupt_the_pool(pool):
    """2-thread GEMVs for 2 s with a busy-looping process on one of this process's CPUs all give
    numpy's results. (Speed under contention is measured by benchmarks, not asserted here.)"""
    rng = np.random.default_rng(0)
    n, k = 2048, 576
    w = rng.integers(-127, 128, (n, k), dtype=np.int8)
    x = rng.standard_normal(k).astype(np.float32)
    reference = w.astype(np.float32) @ x
    y = np.empty(n, np.float32)
    sibling = _busy_sibling(max(os.sched_getaffinity(0)))
    try:
        time.sleep(0.1)  # the sibling is spinning before the first call
        pool.tierlm_pool_configure(0, 1)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            y.fill(np.nan)
            pool.pool_test_gemv(w.ctypes.data, x.ctypes.data, y.ctypes.data, n, k, 64, 2)
            np.testing.assert_allclose(y, reference, rtol=1e-4, atol=1e-2)
    finally:
        sibling.kill()
        sibling.wait()
    stats = _stats(pool)
    assert stats["helper_chunks"] + stats["reduced"] > 0, stats  # the parallel path ran


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("given", "expected"),
    [({}, "1000"), ({"GOMP_SPINCOUNT": "5"}, "5"), ({"OMP_WAIT_POLICY": "ACTIVE"}, None)],
)
def test_importing_tierlm_bounds_openmp_spinning_unless_the_user_chose(given, expected):
    """Set on `import tierlm`, which imports no torch, so libgomp (loaded with torch, reading its
    environment only then) sees it."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = "import os, sys, tierlm; print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], env={**env, **given}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(expected), "False"]


@pytest.mark.e2e
def test_fused_decode_with_a_busy_sibling_gives_the_eager_reference_tokens(tmp_path, monkeypatch, fused_calls):
    """A tiny llama (big enough that every GEMV splits into many chunks) decodes 16 greedy steps
    on 2 threads through the fused native step while a busy-looping process holds one of this
    process's CPUs: the tokens equal the eager reference path's (TIERLM_FUSED=0, machine quiet)
    and the native pool really ran those steps in parallel."""
    import torch

    from tests.tiny import make_case, prompt
    from tierlm.models import fused_decode
    from tierlm.runtime.loader import load_model

    make_case(tmp_path, dict(family="llama", hidden=256, intermediate=768, heads=4, kv_heads=2))
    loaded = load_model(tmp_path, device="cpu", dtype=torch.float32, context_length=64, quant="int8")
    ids = prompt(loaded.config.vocab_size, 9)

    def greedy(steps: int = 16):
        cache = loaded.new_cache()
        rows = [loaded.model.forward(ids, cache)[0, -1]]
        for _ in range(steps):
            rows.append(loaded.model.forward(torch.tensor([[int(rows[-1].argmax())]]), cache)[0, -1])
        return torch.stack(rows)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setenv("TIERLM_FUSED", "0")
        expected = greedy()
        monkeypatch.delenv("TIERLM_FUSED")
        assert fused_calls == []
        lib = fused_decode.native_library()
        assert lib is not None, "the native library did not load"
        _controls(lib)
        sibling = _busy_sibling(max(os.sched_getaffinity(0)))
        try:
            time.sleep(0.1)
            lib.tierlm_pool_configure(0, 1)
            actual = greedy()
            pool = _stats(lib)
        finally:
            sibling.kill()
            sibling.wait()
    finally:
        torch.set_num_threads(threads)
    assert fused_calls and all(fused_calls) and len(fused_calls) == (1 + 16) * loaded.config.num_hidden_layers
    assert actual.argmax(-1).tolist() == expected.argmax(-1).tolist()
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    assert pool["calls"] > 0 and pool["helper_chunks"] + pool["reduced"] > 0, pool
