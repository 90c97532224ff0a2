"""tierlm against Hugging Face transformers on the embedded model, one fresh process per side.

Sides: transformers eager fp32; tierlm fp32 (weights as stored); tierlm INT8 (the 24gb
profile's format). All read the same SmolLM2-135M-Instruct weights (the HF directory tierlm
imports from the embedded GGUF). Method, identical on every side: 2 threads; a fixed 34-token
prompt; one prefill forward (last-position logits) + 127 greedy decode forwards with the KV
cache, argmax on the host each step (128 new tokens; EOS does not stop the loop); one warm-up
run, then the median of 3. Prefill tok/s = 34 / prefill time; decode tok/s = 127 / decode time.
Peak RSS = VmHWM of the side's process at the end (imports, loading and generation). The greedy
tokens of every side are compared with transformers'. Run on an otherwise idle machine:
`.venv/bin/python benchmarks/bench_core.py`.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 19556, 905, 30,
          2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 19556, 905, 30, 11173, 2, 198]  # fmt: skip
NEW_TOKENS = 128
SIDES = (("transformers eager fp32", "hf"), ("tierlm fp32", "none"), ("tierlm int8", "int8"))


def peak_rss() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))


def runner(side: str, model_dir: str):
    """A function doing one greedy run -> (prefill s, decode s, tokens)."""
    import torch

    torch.set_num_threads(2)
    ids = torch.tensor([PROMPT])
    if side == "hf":
        from transformers import AutoModelForCausalLM, DynamicCache

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")

        def step(tokens, cache):
            return model(tokens, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]

        new_cache = DynamicCache
    else:
        from tierlm.runtime.loader import load_model

        loaded = load_model(model_dir, device="cpu", dtype=torch.float32, quant=side, context_length=512)

        def step(tokens, cache):
            return loaded.model.forward(tokens, cache)[0, -1]

        new_cache = loaded.new_cache

    @torch.inference_mode()
    def run():
        cache = new_cache()
        started = time.perf_counter()
        token = int(step(ids, cache).argmax())
        prefill = time.perf_counter() - started
        tokens, started = [token], time.perf_counter()
        for _ in range(NEW_TOKENS - 1):
            token = int(step(torch.tensor([[token]]), cache).argmax())
            tokens.append(token)
        return prefill, time.perf_counter() - started, tokens

    return run


def measure(side: str, model_dir: str) -> dict:
    run = runner(side, model_dir)
    run()
    runs = [run() for _ in range(3)]
    return {
        "prefill_tps": len(PROMPT) / statistics.median(r[0] for r in runs),
        "decode_tps": (NEW_TOKENS - 1) / statistics.median(r[1] for r in runs),
        "peak_rss": peak_rss(),
        "tokens": runs[0][2],
    }


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--side":
        print(json.dumps(measure(sys.argv[2], sys.argv[3])))
        return
    from tierlm.weights.embedded import ensure_embedded_model

    model_dir = str(ensure_embedded_model())
    results = {}
    for label, side in SIDES:
        out = subprocess.run([sys.executable, __file__, "--side", side, model_dir], capture_output=True, text=True, check=True)
        results[label] = json.loads(out.stdout.strip().splitlines()[-1])
    peer = results[SIDES[0][0]]
    print("| run | prefill tok/s | decode tok/s | peak RSS MiB | decode vs HF | RSS vs HF | tokens = HF |")
    print("|---|---|---|---|---|---|---|")
    for label, row in results.items():
        print(f"| {label} | {row['prefill_tps']:.0f} | {row['decode_tps']:.1f} | {row['peak_rss'] / 2**20:.0f} | "
              f"{row['decode_tps'] / peer['decode_tps']:.2f}x | {row['peak_rss'] / peer['peak_rss']:.2f}x | "
              f"{row['tokens'] == peer['tokens']} |")


if __name__ == "__main__":
    main()
