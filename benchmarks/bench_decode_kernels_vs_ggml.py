"""tierlm's decode GEMV against llama.cpp's own kernel (ggml's vec_dot), per GGUF type, in one process.

For each GGUF weight type and shape, the same random blocks are multiplied by one activation row
(a decode step) two ways, alternating call batches so a machine whose speed drifts slows both
alike:
- tierlm: `tierlm_weight_matmul` on the weight as tierlm carries it (`carry_weight`), through the
  kernels decode runs (gemv_a16.h's int16 rows, gemv_a8.h's int8 K-quant rows, or the fp32 tiles);
- ggml: the vec_dot that llama.cpp's CPU backend runs for that type (`ggml_get_type_traits_cpu`),
  one call per row, after quantizing the row as llama.cpp does per token (the vec_dot type's
  `from_float`: Q8_0 or Q8_K), rows split over threads by OpenMP.
It prints GB/s of the type's bytes (min and median of the batches), the median ratio, and the
largest difference between the two results relative to the largest output: ~1e-7 says both
quantize activations alike, ~5e-3 that tierlm kept int16 activations where llama.cpp has int8.

llama.cpp is not a dependency: point `TIERLM_LLAMA_CPP_BIN` at a build's bin folder holding
libggml-cpu.so and libggml-base.so (see bench_vs_llamacpp.py); a C shim is compiled against them
with the system compiler (no headers needed). Default: 1 thread (a kernel's own speed; with 2,
OpenMP's spinning after each batch takes the other engine's core), shapes 2048x2048 (cache
resident on most L3s) and SmolLM2's 1536x576 (`--shapes`), every carried type (`--types`).

Run from the repo root: `TIERLM_LLAMA_CPP_BIN=... .venv/bin/python benchmarks/bench_decode_kernels_vs_ggml.py`
(~1 min).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHIM = r"""
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
typedef void (*from_float_t)(const float*, void*, int64_t);
typedef void (*vec_dot_t)(int, float*, size_t, const void*, size_t, const void*, size_t, int);
struct traits { from_float_t from_float; vec_dot_t vec_dot; int vec_dot_type; int64_t nrows; };
const struct traits* ggml_get_type_traits_cpu(int type);
void ggml_cpu_init(void);
size_t ggml_row_size(int type, int64_t ne);
void shim_init(void) { ggml_cpu_init(); }
// y[n] = W[n, :] . x for every row, x quantized once as llama.cpp quantizes a token's activations.
int shim_matvec(int type, const uint8_t* w, int64_t n, int64_t k, const float* x, float* y, int threads) {
  const struct traits* t = ggml_get_type_traits_cpu(type);
  void* q = malloc(ggml_row_size(t->vec_dot_type, k));
  if (!q) return -1;
  ggml_get_type_traits_cpu(t->vec_dot_type)->from_float(x, q, k);
  size_t row = ggml_row_size(type, k);
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; i++) t->vec_dot((int)k, y + i, 0, w + i * row, 0, q, 0, 1);
  free(q);
  return 0;
}
"""


def build_shim(folder: Path, scratch: Path) -> ctypes.CDLL:
    source, library = scratch / "ggml_shim.c", scratch / "libggml_shim.so"
    source.write_text(SHIM)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-fopenmp", str(source), "-o", str(library), f"-L{folder}",
                    "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{folder}"], check=True)  # fmt: skip
    shim = ctypes.CDLL(str(library))
    shim.shim_init()
    shim.shim_matvec.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_int]  # fmt: skip
    return shim


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> int:
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType

    from tests.test_gguf_carry import random_blocks
    from tierlm.quant import native as nat
    from tierlm.quant.modes import CARRIED_SOURCE_TYPES
    from tierlm.weights.gguf_carry import carry_weight

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(sorted(CARRIED_SOURCE_TYPES)))
    parser.add_argument("--shapes", default="2048x2048,1536x576", help="ROWSxCOLS,...")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, default=15, help="alternating batches of 10 calls each")
    args = parser.parse_args()
    folder = os.environ.get("TIERLM_LLAMA_CPP_BIN")
    if not folder or not (Path(folder) / "libggml-cpu.so").exists():
        print("TIERLM_LLAMA_CPP_BIN must name a llama.cpp build's bin folder with libggml-cpu.so")
        return 1
    torch.set_num_threads(args.threads)
    lib = nat.load_native()
    print(f"CPU {cpu_name()}, tierlm's build: {lib.name} (ISA path {lib.isa}); {args.threads} thread(s); "
          f"load average {os.getloadavg()[0]:.2f} before")  # fmt: skip
    print("| type | shape | tierlm GB/s (min, median) | ggml GB/s (min, median) | tierlm / ggml (median) | "
          "max difference |\n|---|---|---|---|---|---|")  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        shim = build_shim(Path(folder), Path(scratch))
        rng = np.random.default_rng(1)
        for shape in args.shapes.split(","):
            rows, cols = (int(v) for v in shape.split("x"))
            x = torch.randn(1, cols)
            for kind in args.types.split(","):
                if kind in ("F16", "BF16", "F32"):
                    continue
                block = 256 if kind.endswith("_K") or kind == "IQ4_XS" else 32
                if cols % block:
                    continue
                raw = random_blocks(kind, rows, cols, rng, spread=0.02)
                weight, keep = carry_weight(kind, raw), []
                words = (ctypes.c_int64 * 9)(*nat.describe_weight(weight, None, (rows, cols), keep))
                ours_y, ggml_y = torch.empty(1, rows), torch.empty(1, rows)
                kind_id = int(getattr(GGMLQuantizationType, kind))

                def ours():
                    lib.lib.tierlm_weight_matmul(x.data_ptr(), 1, words, ours_y.data_ptr(), args.threads)

                def ggml():
                    shim.shim_matvec(kind_id, raw.ctypes.data, rows, cols, x.data_ptr(), ggml_y.data_ptr(),
                                     args.threads)  # fmt: skip

                ours(), ggml()
                difference = float((ours_y - ggml_y).abs().max() / ggml_y.abs().max())
                samples: dict[str, list[float]] = {"ours": [], "ggml": []}
                for _ in range(args.batches):
                    for name, call in (("ours", ours), ("ggml", ggml)):
                        started = time.perf_counter()
                        for _ in range(10):
                            call()
                        samples[name].append((time.perf_counter() - started) / 10)
                rate = {n: (raw.nbytes / min(v) / 1e9, raw.nbytes / sorted(v)[len(v) // 2] / 1e9)
                        for n, v in samples.items()}  # fmt: skip
                print(f"| {kind} | {rows}x{cols} | {rate['ours'][0]:.1f}, {rate['ours'][1]:.1f} | "
                      f"{rate['ggml'][0]:.1f}, {rate['ggml'][1]:.1f} | {rate['ours'][1] / rate['ggml'][1]:.2f}x | "
                      f"{difference:.1e} |", flush=True)  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
