"""Issue 14: a Qwen3-30B-A3B-shaped INT8 model under the 24gb and 16gb budgets, each run capped.

Model: tests/data/qwen3-30b-a3b/config.json (48 layers, 128 experts, top-8) with random weights
written by tierlm.cache.synthetic (29 GiB), with its routers skewed (Zipf exponent `--skew`,
default 0.5; the synthetic module documents how) and with `--uniform` also unskewed (random
routers, near uniform: the cache's worst case; another 29 GiB of disk). `--layers N` cuts the
config to N layers (a smaller variant, e.g. with an `<N>GiB` budget holding half its experts).

Every run is a fresh child process inside a cgroup v1 memory group capped at the profile's
device budget (page cache included, the artifact evicted from the page cache first, so cold
experts really come from the disk), 2 threads. It prefills `PROMPT_TOKENS` tokens (the warm-up `WARMUP_PROMPT_TOKENS`), then
runs `--tokens` decode steps fed from a seeded random token stream (forced decoding): greedy
decoding of random weights soon repeats one token, which would route every step alike and
flatter every cache. Reported: decode tok/s (steps / their time) beside the planner's predicted
tok/s and expected hit rate, the measured expert hit rate and speculative accuracy (ledger),
peak RSS (VmHWM) and the cgroup's max_usage (RSS + page cache + kernel).

Runs vary the expert cache (TIERLM_EXPERT_CACHE=lfu|lru|stream) and speculative prefetch
(TIERLM_SPECULATE=0 turns it off). A warm-up run first lets the cache learn routing counts
(persisted beside the artifact: the planner places the hottest experts from them), as a
deployment would after its first requests; its own figures are printed too (uniform placement).

Run from the repo root as root: `.venv/bin/python benchmarks/bench_moe.py [--tokens 16]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench_offload import evict_from_page_cache, remove_cgroup

CONFIG = Path(__file__).resolve().parents[1] / "tests" / "data" / "qwen3-30b-a3b" / "config.json"
PROMPT_TOKENS = 8
WARMUP_PROMPT_TOKENS = 64  # the warm-up's prompt: 512 picks per layer for the counts to learn from
WARMUP_SEED = 1  # every run decodes tokens no earlier run saw (seeds 2, 3, ...): the counts it is
# placed from (saved by the warm-up and earlier runs) never include its own tokens
CHILD_TIMEOUT_S = 900


def raw_config(layers: int | None = None) -> dict:
    """Qwen3-30B-A3B's config.json, with `layers` decoder layers where given (smoke runs)."""
    raw = json.loads(CONFIG.read_text())
    return raw if layers is None else {**raw, "num_hidden_layers": layers}


def artifact_path(skew: float | None, layers: int | None = None) -> Path:
    from tierlm.paths import cache_root

    name = "synthetic-qwen3-30b-a3b" + ("" if layers is None else f"-{layers}l")
    return cache_root() / "artifacts" / f"{name}-int8-{'uniform' if skew is None else f'zipf{skew:g}'}"


def build(skew: float | None, layers: int | None = None) -> tuple[Path, float]:
    """The artifact for `skew` (written unless present) and the seconds it took."""
    from tierlm.cache.synthetic import write_synthetic_artifact

    started = time.perf_counter()
    path = write_synthetic_artifact(raw_config(layers), artifact_path(skew, layers), router_skew=skew)
    return path, time.perf_counter() - started


# -- the child: one capped run ---------------------------------------------------------------


def token_stream(vocab: int, seed: int, count: int) -> list[int]:
    import torch

    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_child(artifact: str, profile: str, steps: str, seed: str, prompt: str) -> dict:
    import torch

    from tierlm.profile import load_profile
    from tierlm.runtime.loader import load_model

    torch.set_num_threads(2)
    started = time.perf_counter()
    loaded = load_model(Path(artifact), device="cpu", dtype=torch.float32, profile=load_profile(profile))
    load_s = time.perf_counter() - started
    tokens = token_stream(loaded.config.vocab_size, int(seed), int(prompt) + int(steps))
    cache = loaded.new_cache()
    with torch.inference_mode():
        started = time.perf_counter()
        loaded.model.forward(torch.tensor([tokens[: int(prompt)]]), cache)
        prefill_s = time.perf_counter() - started
        prefill = loaded.store.stats().snapshot().get("experts", {})
        started, cpu = time.perf_counter(), time.process_time()
        for token in tokens[int(prompt) :]:
            loaded.model.forward(torch.tensor([[token]]), cache)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    snapshot = loaded.store.stats().snapshot()
    placement = loaded.placement
    layers = placement.expert_layers
    result = {
        "load_s": load_s,
        "prefill_s": prefill_s,
        "decode_tps": int(steps) / elapsed,
        "decode_cpu_share": cpu / elapsed,  # CPU seconds per wall second while decoding (2 = both cores)
        "predicted_tps": placement.predicted_decode_tokens_per_s,
        "binding_limit": placement.binding_limit,
        "expert_slots": placement.expert_slots,
        "experts_resident": sum(x.resident for x in layers),
        "experts_total": sum(x.experts for x in layers),
        "predicted_hit": sum(x.hit_rate for x in layers) / max(len(layers), 1),
        "decode_experts": _minus(snapshot.get("experts", {}), prefill),
        "bytes_read_per_token": snapshot["bytes_read_per_token"],
        "stall_s": snapshot["stall_s"],
        "peak_rss": next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")),
    }
    loaded.close()  # saves the routing counts the cache learned
    return result


def _minus(after: dict, before: dict) -> dict:
    """Decode steps' expert figures: the totals after decoding less those after the prefill."""
    hits = after.get("hits", 0) - before.get("hits", 0)
    misses = after.get("misses", 0) - before.get("misses", 0)
    guessed = after.get("speculative_guesses", 0) - before.get("speculative_guesses", 0)
    right = after.get("speculative_right", 0) - before.get("speculative_right", 0)
    return {"hits": hits, "misses": misses, "hit_rate": hits / max(hits + misses, 1),
            "speculative_guesses": guessed, "speculative_accuracy": right / guessed if guessed else None}  # fmt: skip


# -- the parent: cgroups, page cache, the table -----------------------------------------------


def profile_file(spec: str, folder: Path) -> str:
    """A shipped profile's name as given, or for "<N>GiB" a profile file of that budget (the
    16gb profile's other settings, headroom 1 GiB as shipped) for the smaller-layer variants."""
    if not spec.lower().endswith("gib"):
        return spec
    path = folder / f"{spec}.toml"
    path.write_text(
        f'description = "bench_moe"\ndevice_memory = "{spec}"\nhost_memory = "{spec}"\ndisk_offload = true\n'
        'headroom = "1GiB"\nquant = "auto"\nkv_cache = "auto"\ncontext_length = 4096\nbatch_size = 1\nprefetch_depth = 2\n'
    )
    return str(path)


def own_memory_cgroup() -> Path | None:
    """This process's cgroup v1 memory group, where a child group can be made (as root)."""
    root = Path("/sys/fs/cgroup/memory")
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            group = root / path.lstrip("/")
            return group if (group / "memory.limit_in_bytes").exists() and os.access(group, os.W_OK) else None
    return None


def capped_run(artifact: Path, profile: str, steps: int, seed: int, env: dict, prompt: int = PROMPT_TOKENS) -> dict:
    """One child run inside a fresh memory cgroup capped at `profile`'s device budget."""
    from tierlm.profile import load_profile

    limit = load_profile(profile).device_memory
    parent = own_memory_cgroup()
    if parent is None:
        raise SystemExit("needs a writable cgroup v1 memory controller (run as root)")
    group = parent / f"tierlm-bench-moe-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        if (group / "memory.memsw.limit_in_bytes").exists():
            (group / "memory.memsw.limit_in_bytes").write_text(str(limit))
        evict_from_page_cache(artifact / "weights.bin")
        command = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh",
                   sys.executable, __file__, "--child", str(artifact), profile, str(steps), str(seed), str(prompt)]  # fmt: skip
        started = time.perf_counter()
        out = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env={**os.environ, **env})
        wall = time.perf_counter() - started
        usage = int((group / "memory.max_usage_in_bytes").read_text())
        failcnt = int((group / "memory.failcnt").read_text())
        oom = (group / "memory.oom_control").read_text()
    finally:
        remove_cgroup(group)
    if out.returncode:
        tail = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
        return {"error": tail, "limit": limit, "cgroup_max_usage": usage, "wall_s": wall, "oom": oom}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    load = f"{os.getloadavg()[0]:.1f}"
    return {**result, "limit": limit, "cgroup_max_usage": usage, "cgroup_failcnt": failcnt, "wall_s": wall, "load": load}


def machine() -> str:
    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return f"{model}, {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"


def routing_share(artifact: Path) -> str:
    """What the learned counts say: the share of picks the busier half (and quarter) of each
    layer's experts got (an ideal frequency cache's hit rate at that size), over the layers."""
    from tierlm.offload.routing_counts import COUNTS_NAME, RoutingCounts

    config = json.loads((artifact / "config.json").read_text())
    layers, experts = config["num_hidden_layers"], config["num_experts"]
    counts = RoutingCounts.load(artifact / COUNTS_NAME, range(layers), experts)

    def shares(size: int) -> str:
        each = [counts.hit_rate(i, counts.ranked(i)[:size]) for i in range(layers)]
        return f"{sum(each) / layers:.1%} (layers {min(each):.1%}..{max(each):.1%}, first {each[0]:.1%}, last {each[-1]:.1%})"

    return f"busier half of each layer's experts got {shares(experts // 2)} of the picks, busier quarter {shares(experts // 4)}"


def row(label: str, r: dict) -> str:
    gib, mib = 2**30, 2**20
    if "error" in r:
        return f"| {label} | failed: {r['error'][:120]} | | | | | | | {r['cgroup_max_usage'] / gib:.2f} / {r['limit'] / gib:.1f} | | |"
    e = r["decode_experts"]
    spec = "off" if e["speculative_accuracy"] is None else f"{e['speculative_accuracy']:.0%}"
    ratio = r["decode_tps"] / r["predicted_tps"] if r["predicted_tps"] else float("nan")
    read = sum(r["bytes_read_per_token"].values()) / mib
    return (f"| {label} | {r['decode_tps']:.3f} | {r['predicted_tps']:.3f} ({ratio:.0%}) | "
            f"{r['experts_resident']}/{r['experts_total']} | {e['hit_rate']:.1%} ({r['predicted_hit']:.1%}) | {spec} | {read:.0f} | "
            f"{r['peak_rss'] / gib:.2f} | {r['cgroup_max_usage'] / gib:.2f} / {r['limit'] / gib:.1f} | "
            f"{r.get('decode_cpu_share', float('nan')):.2f} | {r.get('load', '')} |")  # fmt: skip


HEADER = ("| run | decode tok/s | predicted tok/s (measured/predicted) | experts resident | decode hit rate (planner's) | "
          "spec. accuracy | MiB read/token | peak RSS GiB | cgroup max_usage / cap GiB | CPU share | load avg (1 min) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
VARIANTS = {  # label -> environment
    "lfu + speculation": {"TIERLM_EXPERT_CACHE": "lfu", "TIERLM_SPECULATE": "1"},
    "lru + speculation": {"TIERLM_EXPERT_CACHE": "lru", "TIERLM_SPECULATE": "1"},
    "stream + speculation": {"TIERLM_EXPERT_CACHE": "stream", "TIERLM_SPECULATE": "1"},
    "lfu without speculation": {"TIERLM_EXPERT_CACHE": "lfu", "TIERLM_SPECULATE": "0"},
}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(run_child(*sys.argv[2:])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skew", type=float, default=0.5, help="Zipf exponent of the skewed routers")
    parser.add_argument("--tokens", type=int, default=16, help="decode steps per run")
    parser.add_argument("--profiles", default="16gb,24gb", help="shipped names or <N>GiB budgets")
    parser.add_argument("--runs", help="profile:variant pairs instead of every profile x variant, e.g. 16gb:lfu + speculation")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated labels of VARIANTS")
    parser.add_argument("--uniform", action="store_true", help="also run the unskewed artifact (built if absent: ~31 GB more disk)")
    parser.add_argument("--layers", type=int, help="fewer decoder layers (a smoke run of the script)")
    parser.add_argument("--no-warmup", action="store_true", help="keep the counts the artifact has")
    parser.add_argument("--first-seed", type=int, default=WARMUP_SEED + 1, help="above every seed earlier runs used")
    parser.add_argument("--build-only", action="store_true")
    args = parser.parse_args()
    print(f"machine: {machine()}\n")
    skewed, seconds = build(args.skew, args.layers)
    print(f"skewed artifact ({args.skew:g}): {skewed} ready after {seconds:.0f} s")
    if args.build_only:
        return
    artifacts = {f"zipf {args.skew:g}": skewed}
    if args.uniform:
        artifacts["uniform"] = build(None, args.layers)[0]
    folder = Path(tempfile.mkdtemp(prefix="bench-moe-"))
    profiles = [profile_file(spec, folder) for spec in args.profiles.split(",")]
    variants = args.variants.split(",")
    raw, seeds = {}, iter(range(args.first_seed, 1 << 30))
    for name, artifact in artifacts.items():
        if not args.no_warmup:
            warm = capped_run(artifact, profiles[0], args.tokens, WARMUP_SEED, VARIANTS["lfu + speculation"], WARMUP_PROMPT_TOKENS)
            print(f"\n{name}, warm-up ({Path(profiles[0]).stem}, placed from uniform counts):\n{HEADER}\n{row('warm-up', warm)}", flush=True)
            raw[f"{name} warm-up"] = warm
        print(f"\n{name}: {routing_share(artifact)}; {machine()}\n{HEADER}", flush=True)
        # Interleaved: each profile's variants alternate, so a drift in the machine's load spreads over all
        pairs = [(p, v) for v in variants for p in profiles]
        if args.runs:
            pairs = [(profile_file(p, folder), v) for p, v in (pair.split(":") for pair in args.runs.split(","))]
        for profile, variant in pairs:
            result = capped_run(artifact, profile, args.tokens, next(seeds), VARIANTS[variant])
            label = Path(profile).stem
            raw[f"{name} {label} {variant}"] = result
            print(row(f"{name}, {label}, {variant}", result) + f"  <!-- {machine()}, wall {result['wall_s']:.0f} s -->", flush=True)
        print(f"after the runs: {routing_share(artifact)}")
    print("\nraw:", json.dumps(raw))
    print(f"free disk: {shutil.disk_usage(skewed).free / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
