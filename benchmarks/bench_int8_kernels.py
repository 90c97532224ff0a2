"""INT8 and INT4 weight-only matmul kernels on the CPU against fp32 `F.linear`, per layer shape.

For each shape [out x in] (Llama-7B's 4096x4096, 11008x4096, 4096x11008 and SmolLM2's
576x1536, 1536x576, 49152x576) and each row count (1 = decode, 8 = small batch, 128 = prefill
chunk) it prints ms per call, GB/s of weight bytes read (fp32 bytes for F.linear, int8 or
packed int4 + scale bytes for the quantized kernels) and the speed-up over fp32 F.linear
(t_fp32 / t_kernel).

Candidates:
  fp32             F.linear on the fp32 weight (the baseline)
  native           tierlm's C++ W8A16 kernel, per channel (AVX-512, AVX2 or portable vectors,
                   whichever -march=native gives; streams int8, fp32 FMA)
  native-g128      the same, one scale per 128 columns (int8-g128)
  native-g32-asym  the same, scale and offset per 32 columns (int8-g32-asym, GGUF sources)
  native-int4-g32  tierlm's C++ W4A16 kernel: packed nibbles, fp16 scale per 32 columns
                   (symmetric, GGUF Q4_0's form); streams half of int8's bytes
  native-int4-g32-asym  the same with an fp16 offset per group too (Q4_1's form)
  native-int4-g128 the same, one fp16 scale per 128 columns
  numba            tierlm's numba W8A16 kernel (if numba is installed)
  native-deq+blas  tierlm: dequantize blocks of rows with the native code, then BLAS GEMM
  torch-deq+blas   the same with torch ops for the dequantization (the no-compiler path)
  int8pack-fp32    torch._weight_int8pack_mm with fp32 activations
  int8pack-bf16    the same with bf16 activations (changes accuracy: bf16 inputs/outputs)
  fbgemm-w8a8      torch.ops.quantized.linear_dynamic (quantizes activations to int8: W8A8)
  chosen           Int8Weight.linear with the kernels tierlm chose in this process

Method: 2 threads (`--threads`), fp32 activations. Every candidate cycles through enough
copies of its weight to read at least `--working-set` MiB (default 512, twice this machine's
L3) so each call streams its weight from DRAM as decode of a large model does; `--hot`
reuses one copy instead. Per (candidate, shape, rows): 2 warm-up calls, then calls for at least
`--seconds` (and >= 5), median reported. The 1-min load average is printed before and after
and the process's CPU use per wall second during the timed calls: under ~1.8 with 2 threads
means something else shared the cores and the row is marked '!'.

Last, where 4096x11008 and batch 1 are among those run, it prints the int4 / int8 ratio of
tokens/s (t_int8 / t_int4) of each native int4 candidate against the per-channel int8 kernel
at batch 1 on 4096x11008, from calls that alternate between the two (so a load that comes
and goes on the machine slows both alike), with their GB/s.

Run from the repo root: `.venv/bin/python benchmarks/bench_int8_kernels.py` (a few minutes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (576, 1536), (1536, 576), (49152, 576)]
ROWS = (1, 8, 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--working-set", type=int, default=512, help="MiB read per cycle of copies")
    parser.add_argument("--hot", action="store_true", help="one weight copy (cache-resident)")
    parser.add_argument("--seconds", type=float, default=0.3, help="timed seconds per cell")
    parser.add_argument("--shapes", default=None, help="e.g. 4096x4096,576x1536")
    parser.add_argument("--rows", default=None, help="e.g. 1,8,128")
    parser.add_argument("--only", default=None, help="candidates to run, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows_list = tuple(int(v) for v in args.rows.split(",")) if args.rows else ROWS

    from tierlm.quant.dispatch import kernel_choice

    reads = "hot (one copy)" if args.hot else f"working set >= {args.working_set} MiB"
    print(f"load average before: {os.getloadavg()[0]:.2f}; threads {args.threads}; {reads}")
    start = time.perf_counter()
    chosen = kernel_choice(torch.device("cpu"))
    print(
        f"calibrated kernel choice in {time.perf_counter() - start:.2f} s: gemv={chosen.gemv.name}, "
        f"gemm={chosen.gemm.name}, crossover={chosen.crossover} rows; skipped={list(chosen.skipped)}"
    )
    candidates = _candidates(chosen)
    if args.only:
        keep = set(args.only.split(",")) | {"fp32"}
        candidates = [c for c in candidates if c[0] in keep]
    for shape in shapes:
        _bench_shape(shape, rows_list, candidates, args)
    if (4096, 11008) in shapes and 1 in rows_list:
        _int4_over_int8(candidates, args)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def _candidates(chosen):
    """(name, prepare(w) -> state, run(state, x) -> y, weight bytes of state)."""
    from tierlm.quant.int4 import quantize_int4
    from tierlm.quant.int8 import quantize_int8
    from tierlm.quant.kernel_api import KernelUnavailable
    from tierlm.quant.native import load_native
    from tierlm.quant.torch_kernels import BlasKernel

    def int8(w):
        return quantize_int8(w)

    def kernel_run(kernel):
        return lambda qw, x: kernel.matmul(x, qw.qweight, qw.scales_2d, qw.group, offsets=qw.offsets_2d)

    out = [("fp32", lambda w: w, lambda w, x: F.linear(x, w), lambda w: w.nbytes)]
    try:
        native = load_native()
        out.append(("native", int8, kernel_run(native), _int8_bytes))
        out.append(("native-g128", lambda w: quantize_int8(w, 128), kernel_run(native), _int8_bytes))
        out.append(("native-g32-asym", lambda w: quantize_int8(w, 32, asymmetric=True), kernel_run(native),
                    _int8_bytes))  # fmt: skip

        def int4(group, asymmetric=False):
            return lambda w: quantize_int4(w, group, asymmetric=asymmetric)

        def int4_run(qw, x):
            return native.matmul4(x, qw.packed, qw.scales, qw.offsets, qw.group_size)

        out.append(("native-int4-g32", int4(32), int4_run, _int8_bytes))
        out.append(("native-int4-g32-asym", int4(32, True), int4_run, _int8_bytes))
        out.append(("native-int4-g128", int4(128), int4_run, _int8_bytes))
    except KernelUnavailable as err:
        print(f"native kernel unavailable: {err}")
        native = None
    try:
        from tierlm.quant.numba_kernel import load_numba

        out.append(("numba", int8, kernel_run(load_numba()), _int8_bytes))
    except KernelUnavailable as err:
        print(f"numba kernel unavailable: {err}")
    if native is not None:
        blas = BlasKernel(native.dequantize_into)
        out.append(("native-deq+blas", int8, kernel_run(blas), _int8_bytes))
    out.append(("torch-deq+blas", int8, kernel_run(BlasKernel()), _int8_bytes))

    def int8pack(dtype):
        def run(qw, x):
            return torch._weight_int8pack_mm(x.to(dtype), qw.qweight, qw.scales.to(dtype))

        return run

    out.append(("int8pack-fp32", int8, int8pack(torch.float32), _int8_bytes))
    out.append(("int8pack-bf16", int8, int8pack(torch.bfloat16), _int8_bytes))
    out.append(("fbgemm-w8a8", _fbgemm_pack, _fbgemm_run, lambda p: p[1]))
    out.append(("chosen", int8, lambda qw, x: chosen.linear(x, qw), _int8_bytes))
    return out


def _int8_bytes(qw) -> int:
    return qw.nbytes  # Int8Weight or Int4Weight: quantized bytes plus scales (and offsets)


def _fbgemm_pack(w):
    warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*deprecated")
    scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    zeros = torch.zeros(w.shape[0], dtype=torch.int64)
    qweight = torch.quantize_per_channel(w, scales.double(), zeros, axis=0, dtype=torch.qint8)
    return torch.ops.quantized.linear_prepack(qweight, None), w.numel() + scales.numel() * 4


def _fbgemm_run(state, x):
    return torch.ops.quantized.linear_dynamic(x, state[0], False)


def _bench_shape(shape, rows_list, candidates, args) -> None:
    out_features, in_features = shape
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02
    print(f"\n[{out_features} x {in_features}]  (out x in)")
    header = "".join(f"{f'rows={r}: ms':>16}{'GB/s':>8}{'x fp32':>8}" for r in rows_list)
    print(f"{'candidate':<21}{header}")
    baseline = {}
    for name, prepare, run, nbytes in candidates:
        state = prepare(weight)
        size = nbytes(state)
        copies = 1 if args.hot else max(1, -(-args.working_set * 2**20 // size))
        states = [state] + [_clone(state) for _ in range(copies - 1)]
        cells = []
        for rows in rows_list:
            x = torch.randn(rows, in_features)
            seconds, cpu = _time(lambda i: run(states[i % copies], x), args.seconds)
            if name == "fp32":
                baseline[rows] = seconds
            flag = "!" if cpu < 0.9 * args.threads else " "
            speed, ratio = size / seconds / 1e9, baseline[rows] / seconds
            cells.append(f"{seconds * 1e3:>15.3f}{flag}{speed:>8.1f}{ratio:>8.2f}")
        print(f"{name:<21}" + "".join(cells), flush=True)
        del states, state


def _clone(state):
    """A distinct copy of a candidate's weight state (so calls read different memory)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, tuple):  # fbgemm: repack a fresh copy from the unpacked weight
        qweight, bias = torch.ops.quantized.linear_unpack(state[0])
        return torch.ops.quantized.linear_prepack(qweight.clone(), bias), state[1]
    from tierlm.quant.int4 import Int4Weight
    from tierlm.quant.int8 import Int8Weight

    offsets = None if state.offsets is None else state.offsets.clone()
    if isinstance(state, Int4Weight):
        return Int4Weight(state.packed.clone(), state.scales.clone(), state.group_size, offsets=offsets)
    return Int8Weight(state.qweight.clone(), state.scales.clone(), state.group_size, offsets=offsets)


def _int4_over_int8(candidates, args) -> None:
    """The tokens/s ratio t_int8 / t_int4 at batch 1 on 4096x11008, each native int4 candidate
    against the per-channel int8 kernel, timed in alternating calls over their own copies."""
    by_name = {c[0]: c for c in candidates}
    if "native" not in by_name:
        return
    weight = torch.randn(4096, 11008, generator=torch.Generator().manual_seed(0)) * 0.02
    x = torch.randn(1, 11008)
    base = _copies(by_name["native"], weight, args)
    print("\nint4 / int8 (per-channel native) at batch 1 on 4096x11008, alternating calls:")
    for name in ("native-int4-g32", "native-int4-g32-asym", "native-int4-g128"):
        if name not in by_name:
            continue
        other = _copies(by_name[name], weight, args)
        (t8, t4), cpu = _time_pair(base, other, x, args.seconds * 4)
        flag = " (!: the cores were shared)" if cpu < 0.9 * args.threads else ""
        print(f"  {name:<21} {t8 / t4:5.2f}x tokens/s   int8 {t8 * 1e3:.3f} ms {base[2] / t8 / 1e9:5.1f} GB/s, "
              f"int4 {t4 * 1e3:.3f} ms {other[2] / t4 / 1e9:5.1f} GB/s; {cpu:.2f} CPU s per s{flag}",
              flush=True)  # fmt: skip
        del other


def _copies(candidate, weight, args):
    """(run, states, bytes of one state): enough copies to read the working set per cycle."""
    _, prepare, run, nbytes = candidate
    state = prepare(weight)
    size = nbytes(state)
    copies = 1 if args.hot else max(1, -(-args.working_set * 2**20 // size))
    return run, [state] + [_clone(state) for _ in range(copies - 1)], size


def _time_pair(first, second, x, min_seconds: float):
    """Median seconds per call of two (run, states, bytes) candidates, called in turn."""
    samples = ([], [])
    cpu0, wall0 = time.process_time(), time.perf_counter()
    i = 0
    while i < 10 or time.perf_counter() - wall0 < min_seconds:
        for samples_of, (run, states, _) in zip(samples, (first, second)):
            start = time.perf_counter()
            run(states[i % len(states)], x)
            if i >= 2:  # the first two calls warm up
                samples_of.append(time.perf_counter() - start)
        i += 1
    cpu = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    return (statistics.median(samples[0]), statistics.median(samples[1])), cpu


def _time(call, min_seconds: float) -> tuple[float, float]:
    """Median seconds per call and CPU seconds per wall second over the timed calls."""
    call(0)
    call(1)
    samples = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    i = 2
    while len(samples) < 5 or time.perf_counter() - wall0 < min_seconds:
        start = time.perf_counter()
        call(i)
        samples.append(time.perf_counter() - start)
        i += 1
    cpu = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    return statistics.median(samples), cpu


if __name__ == "__main__":
    main()
