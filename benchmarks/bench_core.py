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

`--dram-bound [--layers N]` instead measures a Llama-2-7B-shaped synthetic INT8 model (random
weights written once into the cache; 8 of its 32 layers unless `--layers` says otherwise)
resident under the `24gb` profile: decode tok/s after a 16-token prompt next to the bound the
machine's DRAM sets, (the probe's int8 bytes/s, measured before and after the decode) / (weight
bytes one token reads: every layer and the head, an embedding row). The share of the bound does
not depend on the layer count; the 32-layer tok/s is extrapolated from it.
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


DRAM_STEPS = 16  # decode steps timed on the 7B-shaped model (one warm-up step first)
# 8 of the 32 layers (1.9 GB, written in ~3 min on 2 cores; all 32 take ~10): far past any L3,
# so the weights stream from DRAM as the whole model's would.
DRAM_LAYERS = 8


def dram_bound_side(artifact: str) -> dict:
    """Decode of `artifact` resident under 24gb in this process, beside the DRAM bound."""
    import torch

    from tierlm.device.cpu import apply_threads
    from tierlm.probe.bandwidth import int8_bytes_per_s
    from tierlm.profile import load_profile
    from tierlm.runtime.loader import load_model

    apply_threads(2)
    loaded = load_model(artifact, device="cpu", dtype=torch.float32, profile=load_profile("24gb"))
    sizes, placement = loaded.sizes, loaded.placement
    layer_bytes = sum(sizes.bytes_used(b) for b in sizes.names if b.startswith("layers."))
    per_token = sum(sizes.bytes_used(b) for b in sizes.names if b != "embed") + sizes.row_bytes
    cache = loaded.new_cache()
    # The probe's int8 bandwidth measured now, before and after the decode: the bound is this
    # run's, not a cached figure from another hour of the machine's day.
    dram = [int8_bytes_per_s(torch.device("cpu"), torch.float32)]
    with torch.inference_mode():
        token = int(loaded.model.forward(torch.tensor([PROMPT[:16]]) % loaded.config.vocab_size, cache)[0, -1].argmax())
        token = int(loaded.model.forward(torch.tensor([[token]]), cache)[0, -1].argmax())  # warm-up step
        started = time.perf_counter()
        for _ in range(DRAM_STEPS):
            token = int(loaded.model.forward(torch.tensor([[token]]), cache)[0, -1].argmax())
        elapsed = time.perf_counter() - started
    dram.append(int8_bytes_per_s(torch.device("cpu"), torch.float32))
    return {"decode_tps": DRAM_STEPS / elapsed, "bytes_per_token": per_token, "layer_bytes": layer_bytes,
            "dram_bytes_per_s": statistics.mean(dram), "resident": placement.fully_resident,
            "predicted_tps": placement.predicted_decode_tokens_per_s, "peak_rss": peak_rss()}  # fmt: skip


def dram_bound(layers: int) -> None:
    from bench_offload import LLAMA2_7B

    from tierlm.cache.synthetic import write_synthetic_artifact
    from tierlm.paths import cache_root

    target = cache_root() / "artifacts" / f"synthetic-llama2-7b-{layers}l-int8"
    started = time.perf_counter()
    write_synthetic_artifact({**LLAMA2_7B, "num_hidden_layers": layers}, target)
    print(f"Llama-2-7B-shaped synthetic INT8, {layers} of 32 layers, ready in {time.perf_counter() - started:.0f} s")
    out = subprocess.run([sys.executable, __file__, "--dram-side", str(target)], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(out.stderr.strip()[-2000:])
    row = json.loads(out.stdout.strip().splitlines()[-1])
    bound = row["dram_bytes_per_s"] / row["bytes_per_token"]
    share = row["decode_tps"] / bound
    print("| layers | resident | GB read per token | probe DRAM GB/s | bound tok/s | decode tok/s | share of bound "
          "| predicted tok/s | 32 layers, extrapolated tok/s | peak RSS GiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    # At 32 layers a token reads the other blocks' bytes plus 32 layers' at the same share of the bound.
    bytes_32 = row["bytes_per_token"] + row["layer_bytes"] * (32 - layers) / layers
    print(f"| {layers} | {row['resident']} | {row['bytes_per_token'] / 1e9:.2f} | {row['dram_bytes_per_s'] / 1e9:.1f} | "
          f"{bound:.2f} | {row['decode_tps']:.2f} | {share:.0%} (target >= 90%) | {row['predicted_tps']:.2f} | "
          f"{share * row['dram_bytes_per_s'] / bytes_32:.2f} | {row['peak_rss'] / 2**30:.2f} |")  # fmt: skip


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--side":
        print(json.dumps(measure(sys.argv[2], sys.argv[3])))
        return
    if len(sys.argv) == 3 and sys.argv[1] == "--dram-side":
        print(json.dumps(dram_bound_side(sys.argv[2])))
        return
    if "--dram-bound" in sys.argv:
        layers = int(sys.argv[sys.argv.index("--layers") + 1]) if "--layers" in sys.argv else DRAM_LAYERS
        dram_bound(layers)
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
