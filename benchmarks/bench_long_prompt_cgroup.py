"""A 16k-token prompt on a Llama-3-8B-shaped INT8 model inside a real 8 GiB memory cgroup (issue 25).

What it measures: whether `tierlm bench` under `--profile 8gb --context 16k --kv-cache q8_0` holds a
16,000-token prompt (plus 8 decoded tokens) on an 8B model whose INT8 weights (~7.5 GiB) do not fit
the profile's 7 GiB beside the KV cache, inside a cgroup v1 memory group capped at 8 GiB (swap
included where memsw exists). The cgroup charges everything the process touches: anonymous memory,
the q8_0 KV cache (~1.06 GiB for 16k positions) and the page cache of the streamed artifact, which is
evicted from the page cache first so its reads are charged to the group. It prints the plan, then one
JSON line: the group's peak (memory.max_usage_in_bytes) against its limit, how often the limit was
hit (memory.failcnt, memory.memsw.failcnt) and whether the OOM killer ran, the largest anonymous share seen (memory.stat
rss, sampled every 0.5 s), the bench's own peak RSS and prefill/decode tokens/s, wall seconds, the
exit code, the prefill chunks reached, the CPU model and the load average before and after.

The model: a synthetic artifact (`tierlm/cache/synthetic.py`, random INT8 weights) in Llama-3-8B's
shape (hidden 4096, 32 layers, 32 heads, 8 KV heads of 128, intermediate 14336, vocab 128256,
131072 positions), written once under `--root` (~8 GiB of disk) and reused. Every tierlm process
runs with TIERLM_CACHE=<root>/cache, so the user's cache is untouched. `tierlm plan` runs first,
outside the group: it must fit, and as the first use of that cache it also does the one-time work
(kernel build, machine probe, baseline record) a real first load would not be measured by.

The bench runs as `python -m tierlm bench ...` would, through a short wrapper that prints one stderr
line per prefill chunk (512 tokens) so a run stopped by `--timeout-s` says how far it got.

Needs root and a writable cgroup v1 memory controller. Run from the repo root, small first:
    .venv/bin/python benchmarks/bench_long_prompt_cgroup.py --root /tmp/b8 --prompt-tokens 512
    nice -n 10 .venv/bin/python benchmarks/bench_long_prompt_cgroup.py --root /tmp/b8
`--build-only` writes the artifact and stops; remove `--root` afterwards to free the disk.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLAMA_3_8B = {
    "model_type": "llama", "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
}  # fmt: skip
PREFILL_CHUNK = 512  # tierlm.offload.sizes.PREFILL_CHUNK
GiB = 2**30

# `python -m tierlm` with a line on stderr after each prefill chunk (a step of more than one token).
CHILD = r"""
import sys, time
from tierlm.runtime import engine
step, started = engine.Engine._step, time.perf_counter()
def timed_step(self, ids):
    logits = step(self, ids)
    if len(ids) > 1:
        print(f"prefill chunk {-(-len(self.cached_ids) // 512)}: {len(self.cached_ids)} positions, "
              f"{time.perf_counter() - started:.1f} s since start", file=sys.stderr, flush=True)
    return logits
engine.Engine._step = timed_step
sys.argv = ["tierlm", *sys.argv[1:]]
from tierlm.cli.app import main
main()
"""


def artifact_dir(root: Path) -> Path:
    return root / "artifact" / "llama-3-8b-synthetic-int8"


def build(root: Path) -> Path:
    from tierlm.cache.synthetic import write_synthetic_artifact

    target = artifact_dir(root)
    started = time.perf_counter()
    write_synthetic_artifact(LLAMA_3_8B, target)
    weights = (target / "weights.bin").stat().st_size
    print(f"artifact {target}: {weights / GiB:.2f} GiB of weights, ready in {time.perf_counter() - started:.0f} s",
          flush=True)  # fmt: skip
    return target


def own_memory_cgroup() -> Path:
    root = Path("/sys/fs/cgroup/memory")
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            group = root / path.lstrip("/")
            if (group / "memory.limit_in_bytes").exists() and os.access(group, os.W_OK):
                return group
    raise SystemExit("no writable cgroup v1 memory controller for this process: cannot cap the run")


def make_group(limit: int) -> Path:
    group = own_memory_cgroup() / f"tierlm-long-prompt-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(limit))
    if (group / "memory.memsw.limit_in_bytes").exists():
        (group / "memory.memsw.limit_in_bytes").write_text(str(limit))  # no escape into swap
    return group


def remove_group(group: Path) -> None:
    for _ in range(100):  # a killed child leaves the group a moment later
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def evict(path: Path) -> None:
    """Drop the file's clean pages, so the group's reads come from disk and are charged to it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def memory_stat(group: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (l.split() for l in (group / "memory.stat").read_text().splitlines())}
    except (OSError, ValueError):
        return {}


def oom_kills(group: Path) -> int | None:
    try:
        for line in (group / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def tierlm_env(root: Path) -> dict[str, str]:
    return {**os.environ, "TIERLM_CACHE": str(root / "cache")}


def run_plan(artifact: Path, root: Path, settings: list[str]) -> None:
    argv = [sys.executable, "-m", "tierlm", "plan", str(artifact), *settings]
    print("$ TIERLM_CACHE=" + str(root / "cache") + " tierlm plan " + " ".join(argv[4:]), flush=True)
    done = subprocess.run(argv, capture_output=True, text=True, env=tierlm_env(root), cwd=REPO)
    print(done.stdout, end="", flush=True)
    if done.returncode != 0:
        print(done.stderr, end="", file=sys.stderr)
        raise SystemExit(f"tierlm plan failed (rc {done.returncode}): the run would not fit")


def run_bench(artifact: Path, root: Path, settings: list[str], args) -> dict:
    limit = args.limit_gib * GiB
    bench = ["bench", str(artifact), *settings, "--prompt-tokens", str(args.prompt_tokens),
             "--tokens", str(args.tokens), "--runs", "1", "--json"]  # fmt: skip
    print("$ TIERLM_CACHE=" + str(root / "cache") + " tierlm " + " ".join(bench)
          + f"   (in a cgroup of {args.limit_gib} GiB)", flush=True)  # fmt: skip
    evict(artifact / "weights.bin")
    group = make_group(limit)
    load_before = loadavg()
    chunks = {"reached": 0}
    stderr_tail: list[str] = []
    max_rss = {"anon": 0}
    # Join the group before Python starts, so every byte the child touches is charged.
    argv = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", sys.executable, "-c", CHILD, *bench]
    started = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=tierlm_env(root), cwd=REPO, start_new_session=True)  # fmt: skip

    def read_stderr():
        for line in child.stderr:
            line = line.rstrip("\n")
            if line.startswith("prefill chunk "):
                chunks["reached"] = int(line.split()[2].rstrip(":"))
                print("  " + line, flush=True)
            stderr_tail.append(line)
            del stderr_tail[:-40]

    out: list[str] = []
    readers = [threading.Thread(target=read_stderr, daemon=True),
               threading.Thread(target=lambda: out.append(child.stdout.read()), daemon=True)]  # fmt: skip
    for reader in readers:
        reader.start()
    stopped = None

    def on_signal(signum, frame):
        nonlocal stopped
        stopped = f"signal {signum}"

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        while child.poll() is None:
            stat = memory_stat(group)
            max_rss["anon"] = max(max_rss["anon"], stat.get("rss", 0))  # anonymous, huge pages included
            if stopped is None and args.timeout_s and time.perf_counter() - started > args.timeout_s:
                stopped = f"timeout {args.timeout_s} s"
            if stopped is not None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                break
            time.sleep(0.5)
        wall = time.perf_counter() - started
        for reader in readers:
            reader.join(timeout=10)
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        failcnt = int((group / "memory.failcnt").read_text())
        memsw = group / "memory.memsw.max_usage_in_bytes"  # with memsw = limit, its counter fails first
        memsw_peak = int(memsw.read_text()) if memsw.exists() else None
        memsw_failcnt = int((group / "memory.memsw.failcnt").read_text()) if memsw.exists() else None
        kills = oom_kills(group)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        remove_group(group)
    figures = {}
    if child.returncode == 0 and out and out[0].strip():
        figures = json.loads(out[0])
    else:
        print("\n".join(stderr_tail[-20:]), file=sys.stderr)
    return {
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.tokens,
        "context": figures.get("context"),
        "kv_cache": figures.get("kv_cache"),
        "kv_cache_bytes": figures.get("kv_cache_bytes"),
        "cgroup_limit_bytes": limit,
        "cgroup_peak_bytes": peak,
        "peak_within_limit": peak <= limit,
        "cgroup_failcnt": failcnt,
        "cgroup_memsw_peak_bytes": memsw_peak,
        "cgroup_memsw_failcnt": memsw_failcnt,
        "cgroup_oom_kills": kills,
        "cgroup_max_anon_rss_bytes_sampled": max_rss["anon"],
        "bench_peak_rss_bytes": figures.get("peak_rss_bytes"),
        "prefill_tokens_per_s": figures.get("prefill_tokens_per_s"),
        "decode_tokens_per_s": figures.get("decode_tokens_per_s"),
        "ttft_s": figures.get("ttft_s"),
        "load_s": figures.get("load_s"),
        "predicted_prefill_tokens_per_s": figures.get("predicted_prefill_tokens_per_s"),
        "predicted_decode_tokens_per_s": figures.get("predicted_decode_tokens_per_s"),
        "placement_bytes": figures.get("placement_bytes"),
        "threads": figures.get("threads"),
        "prefill_chunks": f"{chunks['reached']}/{math.ceil(args.prompt_tokens / PREFILL_CHUNK)}",
        "wall_s": round(wall, 1),
        "exit_code": child.returncode,
        "stopped": stopped,
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/tierlm-long-prompt"),
                        help="where the artifact and the private TIERLM_CACHE live (~8 GiB)")  # fmt: skip
    parser.add_argument("--prompt-tokens", type=int, default=16000)
    parser.add_argument("--tokens", type=int, default=8, help="tokens decoded after the prompt")
    parser.add_argument("--context", default="16k")
    parser.add_argument("--kv-cache", default="q8_0")
    parser.add_argument("--profile", default="8gb")
    parser.add_argument("--limit-gib", type=int, default=8, help="the cgroup's memory limit")
    parser.add_argument("--timeout-s", type=float, default=0, help="kill the bench after this long (0: never)")
    parser.add_argument("--build-only", action="store_true")
    args = parser.parse_args()
    os.environ["TIERLM_CACHE"] = str(args.root / "cache")
    artifact = build(args.root)
    if args.build_only:
        return
    settings = ["--profile", args.profile, "--context", args.context, "--kv-cache", args.kv_cache]
    run_plan(artifact, args.root, settings)
    result = run_bench(artifact, args.root, settings, args)
    print(json.dumps(result), flush=True)
    sys.exit(0 if result["exit_code"] == 0 else 1)


if __name__ == "__main__":
    main()
