"""Offloaded decode under a memory cap: tierlm tiered vs resident vs the planner vs accelerate.

Model: the embedded SmolLM2-135M-Instruct. tierlm runs its INT8 artifact under a profile whose
device budget leaves about 40% of the weights resident (the rest streams from disk through the
prefetch ring), and fully resident; the planner's predicted decode rate is printed beside the
measured one. The peer is transformers + accelerate with `device_map="auto"`, a CPU
`max_memory` cap and disk offload (`offload_folder`), fp32 as accelerate runs it.
Each configuration is a fresh subprocess: 2 threads, a 16-token prompt, 32 greedy tokens,
decode tokens/s = 31 / time of the 31 decode steps; peak RSS = VmHWM at the end.

`--headline` instead writes a 6.7B-shaped synthetic INT8 model (Llama-2-7B shapes, random
weights, ~7 GB, generated once into the cache) and runs it under `--profile 24gb` (resident)
and `--profile 4gb` (streamed from disk), `HEADLINE_STEPS` decode steps each. Where cgroup v1
memory control is writable, the 4gb run executes inside a memory cgroup capped at the
profile's 4 GiB with the artifact evicted from the page cache first: the page cache is charged
to the cgroup, so streamed blocks really come from disk, as on a 4 GB machine.

`--mixed` writes a ChatGLM3-6B-shaped synthetic model (its real config.json, tests/data/chatglm3-6b,
random weights) at `--quant mixed:5.2GiB` (int8 or int4 per weight, estimated: random weights
are all alike) and runs it under `--profile 8gb` inside a memory cgroup capped at the profile's
7 GiB device budget, cold page cache: the seed's "ChatGLM-6B in 5.2 GB" on an 8 GB machine.

Run from the repo root: `.venv/bin/python benchmarks/bench_offload.py [--headline | --mixed]`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 19556, 905]
STEPS = 32
LLAMA2_7B = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def peak_rss() -> int:
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))


HEADLINE_STEPS = 8


def run_tierlm(model: str, profile: str, steps: str = str(STEPS)) -> dict:
    import torch

    from tierlm.profile import load_profile
    from tierlm.runtime.loader import load_model

    torch.set_num_threads(2)
    loaded = load_model(model, device="cpu", dtype=torch.float32, profile=load_profile(profile))
    prompt = [t % loaded.config.vocab_size for t in PROMPT]
    cache = loaded.new_cache()
    logits = loaded.model.forward(torch.tensor([prompt]), cache)
    token = int(logits[0, -1].argmax())
    started = time.perf_counter()
    for _ in range(int(steps) - 1):
        token = int(loaded.model.forward(torch.tensor([[token]]), cache)[0, -1].argmax())
    elapsed = time.perf_counter() - started
    placement = loaded.placement
    ledger = getattr(loaded.store, "ledger", None)
    result = {
        "decode_tps": (int(steps) - 1) / elapsed,
        "predicted_tps": placement.predicted_decode_tokens_per_s,
        "binding_limit": placement.binding_limit,
        "bytes_by_tier": placement.block_bytes_by_tier(),
        "budget": load_profile(profile).device_memory,
        "peak_rss": peak_rss(),
        "overlap": ledger.overlap if ledger else None,
        "stall_s": ledger.stall_s if ledger else None,
    }
    loaded.close()
    return result


def run_accelerate(model_dir: str, cap: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    offload = tempfile.mkdtemp(prefix="accelerate-offload-")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, device_map="auto", max_memory={"cpu": cap}, offload_folder=offload
    )
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[0, -1].argmax()
        started = time.perf_counter()
        for _ in range(STEPS - 1):
            out = model(token.view(1, 1), past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[0, -1].argmax()
        elapsed = time.perf_counter() - started
    return {"decode_tps": (STEPS - 1) / elapsed, "peak_rss": peak_rss()}


def side(argv: list[str], cgroup: Path | None = None, script: str = __file__, flag: str = "--side") -> dict:
    """`script --side argv` (or `flag`) in a fresh process (joined to `cgroup` before Python starts)."""
    command = [sys.executable, script, flag, *argv]
    if cgroup is not None:  # join before Python starts, so every byte the child touches is charged
        command = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *command]
    out = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def budget_profile(folder: Path, name: str, device_memory: int) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(
        f'description = "benchmark"\ndevice_memory = {device_memory}\nhost_memory = {device_memory}\n'
        'disk_offload = true\nheadroom = "16MiB"\nquant = "int8"\nkv_cache = "auto"\n'
        "context_length = 512\nbatch_size = 1\nprefetch_depth = 2\n"
    )
    return path


def child_baseline() -> int:
    """The RSS a fresh run process reaches before loading weights (torch, tierlm, kernels)."""
    return side(["baseline"])["rss"]


def run_baseline() -> dict:
    """What `run_tierlm`'s process holds when the loader reads its baseline."""
    import torch

    from tierlm.profile import load_profile  # noqa: F401 - imported as run_tierlm does
    from tierlm.runtime.loader import runtime_baseline

    torch.set_num_threads(2)
    return {"rss": runtime_baseline(torch.device("cpu"), "int8").charged}


def budget_for_resident_share(artifact: Path, folder: Path, share: float) -> int:
    """The smallest device budget whose plan keeps `share` of the weights resident: the rest of
    the budget is what the planner charges besides weights (baseline, KV, workspace, ring)."""
    from tierlm.models import read_config
    from tierlm.errors import TierlmError
    from tierlm.offload.planner.search import plan
    from tierlm.probe.machine import load_bandwidths
    from tierlm.offload.sizes import sizes_from_artifact
    from tierlm.profile import load_profile

    baseline = child_baseline() + (16 << 20)  # margin for run-to-run drift
    config, sizes = read_config(artifact), sizes_from_artifact(artifact)
    bandwidths = load_bandwidths("cpu")
    low, high = baseline, baseline + 2 * sizes.total
    while high - low > (1 << 20):
        mid = (low + high) // 2
        try:
            placed = plan(config, sizes, load_profile(str(budget_profile(folder, "probe", mid))),
                          bandwidths, accelerator=False, baseline_bytes=baseline)  # fmt: skip
            resident = placed.charges["device"].get("weights", 0)
        except TierlmError:
            resident = -1
        low, high = (low, mid) if resident >= share * sizes.total else (mid, high)
    return high


def smollm(folder: Path) -> None:
    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.offload.sizes import sizes_from_artifact
    from tierlm.weights.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    artifact = ensure_artifact(ConversionRequest(model_dir, (), "int8"))
    weights = sizes_from_artifact(artifact).total
    budget = budget_for_resident_share(artifact, folder, 0.4)
    capped, enforced = capped_side(["tierlm", str(artifact), str(budget_profile(folder, "capped", budget))],
                                   budget, artifact)  # fmt: skip
    resident = side(["tierlm", str(artifact), str(budget_profile(folder, "resident", 16 << 30))])
    peer = side(["accelerate", str(model_dir), f"{max(int(0.4 * 4 * weights) >> 20, 1)}MB"])
    print(f"SmolLM2-135M INT8 weights {weights / 2**20:.0f} MiB; capped budget {budget / 2**20:.0f} MiB"
          + (" (enforced by a cgroup, cold page cache)" if enforced else " (no cgroup here)") + "\n")
    print("| run | decode tok/s | predicted | binding limit | peak RSS MiB | vs accelerate |")
    print("|---|---|---|---|---|---|")
    for label, row in (("tierlm streamed (cap)", capped), ("tierlm resident", resident), ("accelerate disk offload (cap)", peer)):
        if "error" in row:
            print(f"| {label} | failed: {row['error']} | | | | |")
            continue
        ratio = row["decode_tps"] / peer["decode_tps"] if "decode_tps" in peer else float("nan")
        print(f"| {label} | {row['decode_tps']:.1f} | {row.get('predicted_tps', float('nan')):.1f} | "
              f"{row.get('binding_limit', '')} | {row['peak_rss'] / 2**20:.0f} | {ratio:.1f}x |")
    print("\nraw:", json.dumps({"capped": capped, "resident": resident, "accelerate": peer}))


def headline() -> None:
    from tierlm.cache.synthetic import write_synthetic_artifact
    from tierlm.paths import cache_root

    target = cache_root() / "artifacts" / "synthetic-llama2-7b-int8"
    started = time.perf_counter()
    write_synthetic_artifact(LLAMA2_7B, target)
    print(f"synthetic Llama-2-7B-shaped INT8 artifact ready in {time.perf_counter() - started:.0f} s: {target}\n")
    from tierlm.profile import format_size, load_profile

    print("| profile | decode tok/s | predicted | binding limit | resident / disk bytes | peak RSS GiB | cap |")
    print("|---|---|---|---|---|---|---|")
    for profile in ("24gb", "4gb"):
        argv, limit = ["tierlm", str(target), profile, str(HEADLINE_STEPS)], load_profile(profile).device_memory
        if profile == "4gb":
            row, enforced = capped_side(argv, limit, target)
        else:
            row, enforced = side(argv), False
        cap = f"cgroup {format_size(limit)}, cold page cache" if enforced else "none"
        if "error" in row:
            print(f"| {profile} | failed: {row['error']} | | | | | {cap} |")
            continue
        tiers = row["bytes_by_tier"]
        print(f"| {profile} | {row['decode_tps']:.2f} | {row['predicted_tps']:.2f} | {row['binding_limit']} | "
              f"{tiers.get('device', 0) / 2**30:.1f} / {tiers.get('disk', 0) / 2**30:.1f} GiB | "
              f"{row['peak_rss'] / 2**30:.2f} | {cap} |")


CHATGLM3_6B = Path(__file__).resolve().parent.parent / "tests" / "data" / "chatglm3-6b" / "config.json"
MIXED_SIZE = "mixed:5.2GiB"


def mixed_headline() -> None:
    from tierlm.cache.artifact import Artifact
    from tierlm.cache.synthetic import write_synthetic_artifact
    from tierlm.paths import cache_root
    from tierlm.profile import format_size, load_profile
    from tierlm.quant.mixed import summary

    target = cache_root() / "artifacts" / "synthetic-chatglm3-6b-mixed-5.2gib"
    started = time.perf_counter()
    write_synthetic_artifact(json.loads(CHATGLM3_6B.read_text()), target, quant=MIXED_SIZE)
    artifact = Artifact.open(target)
    modes = {f"{b}/{t}": f"{r.encoding}" for b, block in artifact.blocks.items() for t, r in block.tensors.items()}
    weights = (target / "weights.bin").stat().st_size
    print(f"synthetic ChatGLM3-6B-shaped {MIXED_SIZE} artifact ready in {time.perf_counter() - started:.0f} s: "
          f"{weights / 2**30:.3f} GiB of weights ({summary(modes)}): {target}\n")  # fmt: skip
    limit = load_profile("8gb").device_memory
    row, enforced = capped_side(["tierlm", str(target), "8gb", str(HEADLINE_STEPS)], limit, target)
    cap = f"cgroup {format_size(limit)}, cold page cache" if enforced else "none"
    print("| profile | weights | decode tok/s | predicted | binding limit | resident / disk bytes | peak RSS GiB | cap |")
    print("|---|---|---|---|---|---|---|---|")
    if "error" in row:
        print(f"| 8gb | {MIXED_SIZE} | failed: {row['error']} | | | | | {cap} |")
        return
    tiers = row["bytes_by_tier"]
    print(f"| 8gb | {weights / 2**30:.2f} GiB | {row['decode_tps']:.2f} | {row['predicted_tps']:.2f} | {row['binding_limit']} | "
          f"{tiers.get('device', 0) / 2**30:.2f} / {tiers.get('disk', 0) / 2**30:.2f} GiB | {row['peak_rss'] / 2**30:.2f} | "
          f"{cap} |")  # fmt: skip


def capped_side(argv: list[str], limit: int, artifact: Path, script: str = __file__,
                flag: str = "--side") -> tuple[dict, bool]:  # fmt: skip
    """`side(argv)` inside a cgroup capped at `limit` (page cache included) with the artifact
    evicted from the page cache first, so streamed blocks come from the disk and not from RAM
    left over; (its result, whether the cap was enforced)."""
    group = memory_cgroup(limit)
    if group is None:
        return side(argv, script=script, flag=flag), False
    evict_from_page_cache(artifact / "weights.bin")
    try:
        return side(argv, cgroup=group, script=script, flag=flag), True
    finally:
        remove_cgroup(group)


def memory_cgroup(limit: int) -> Path | None:
    """A fresh cgroup v1 memory group capped at `limit` bytes (swap included), or None."""
    import os
    import uuid

    root = Path("/sys/fs/cgroup/memory")
    if not (root / "memory.limit_in_bytes").exists() or not os.access(root, os.W_OK):
        print("(no writable cgroup v1 memory controller: the run is not capped)\n")
        return None
    group = root / f"tierlm-bench-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(limit))
    if (group / "memory.memsw.limit_in_bytes").exists():
        (group / "memory.memsw.limit_in_bytes").write_text(str(limit))
    return group


def remove_cgroup(group: Path) -> None:
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def evict_from_page_cache(path: Path) -> None:
    """Drop the file's clean pages from the page cache, so the next reads go to the disk."""
    import os

    from tierlm.probe.bandwidth import drop_pages

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        drop_pages(fd)
    finally:
        os.close(fd)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--side":
        kind, *rest = sys.argv[2:]
        runs = {"tierlm": run_tierlm, "accelerate": run_accelerate, "baseline": run_baseline}
        result = runs[kind](*rest)
        print(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headline", action="store_true", help="the 7B-shaped synthetic model instead")
    parser.add_argument("--mixed", action="store_true", help="the ChatGLM3-6B-shaped mixed:5.2GiB model under 8gb")
    args = parser.parse_args()
    if args.headline:
        headline()
    elif args.mixed:
        mixed_headline()
    else:
        with tempfile.TemporaryDirectory() as folder:
            smollm(Path(folder))


if __name__ == "__main__":
    main()
