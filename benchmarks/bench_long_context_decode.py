"""Decode speed deep in a long context, per KV cache format: the embedded SmolLM2 prefilled with N
tokens of real text (`pydoc_data.topics`), then `--steps` greedy one-token steps timed (the fused
CPU decode step: its attention reads every cached position each step, so it grows with N).

Run one format per process, e.g. interleaved A/B against another checkout:
`.venv/bin/python benchmarks/bench_long_context_decode.py --kv-cache q8_0 --context 4000`;
PYTHONPATH=<other checkout> runs that checkout's tierlm (and its native library) instead.
Prints one JSON line: format, context, decode tok/s, ms per step. `--paged`: the cache is the
server's (kv/paged.py: a page table over a pool of 16-position pages) instead of a contiguous one.

`--kernel`: the decode step's attention alone (the native `kv_attend`: one query head over N
stored rows of 64 values, the embedded model's head), ns per position for every format, rows
contiguous, on pages of 16 in order and on pages in shuffled order (median of 5 interleaved
rounds).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache", default="f32")
    parser.add_argument("--context", type=int, default=4000, help="tokens prefilled before the timed steps")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--kernel", action="store_true", help="time the attention kernel alone, every format")
    parser.add_argument("--paged", action="store_true", help="a paged cache (the server's) instead of a contiguous one")
    args = parser.parse_args()
    if args.kernel:
        return kernel(args.context)

    from tierlm.cli.bench import prompt_ids
    from tierlm.runtime.loader import load_model
    from tierlm.runtime.source import resolve_model_dir
    from tierlm.runtime.tokenizer import Tokenizer

    model_dir = resolve_model_dir("smollm2")
    loaded = load_model(model_dir, device="cpu", dtype=torch.float32, context_length=args.context + args.steps + 1,
                        kv_cache=args.kv_cache)  # fmt: skip
    ids = prompt_ids(Tokenizer.from_dir(model_dir), args.context)
    cache = loaded.new_paged_cache(1, 1).slot(0) if args.paged else loaded.new_cache()
    with torch.inference_mode():
        for start in range(0, len(ids), 512):
            logits = loaded.model.forward(torch.tensor([ids[start : start + 512]]), cache)
        token = int(logits[0, -1].argmax())
        started = time.perf_counter()
        for _ in range(args.steps):
            token = int(loaded.model.forward(torch.tensor([[token]]), cache)[0, -1].argmax())
        elapsed = time.perf_counter() - started
    print(json.dumps({"kv_cache": args.kv_cache, "paged": args.paged, "context": args.context, "tok_s": round(args.steps / elapsed, 2),
                      "ms_per_step": round(1000 * elapsed / args.steps, 2)}))


def kernel(positions: int, reps: int = 200) -> None:
    from tierlm.kv import codec
    from tierlm.kv.formats import FORMATS
    from tierlm.models.fused_decode import KV_TYPES
    from tierlm.quant.native import load_native

    native = load_native()
    gen = torch.Generator().manual_seed(0)
    keys, values, q = torch.randn(positions, 64, generator=gen), torch.randn(positions, 64, generator=gen), torch.randn(64, generator=gen)
    pages = torch.arange(-(-positions // 16), dtype=torch.long)  # in order, as a fresh pool hands them out
    scattered = pages[torch.randperm(len(pages), generator=gen)]  # a long-running pool's, in any order
    for name, fmt in FORMATS.items():
        parts = [*codec.encode(fmt, keys), *codec.encode(fmt, values)]
        calls = {"contiguous": lambda: native.kv_attend(KV_TYPES[name], q, *parts),
                 "paged": lambda: native.kv_attend(KV_TYPES[name], q, *parts, pages=pages, page_tokens=16),
                 "scattered": lambda: native.kv_attend(KV_TYPES[name], q, *parts, pages=scattered, page_tokens=16)}  # fmt: skip
        timings: dict[str, list[float]] = {layout: [] for layout in calls}
        for _ in range(5):  # interleaved rounds: both layouts see the same load
            for layout, call in calls.items():
                call()
                started = time.perf_counter()
                for _ in range(reps // 5):
                    call()
                timings[layout].append((time.perf_counter() - started) / (reps // 5))
        print(json.dumps({"kv_cache": name, "positions": positions,
                          **{f"{layout}_ns_per_position": round(sorted(t)[2] / positions * 1e9, 2)
                             for layout, t in timings.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
