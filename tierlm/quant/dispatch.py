"""Which INT8 kernel runs where, decided by measuring the candidates once per process.

A `KernelChoice` names two kernels: `gemv` for few activation rows (decode, small batches),
where the int8 weight bytes stream from memory once, and `gemm` for many rows (prefill),
where dequantizing blocks into BLAS wins; `crossover` is the largest row count still sent
to `gemv`. Past INTEGER_GEMM_ROWS rows (a fixed count, not a timed one: it changes the numerics)
a native `gemv` kernel's integer GEMM (csrc/gemm_a16.h) runs first, and the timed choice only
where it declines (fp32 weights, the portable build, NaN or inf in x). On CPUs `calibrate` makes the choice: it loads each candidate (a loader that
raises KernelUnavailable is skipped with its reason), times them at batch 1 on a
representative layer, then finds the crossover against dequantize+BLAS. Accelerators use
torch ops (dequantize to bf16/fp16 + the device GEMM).

The per-process cache is `functools.lru_cache` on `cpu_kernel_choice(threads, build_root)` and
`accelerator_kernel_choice(device_type)`; nothing else is kept.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tierlm.quant.kernel_api import Int8Kernel, KernelUnavailable
from tierlm.quant.native import load_native
from tierlm.quant.numba_kernel import load_numba
from tierlm.quant.torch_kernels import BlasKernel, TorchKernel

# Batch-1 calibration layer: 8 MiB of int8, larger than L2 and typical of a 1-3B model's layer.
CALIBRATION_SHAPE = (2048, 4096)
# Row counts tried for the gemv -> gemm crossover, in order; the first where gemm wins ends it.
CROSSOVER_ROWS = (2, 4, 8, 16, 32, 64)
# Rows past which the native integer GEMM runs, fixed rather than timed: its numerics (x as int16
# per 32 columns) differ from the fp32 tiles', and a crossover timed per process made a prompt's
# logits depend on the machine's load at start-up. Measured on Zen 3 (AVX2, 2 threads): the
# tiles and the GEMM tie at ~32 rows (the GEMM expands each weight once per call), the GEMM is
# 1.2-1.6x faster at 64.
INTEGER_GEMM_ROWS = 32
# The activation rows the native decode rows multiply in integers (csrc/gemv_a16.h kA16MaxRows).
DECODE_ROWS = 4

KernelLoader = Callable[[Path | None], Int8Kernel]  # build dir -> the kernel, or KernelUnavailable


@dataclass(frozen=True)
class KernelChoice:
    """The kernels for one device (and CPU thread count), with what calibration saw."""

    gemv: Int8Kernel
    gemm: Int8Kernel
    crossover: int
    fp32_only: bool = True  # CPU kernels take fp32 activations; other dtypes are converted
    skipped: tuple[str, ...] = ()  # "name: reason" for candidates that could not load
    timings: tuple[tuple[str, int, float], ...] = ()  # (kernel, rows, seconds) measured

    def kernel_for(self, rows: int) -> Int8Kernel:
        return self.gemv if rows <= self.crossover else self.gemm

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ weight.dequantize().T (+ bias) -> [..., out] in x's dtype.

        Written for per-call overhead (~200 calls per token on a small model): no conversion
        or copy unless the dtype or layout asks for one.
        """
        out_features, in_features = weight.shape
        if x.shape[-1] != in_features:
            raise ValueError(f"x has {x.shape[-1]} features, weight {list(weight.shape)} wants "
                             f"{in_features}")  # fmt: skip
        if bias is not None and bias.shape != (out_features,):
            raise ValueError(f"bias {list(bias.shape)} does not match {out_features} outputs")
        rows = x.reshape(-1, in_features)
        if self.fp32_only:
            # The CPU kernels read raw pointers: a tensor on another device must not reach them.
            if not (x.is_cpu and weight.device.type == "cpu"):
                raise ValueError(f"CPU INT8 kernels got x on {x.device}, weight on {weight.device}")
            if rows.dtype != torch.float32:
                rows = rows.float()
            if bias is not None and bias.dtype != torch.float32:
                bias = bias.float()
        if not rows.is_contiguous():
            rows = rows.contiguous()
        if bias is not None and not bias.is_contiguous():
            bias = bias.contiguous()
        if rows.shape[0] > INTEGER_GEMM_ROWS and hasattr(self.gemv, "gemm"):
            # Prefill multiplied in integers where the native build can (csrc/gemm_a16.h), else below.
            out = self.gemv.gemm(rows, weight, bias)
            if out is not None:
                return out.to(x.dtype) if x.dim() == 2 else out.to(x.dtype).view(*x.shape[:-1], out_features)
        kernel = self.gemv if rows.shape[0] <= self.crossover else self.gemm
        if hasattr(weight, "native_words"):  # a weight that describes itself (LowBitKWeight: GGUF Q2_K/Q3_K)
            if not hasattr(kernel, "matmul_words"):
                kernel = self.gemm
            out = kernel.matmul_words(rows, weight, bias)
        elif getattr(weight, "codebook", False):  # IQ4Weight: GGUF IQ4_NL / IQ4_XS
            if not hasattr(kernel, "matmul_iq4"):
                kernel = self.gemm
            out = kernel.matmul_iq4(rows, weight.packed, weight.scales, weight.superblocks, bias)
        elif hasattr(weight, "codes"):  # FiveBitWeight: GGUF Q5_0/Q5_1/Q5_K
            if not hasattr(kernel, "matmul5"):
                kernel = self.gemm
            out = kernel.matmul5(rows, weight.codes, weight.scales, weight.offsets, weight.superblocks, bias)
        elif hasattr(weight, "high"):  # Q6KWeight: GGUF Q6_K's 6-bit codes and super-block scales
            if not hasattr(kernel, "matmul6k"):
                kernel = self.gemm
            out = kernel.matmul6k(rows, weight.packed, weight.high, weight.superblocks, bias)
        elif hasattr(weight, "superblocks"):  # Q4KWeight: nibbles, GGUF Q4_K super-block scales
            if not hasattr(kernel, "matmul4k"):
                kernel = self.gemm
            out = kernel.matmul4k(rows, weight.packed, weight.superblocks, bias)
        elif hasattr(weight, "packed"):  # Int4Weight: packed nibbles, fp16 scales
            if not hasattr(kernel, "matmul4"):
                kernel = self.gemm  # a GEMV kernel without an int4 path: dequantize + GEMM
            out = kernel.matmul4(rows, weight.packed, weight.scales, weight.offsets, weight.group_size, bias)
        else:
            out = kernel.matmul(rows, weight.qweight, weight.scales_2d, weight.group, bias,
                                offsets=weight.offsets_2d)  # fmt: skip
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def kernel_choice(device: torch.device) -> KernelChoice:
    """The calibrated choice for `device` at the current torch thread count."""
    if device.type == "cpu":
        return cpu_kernel_choice(torch.get_num_threads())
    return accelerator_kernel_choice(device.type)


@functools.lru_cache(maxsize=None)
def cpu_kernel_choice(threads: int, build_root: Path | None = None) -> KernelChoice:
    """Calibrate the CPU candidates once per (thread count, build dir) in this process.

    `threads` must be torch's current thread count: the kernels run with that many.
    """
    return calibrate(default_cpu_loaders(), build_root)


@functools.lru_cache(maxsize=None)
def accelerator_kernel_choice(device_type: str) -> KernelChoice:
    """Accelerators: dequantize to the activation dtype and use the device's GEMM."""
    kernel = TorchKernel()
    return KernelChoice(gemv=kernel, gemm=kernel, crossover=0, fp32_only=False)


def default_cpu_loaders() -> list[tuple[str, KernelLoader]]:
    """CPU candidates in order of preference: native C++ first, numba when there is no compiler.

    numba only stands in for the native kernel: on the 2-core AVX-512 Xeon it read 9-19 GB/s
    at batch 1 against the native kernel's 18-27 GB/s (benchmarks/bench_int8_kernels.py), and
    importing it costs ~0.6 s per process, so it is not loaded when the native kernel loads.
    """
    return [("native", load_native), ("numba", load_numba)]


def calibrate(
    loaders: Sequence[tuple[str, KernelLoader]],
    build_root: Path | None = None,
    *,
    first_only: bool = True,
    shape: tuple[int, int] = CALIBRATION_SHAPE,
    reps: int = 5,
    budget_s: float = 1.0,
) -> KernelChoice:
    """Load the candidates and time them; dequantize+BLAS is always a candidate.

    With `first_only`, loading stops at the first candidate that loads (the list is a
    preference order of interchangeable GEMV kernels); otherwise every loadable one is timed.
    The crossover sweep stops once timing has taken `budget_s` (a busy machine makes every
    OpenMP barrier cost a scheduler slice), keeping the largest row count verified so far.
    """
    skipped, loaded = [], []
    for name, load in loaders:
        try:
            loaded.append(load(build_root))
        except KernelUnavailable as err:
            skipped.append(f"{name}: {err}")
            continue
        if first_only:
            break
    # BLAS needs a dequantizer; the native one (one pass, no temporaries) measured ~2x faster
    # than torch ops.
    native = next((k for k in loaded if hasattr(k, "dequantize_into")), None)
    blas = (BlasKernel(native.dequantize_into, name="native-dequant+blas",
                       dequantize4=getattr(native, "dequantize4_into", None),
                       dequantize4k=getattr(native, "dequantize4k_into", None),
                       dequantize6k=getattr(native, "dequantize6k_into", None),
                       dequantize5=getattr(native, "dequantize5_into", None),
                       dequantize_iq4=getattr(native, "dequantize_iq4_into", None),
                       dequantize_words=getattr(native, "dequantize_words_into", None)) if native else BlasKernel())  # fmt: skip

    out_features, in_features = shape
    gen = torch.Generator().manual_seed(0)
    qweight = torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
    scales = torch.rand(out_features, 1, generator=gen) / 127
    timings = []

    def timed(kernel, rows: int) -> float:
        x = torch.randn(rows, in_features, generator=gen)
        seconds = _median_seconds(lambda: kernel.matmul(x, qweight, scales, in_features), reps)
        timings.append((kernel.name, rows, seconds))
        return seconds

    started = time.perf_counter()
    speeds = {kernel: timed(kernel, 1) for kernel in (*loaded, blas)}
    gemv = min(speeds, key=speeds.get)
    crossover = 1
    if gemv is not blas:
        for rows in CROSSOVER_ROWS:
            if time.perf_counter() - started > budget_s or timed(blas, rows) < timed(gemv, rows):
                break
            crossover = rows
    if hasattr(gemv, "gemm"):
        # Decode's few rows stay on the native rows whatever the sweep saw (a busy machine can
        # end it before its first step): they are its integer path, with its numerics.
        crossover = max(crossover, DECODE_ROWS)
    return KernelChoice(gemv, blas, crossover, True, tuple(skipped), tuple(timings))


def _median_seconds(run: Callable[[], object], reps: int) -> float:
    run()  # warm-up: first-touch page faults, OpenMP pool start
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
