"""tierlm INT8 and fp32 next to llama.cpp on the embedded SmolLM2-135M-Instruct, in one run.

llama.cpp is measured with its own `llama-bench` (prompt processing of `--prompt` tokens and
generation of `--gen` tokens, `-t 2`), on the package's Q4_1 GGUF and on a Q8_0 GGUF made from it
with `llama-quantize --allow-requantize` (same weights, 8-bit format: the peer of W8A16). tierlm
runs `tierlm bench`'s measurement in-process (the same prompt and token counts, greedy, median
of `--runs`). Configurations alternate round by round so drift on a shared machine hits all.

llama.cpp is not a dependency: build it once outside CI (e.g. from the llama-cpp-python sdist's
vendor/llama.cpp: `cmake -B build -DGGML_NATIVE=ON && ninja -C build llama-bench llama-quantize`)
and point `TIERLM_LLAMA_CPP_BIN` at the folder holding the two binaries. Without them the
llama.cpp rows are skipped with a message.

Run from the repo root: `.venv/bin/python benchmarks/bench_vs_llamacpp.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import subprocess
import tempfile
from pathlib import Path


def llama_cpp_bin(name: str) -> Path | None:
    folder = os.environ.get("TIERLM_LLAMA_CPP_BIN")
    found = Path(folder) / name if folder else shutil.which(name)
    return Path(found) if found and Path(found).exists() else None


def llama_bench(binary: Path, gguf: Path, prompt: int, gen: int) -> dict:
    """{"prefill": tok/s, "decode": tok/s} from one llama-bench invocation (its own 5 repetitions)."""
    out = subprocess.run(
        [str(binary), "-m", str(gguf), "-p", str(prompt), "-n", str(gen), "-t", "2", "-o", "json"],
        capture_output=True, text=True, check=True, timeout=1800,
    )  # fmt: skip
    rows = json.loads(out.stdout)
    figures = {}
    for row in rows:
        kind = "prefill" if row["n_prompt"] and not row["n_gen"] else "decode"
        figures[kind] = row["avg_ts"]
    return figures


def tierlm_bench(quant: str, prompt: int, gen: int, runs: int) -> dict:
    """`tierlm bench` figures in a fresh process (each quant mode loads alone)."""
    code = (
        "import json, sys, torch; torch.set_num_threads(2)\n"
        "from tierlm.cli.bench import run_bench\n"
        "from tierlm.profile import load_profile\n"
        "from tierlm.runtime.session import open_session\n"
        f"s = open_session(None, load_profile('24gb'), device='cpu', quant={quant!r})\n"
        f"print(json.dumps(run_bench(s, {prompt}, {gen}, {runs})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=1800)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {"prefill": row["prefill_tokens_per_s"], "decode": row["decode_tokens_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3, help="tierlm runs per round (median)")
    args = parser.parse_args()

    from tierlm.weights.embedded import embedded_gguf_path, ensure_embedded_model

    ensure_embedded_model()
    configs = {
        "tierlm int8": lambda: tierlm_bench("int8", args.prompt, args.gen, args.runs),
        "tierlm int8-g32-asym": lambda: tierlm_bench("int8-g32-asym", args.prompt, args.gen, args.runs),
        "tierlm fp32": lambda: tierlm_bench("fp32", args.prompt, args.gen, args.runs),
    }
    bench, quantize = llama_cpp_bin("llama-bench"), llama_cpp_bin("llama-quantize")
    scratch = Path(tempfile.mkdtemp(prefix="tierlm-llamacpp-"))
    if bench and quantize:
        q4 = embedded_gguf_path()
        q8 = scratch / "smollm2-q8_0.gguf"
        subprocess.run([str(quantize), "--allow-requantize", str(q4), str(q8), "Q8_0"],
                       capture_output=True, check=True, timeout=600)  # fmt: skip
        configs["llama.cpp Q8_0"] = lambda: llama_bench(bench, q8, args.prompt, args.gen)
        configs["llama.cpp Q4_1"] = lambda: llama_bench(bench, q4, args.prompt, args.gen)
    else:
        print("llama.cpp rows skipped: llama-bench / llama-quantize not found "
              "(set TIERLM_LLAMA_CPP_BIN to the folder holding them)\n")  # fmt: skip
    samples: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, run in configs.items():
            samples[name].append(run())
    shutil.rmtree(scratch, ignore_errors=True)

    def median(name: str, kind: str) -> float:
        return statistics.median(s[kind] for s in samples[name])

    peer = "llama.cpp Q8_0" if "llama.cpp Q8_0" in samples else None
    print(f"SmolLM2-135M-Instruct, 2 threads, prompt {args.prompt} tokens, {args.gen} generated; "
          f"median of {args.rounds} interleaved rounds\n")  # fmt: skip
    print("| engine | prefill tok/s | decode tok/s | decode vs llama.cpp Q8_0 | decode vs tierlm fp32 |")
    print("|---|---|---|---|---|")
    for name in samples:
        decode = median(name, "decode")
        vs_peer = f"{decode / median(peer, 'decode'):.2f}x" if peer else "n/a"
        vs_fp32 = f"{decode / median('tierlm fp32', 'decode'):.2f}x"
        print(f"| {name} | {median(name, 'prefill'):.0f} | {decode:.1f} | {vs_peer} | {vs_fp32} |")
    print("\nraw:", json.dumps(samples))


if __name__ == "__main__":
    main()
