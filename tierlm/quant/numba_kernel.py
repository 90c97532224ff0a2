"""The numba INT8 kernel: the same W8A16 GEMV as the native one, for machines with no compiler.

Needs the optional `numba` package. Parallel over output rows (prange), two weight rows per
step so each activation load feeds two FMAs, fp32 accumulation per group, then times the
group's scale. `fastmath` only lets LLVM
reorder the fp32 sum into vector lanes (as the native kernel's lanes do); there are no NaN/inf
shortcuts that change results for finite inputs. Compiled machine code is cached under
`cache_root()/kernels/numba-<version>`, so later processes load it instead of recompiling.

numba's OpenMP threading layer loads its own copy of libgomp beside torch's, so two thread
pools take turns on the cores; the native kernel shares torch's pool and is preferred.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tierlm.paths import cache_root
from tierlm.quant.kernel_api import KernelUnavailable
from tierlm.quant.torch_kernels import offset_term


class NumbaKernel:
    """A numba-compiled `Int8Kernel`: x [M, K] fp32 @ (q [N, K] * s [N, G]).T -> [M, N]."""

    name = "numba"

    def __init__(self, matmul_fn, set_threads):
        self._matmul = matmul_fn
        self._set_threads = set_threads

    def matmul(self, x, qweight, scales, group, bias=None, offsets=None):
        """x [M, K] fp32, qweight [N, K] int8, scales [N, G] fp32 (or fp16) -> [M, N] fp32 (+ bias).

        Asymmetric offsets are added after the compiled loop (torch ops): numba is the fallback
        kernel, kept simple rather than fastest.
        """
        y = torch.empty(x.shape[0], qweight.shape[0], dtype=torch.float32)
        self._set_threads(torch.get_num_threads())
        self._matmul(x.numpy(), qweight.numpy(), scales.float().numpy(), group, y.numpy())  # fp16: widened
        if offsets is not None:
            y.add_(offset_term(x, offsets, group))
        return y.add_(bias) if bias is not None else y


def load_numba(build_root: Path | None = None) -> NumbaKernel:
    """Compile (or load from cache) the numba kernel; KernelUnavailable without numba."""
    try:
        import numba  # the optional `cpu` extra: absent on most installs, ~0.6 s to import
    except ImportError:
        raise KernelUnavailable("numba is not installed") from None
    if build_root is None:
        build_root = cache_root() / "kernels"
    cache_dir = build_root / f"numba-{numba.__version__}"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a read-only cache: the caller falls back to another kernel
        raise KernelUnavailable(f"cannot create numba's cache {cache_dir}: {err.strerror or err}") from None
    matmul_fn = _compile(numba, cache_dir)

    def set_threads(count: int) -> None:
        # numba's pool is sized at first use; it can run fewer threads than that, not more.
        numba.set_num_threads(max(1, min(count, numba.config.NUMBA_NUM_THREADS)))

    kernel = NumbaKernel(matmul_fn, set_threads)
    try:  # compile now (or load the cached code), so the first real call is not slow
        probe = torch.ones(1, 3)
        kernel.matmul(probe, torch.ones(2, 3, dtype=torch.int8), torch.ones(2, 1), 3)
    except Exception as err:  # a numba build that cannot compile this: fall back
        raise KernelUnavailable(f"numba failed to compile the int8 kernel: {err}") from None
    return kernel


def _compile(numba, cache_dir: Path):
    """Define the jitted kernel with numba's disk cache pointed at `cache_dir`.

    numba reads its cache directory from its config when a cached function is created, so the
    setting is swapped in for the decoration only and put back at once.
    """
    previous = numba.config.CACHE_DIR
    numba.config.CACHE_DIR = str(cache_dir)
    try:

        # The dot products are over slices in a helper: with loop bounds computed inline
        # (k0..k1 of a group) LLVM left the int8 -> fp32 loop scalar, ~10x slower.
        @numba.njit(fastmath=True, inline="always", cache=True)
        def dot2(a0, a1, b):
            acc0 = np.float32(0.0)
            acc1 = np.float32(0.0)
            for k in range(b.shape[0]):
                acc0 += np.float32(a0[k]) * b[k]
                acc1 += np.float32(a1[k]) * b[k]
            return acc0, acc1

        @numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
        def matmul(x, q, s, group, y):
            m_rows, k_cols = x.shape
            n_rows = q.shape[0]
            for pair in numba.prange((n_rows + 1) // 2):
                n0 = 2 * pair
                n1 = min(n0 + 1, n_rows - 1)  # an odd last row pairs with itself
                for m in range(m_rows):
                    acc0 = np.float32(0.0)
                    acc1 = np.float32(0.0)
                    for g in range(s.shape[1]):
                        k0 = g * group
                        k1 = min(k_cols, k0 + group)
                        d0, d1 = dot2(q[n0, k0:k1], q[n1, k0:k1], x[m, k0:k1])
                        acc0 += d0 * s[n0, g]
                        acc1 += d1 * s[n1, g]
                    y[m, n0] = acc0
                    y[m, n1] = acc1

        return matmul
    finally:
        numba.config.CACHE_DIR = previous
