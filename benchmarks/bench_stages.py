"""One model on 1 vs 2 pipeline stages on this machine: decode tok/s and each stage's peak memory.

Method:
- Each configuration is one `tierlm bench MODEL --threads 1 --json --runs 1 [--stages 2]`
  subprocess (one core per stage: rank 0 and its local worker each get one compute thread).
  Configurations run interleaved, round after round (1 stage, 2 stages, 1 stage, ...), so a
  change in the machine's load lands on both alike; the table gives the median and the range.
- Memory: every 0.1 s the script reads VmHWM (peak RSS) of the bench process (rank 0) and of
  each of its descendants from /proc/PID/status; the worker is the descendant with the largest
  VmHWM (the others are interpreter helpers of a few MiB). VmHWM only grows, so the last sample
  before a process exits is its peak up to ~0.1 s before exit (decode is over by then).
- Prediction: `tierlm plan MODEL --threads 1 --json` (1 stage) and `... --stages 2 --json`.
  Predicted memory per stage, two figures: the plan's weights + baseline (what a short run
  touches), and its full charge without the headroom (adds the KV cache for the whole context
  and the workspace, which a 128-token run does not fill; the headroom is a reserve).
- Models: the embedded SmolLM2-135M (int8 as the profile resolves it) and, with --synthetic-layers N,
  a Llama-2-7B-shaped synthetic INT8 model (random weights, tierlm/cache/synthetic.py) with only N
  of its 32 layers, so it is written and loaded within the run's time (every layer has 7B's shape;
  the embedding and head are the full 32000 x 4096).

Run from the repo root: `.venv/bin/python benchmarks/bench_stages.py [--rounds 2] [--synthetic-layers 8]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TIERLM = str(Path(sys.executable).with_name("tierlm"))
SAMPLE_S = 0.1
PLAN_CHARGES = ("baseline", "weights", "kv_cache", "workspace", "staging", "hot_cache")  # not headroom

LLAMA2_7B = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def vm_hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return None  # exited between listing and reading


def run_bench(model: str, stages: int, tokens: int, prompt_tokens: int) -> dict:
    """One bench subprocess; its JSON plus the peak RSS of rank 0 and of the worker."""
    import psutil

    argv = [TIERLM, "bench", model, "--threads", "1", "--json", "--runs", "1",
            "--tokens", str(tokens), "--prompt-tokens", str(prompt_tokens)]
    if stages > 1:
        argv += ["--stages", str(stages)]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    parent = psutil.Process(proc.pid)
    peaks: dict[int, int] = {}
    while proc.poll() is None:
        try:
            pids = [proc.pid] + [child.pid for child in parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for pid in pids:
            peak = vm_hwm(pid)
            if peak is not None:
                peaks[pid] = max(peaks.get(pid, 0), peak)
        time.sleep(SAMPLE_S)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{err[-2000:]}")
    row = json.loads(out)
    workers = sorted((peak for pid, peak in peaks.items() if pid != proc.pid), reverse=True)
    row["rank0_peak"] = peaks.get(proc.pid, row["peak_rss_bytes"])
    row["worker_peak"] = workers[0] if stages > 1 and workers else None
    row["wall_s"] = time.perf_counter() - started
    return row


def plan(model: str, stages: int) -> dict:
    argv = [TIERLM, "plan", model, "--threads", "1", "--json"] + (["--stages", str(stages)] if stages > 1 else [])
    placement = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)

    def charged(stage_plan: dict) -> tuple[int, int]:
        device = stage_plan["charges"]["device"]
        return device["weights"] + device["baseline"], sum(device.get(name, 0) for name in PLAN_CHARGES)

    if stages == 1:
        return {"tps": placement["predicted_decode_tokens_per_s"], "memory": [charged(placement)], "layers": None}
    return {"tps": placement["tokens_per_s"],
            "memory": [charged(stage["placement"]) for stage in placement["stages"]],
            "layers": [(stage["first"], stage["end"]) for stage in placement["stages"]],
            "bottleneck": placement["bottleneck_rank"], "link": placement["link"]["source"]}


def synthetic_model(layers: int) -> str:
    from tierlm.cache.synthetic import write_synthetic_artifact
    from tierlm.paths import cache_root

    config = dict(LLAMA2_7B, num_hidden_layers=layers)
    started = time.perf_counter()
    target = write_synthetic_artifact(config, cache_root() / "artifacts" / f"synthetic-llama2-7b-{layers}layers-int8")
    print(f"synthetic Llama-2-7B-shaped INT8 artifact, {layers} layers: ready in {time.perf_counter() - started:.0f} s", flush=True)
    return str(target)


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def report(label: str, model: str, rows: dict[int, list[dict]], plans: dict[int, dict]) -> None:
    print(f"\n### {label}\n")
    print("| stages | decode tok/s median (range) | predicted tok/s | measured/predicted | prefill tok/s | "
          "rank 0 peak RSS MiB | worker peak RSS MiB | predicted per stage MiB: weights+baseline (full charge) | layers (plan) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for stages, runs in rows.items():
        tps = [run["decode_tokens_per_s"] for run in runs]
        median = statistics.median(tps)
        predicted = plans[stages]
        rank0 = max(run["rank0_peak"] for run in runs)
        worker = max((run["worker_peak"] or 0) for run in runs) or None
        layers = ", ".join(f"{a}-{b - 1}" for a, b in predicted["layers"]) if predicted["layers"] else "all"
        print(f"| {stages} | {median:.1f} ({min(tps):.1f}-{max(tps):.1f}) | {predicted['tps']:.1f} | "
              f"{median / predicted['tps']:.2f} | {statistics.median(run['prefill_tokens_per_s'] for run in runs):.0f} | "
              f"{mib(rank0)} | {mib(worker)} | {' / '.join(f'{mib(touched)} ({mib(full)})' for touched, full in predicted['memory'])} | {layers} |")
    for stages, runs in rows.items():
        print(f"- {stages} stage(s): bench's split: {runs[0].get('stages', ['one process'])}; quant {runs[0]['quant']}")
    print(f"- plan, 2 stages: bottleneck rank {plans[2].get('bottleneck')}, link {plans[2].get('link')}")
    print("\nraw:", json.dumps({str(k): [{key: run[key] for key in ("decode_tokens_per_s", "prefill_tokens_per_s", "rank0_peak",
                                                                   "worker_peak", "load_s", "wall_s")} for run in v]
                                 for k, v in rows.items()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--synthetic-layers", type=int, default=0, help="also a 7B-shaped INT8 model with N layers (0: skip)")
    parser.add_argument("--synthetic-tokens", type=int, default=16)
    parser.add_argument("--synthetic-prompt-tokens", type=int, default=32)
    args = parser.parse_args()

    print(f"CPU: {next(l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name'))}, "
          f"{os.cpu_count()} cores; load average before: {open('/proc/loadavg').read().split()[:3]}", flush=True)
    cases = [("embedded SmolLM2-135M", "smollm2", args.tokens, args.prompt_tokens)]
    if args.synthetic_layers:
        cases.append((f"Llama-2-7B-shaped synthetic INT8, {args.synthetic_layers} of 32 layers",
                      synthetic_model(args.synthetic_layers), args.synthetic_tokens, args.synthetic_prompt_tokens))
    for label, model, tokens, prompt_tokens in cases:
        plans = {stages: plan(model, stages) for stages in (1, 2)}
        rows: dict[int, list[dict]] = {1: [], 2: []}
        for round_index in range(args.rounds):
            for stages in (1, 2):
                row = run_bench(model, stages, tokens, prompt_tokens)
                rows[stages].append(row)
                print(f"  round {round_index + 1}, {stages} stage(s): {row['decode_tokens_per_s']:.1f} tok/s, "
                      f"rank 0 {mib(row['rank0_peak'])} MiB, worker {mib(row['worker_peak'])} MiB, {row['wall_s']:.0f} s", flush=True)
        report(label, model, rows, plans)
    print(f"\nload average after: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
