"""Speculative decoding against plain decoding, resident and streamed from disk: prompt-lookup
drafts (--draft ngram) and a draft model (--draft MODEL).

Model: the embedded SmolLM2-135M-Instruct as its INT8 artifact, 2 threads, greedy. The draft
model is the same network as the package ships it (its Q4_1 GGUF, carried at 4.5 bits: ~0.6x
the target's bytes), the one smaller model of its tokenizer there is offline; it is held resident
beside the target and charged to its plan. Two workloads: quoting (prompts that ask to repeat or
extract from a source text, as summaries, RAG answers and code edits do) and free-form chat (text
that does not repeat its prompt). Two placements: resident (a roomy profile) and streamed (a device
budget that keeps 40 % of the target's weights resident beside the draft model, the rest read from
disk each forward, inside a cgroup v1 memory group capped at that budget with the artifact evicted
from the page cache, as bench_offload.py runs it). Each placement is one fresh process that runs
plain, ngram and draft-model generations of every prompt interleaved, `--rounds` times; rows report
the median decode tok/s, the drafted/accepted counts, the weight bytes read from the tiers per
generated token (the ledger's, streamed runs only), whether the greedy tokens were equal to plain
decoding's, and the process's peak RSS against the budget.

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
    """In a fresh process: every prompt plain, ngram-drafted and model-drafted, interleaved, `rounds`
    times. The draft model (`model_dir`, as the package ships it) is charged beside the target."""
    import torch

    from tierlm.profile import load_profile
    from tierlm.runtime.draft_model import resolve_draft
    from tierlm.runtime.engine import Engine
    from tierlm.runtime.loader import load_model
    from tierlm.runtime.sampling import SamplingParams
    from tierlm.runtime.session import load_draft
    from tierlm.runtime.source import resolve_source
    from tierlm.runtime.speculative import DraftSettings
    from tierlm.runtime.tokenizer import Tokenizer

    torch.set_num_threads(2)
    budget = load_profile(profile)
    tokenizer = Tokenizer.from_dir(model_dir)
    drafting = resolve_draft(model_dir, resolve_source(Path(artifact), "int8", accelerator=False), tokenizer,
                             budget, accelerator=False)  # fmt: skip
    loaded = load_model(artifact, device="cpu", dtype=torch.float32, profile=budget, beside=drafting.beside)
    engine = Engine(loaded, tokenizer, draft_model=load_draft(drafting, loaded, budget))
    ledger = getattr(loaded.store, "ledger", None)
    params = SamplingParams(temperature=0, max_new_tokens=tokens)
    modes = {"plain": DraftSettings(), "ngram": DraftSettings("ngram"), "model": DraftSettings.parse(model_dir, None)}
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
                equal &= outputs["plain"] == outputs["ngram"] == outputs["model"]
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
    engine.draft_model.close()
    loaded.close()
    return {"rows": rows, "peak_rss": peak_rss(), "budget": budget.device_memory, "draft_charge": drafting.beside.nbytes}


def run_headline_side(artifact: str, tokenizer_dir: str, profile: str, tokens: int) -> dict:
    """In a fresh process: the 7B-shaped model, plain and ngram-drafted, on a prompt that repeats a
    random stretch three times and on one that never repeats (random weights say nothing of text:
    what the row shows is what a pass's drafts save in disk reads)."""
    import torch

    from tierlm.profile import load_profile
    from tierlm.runtime.engine import Engine
    from tierlm.runtime.loader import load_model
    from tierlm.runtime.sampling import SamplingParams
    from tierlm.runtime.speculative import DraftSettings
    from tierlm.runtime.tokenizer import Tokenizer

    torch.set_num_threads(2)
    loaded = load_model(artifact, device="cpu", dtype=torch.float32, profile=load_profile(profile))
    # Any tokenizer decodes the ids (all below the model's vocabulary); EOS is ignored.
    engine = Engine(loaded, Tokenizer.from_dir(tokenizer_dir))
    ledger = loaded.store.stats()
    draw = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    stretch = torch.randint(100, vocab, (32,), generator=draw).tolist()
    prompts = {"repeating prompt": stretch * 3, "random prompt": torch.randint(100, vocab, (96,), generator=draw).tolist()}
    params = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)
    rows = {}
    for workload, ids in prompts.items():
        outputs, rows[workload] = {}, {}
        for mode, draft in {"plain": DraftSettings(), "ngram": DraftSettings("ngram")}.items():
            engine.reset()
            before = sum(ledger.bytes_read.values())
            generation = engine.generate(ids, params, draft=draft)
            generation.text()
            stats = generation.stats
            rows[workload][mode] = {"tok_s": stats.decode_tokens_per_s, "drafted": stats.drafted,
                                    "accepted": stats.accepted,
                                    "bytes_per_token": (sum(ledger.bytes_read.values()) - before) / stats.new_tokens}
            outputs[mode] = generation.token_ids
        rows[workload]["greedy_equal"] = outputs["plain"] == outputs["ngram"]
    budget = load_profile(profile).device_memory
    loaded.close()
    return {"rows": rows, "peak_rss": peak_rss(), "budget": budget}


def draft_charge(artifact: Path, model_dir: Path, profile: Path) -> int:
    """What the draft model is charged beside the target under `profile` (resolve_draft's price)."""
    from tierlm.profile import load_profile
    from tierlm.runtime.draft_model import resolve_draft
    from tierlm.runtime.source import resolve_source
    from tierlm.runtime.tokenizer import Tokenizer

    target = resolve_source(artifact, "int8", accelerator=False)
    checked = resolve_draft(str(model_dir), target, Tokenizer.from_dir(model_dir), load_profile(str(profile)),
                            accelerator=False)  # fmt: skip
    return checked.beside.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--headline", action="store_true",
                        help="the Llama-2-7B-shaped INT8 model under --profile 4gb instead (bench_offload's)")
    parser.add_argument("--side", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--headline-side", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        artifact, model_dir, profile = args.side
        print(json.dumps(run_side(artifact, model_dir, profile, args.tokens, args.rounds)))
        return
    if args.headline_side:
        print(json.dumps(run_headline_side(*args.headline_side, args.tokens)))
        return
    if args.headline:
        headline(args.tokens)
        return

    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.weights.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    artifact = ensure_artifact(ConversionRequest(model_dir, (), "int8"))
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        # 40 % of the target's weights resident, and room for the draft model beside them.
        budget = budget_for_resident_share(artifact, folder, 0.4)
        budget += draft_charge(artifact, model_dir, budget_profile(folder, "capped", budget))
        common = ["--tokens", str(args.tokens), "--rounds", str(args.rounds)]
        resident = budget_profile(folder, "resident", 16 << 30)
        placements = {"resident": side([str(artifact), str(model_dir), str(resident), *common], script=__file__)}
        capped = budget_profile(folder, "capped", budget)
        streamed, enforced = capped_side([str(artifact), str(model_dir), str(capped), *common], budget, artifact,
                                         script=__file__)  # fmt: skip
        placements["streamed (40 % resident" + (", cgroup-capped, cold cache)" if enforced else ", no cgroup)")] = streamed
    print(f"CPU: {cpu_name()}; 2 threads; load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print(f"{args.tokens} greedy tokens a prompt, {args.rounds} rounds, plain, ngram and draft model interleaved; "
          "median tok/s\n")
    print_rows(placements)


def headline(tokens: int) -> None:
    """The 7B-shaped synthetic INT8 model (written once into the cache) under the 4gb profile,
    inside a cgroup capped at its device budget with a cold page cache: plain against ngram."""
    from bench_offload import LLAMA2_7B

    from tierlm.cache.synthetic import write_synthetic_artifact
    from tierlm.paths import cache_root
    from tierlm.profile import load_profile
    from tierlm.weights.embedded import ensure_embedded_model

    target = cache_root() / "artifacts" / "synthetic-llama2-7b-int8"
    write_synthetic_artifact(LLAMA2_7B, target)
    profile = load_profile("4gb")
    load = os.getloadavg()
    argv = [str(target), str(ensure_embedded_model()), "4gb", "--tokens", str(tokens)]
    result, enforced = capped_side(argv, profile.device_memory, target, script=__file__, flag="--headline-side")
    name = "7B-shaped INT8, 4gb" + (" (cgroup-capped, cold cache)" if enforced else " (no cgroup)")
    print(f"CPU: {cpu_name()}; 2 threads; load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print(f"{tokens} greedy tokens a prompt, plain then ngram\n")
    print_rows({name: result})


def print_rows(placements: dict) -> None:
    print("| placement | workload | drafts | plain tok/s | drafted tok/s | speedup | accepted/drafted "
          "| bytes/token vs plain | greedy equal | peak RSS / budget |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, result in placements.items():
        if "error" in result:
            print(f"| {name} | failed: {result['error']} | | | | | | | | |")
            continue
        for workload, row in result["rows"].items():
            plain = row["plain"]
            for mode in [m for m in ("ngram", "model") if m in row]:
                drafted = row[mode]
                read = (f"{drafted['bytes_per_token'] / plain['bytes_per_token']:.2f}x" if plain["bytes_per_token"]
                        else "(nothing streamed)")  # fmt: skip
                print(f"| {name} | {workload} | {mode} | {_rate(plain['tok_s'])} | {_rate(drafted['tok_s'])} | "
                      f"{drafted['tok_s'] / plain['tok_s']:.2f}x | {drafted['accepted']}/{drafted['drafted']} | {read} | "
                      f"{'yes' if row['greedy_equal'] else 'NO'} | {result['peak_rss'] / 2**20:.0f} MiB / "
                      f"{result['budget'] / 2**20:.0f} MiB |")
    print("\nraw:", json.dumps(placements))


def _rate(tok_s: float) -> str:
    return f"{tok_s:.2f}" if tok_s < 10 else f"{tok_s:.1f}"


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
