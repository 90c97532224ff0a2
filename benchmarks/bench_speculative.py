"""Speculative decoding (--draft ngram) against plain decoding, resident and streamed from disk.

Model: the embedded SmolLM2-135M-Instruct as its INT8 artifact, 2 threads, greedy. Two workloads:
quoting (prompts that ask to repeat or extract from a source text, as summaries, RAG answers and
code edits do) and free-form chat (text that does not repeat its prompt). Two placements: resident
(a roomy profile) and streamed (a device budget that keeps 40 % of the weights resident, the rest
read from disk each forward, inside a cgroup v1 memory group capped at that budget with the
artifact evicted from the page cache, as bench_offload.py runs it). Each placement is one fresh
process that runs plain and drafted generations of every prompt interleaved, `--rounds` times;
rows report the median decode tok/s, the drafted/accepted counts, the weight bytes read from the
tiers per generated token (the ledger's, streamed runs only), whether the greedy tokens were equal
to plain decoding's, and the process's peak RSS against the budget.

Run from the repo root: `.venv/bin/python benchmarks/bench_speculative.py [--rounds 2] [--tokens 96]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offload import budget_for_resident_share, budget_profile, capped_side, peak_rss, side  # noqa: E402

SOURCE = (
    "The Apollo 11 mission launched on July 16, 1969, from Kennedy Space Center in Florida. Neil Armstrong, "
    "Buzz Aldrin and Michael Collins made up the crew. On July 20, Armstrong and Aldrin landed the lunar module "
    "Eagle in the Sea of Tranquility, while Collins remained in orbit aboard the command module Columbia. "
    "Armstrong became the first person to step onto the lunar surface, followed by Aldrin about twenty minutes "
    "later. They spent about two and a quarter hours outside the spacecraft, collected 47.5 pounds of lunar "
    "material, and planted an American flag. The crew returned to Earth on July 24, splashing down in the "
    "Pacific Ocean."
)
CODE = (
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / len(values)\n\n"
    "def variance(values):\n    center = mean(values)\n    total = 0\n    for value in values:\n"
    "        total += (value - center) ** 2\n    return total / len(values)\n"
)
WORKLOADS = {
    "quoting": [
        "Repeat the text below exactly, word for word.\n\n" + SOURCE,
        "Copy every sentence of the text below that mentions Armstrong.\n\n" + SOURCE,
        "Rename the variable `total` to `running_sum` in this code and show the whole code.\n\n" + CODE,
    ],
    "free-form chat": [
        "Write a short poem about autumn leaves.",
        "What are three tips for a good night's sleep?",
        "Tell me a story about a dragon who learns to bake.",
    ],
}


def run_side(artifact: str, model_dir: str, profile: str, tokens: int, rounds: int) -> dict:
    """In a fresh process: every prompt plain and drafted, interleaved, `rounds` times."""
    import torch

    from tierlm.profile import load_profile
    from tierlm.runtime.engine import Engine
    from tierlm.runtime.loader import load_model
    from tierlm.runtime.sampling import SamplingParams
    from tierlm.runtime.speculative import DraftSettings
    from tierlm.runtime.tokenizer import Tokenizer

    torch.set_num_threads(2)
    loaded = load_model(artifact, device="cpu", dtype=torch.float32, profile=load_profile(profile))
    engine = Engine(loaded, Tokenizer.from_dir(model_dir))
    ledger = getattr(loaded.store, "ledger", None)
    params = SamplingParams(temperature=0, max_new_tokens=tokens)
    modes = {"plain": DraftSettings(), "ngram": DraftSettings("ngram")}
    rows = {}
    for workload, prompts in WORKLOADS.items():
        samples = {mode: [] for mode in modes}
        equal = True
        for _ in range(rounds):
            for text in prompts:
                ids = engine.tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)
                outputs = {}
                for mode, draft in modes.items():
                    engine.reset()
                    before = sum(ledger.bytes_read.values()) if ledger else 0
                    generation = engine.generate(ids, params, draft=draft)
                    generation.text()
                    read = (sum(ledger.bytes_read.values()) - before) if ledger else 0
                    stats = generation.stats
                    samples[mode].append({"tok_s": stats.decode_tokens_per_s, "new": stats.new_tokens,
                                          "drafted": stats.drafted, "accepted": stats.accepted,
                                          "bytes_per_token": read / max(stats.new_tokens, 1)})  # fmt: skip
                    outputs[mode] = generation.token_ids
                equal &= outputs["plain"] == outputs["ngram"]
        rows[workload] = {
            mode: {
                "tok_s": statistics.median(s["tok_s"] for s in runs),
                "drafted": sum(s["drafted"] for s in runs),
                "accepted": sum(s["accepted"] for s in runs),
                "bytes_per_token": statistics.median(s["bytes_per_token"] for s in runs),
            }
            for mode, runs in samples.items()
        }
        rows[workload]["greedy_equal"] = equal
    budget = load_profile(profile).device_memory
    loaded.close()
    return {"rows": rows, "peak_rss": peak_rss(), "budget": budget}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--side", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        artifact, model_dir, profile = args.side
        print(json.dumps(run_side(artifact, model_dir, profile, args.tokens, args.rounds)))
        return

    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.weights.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    artifact = ensure_artifact(ConversionRequest(model_dir, (), "int8"))
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        budget = budget_for_resident_share(artifact, folder, 0.4)
        common = ["--tokens", str(args.tokens), "--rounds", str(args.rounds)]
        resident = budget_profile(folder, "resident", 16 << 30)
        placements = {"resident": side([str(artifact), str(model_dir), str(resident), *common], script=__file__)}
        capped = budget_profile(folder, "capped", budget)
        streamed, enforced = capped_side([str(artifact), str(model_dir), str(capped), *common], budget, artifact,
                                         script=__file__)  # fmt: skip
        placements["streamed (40 % resident" + (", cgroup-capped, cold cache)" if enforced else ", no cgroup)")] = streamed
    print(f"CPU: {cpu_name()}; 2 threads; load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print(f"{args.tokens} greedy tokens a prompt, {args.rounds} rounds, plain and ngram interleaved; median tok/s\n")
    print("| placement | workload | plain tok/s | ngram tok/s | speedup | accepted/drafted | bytes/token ngram vs plain "
          "| greedy equal | peak RSS / budget |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, result in placements.items():
        if "error" in result:
            print(f"| {name} | failed: {result['error']} | | | | | | | |")
            continue
        for workload, row in result["rows"].items():
            plain, ngram = row["plain"], row["ngram"]
            read = (f"{ngram['bytes_per_token'] / plain['bytes_per_token']:.2f}x" if plain["bytes_per_token"]
                    else "(nothing streamed)")  # fmt: skip
            print(f"| {name} | {workload} | {plain['tok_s']:.1f} | {ngram['tok_s']:.1f} | "
                  f"{ngram['tok_s'] / plain['tok_s']:.2f}x | {ngram['accepted']}/{ngram['drafted']} | {read} | "
                  f"{'yes' if row['greedy_equal'] else 'NO'} | {result['peak_rss'] / 2**20:.0f} MiB / "
                  f"{result['budget'] / 2**20:.0f} MiB |")
    print("\nraw:", json.dumps(placements))


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
