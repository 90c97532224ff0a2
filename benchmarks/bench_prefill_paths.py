"""Prefill through the fused native layers against the eager torch layers, at several prompt
lengths, interleaved in one process: where the fused chunk's attention (csrc/prefill_attention.h)
stops paying, which sets models/fused_decode.py's FUSED_CHUNK_SPAN.

Each round prefills the same prompt (real text, `pydoc_data.topics`, in the engine's chunks of
512) once with TIERLM_FUSED=1, every chunk fused whatever its span, and once with TIERLM_FUSED=0
(the eager path: torch's attention, the same integer GEMM for the products). Prints the CPU, the
native build's ISA path and the load average, then a markdown row per length: median and best
prompt tok/s of each path over the rounds and their ratio.

    .venv/bin/python benchmarks/bench_prefill_paths.py --model smollm2-q8_0 --lengths 128,512,2048,4000
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a model `tierlm list` shows (the embedded one by default)")
    parser.add_argument("--lengths", default="128,512,2048,4000", help="prompt tokens, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]

    from tierlm.cli.bench import prompt_ids
    from tierlm.models import fused_decode
    from tierlm.profile import load_profile
    from tierlm.quant.native import load_native
    from tierlm.runtime.sampling import SamplingParams
    from tierlm.runtime.session import open_session

    fused_decode.FUSED_CHUNK_SPAN = max(lengths)  # the fused path at every length measured
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())  # fmt: skip
    native = load_native()
    print(f"CPU {cpu}, {os.cpu_count()} CPUs; native build {native.name} (ISA path {native.isa}); "
          f"{args.threads} threads; load average {os.getloadavg()[0]:.2f} before")  # fmt: skip
    print(f"model {args.model}; {args.rounds} interleaved rounds per length\n")
    print("| prompt tokens | fused tok/s (median, best) | eager tok/s (median, best) | fused / eager (median) |")
    print("|---|---|---|---|")
    with open_session(args.model, load_profile("24gb"), device="cpu", threads=args.threads) as session:
        engine = session.engine
        warm = prompt_ids(engine.tokenizer, 64)
        for _ in engine.generate(warm, SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)):
            pass
        for length in lengths:
            ids = prompt_ids(engine.tokenizer, length)
            rates: dict[str, list[float]] = {"1": [], "0": []}
            for _ in range(args.rounds):
                for fused in rates:
                    os.environ["TIERLM_FUSED"] = fused
                    engine.reset()
                    started = time.perf_counter()
                    for _ in engine.generate(ids, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)):
                        pass
                    rates[fused].append(length / (time.perf_counter() - started))
            fused, eager = (statistics.median(rates[k]) for k in ("1", "0"))
            print(f"| {length} | {fused:.0f}, {max(rates['1']):.0f} | {eager:.0f}, {max(rates['0']):.0f} | "
                  f"{fused / eager:.2f}x |", flush=True)  # fmt: skip
    os.environ.pop("TIERLM_FUSED", None)
    print(f"\nload average {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
