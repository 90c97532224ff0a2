"""tierlm next to llama.cpp on the embedded SmolLM2-135M-Instruct, in one run, in three conditions.

Conditions (each configuration is a fresh process; rounds interleave every configuration, so
drift on a shared machine hits all alike):
- quiet, 2 threads: tierlm int8 (fused decode, the default), int8 with `TIERLM_FUSED=0` (the
  eager path: before/after the fused step in one run), int8-g32-asym, fp32, and the 4-bit rows
  int4-g32-asym and auto (= mixed:source: the Q4_1 layers at 4 bits bit for bit, the Q8_0
  embedding as q8_0); tierlm auto on llama.cpp's Q8_0 file (every tensor carried as q8_0, the
  same bytes llama.cpp reads); llama.cpp Q8_0 and Q4_1 (`-t 2`);
- 1 thread: tierlm int8 `--threads 1`, llama.cpp Q8_0 `-t 1`;
- one core busy: a sibling process spins (`python3 -c "while True: pass"`) for the duration of
  these rows only; tierlm int8 at its default thread count (fused and eager) and auto on the Q8_0
  file, llama.cpp Q8_0 `-t 2`.

llama.cpp is measured with its own `llama-bench` (prompt processing of `--prompt` tokens and
generation of `--gen` tokens, `--reps` repetitions), on the package's Q4_1 GGUF and on a Q8_0
GGUF made from it with `llama-quantize --allow-requantize` (same weights, 8-bit format: the peer
of W8A16). tierlm runs `tierlm bench`'s measurement in-process (the same prompt and token counts,
greedy, median of `--runs`), without recording the run in the probe cache (a busy-core run
would "correct" the user's probe); its planner's prediction is reported beside it. Ratios are
against llama.cpp Q8_0 measured in the same condition of the same run, and for the quiet rows
against llama.cpp Q4_1 too (the peer of the 4-bit rows: the same file).

llama.cpp is not a dependency: build it once outside CI (e.g. from the llama-cpp-python sdist's
vendor/llama.cpp: `cmake -B build -DGGML_NATIVE=ON && ninja -C build llama-bench llama-quantize`)
and point `TIERLM_LLAMA_CPP_BIN` at the folder holding the two binaries. Without them the
llama.cpp rows are skipped with a message.

`--also Q4_K_M,...` adds the embedded model re-quantized to those types; `--shape-1b` a 1B-shaped
model (`write_1b_shaped`: Llama-3.2-1B's layers, the embedded tokenizer, random F16 weights) made
into Q8_0 and Q4_K_M files by llama-quantize. Each file's tierlm row also gives its ratios against
llama.cpp on the same file.

Run from the repo root: `.venv/bin/python benchmarks/bench_vs_llamacpp.py` (~8 min on 2 cores,
plus ~1 min probing the machine afresh first; `--shape-1b` adds ~10 min and 6 GB of scratch).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

QUIET, ONE_THREAD, BUSY = "quiet, 2 threads", "1 thread", "one core busy"
PEER = "llama.cpp Q8_0"
PEER4 = "llama.cpp Q4_1"


@dataclass
class Config:
    condition: str
    engine: str
    threads: str  # as shown: "2", "1", "default (N)"
    run: Callable[[], dict]
    samples: list[dict] = field(default_factory=list)
    peer: str = ""  # the llama.cpp row on the same file, for the same-file ratios


def llama_cpp_bin(name: str) -> Path | None:
    folder = os.environ.get("TIERLM_LLAMA_CPP_BIN")
    found = Path(folder) / name if folder else shutil.which(name)
    return Path(found) if found and Path(found).exists() else None


def llama_bench(binary: Path, gguf: Path, prompt: int, gen: int, threads: int, reps: int) -> dict:
    """{"prefill": tok/s, "decode": tok/s} from one llama-bench invocation (`reps` repetitions)."""
    out = subprocess.run(
        [str(binary), "-m", str(gguf), "-p", str(prompt), "-n", str(gen), "-t", str(threads),
         "-r", str(reps), "-o", "json"],
        capture_output=True, text=True, check=True, timeout=1800,
    )  # fmt: skip
    figures = {}
    for row in json.loads(out.stdout):
        kind = "prefill" if row["n_prompt"] and not row["n_gen"] else "decode"
        figures[kind] = row["avg_ts"]
    return figures


# The child: `tierlm bench`'s measurement, its probe check switched off (see the docstring).
TIERLM_CHILD = """
import json, sys
import tierlm.probe.measured as measured
measured.note_measured_decode = lambda *args, **kwargs: None
from tierlm.cli.bench import run_bench
from tierlm.profile import load_profile
from tierlm.runtime.session import open_session
quant, threads, prompt, gen, runs = sys.argv[1], int(sys.argv[2]) or None, *map(int, sys.argv[3:6])
model = sys.argv[6] or None
with open_session(model, load_profile("24gb"), device="cpu", quant=quant, threads=threads) as s:
    print(json.dumps(run_bench(s, prompt, gen, runs)))
"""


# Llama-3.2-1B's layers with the embedded model's tokenizer (49,152 tokens, tied embeddings):
# 1.07 B weights, the size class the "1B-shaped file" names.
SHAPE_1B = {"embedding_length": 2048, "block_count": 16, "feed_forward_length": 8192, "attention.head_count": 32,
            "attention.head_count_kv": 8, "rope.dimension_count": 64}  # fmt: skip


def write_1b_shaped(path: Path, tokenizer_from: Path) -> None:
    """An F16 GGUF of SHAPE_1B with random weights (normal, std 0.02; norms 1) and `tokenizer_from`'s
    tokenizer and chat template, for llama-quantize to make the files both engines read."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(tokenizer_from)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("1B-shaped (random weights)")
    for field in reader.fields.values():  # the tokenizer as the embedded model has it
        if field.name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    for key, value in {**SHAPE_1B, "context_length": 8192, "vocab_size": vocab}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 500000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    hidden, inter = SHAPE_1B["embedding_length"], SHAPE_1B["feed_forward_length"]
    kv = SHAPE_1B["attention.head_count_kv"] * SHAPE_1B["rope.dimension_count"]
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(SHAPE_1B["block_count"]):
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv, hidden),
                   f"blk.{i}.attn_v.weight": (kv, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                   f"blk.{i}.ffn_gate.weight": (inter, hidden), f"blk.{i}.ffn_up.weight": (inter, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, inter)}  # fmt: skip
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
        else:
            writer.add_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tierlm_bench(quant: str, threads: int, prompt: int, gen: int, runs: int, env: dict | None = None,
                 model: Path | None = None) -> dict:
    """`tierlm bench` figures in a fresh process (each configuration loads alone); threads 0:
    tierlm's default (the CPUs this process may use); model None: the embedded one."""
    argv = [sys.executable, "-c", TIERLM_CHILD, quant, str(threads), str(prompt), str(gen), str(runs), str(model or "")]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env={**os.environ, **(env or {})})
    if out.returncode != 0:
        raise RuntimeError(f"tierlm {quant} ({threads} threads) failed: {out.stderr.strip()[-1500:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {"prefill": row["prefill_tokens_per_s"], "decode": row["decode_tokens_per_s"],
            "predicted": row.get("predicted_decode_tokens_per_s"), "threads": row["threads"]}  # fmt: skip


def prepare_probes(env_threads: list[tuple[dict, int]]) -> None:
    """Probe the machine afresh for each distinct (env, threads) before any row runs (the
    prediction column compares with figures taken now, and no probe is taken while the busy
    sibling spins); threads 0: tierlm's default. Rewrites the probe cache, as `doctor --probe`."""
    from tierlm.device.cpu import resolve_threads

    code = ("import sys, torch\ntorch.set_num_threads(int(sys.argv[1]))\n"
            "from tierlm.probe.machine import load_probe\nload_probe('cpu', refresh=True)\n")  # fmt: skip
    for env, threads in {(tuple(env.items()), resolve_threads(threads or None)) for env, threads in env_threads}:
        subprocess.run([sys.executable, "-c", code, str(threads)], env={**os.environ, **dict(env)}, check=True,
                       capture_output=True, timeout=900)  # fmt: skip


def machine() -> dict:
    """CPU model, vector ISA, L3 size and usable CPUs, for the report."""
    from tierlm.probe.bandwidth import last_level_cache_bytes

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    listed = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
    flags = set(listed.group(1).split()) if listed else set()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return {"cpu": model.group(1).strip() if model else "unknown", "isa": isa,
            "l3_mib": last_level_cache_bytes() >> 20, "cpus": len(os.sched_getaffinity(0))}  # fmt: skip


def busy_sibling() -> subprocess.Popen:
    """A process spinning one core at 100% for as long as it lives."""
    return subprocess.Popen(["python3", "-c", "while True: pass"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=2, help="tierlm runs per round (median)")
    parser.add_argument("--reps", type=int, default=3, help="llama-bench repetitions per round")
    parser.add_argument("--json", type=Path, help="also write the raw samples here")
    parser.add_argument("--also", default="", help="more llama-quantize types (e.g. Q4_K_M,Q6_K): tierlm auto on "
                        "each file beside llama.cpp on the same file, quiet")  # fmt: skip
    parser.add_argument("--only-files", action="store_true", help="only the rows of the files (no int8/fp32/... rows)")
    parser.add_argument("--shape-1b", action="store_true", help="also a 1B-shaped model (write_1b_shaped): tierlm "
                        "auto beside llama.cpp on its Q8_0 and Q4_K_M files, quiet")  # fmt: skip
    args = parser.parse_args()

    from tierlm.weights.embedded import embedded_gguf_path, ensure_embedded_model

    ensure_embedded_model()
    p, g, runs = args.prompt, args.gen, args.runs
    eager = {"TIERLM_FUSED": "0"}

    def tierlm(quant, threads, env=None, model=None):
        return lambda: tierlm_bench(quant, threads, p, g, runs, env, model)

    configs = [] if args.only_files else [
        Config(QUIET, "tierlm int8 (fused)", "2", tierlm("int8", 2)),
        Config(QUIET, "tierlm int8 eager (TIERLM_FUSED=0)", "2", tierlm("int8", 2, eager)),
        Config(QUIET, "tierlm int8-g32-asym", "2", tierlm("int8-g32-asym", 2)),
        Config(QUIET, "tierlm fp32", "2", tierlm("fp32", 2)),
        Config(QUIET, "tierlm int4-g32-asym (fused)", "2", tierlm("int4-g32-asym", 2)),
        Config(QUIET, "tierlm auto = mixed:source (fused)", "2", tierlm("auto", 2)),
        Config(ONE_THREAD, "tierlm int8 (fused)", "1", tierlm("int8", 1)),
        Config(BUSY, "tierlm int8 (fused)", "default", tierlm("int8", 0)),
        Config(BUSY, "tierlm int8 eager (TIERLM_FUSED=0)", "default", tierlm("int8", 0, eager)),
    ]
    bench, quantize = llama_cpp_bin("llama-bench"), llama_cpp_bin("llama-quantize")
    scratch = Path(tempfile.mkdtemp(prefix="tierlm-llamacpp-"))
    if bench and quantize:
        q4 = embedded_gguf_path()
        q8 = scratch / "smollm2-q8_0.gguf"
        subprocess.run([str(quantize), "--allow-requantize", str(q4), str(q8), "Q8_0"],
                       capture_output=True, check=True, timeout=600)  # fmt: skip
        tierlm_bench("auto", 2, 8, 2, 1, model=q8)  # import and convert it before anything is timed

        def peer(gguf, threads):
            return lambda: llama_bench(bench, gguf, p, g, threads, args.reps)

        configs += [
            # The same Q8_0 file for both: tierlm's auto carries every tensor as q8_0.
            Config(QUIET, "tierlm auto on the Q8_0 file (= q8_0, fused)", "2", tierlm("auto", 2, model=q8), peer=PEER),
            Config(BUSY, "tierlm auto on the Q8_0 file (= q8_0, fused)", "default", tierlm("auto", 0, model=q8)),
            Config(QUIET, PEER, "2", peer(q8, 2)),
            Config(QUIET, PEER4, "2", peer(q4, 2)),
            Config(ONE_THREAD, PEER, "1", peer(q8, 1)),
            Config(BUSY, PEER, "2", peer(q8, 2)),
        ]
        if args.only_files:
            configs = [c for c in configs if c.condition == QUIET]
        for kind in filter(None, args.also.split(",")):
            other = scratch / f"smollm2-{kind.lower()}.gguf"
            subprocess.run([str(quantize), "--allow-requantize", str(q4), str(other), kind],
                           capture_output=True, check=True, timeout=600)  # fmt: skip
            tierlm_bench("auto", 2, 8, 2, 1, model=other)
            configs += [Config(QUIET, f"tierlm auto on the {kind} file (fused)", "2", tierlm("auto", 2, model=other),
                               peer=f"llama.cpp {kind}"),
                        Config(QUIET, f"llama.cpp {kind}", "2", peer(other, 2))]
        if args.shape_1b:
            f16 = scratch / "1b-shaped-f16.gguf"
            write_1b_shaped(f16, q4)
            for kind in ("Q8_0", "Q4_K_M"):
                other = scratch / f"1b-shaped-{kind.lower()}.gguf"
                subprocess.run([str(quantize), str(f16), str(other), kind], capture_output=True, check=True,
                               timeout=1800)  # fmt: skip
                tierlm_bench("auto", 2, 8, 2, 1, model=other)
                configs += [Config(QUIET, f"tierlm auto on the 1B-shaped {kind} file (fused)", "2",
                                   tierlm("auto", 2, model=other), peer=f"llama.cpp 1B-shaped {kind}"),
                            Config(QUIET, f"llama.cpp 1B-shaped {kind}", "2", peer(other, 2))]  # fmt: skip
            f16.unlink()
    else:
        print("llama.cpp rows skipped: llama-bench / llama-quantize not found "
              "(set TIERLM_LLAMA_CPP_BIN to the folder holding them)\n")  # fmt: skip
    prepare_probes([({}, 2), (eager, 2), ({}, 1), ({}, 0), (eager, 0)])
    host = machine()
    load_before = os.getloadavg()
    try:
        for index in range(args.rounds):
            for condition in (QUIET, ONE_THREAD, BUSY):
                rows = [c for c in configs if c.condition == condition]
                rows = rows if index % 2 == 0 else rows[::-1]  # alternate the order round by round
                sibling = busy_sibling() if condition == BUSY else None
                try:
                    for config in rows:
                        config.samples.append(config.run())
                finally:
                    if sibling is not None:
                        sibling.kill()
                        sibling.wait()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    load_after = os.getloadavg()
    report(configs, host, load_before, load_after, args)
    if args.json:
        args.json.write_text(json.dumps({"machine": host, "load_before": load_before, "load_after": load_after,
                                         "rows": [{"condition": c.condition, "engine": c.engine, "threads": c.threads,
                                                   "samples": c.samples} for c in configs]}, indent=1))  # fmt: skip


def report(configs: list[Config], host: dict, load_before, load_after, args) -> None:
    def median(config: Config, kind: str) -> float | None:
        values = [s[kind] for s in config.samples if s.get(kind)]
        return statistics.median(values) if values else None

    def find(condition: str, engine: str) -> Config | None:
        return next((c for c in configs if c.condition == condition and c.engine == engine), None)

    print(f"CPU {host['cpu']}, {host['isa']}, L3 {host['l3_mib']} MiB, {host['cpus']} usable CPUs; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")  # fmt: skip
    print(f"SmolLM2-135M-Instruct{' (and the 1B-shaped model)' if args.shape_1b else ''}, prompt {args.prompt} tokens, {args.gen} generated; median of "
          f"{args.rounds} interleaved rounds (tierlm: median of {args.runs} runs each; llama-bench: "
          f"mean of {args.reps} repetitions each)\n")  # fmt: skip
    print("| condition | engine | threads | prefill tok/s | decode tok/s | prefill vs Q8_0 | decode vs Q8_0 "
          "| decode vs Q4_1 | decode vs predicted | prefill, decode vs llama.cpp on the same file |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for config in configs:
        prefill, decode = median(config, "prefill"), median(config, "decode")
        peer = find(config.condition, PEER)
        vs = {k: (f"{v / median(peer, k):.2f}x" if peer and v else "n/a") for k, v in
              (("prefill", prefill), ("decode", decode))}  # fmt: skip
        peer4 = find(config.condition, PEER4)
        vs4 = f"{decode / median(peer4, 'decode'):.2f}x" if peer4 and decode else "n/a"
        predicted = median(config, "predicted")
        shown_threads = config.threads
        if config.threads == "default" and config.samples:
            shown_threads = f"default ({config.samples[0].get('threads')})"
        same = find(config.condition, config.peer) if config.peer else None
        same_file = (f"{prefill / median(same, 'prefill'):.2f}x, {decode / median(same, 'decode'):.2f}x"
                     if same and prefill and decode else "")  # fmt: skip
        print(f"| {config.condition} | {config.engine} | {shown_threads} | {prefill:.0f} | {decode:.1f} | "
              f"{vs['prefill']} | {vs['decode']} | {vs4} | {f'{decode / predicted:.0%}' if predicted else 'n/a'} "
              f"| {same_file} |")  # fmt: skip
    busy, alone = find(BUSY, "tierlm int8 (fused)"), find(ONE_THREAD, "tierlm int8 (fused)")
    if busy and alone:
        print(f"\none core busy: tierlm default decode is {median(busy, 'decode') / median(alone, 'decode'):.2f}x "
              f"its own quiet 1-thread figure (target >= 0.8x)")  # fmt: skip
    print("\nraw:", json.dumps({f"{c.condition} | {c.engine}": c.samples for c in configs}))


if __name__ == "__main__":
    main()
