"""The native CPU INT8 kernel: a small C++ library built once with the system compiler.

One owner: this module holds the C++ source, builds it into a shared library cached under
`cache_root()/kernels`, and wraps its two entry points:

- `matmul`: y[M, N] = x[M, K] @ (q[N, K] * s[N, G] (+ o[N, G])).T (+ bias), for small M
  (decode); asymmetric offsets o add each output's dot with x summed per group. Each
  16 int8 weights are widened to fp32 in registers (and multiplied by their group's scale;
  per channel the scale multiplies the finished sum), then FMA'd with up to 4 activation
  rows; 8 weight rows at a time at M = 1, each step prefetching the next tile into L2. Only
  the int8 bytes cross the memory bus and accumulation is fp32: W8A16, activations are never
  quantized. AVX-512 intrinsics where the compiler targets them, else a portable loop the
  compiler vectorises (`omp simd`).
- `dequantize_into`: fp32 rows of a weight block, for the dequantize-then-BLAS path (prefill).

The library is compiled with `-march=native`, so its cache key includes the CPU's identity as
well as the source, flags and compiler. Threads come from OpenMP; on Linux the library binds to
the `libgomp.so.1` torch has already loaded, so it shares torch's thread pool. Any failure
(no compiler, no OpenMP, a build error) raises `KernelUnavailable`, and the caller falls back.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tierlm.quant.kernel_api import KernelUnavailable, group_count

_SOURCE = r"""
#include <cstdint>
#include <algorithm>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TIERLM_AVX512 1
#endif

namespace {

#ifdef TIERLM_AVX512
// Tuning constants, measured on a 2-core AVX-512 Xeon (benchmarks/bench_int8_kernels.py) and
// overridable with -D for experiments: weight rows per tile at M == 1, and at M > 1 (where a
// tile is R rows x 4 activation rows: 16 accumulators). TL_PREFETCH: each step also prefetches
// the same line of the next tile into L2. One tile ahead keeps enough misses in flight per
// core; without it decode GEMV read 10-23 GB/s, with it 20-28 GB/s (fixed distances of
// 1-4 KiB along a row did worse on short rows such as K = 576).
#ifndef TL_ROWS1
#define TL_ROWS1 8
#endif
#ifndef TL_ROWSM
#define TL_ROWSM 4
#endif
#ifndef TL_PREFETCH
#define TL_PREFETCH 1
#endif

// One 16-column step of a tile: widen R x 16 int8 to fp32 (times the group scale when
// GROUPED), FMA with MB activation rows. MASKED reads only the first popcount(mask) columns.
template <int R, int MB, bool GROUPED, bool MASKED>
inline __attribute__((always_inline)) void step(__m512 (&acc)[R][MB], const __m512 (&sv)[R],
                                                const float* x, int64_t K, const int8_t* w,
                                                int64_t k, __mmask16 mask) {
  __m512 wf[R];
  for (int r = 0; r < R; ++r) {
    __m128i q;
    if constexpr (MASKED) q = _mm_maskz_loadu_epi8(mask, w + r * K + k);
    else q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * K + k));
    wf[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
    if constexpr (GROUPED) wf[r] = _mm512_mul_ps(wf[r], sv[r]);
  }
  for (int m = 0; m < MB; ++m) {
    __m512 xv;
    if constexpr (MASKED) xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
    else xv = _mm512_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wf[r], xv, acc[r][m]);
  }
}

// y[m][r] = sum_k x[m][k] * w[r][k] * s[r][k / group] for R weight rows x MB activation rows.
// Per channel (!GROUPED) the scale multiplies the finished sum: one op fewer per 16 weights.
template <int R, int MB, bool GROUPED>
void tile(const float* x, int64_t K, const int8_t* w, const float* s, int64_t G, int64_t group,
          float* y, int64_t ldy) {
  __m512 acc[R][MB];
  __m512 sv[R];
  for (int r = 0; r < R; ++r) {
    sv[r] = _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k1 = std::min(K, (g + 1) * group);
    if constexpr (GROUPED)
      for (int r = 0; r < R; ++r) sv[r] = _mm512_set1_ps(s[r * G + g]);
    int64_t k = g * group;
    for (; k + 64 <= k1; k += 64) {  // one cache line per row per iteration
      if (TL_PREFETCH)
        for (int r = 0; r < R; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(w + (r + R) * K + k), _MM_HINT_T1);
      for (int u = 0; u < 64; u += 16) step<R, MB, GROUPED, false>(acc, sv, x, K, w, k + u, 0);
    }
    for (; k + 16 <= k1; k += 16) {  // groups shorter than 64 (int8-g32) still prefetch
      if (TL_PREFETCH && (k & 63) == 0)
        for (int r = 0; r < R; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(w + (r + R) * K + k), _MM_HINT_T1);
      step<R, MB, GROUPED, false>(acc, sv, x, K, w, k, 0);
    }
    if (k < k1)  // ragged end of a group (or of K): masked loads read nothing past it
      step<R, MB, GROUPED, true>(acc, sv, x, K, w, k,
                                 static_cast<__mmask16>((1u << (k1 - k)) - 1u));
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r)
      y[m * ldy + r] = GROUPED ? _mm512_reduce_add_ps(acc[r][m])
                               : _mm512_reduce_add_ps(acc[r][m]) * s[r];
}

typedef void (*TileFn)(const float*, int64_t, const int8_t*, const float*, int64_t, int64_t,
                       float*, int64_t);

template <int R, bool GROUPED>
TileFn pick_mb(int mb) {
  switch (mb) {
    case 1: return tile<R, 1, GROUPED>;
    case 2: return tile<R, 2, GROUPED>;
    case 3: return tile<R, 3, GROUPED>;
    default: return tile<R, 4, GROUPED>;
  }
}

static_assert(TL_ROWS1 >= 1 && TL_ROWS1 <= 8 && TL_ROWSM >= 1 && TL_ROWSM <= 4,
              "tiles wider than 4 rows exist only for one activation row");

// The tile function for r weight rows x mb activation rows (r > 4 only when mb == 1).
template <bool GROUPED>
TileFn pick(int r, int mb) {
  switch (r) {
    case 1: return pick_mb<1, GROUPED>(mb);
    case 2: return pick_mb<2, GROUPED>(mb);
    case 3: return pick_mb<3, GROUPED>(mb);
    case 4: return pick_mb<4, GROUPED>(mb);
    case 5: return pick_mb<5, GROUPED>(1);
    case 6: return pick_mb<6, GROUPED>(1);
    case 7: return pick_mb<7, GROUPED>(1);
    default: return pick_mb<8, GROUPED>(1);
  }
}
#endif

}  // namespace

extern "C" {

int tierlm_i8_isa() {
#ifdef TIERLM_AVX512
  return 512;
#else
  return 0;
#endif
}

// Asymmetric weights add o[N, G]: W = w * s + o per group, so x @ W.T gains, for every output,
// the dot of its offsets with x summed per group (xs[M, G], computed once per call).
static inline float offset_term(const float* o, const float* xs, int64_t G) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t g = 0; g < G; ++g) acc += o[g] * xs[g];
  return acc;
}

// y[M, N] = x[M, K] @ (w[N, K] * s[N, G] (+ o[N, G])).T (+ bias[N]); all row-major and
// contiguous; o may be null (symmetric weights).
int tierlm_i8_matmul(const float* x, int64_t M, int64_t K, const int8_t* w, const float* s,
                     const float* o, int64_t N, int64_t group, const float* bias, float* y,
                     int threads) {
  const int64_t G = (K + group - 1) / group;
  std::vector<float> xs(o ? M * G : 0);
  if (o)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) {
        float acc = 0.0f;
        for (int64_t k = g * group; k < std::min(K, (g + 1) * group); ++k) acc += x[m * K + k];
        xs[m * G + g] = acc;
      }
#ifdef TIERLM_AVX512
  const bool grouped = G > 1;
  const int64_t rows = M == 1 ? TL_ROWS1 : TL_ROWSM;
  const int64_t tiles = (N + rows - 1) / rows;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = t * rows;
    const int r = static_cast<int>(std::min<int64_t>(rows, N - n0));
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int mb = static_cast<int>(std::min<int64_t>(4, M - m0));
      const TileFn fn = grouped ? pick<true>(r, mb) : pick<false>(r, mb);
      fn(x + m0 * K, K, w + n0 * K, s + n0 * G, G, group, y + m0 * N + n0, N);
    }
    if (o)
      for (int64_t m = 0; m < M; ++m)
        for (int i = 0; i < r; ++i)
          y[m * N + n0 + i] += offset_term(o + (n0 + i) * G, xs.data() + m * G, G);
    if (bias)
      for (int64_t m = 0; m < M; ++m)
        for (int i = 0; i < r; ++i) y[m * N + n0 + i] += bias[n0 + i];
  }
#else
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        const float sg = s[n * G + g];
        const int64_t k1 = std::min(K, (g + 1) * group);
#pragma omp simd reduction(+ : acc)
        for (int64_t k = g * group; k < k1; ++k)
          acc += (static_cast<float>(w[n * K + k]) * sg) * x[m * K + k];
      }
      if (o) acc += offset_term(o + n * G, xs.data() + m * G, G);
      y[m * N + n] = bias ? acc + bias[n] : acc;
    }
  }
#endif
  return 0;
}

// out[N, K] = w[N, K] * s[N, G] (+ o[N, G]), broadcast over each group of `group` columns.
int tierlm_i8_dequant(const int8_t* w, const float* s, const float* o, int64_t N, int64_t K,
                      int64_t group, float* out, int threads) {
  const int64_t G = (K + group - 1) / group;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t g = 0; g < G; ++g) {
      const float sg = s[n * G + g];
      const float og = o ? o[n * G + g] : 0.0f;
      const int64_t k1 = std::min(K, (g + 1) * group);
#pragma omp simd
      for (int64_t k = g * group; k < k1; ++k)
        out[n * K + k] = static_cast<float>(w[n * K + k]) * sg + og;
    }
  }
  return 0;
}

}  // extern "C"
"""

# -march=native: the AVX-512 path where the CPU has it, else the portable loop tuned for this CPU.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")


class NativeKernel:
    """The compiled library behind the `Int8Kernel` interface (see `kernel_api`)."""

    def __init__(self, library: Path):
        lib = ctypes.CDLL(str(library))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.tierlm_i8_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, ctypes.c_int]
        lib.tierlm_i8_matmul.restype = ctypes.c_int
        lib.tierlm_i8_dequant.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
        lib.tierlm_i8_dequant.restype = ctypes.c_int
        self._lib = lib
        self.library = library
        self.name = "native-avx512" if lib.tierlm_i8_isa() == 512 else "native-simd"

    def matmul(self, x, qweight, scales, group, bias=None, offsets=None):
        """x [M, K] fp32 @ dequantized qweight [N, K].T (+ bias [N]) -> [M, N] fp32.

        All inputs contiguous, on the CPU; scales (and offsets) fp32 [N, G], G = ceil(K / group).
        """
        m, k = x.shape
        n = qweight.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        self._lib.tierlm_i8_matmul(
            x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(),
            offsets.data_ptr() if offsets is not None else None, n, group,
            bias.data_ptr() if bias is not None else None, y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return y

    def dequantize_into(self, qweight, scales, group, out, offsets=None):
        """out [N, K] fp32 = qweight [N, K] * scales [N, G] (+ offsets [N, G]) broadcast per
        group (all contiguous)."""
        n, k = qweight.shape
        self._lib.tierlm_i8_dequant(
            qweight.data_ptr(), scales.data_ptr(), offsets.data_ptr() if offsets is not None else None,
            n, k, group, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out


def load_native(build_root: Path | None = None, flags: tuple[str, ...] = FLAGS) -> NativeKernel:
    """The native kernel, compiled into `build_root` (default `cache_root()/kernels`) if needed.

    `flags` are the compiler flags (tests pass e.g. `-march=x86-64-v3` to build the portable
    path on an AVX-512 machine). Raises KernelUnavailable when there is no C++ compiler or the
    build fails.
    """
    if build_root is None:
        from tierlm.paths import cache_root

        build_root = cache_root() / "kernels"
    compiler = _compiler()
    library = build_root / f"int8_cpu-{_build_key(compiler, flags)}.so"
    if not library.exists():
        _compile(compiler, flags, library)
    try:
        return NativeKernel(library)
    except OSError as err:  # a truncated or foreign library: report, the caller falls back
        raise KernelUnavailable(f"cannot load {library}: {err}") from None


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise KernelUnavailable("no C++ compiler found (set $CXX or install g++)")


def _build_key(compiler: str, flags: tuple[str, ...]) -> str:
    """Hash of everything the library's bytes depend on: source, flags, compiler, CPU."""
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise KernelUnavailable(f"{compiler} --version failed: {err}") from None
    parts = [_SOURCE, " ".join(flags), version, platform.machine(), _cpu_identity()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _cpu_identity() -> str:
    """The CPU model and feature flags, since `-march=native` bakes them into the library."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))


def _compile(compiler: str, flags: tuple[str, ...], library: Path) -> None:
    try:
        _build(compiler, flags, library)
    except OSError as err:  # a read-only or full cache: the caller falls back to another kernel
        raise KernelUnavailable(f"cannot build the int8 kernel in {library.parent}: {err.strerror or err}") from None


def _build(compiler: str, flags: tuple[str, ...], library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    # Build under a unique name and rename: concurrent builders never expose a partial file.
    with tempfile.TemporaryDirectory(dir=library.parent, prefix=".build-") as tmp:
        source = Path(tmp) / "int8_cpu.cpp"
        source.write_text(_SOURCE)
        output = Path(tmp) / library.name
        try:
            done = subprocess.run(
                [compiler, *flags, str(source), "-o", str(output)],
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as err:
            raise KernelUnavailable(f"{compiler} failed to run: {err}") from None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise KernelUnavailable(f"building the int8 kernel failed: {' | '.join(tail)}")
        os.replace(output, library)
