"""Serving 4 LoRA variants from one server, all requests mixed, vs the same load on one merged variant.

Method:
- Model: the embedded SmolLM2-135M-Instruct, INT8 (W8A16), CPU, fp32 compute. Four PEFT LoRA
  adapters are made here with peft (seeded random, non-zero A and B; different targets and ranks,
  one DoRA), written to a temp dir. Nothing is downloaded.
- Server V (`serve --lora v1=DIR --lora v2=DIR ...`): the base plus the 4 variants; each variant's
  mode (merged/unmerged, and why) is read from GET /v1/adapters. Server M (`serve --lora DIR`):
  v1's adapter merged into the base, one model.
- Loads, each C clients x R requests, greedy, fixed max_tokens, non-streamed; request r of client c
  uses prompt (c + r) % 16 (bench_server.py's prompts), so at any moment the clients ask for
  different prompts:
    mixed    on V: model = variant (c + r) % 4, so concurrent requests name different variants;
    v1 only  on V: every request names v1 (separates the cost of mixing from v1's own path);
    base     on V: every request names the base;
    merged   on M: every request names M's model (v1 merged into the weights);
    merged, eager on E: as M, with TIERLM_FUSED=0 (no fused CPU decode step): what a decode step
             costs when its layers run as eager torch ops, as layers with a variant's rows do.
  (--no-extra-loads: mixed and merged only.) The loads run interleaved, round after round (mixed, v1 only, base, merged, mixed, ...), both
  servers up all along, so a change in the machine's load lands on every configuration alike.
- Before the rounds every (model, prompt) pair a load uses is asked alone (one request at a time);
  a reply under load must equal that solo reply (text and token counts) to count as matched.
- Latency = wall time of one request at the client; req/s and completion tok/s = over the wall
  time of the whole load. Mean batch and decode steps from the server's /metrics (deltas per
  load); ms/step = load wall / decode steps (prefill included: an upper bound).
- Memory: the server process's VmRSS (steady: after startup, and after its last load) and VmHWM
  (peak) from /proc/PID/status; each server's startup line gives the variants' modes and bytes.

Run from the repo root: `.venv/bin/python benchmarks/bench_variants.py [--quick]`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_server import PROMPTS, percentile  # noqa: E402 - after the path insert

PROFILE = """
description = "bench_variants"
device_memory = "4GiB"
host_memory = "4GiB"
disk_offload = false
headroom = "512MiB"
quant = "int8"
kv_cache = "auto"
context_length = 512
batch_size = {batch}
prefetch_depth = 0
"""
# name -> peft LoraConfig kwargs: different targets and ranks; v4 is DoRA (never low rank: merged).
ADAPTERS = {
    "v1": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "v2": dict(r=16, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "v3": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "v4": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["o_proj", "down_proj"]),
}
MERGED_VARIANT = "v1"  # the adapter server M merges, and the "v1 only" load's variant
BASE_ID = "base"
MERGED_ID = "merged"


def make_adapters(base: Path, out: Path, scale: float) -> dict[str, Path]:
    """Each adapter of ADAPTERS over `base`, every LoRA parameter seeded randn * scale (a DoRA
    magnitude scaled by 1 + randn * scale), saved under out/NAME."""
    import warnings

    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    paths = {}
    for seed, (name, kwargs) in enumerate(ADAPTERS.items(), start=1):
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = get_peft_model(model, LoraConfig(**kwargs))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in peft_model.named_parameters():
                if "lora_magnitude_vector" in param_name:  # peft starts it at the weight's norms
                    param.mul_(1.0 + scale * torch.randn(param.shape, generator=generator))
                elif "lora_" in param_name:
                    param.copy_(scale * torch.randn(param.shape, generator=generator))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model.save_pretrained(out / name)
        paths[name] = out / name
    return paths


class Server:
    """A `tierlm serve` subprocess on loopback; its stderr up to the listening line is kept."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.command = [sys.executable, "-m", "tierlm", "serve", "--port", "0", "--quiet", *args]
        self.env = env or {}
        started = time.perf_counter()
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, env={**os.environ, **self.env})
        self.startup: list[str] = []
        for line in self.process.stderr:
            self.startup.append(line.rstrip())
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                self.url = match.group(1)
                self.startup_s = time.perf_counter() - started
                threading.Thread(target=lambda: [None for _ in self.process.stderr], daemon=True).start()
                return
        tail = "\n".join(self.startup[-20:])
        raise SystemExit(f"the server did not start (exit {self.process.wait()}):\n{tail}")

    def memory_mib(self) -> dict[str, float]:
        """VmRSS and VmHWM of the server process, MiB."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return {key: int(re.search(rf"^{key}:\s+(\d+) kB", status, re.M).group(1)) / 1024 for key in ("VmRSS", "VmHWM")}

    def metric(self, name: str) -> float:
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=30).text
        match = re.search(rf"^{name} (\S+)", text, re.M)
        return float(match.group(1)) if match else 0.0

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def chat(client, model: str, prompt: str, max_tokens: int) -> dict:
    payload = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
               "max_tokens": max_tokens}
    started = time.perf_counter()
    reply = client.post("/v1/chat/completions", json=payload)
    reply.raise_for_status()
    data = reply.json()
    choice = data["choices"][0]
    return {"latency": time.perf_counter() - started, "text": choice["message"]["content"],
            "finish_reason": choice["finish_reason"], "usage": data["usage"]}


def plan(models: list[str], clients: int, requests: int) -> list[list[tuple[str, str]]]:
    """Per client, its requests' (model, prompt): model (c + r) % len(models), prompt (c + r) % 16."""
    return [[(models[(c + r) % len(models)], PROMPTS[(c + r) % len(PROMPTS)]) for r in range(requests)]
            for c in range(clients)]


def solo_replies(server: Server, pairs: set[tuple[str, str]], max_tokens: int) -> dict[tuple[str, str], dict]:
    """Each (model, prompt) asked alone, one request at a time: the reference a loaded reply must equal."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=600) as client:
        return {pair: chat(client, pair[0], pair[1], max_tokens) for pair in sorted(pairs)}


def run_load(server: Server, work: list[list[tuple[str, str]]], max_tokens: int, solo: dict) -> dict:
    import httpx

    results, failures = [], []
    lock = threading.Lock()

    def client_loop(requests: list[tuple[str, str]]) -> None:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            for model, prompt in requests:
                try:
                    got = chat(client, model, prompt, max_tokens)
                except Exception as err:  # noqa: BLE001 - counted as a failure
                    with lock:
                        failures.append(f"{model} {prompt!r}: {err}")
                    continue
                want = solo[(model, prompt)]
                same = (got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"]
                        and got["usage"] == want["usage"])
                with lock:
                    results.append(got)
                    if not same:
                        failures.append(f"{model} {prompt!r}: got {got['text']!r}, solo {want['text']!r}")

    steps_before = server.metric("tierlm_batch_size_count")
    rows_before = server.metric("tierlm_batch_size_sum")
    threads = [threading.Thread(target=client_loop, args=(requests,)) for requests in work]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    steps = server.metric("tierlm_batch_size_count") - steps_before
    rows = server.metric("tierlm_batch_size_sum") - rows_before
    return {"requests": sum(len(w) for w in work), "latencies": [r["latency"] for r in results],
            "tokens": sum(r["usage"]["completion_tokens"] for r in results), "wall_s": wall, "steps": steps,
            "rows": rows, "failures": failures, "memory": server.memory_mib()}


def summarize(runs: list[dict]) -> dict:
    """All rounds of one load together: totals over summed wall time, percentiles over all requests."""
    wall = sum(r["wall_s"] for r in runs)
    latencies = sorted(x for r in runs for x in r["latencies"])
    steps = sum(r["steps"] for r in runs)
    per_round = [len(r["latencies"]) / r["wall_s"] for r in runs]
    return {
        "requests": sum(r["requests"] for r in runs), "failures": [f for r in runs for f in r["failures"]],
        "req_per_s": len(latencies) / wall, "req_per_s_range": (min(per_round), max(per_round)),
        "tokens_per_s": sum(r["tokens"] for r in runs) / wall,
        "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
        "mean_batch": sum(r["rows"] for r in runs) / steps if steps else 0.0,
        "ms_per_step": 1e3 * wall / steps if steps else float("nan"),
        "rss_mib": runs[-1]["memory"]["VmRSS"], "hwm_mib": max(r["memory"]["VmHWM"] for r in runs),
    }


def machine_facts() -> str:
    cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    simd = "AVX-512" if flags and "avx512f" in flags.group(1).split() else "AVX2" if flags and "avx2" in flags.group(1) else "no AVX2"
    import torch

    return (f"CPU: {cpu.group(1) if cpu else platform.processor()} ({simd}), {os.cpu_count()} cores "
            f"({len(os.sched_getaffinity(0))} usable), torch {torch.__version__}, torch threads {torch.get_num_threads()}")


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=6, help="per client per load (clients x requests per round)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--scale", type=float, default=0.06, help="std of the random LoRA parameters")
    parser.add_argument("--no-extra-loads", action="store_true",
                        help="only the mixed and merged loads (not v1 only, base only, merged eager)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 2 requests per client, 12 tokens")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.max_tokens = 1, 2, 12
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tierlm.weights.embedded import ensure_embedded_model

    print(f"# bench_variants {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}")
    print(machine_facts())
    load_before = load_average()
    print(f"load average before: {load_before}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-variants-") as scratch:
        scratch = Path(scratch)
        model = ensure_embedded_model()
        profile = scratch / "bench.toml"
        profile.write_text(PROFILE.format(batch=args.clients))
        adapters = make_adapters(model, scratch / "adapters", args.scale)
        common = ["--model", str(model), "--profile", str(profile), "--batch-size", str(args.clients),
                  "--max-queue", str(args.clients), "--device", "cpu", "--dtype", "fp32"]
        servers: dict[str, Server] = {}
        try:
            servers["V"] = Server([*common, "--model-name", BASE_ID,
                                   *[a for name, path in adapters.items() for a in ("--lora", f"{name}={path}")]])
            merged_args = [*common, "--model-name", MERGED_ID, "--lora", str(adapters[MERGED_VARIANT])]
            servers["M"] = Server(merged_args)
            if not args.no_extra_loads:  # the merged model without the fused CPU decode step
                servers["E"] = Server(merged_args, env={"TIERLM_FUSED": "0"})
            report_servers(servers, adapters)
            names = list(ADAPTERS)
            loads = {"mixed (4 variants)": ("V", plan(names, args.clients, args.requests)),
                     f"{MERGED_VARIANT} only": ("V", plan([MERGED_VARIANT], args.clients, args.requests)),
                     "base only": ("V", plan([BASE_ID], args.clients, args.requests)),
                     f"merged ({MERGED_VARIANT} in the weights)": ("M", plan([MERGED_ID], args.clients, args.requests)),
                     "merged, eager (TIERLM_FUSED=0)": ("E", plan([MERGED_ID], args.clients, args.requests))}
            if args.no_extra_loads:
                loads = {k: v for k, v in loads.items() if k.startswith(("mixed", "merged (")) }
            # Every model's reply to the first prompt too: the variants must differ from the base and
            # each other, and M's merged v1 should read like V's v1.
            probes = {"V": {(n, PROMPTS[0]) for n in [BASE_ID, *names]}, "M": {(MERGED_ID, PROMPTS[0])}}
            probes.update({key: set() for key in servers if key not in probes})
            solo = {}
            for key in servers:
                pairs = probes[key] | {pair for label, (on, work) in loads.items() if on == key for w in work for pair in w}
                started = time.perf_counter()
                solo[key] = solo_replies(servers[key], pairs, args.max_tokens)
                print(f"server {key}: {len(pairs)} solo references in {time.perf_counter() - started:.1f} s; "
                      f"RSS {servers[key].memory_mib()['VmRSS']:.0f} MiB after them", flush=True)
            for key, pairs in probes.items():
                for pair in sorted(pairs):
                    print(f"  {key} {pair[0]:6} {pair[1]!r} -> {solo[key][pair]['text'][:70]!r}")
            distinct = len({solo["V"][(n, PROMPTS[0])]["text"] for n in [BASE_ID, *names]})
            runs: dict[str, list[dict]] = {label: [] for label in loads}
            for round_no in range(args.rounds):
                for label, (on, work) in loads.items():
                    run = run_load(servers[on], work, args.max_tokens, solo[on])
                    runs[label].append(run)
                    print(f"round {round_no + 1} {label}: {run['requests']} requests in {run['wall_s']:.1f} s, "
                          f"{run['steps']:.0f} steps, load {load_average()}", flush=True)
        finally:
            for server in servers.values():
                server.stop()
    load_after = load_average()
    print(f"\nload average after: {load_after}")
    print(f"{args.clients} clients x {args.requests} requests x {args.rounds} rounds per load, max_tokens "
          f"{args.max_tokens}, greedy, batch size {args.clients}; INT8; {distinct} distinct replies to one prompt "
          f"over the base and the {len(names)} variants\n")
    print("| load | server | matched solo | req/s (per-round range) | completion tok/s | p50 s | p95 s | mean batch "
          "| ms/step | steady RSS MiB | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    failed = False
    for label, (on, _) in loads.items():
        s = summarize(runs[label])
        low, high = s["req_per_s_range"]
        print(f"| {label} | {on} | {s['requests'] - len(s['failures'])}/{s['requests']} | {s['req_per_s']:.2f} "
              f"({low:.2f}-{high:.2f}) | {s['tokens_per_s']:.1f} | {s['p50_s']:.2f} | {s['p95_s']:.2f} "
              f"| {s['mean_batch']:.2f} | {s['ms_per_step']:.0f} | {s['rss_mib']:.0f} | {s['hwm_mib']:.0f} |")
        failed |= bool(s["failures"])
    for label in loads:
        for failure in summarize(runs[label])["failures"][:3]:
            print(f"  MISMATCH {label}: {failure}")
    sys.exit(1 if failed else 0)


def report_servers(servers: dict[str, "Server"], adapters: dict[str, Path]) -> None:
    """Each server's startup time, RSS, and the variants' modes (GET /v1/adapters) and startup lines."""
    import httpx

    for key, server in servers.items():
        memory = server.memory_mib()
        env = "".join(f"{k}={v} " for k, v in server.env.items())
        print(f"server {key}: up in {server.startup_s:.1f} s, RSS {memory['VmRSS']:.0f} MiB "
              f"(peak {memory['VmHWM']:.0f}); {env}{shlex.join(server.command[2:])}")
        for line in server.startup:
            if re.search(r"merged|unmerged|variant|listening", line):
                print(f"  | {line}")
        cards = httpx.get(server.url + "/v1/adapters", timeout=30).json().get("data", [])
        for card in cards:
            size = f"{card['bytes'] / 2**20:.2f} MiB" if card.get("bytes") is not None else "?"
            print(f"  {card['id']}: {card['status']}, {card['mode']} ({size}): {card['why']}")
    print(flush=True)


if __name__ == "__main__":
    main()
