"""A bounded load test of `tierlm serve` on loopback: C concurrent clients x R requests each.

Method:
- The server is a subprocess (`python -m tierlm serve --port 0 --batch-size B`), on the embedded
  SmolLM2-135M-Instruct (default) or a tiny random Llama (`--model tiny`, needs transformers).
- 16 distinct chat prompts; request r of client c uses prompt (c + r) % 16, greedy, with
  `max_tokens` = --max-tokens; even clients stream (SSE), odd clients do not. Every reply must be
  complete (a finish reason, and `[DONE]` when streamed) and equal, text and token counts, to what
  the single-sequence engine gives that prompt alone (computed in this process first), so a reply
  mixed up with another request's, or cut short, fails the run.
- Latency = wall time of one request at the client (send to last byte); TTFT for streamed
  requests = send to the first content chunk. Throughput = requests and generated tokens over
  the wall time of the whole load. Server-side batch sizes come from its /metrics afterwards.

Run from the repo root: `.venv/bin/python benchmarks/bench_server.py [--model tiny] [--batch-sizes 1,8]`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOPICS = ["the sea", "a red bicycle", "winter mornings", "a lost key", "coffee", "the moon", "trains",
          "a small garden", "rain on a roof", "old books", "a city at night", "mountains", "a cat",
          "learning to swim", "a thunderstorm", "bread baking"]
PROMPTS = [f"Write one sentence about {topic}." for topic in TOPICS]
PROFILE = """
description = "bench_server"
device_memory = "4GiB"
host_memory = "4GiB"
disk_offload = false
headroom = "512MiB"
quant = "none"
kv_cache = "auto"
context_length = 512
batch_size = 1
prefetch_depth = 0
"""


def model_dir(kind: str, scratch: Path) -> Path:
    if kind == "tiny":
        from tests.tiny import make_model

        make_model(scratch / "tiny-llama", hidden=128, layers=4, heads=4, kv_heads=2, intermediate=256)
        return scratch / "tiny-llama"
    from tierlm.weights.embedded import ensure_embedded_model

    return ensure_embedded_model()


def expected_replies(model: Path, profile: Path, max_tokens: int) -> list[dict]:
    from tierlm.profile import load_profile
    from tierlm.runtime.sampling import SamplingParams
    from tierlm.runtime.session import open_session

    engine = open_session(str(model), load_profile(str(profile)), device="cpu", dtype="fp32").engine
    out = []
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        generation = engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=max_tokens))
        text = generation.text()
        if generation.token_ids[-1] in engine.tokenizer.eos_token_ids:  # the server flushes at EOS
            text = engine.tokenizer.decode(generation.token_ids[:-1], skip_special_tokens=True)
        out.append({"text": text, "prompt_tokens": len(ids), "completion_tokens": len(generation.token_ids),
                    "finish_reason": generation.stats.finish_reason})
    return out


def start_server(model: Path, profile: Path, batch: int, clients: int) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tierlm", "serve", "--model", str(model), "--profile", str(profile), "--port", "0",
         "--batch-size", str(batch), "--max-queue", str(clients), "--device", "cpu", "--dtype", "fp32"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    for line in process.stderr:
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()
            return process, match.group(1)
    raise SystemExit(f"the server did not start (exit {process.wait()})")


def one_request(client, prompt: str, max_tokens: int, streamed: bool) -> dict:
    payload = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
               "max_tokens": max_tokens}
    started = time.perf_counter()
    if not streamed:
        reply = client.post("/v1/chat/completions", json=payload)
        reply.raise_for_status()
        data = reply.json()
        choice = data["choices"][0]
        return {"latency": time.perf_counter() - started, "ttft": None, "text": choice["message"]["content"],
                "finish_reason": choice["finish_reason"], "usage": data["usage"], "done": True}
    payload.update(stream=True, stream_options={"include_usage": True})
    text, reason, usage, ttft, done = [], None, None, None, False
    with client.stream("POST", "/v1/chat/completions", json=payload) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    text.append(choice["delta"]["content"])
                reason = choice["finish_reason"] or reason
    return {"latency": time.perf_counter() - started, "ttft": ttft, "text": "".join(text), "finish_reason": reason,
            "usage": usage, "done": done}


def run_load(url: str, clients: int, requests: int, max_tokens: int, expected: list[dict]) -> dict:
    import httpx

    results: list[dict] = []
    failures: list[str] = []
    lock = threading.Lock()

    def client_loop(c: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as client:
            for r in range(requests):
                which = (c + r) % len(PROMPTS)
                try:
                    got = one_request(client, PROMPTS[which], max_tokens, streamed=c % 2 == 0)
                except Exception as err:  # noqa: BLE001 - counted as a failure
                    with lock:
                        failures.append(f"client {c} request {r}: {err}")
                    continue
                want = expected[which]
                ok = (got["done"] and got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"]
                      and got["usage"]["completion_tokens"] == want["completion_tokens"]
                      and got["usage"]["prompt_tokens"] == want["prompt_tokens"])
                with lock:
                    results.append(got)
                    if not ok:
                        failures.append(f"client {c} request {r}: got {got['text']!r} ({got['finish_reason']}), "
                                        f"expected {want['text']!r} ({want['finish_reason']})")

    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    metrics = httpx.get(url + "/metrics").text
    batch_sum = float(re.search(r"^tierlm_batch_size_sum (\S+)", metrics, re.M).group(1))
    batch_count = float(re.search(r"^tierlm_batch_size_count (\S+)", metrics, re.M).group(1))
    latencies = sorted(r["latency"] for r in results)
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    return {
        "requests": clients * requests, "complete_and_matched": clients * requests - len(failures),
        "failures": failures[:5], "wall_s": wall, "req_per_s": len(results) / wall, "tokens_per_s": tokens / wall,
        "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
        "mean_batch": batch_sum / batch_count if batch_count else 0.0,
        "peak_rss_mib": float(re.search(r"^tierlm_process_peak_resident_bytes (\S+)", metrics, re.M).group(1)) / 2**20,
    }


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("embedded", "tiny"), default="embedded")
    parser.add_argument("--batch-sizes", default="8", help="comma-separated; one server run each")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=20, help="per client")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as scratch:
        profile = Path(scratch) / "bench.toml"
        profile.write_text(PROFILE)
        model = model_dir(args.model, Path(scratch))
        expected = expected_replies(model, profile, args.max_tokens)
        print(f"model {args.model} ({model.name}); {args.clients} clients x {args.requests} requests, "
              f"max_tokens {args.max_tokens}, greedy; half streamed")
        print("| batch | complete+matched | wall s | req/s | tok/s | p50 s | p95 s | TTFT p50 s | TTFT p95 s "
              "| mean batch | server peak RSS MiB |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        failed = False
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            process, url = start_server(model, profile, batch, args.clients)
            try:
                r = run_load(url, args.clients, args.requests, args.max_tokens, expected)
            finally:
                process.terminate()
                process.wait(30)
            print(f"| {batch} | {r['complete_and_matched']}/{r['requests']} | {r['wall_s']:.1f} | {r['req_per_s']:.2f} "
                  f"| {r['tokens_per_s']:.0f} | {r['p50_s']:.2f} | {r['p95_s']:.2f} | {r['ttft_p50_s']:.2f} "
                  f"| {r['ttft_p95_s']:.2f} | {r['mean_batch']:.1f} | {r['peak_rss_mib']:.0f} |", flush=True)
            for failure in r["failures"]:
                print("  FAIL", failure)
            failed |= r["complete_and_matched"] != r["requests"]
        sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
