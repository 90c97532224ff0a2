"""tierlm against Hugging Face transformers on the embedded model, one process per side.

Measures prefill tokens/s, decode tokens/s and peak RSS of tierlm (fp32, and bf16 weights and
compute as with `--dtype bf16`) next to transformers eager fp32 (and sdpa fp32, for reference) on
the same SmolLM2-135M-Instruct weights: the HF-layout directory `ensure_embedded_model()` imports.

Method, identical on every side:
- 2 threads (`torch.set_num_threads(2)`); a fixed English prompt of exactly 34 token ids, encoded
  once by the parent with tierlm's tokenizer and handed to every side, so all see the same ids.
- One greedy run = 1 prefill forward of the 34 ids (logits of the last position only) + 127
  decode forwards of one token each, with argmax on the host after every forward: 128 new tokens.
  EOS does not stop the loop, so every side does exactly this work whatever the model emits.
  Both sides run as plain loops over the model's forward with a KV cache (tierlm:
  `model.forward(ids, cache, logits="last")` on a reset preallocated cache; transformers:
  `model(ids, cache=DynamicCache(), logits_to_keep=1)`), so neither pays for generate()/Engine
  machinery (stop strings, streaming detokenization, logits processors).
- prefill tok/s = 34 / prefill time (including the first argmax); decode tok/s = 127 / time of
  the 127 decode steps. One warm-up run, then the median of `--reps` (default 3) runs.
- Each side is a fresh subprocess (this script with `--side NAME`) that loads its model and then
  runs one greedy run per request from the parent. The parent interleaves the runs round-robin,
  so a burst of load from another process on a shared machine hits all sides alike instead of
  one. Each run records its CPU use (CPU s per wall s): a run that used under 1.8 of its 2 cores
  shared them with another process (and with 2 OpenMP threads on 2 cores that can cost 10x), so
  a side keeps running (for 150 s at most past its first `--reps` runs) until `--reps` of its
  runs are clean; each side keeps its `--reps` least disturbed runs.
- Peak RSS is VmHWM from /proc/self/status at the end of each side's process, so it covers
  interpreter, imports, weight loading and generation.
- The greedy tokens of every side are compared with transformers eager fp32.

Run from the repo root: `.venv/bin/python benchmarks/bench_core.py` (2-4 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = (
    "The history of computing began long before electronic machines. Early mechanical "
    "calculators, such as those built by Blaise Pascal and Gottfried Leibniz, could add and "
    "multiply large numbers."
)
PROMPT_TOKENS = 34
NEW_TOKENS = 128
THREADS = 2
MIN_CPU_USE = 1.8  # CPU s per wall s below which a run shared its cores with another process
EXTRA_RUNS_UNTIL_S = 150  # contended runs are redone only this long, to bound the run time
BASELINE = "transformers eager fp32"
# Row label -> side; each side is one subprocess.
SIDES = {
    BASELINE: "hf-eager",
    "transformers sdpa fp32": "hf-sdpa",
    "tierlm fp32": "tierlm-fp32",
    "tierlm --dtype bf16": "tierlm-bf16",
}


def proc_status_mib(field: str) -> float:
    """A memory line of /proc/self/status (VmHWM = peak RSS, VmRSS = current RSS) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # the kernel reports kB
    raise RuntimeError(f"{field} not in /proc/self/status")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --- a side: runs in its own process --------------------------------------------------------


def tierlm_starter(model_dir: Path, dtype):
    """Load tierlm resident; returns start() -> forward(ids) -> logits [V] over a reset cache."""
    import torch

    from tierlm.runtime.loader import load_model

    loaded = load_model(model_dir, device="cpu", dtype=dtype)
    cache = loaded.new_cache()

    def start():
        cache.reset()
        return lambda ids: loaded.model.forward(torch.tensor([ids]), cache, logits="last")[0, -1]

    return start


def transformers_starter(model_dir: Path, attn: str):
    """Load transformers fp32; returns start() -> forward(ids) -> logits [V] over a new cache."""
    import inspect

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn
    ).eval()
    # transformers 5.x renamed `past_key_values` to `cache`; an unknown keyword would be ignored.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def start():
        cache = DynamicCache(config=model.config)
        return lambda ids: model(
            torch.tensor([ids]), use_cache=True, logits_to_keep=1, **{cache_arg: cache}
        ).logits[0, -1]

    return start


def greedy_run(start, prompt_ids: list[int]) -> dict:
    """One timed greedy run of 1 prefill + 127 decode forwards."""
    forward = start()
    cpu = cpu_seconds()
    began = time.perf_counter()
    tokens = [int(forward(prompt_ids).argmax())]
    prefilled = time.perf_counter()
    for _ in range(NEW_TOKENS - 1):
        tokens.append(int(forward([tokens[-1]]).argmax()))
    ended = time.perf_counter()
    return {
        "tokens": tokens,
        "prefill_s": prefilled - began,
        "decode_s": ended - prefilled,
        "cpu_use": (cpu_seconds() - cpu) / (ended - began),
    }


def serve_side(side: str, model_dir: Path, prompt_ids: list[int]) -> None:
    """Load one side, then answer each stdin line: "run" -> one greedy run, "exit" -> peak RSS.

    Every answer is one JSON line on stdout.
    """
    import torch

    torch.set_num_threads(THREADS)
    rss_import = proc_status_mib("VmRSS")
    began = time.perf_counter()
    if side.startswith("tierlm-"):
        dtype = {"tierlm-fp32": torch.float32, "tierlm-bf16": torch.bfloat16}[side]
        start = tierlm_starter(model_dir, dtype)
    else:
        start = transformers_starter(model_dir, side.removeprefix("hf-"))
    ready = {
        "load_s": time.perf_counter() - began,
        "rss_after_import_torch_mib": rss_import,
        "rss_after_load_mib": proc_status_mib("VmRSS"),
    }
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            print(json.dumps({"peak_rss_mib": proc_status_mib("VmHWM")}), flush=True)
            return
        with torch.inference_mode():
            print(json.dumps(greedy_run(start, prompt_ids)), flush=True)


# --- the parent: starts the sides, interleaves their runs, tabulates -------------------------


class SideProcess:
    """A side's subprocess, spoken to one JSON line at a time."""

    def __init__(self, side: str, model_dir: Path, prompt_ids: list[int]):
        cmd = [sys.executable, __file__, "--side", side, "--model-dir", str(model_dir),
               "--prompt-ids", ",".join(map(str, prompt_ids))]
        env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
                            "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.info = self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"side {self.proc.args[3]} exited with {self.proc.wait()}")
        return json.loads(line)

    def ask(self, request: str) -> dict:
        self.proc.stdin.write(request + "\n")
        return self.read()

    def finish(self) -> dict:
        self.info |= self.ask("exit")
        self.proc.wait()
        return self.info


def benchmark(model_dir: Path, prompt_ids: list[int], reps: int) -> dict[str, dict]:
    """Every side's load info, peak RSS, median speeds and greedy tokens."""
    procs = {}
    try:
        for label, side in SIDES.items():  # loaded one after another, so loads do not overlap
            procs[label] = SideProcess(side, model_dir, prompt_ids)
        for proc in procs.values():  # warm-up
            proc.ask("run")
        runs = collect_runs(procs, reps)
        return {label: summarize(runs[label], prompt_ids) | procs[label].finish() for label in procs}
    finally:
        for proc in procs.values():
            proc.proc.kill()


def collect_runs(procs: dict[str, SideProcess], reps: int) -> dict[str, list[dict]]:
    """Greedy runs round-robin until every side has `reps` clean ones (or time is up); each
    side's `reps` least disturbed runs."""
    runs: dict[str, list[dict]] = {label: [] for label in procs}
    began, turn = time.perf_counter(), 0
    while True:
        short = [label for label in procs if clean_runs(runs[label]) < reps]
        enough = all(len(r) >= reps for r in runs.values())
        if not short or (enough and time.perf_counter() - began > EXTRA_RUNS_UNTIL_S):
            break
        shift = turn % len(short)  # rotate the order so no side always runs first
        for label in short[shift:] + short[:shift]:
            runs[label].append(procs[label].ask("run"))
        turn += 1
    for label, side_runs in runs.items():
        clean = clean_runs(side_runs)
        print(f"{label}: {len(side_runs)} runs, {clean} with both cores to itself", flush=True)
        if clean < reps:
            print("  WARNING: too few undisturbed runs; its numbers are not to be trusted")
    return {label: sorted(r, key=lambda run: -run["cpu_use"])[:reps] for label, r in runs.items()}


def clean_runs(runs: list[dict]) -> int:
    return sum(run["cpu_use"] >= MIN_CPU_USE for run in runs)


def summarize(runs: list[dict], prompt_ids: list[int]) -> dict:
    tokens = runs[0]["tokens"]
    assert all(r["tokens"] == tokens for r in runs), "greedy tokens differ between repetitions"
    decode = sorted((NEW_TOKENS - 1) / r["decode_s"] for r in runs)
    return {
        "tokens": tokens,
        "prefill_tok_s": len(prompt_ids) / statistics.median(r["prefill_s"] for r in runs),
        "decode_tok_s": statistics.median(decode),
        "decode_range": (decode[0], decode[-1]),
        "cpu_use": min(r["cpu_use"] for r in runs),
    }


def agreement(tokens: list[int], reference: list[int]) -> str:
    if tokens == reference:
        return f"all {len(tokens)} match"
    first = next(i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)
    return f"first {first} match"


def table(results: dict[str, dict]) -> str:
    """Markdown table; ratios are each row / transformers eager fp32."""
    base = results[BASELINE]
    lines = [
        "| configuration | prefill tok/s | decode tok/s | peak RSS MiB "
        "| prefill ratio | decode ratio | RSS ratio | greedy tokens vs HF eager |",
        "|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for label, r in results.items():
        lines.append(
            f"| {label} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | {r['peak_rss_mib']:.0f} "
            f"| {r['prefill_tok_s'] / base['prefill_tok_s']:.2f} "
            f"| {r['decode_tok_s'] / base['decode_tok_s']:.2f} "
            f"| {r['peak_rss_mib'] / base['peak_rss_mib']:.2f} "
            f"| {agreement(r['tokens'], base['tokens'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per side (≥3)")
    parser.add_argument("--side", choices=sorted(SIDES.values()), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reps < 3:
        parser.error("--reps must be at least 3")

    if args.side:
        serve_side(args.side, args.model_dir, [int(i) for i in args.prompt_ids.split(",")])
        return

    import torch

    from tierlm.runtime.tokenizer import Tokenizer
    from tierlm.weights.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    prompt_ids = Tokenizer.from_dir(model_dir).encode(PROMPT)
    assert len(prompt_ids) == PROMPT_TOKENS, f"prompt is {len(prompt_ids)} tokens, not {PROMPT_TOKENS}"
    print(f"model {model_dir}\ntorch {torch.__version__}, {THREADS} threads, {PROMPT_TOKENS}-token "
          f"prompt, {NEW_TOKENS} greedy new tokens, median of {args.reps}; "
          f"load average before: {os.getloadavg()[0]:.2f}\n")
    results = benchmark(model_dir, prompt_ids, args.reps)
    for label, r in results.items():
        low, high = r["decode_range"]
        print(f"{label}: load {r['load_s']:.1f} s; RSS after import torch "
              f"{r['rss_after_import_torch_mib']:.0f} MiB, after load {r['rss_after_load_mib']:.0f} MiB; "
              f"decode {low:.1f}-{high:.1f} tok/s over the runs; lowest CPU use {r['cpu_use']:.2f}")
    print("\n" + table(results))


if __name__ == "__main__":
    main()
