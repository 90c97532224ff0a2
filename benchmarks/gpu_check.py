"""The prepared check for a lent accelerator: parity on the device, then 7B-shaped INT8 decode,
resident and streamed.

1. Parity: a tiny random Llama checkpoint in transformers (fp32, on the device) against tierlm
   on the device in fp32 (logits) and in the device's compute dtype (greedy tokens); the INT8
   kernels on the device (symmetric and asymmetric, compute-dtype activations) against
   dequantize-then-matmul in fp32.
2. Decode: a synthetic Llama-2-7B-shaped INT8 artifact (random weights, written once into
   `--workdir`) under the `24gb` profile (resident on the device) and under `4gb` (the rest
   streamed from host RAM / disk through the copy stream); 32 greedy tokens each, tokens/s,
   the planner's prediction, peak device memory against the budget, and whether the streamed
   run's tokens equal the resident run's.
3. Graphs (issue 13 item 6): decode captured as a CUDA graph (models/graph_decode.py) against the
   eager step, on the embedded SmolLM2 (int8) and the 7B-shaped artifact under `24gb`: tokens/s of
   each, whether their greedy tokens are equal, and per decode token the launch calls the host
   makes and the kernels the device runs (torch.profiler). Where the device captures no graphs
   (the CPU dry run, an NPU without NPUGraph) each row is skipped with the reason printed.

Everything is written to `--out/gpu_check.json` and summarised on stdout. A dry run on the CPU
(`--device cpu --layers 2`) checks the script itself on a machine without an accelerator.

    python benchmarks/gpu_check.py --device cuda --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.tiny builds the tiny model

LLAMA2_7B = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}  # fmt: skip
PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203, 29889]
STEPS = 32
# Host calls that launch device work: one per eager kernel, one per graph replay.
LAUNCH_CALLS = ("cudaLaunch", "cuLaunch", "cudaGraphLaunch")


def parity(device, workdir: Path) -> dict:
    import torch

    from tests.tiny import make_model
    from tierlm.device.resolve import compute_dtype
    from tierlm.quant.int8 import quantize_int8
    from tierlm.runtime.loader import load_model

    model_dir = workdir / "tiny-llama"
    reference = make_model(model_dir, with_tokenizer=False, family="llama", heads=4, kv_heads=2).to(device)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        expected = reference(ids).logits.float()
    fp32 = load_model(model_dir, device=device, dtype=torch.float32)
    logits = fp32.model.forward(ids, fp32.new_cache(), logits="all").float()
    dtype = compute_dtype(device)
    low = load_model(model_dir, device=device, dtype=dtype)
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)[0, 24:]
    got, cache, step = [], low.new_cache(), ids
    for _ in range(12):
        token = low.model.forward(step, cache)[0, -1].argmax()
        got.append(int(token))
        step = token.view(1, 1)
    kernels = {}
    gen = torch.Generator().manual_seed(1)
    for name, asym in (("int8-g128", False), ("int8-g32-asym", True), ("int8", False)):
        group = None if name == "int8" else int(name.split("-g")[1].split("-")[0])
        weight = quantize_int8(torch.randn(4096, 4096, generator=gen) * 0.02, group, asymmetric=asym)
        x = torch.randn(3, 4096, generator=gen)
        ref = x @ weight.dequantize().T
        y = weight.to(device, dtype).linear(x.to(device, dtype)).float().cpu()
        kernels[name] = float((y - ref).abs().max() / ref.abs().max())
    return {
        "fp32_logits_max_abs_diff": float((logits - expected).abs().max()),
        "compute_dtype": str(dtype),
        "greedy_equal_to_transformers_fp32": got == want.tolist(),
        "int8_kernel_rel_error": kernels,
    }


def decode(artifact: Path, profile_name: str, device) -> dict:
    from tierlm.device.backend import backend_for
    from tierlm.profile import load_profile
    from tierlm.runtime.loader import load_model

    backend = backend_for(device)
    profile = load_profile(profile_name)
    started = time.perf_counter()
    loaded = load_model(artifact, device=device, profile=profile, context_length=512)
    load_s = time.perf_counter() - started
    tokens, elapsed = greedy_decode(loaded, loaded.new_cache(), backend)
    memory = backend.memory()
    ledger = getattr(loaded.store, "ledger", None)
    result = {
        "profile": profile_name,
        "load_s": load_s,
        "decode_tokens_per_s": (STEPS - 1) / elapsed,
        "predicted_tokens_per_s": loaded.placement.predicted_decode_tokens_per_s,
        "binding_limit": loaded.placement.binding_limit,
        "bytes_by_tier": loaded.placement.block_bytes_by_tier(),
        "device_budget": profile.device_memory,
        "device_peak": memory.peak,
        "tokens": tokens,
        "stall_s": ledger.stall_s if ledger else None,
        "overlap": ledger.overlap if ledger else None,
    }
    loaded.close()
    return result


def greedy_decode(loaded, cache, backend) -> tuple[list[int], float]:
    """Prefill PROMPT into `cache` (reset first), then STEPS - 1 greedy decode steps: the tokens
    and the seconds the decode steps took."""
    import torch

    cache.reset()
    logits = loaded.model.forward(torch.tensor([PROMPT], device=loaded.device), cache)
    tokens = [int(logits[0, -1].argmax())]
    backend.synchronize()
    started = time.perf_counter()
    for _ in range(STEPS - 1):
        logits = loaded.model.forward(torch.tensor([[tokens[-1]]], device=loaded.device), cache)
        tokens.append(int(logits[0, -1].argmax()))
    backend.synchronize()
    return tokens, time.perf_counter() - started


def graph_rows(device, models: list[tuple[str, object, dict]]) -> list[dict]:
    """Item 6 per model (name, directory or a callable giving it, load_model options): decode
    eager vs graphed, or why the row is skipped."""
    from tierlm.device.graphs import graph_kind
    from tierlm.errors import TierlmError

    kind, why = graph_kind(device)
    rows = []
    for name, where, options in models:
        if kind is None:
            rows.append({"model": name, "skipped": why})
            continue
        try:
            rows.append(graph_row(name, where() if callable(where) else where, options, device))
        except TierlmError as err:  # e.g. the embedded model's package is not installed
            rows.append({"model": name, "skipped": err.message})
    return rows


def graph_row(name: str, model_dir: Path, options: dict, device) -> dict:
    import torch

    from tierlm.device.backend import backend_for
    from tierlm.models import graph_decode
    from tierlm.runtime.loader import load_model

    backend = backend_for(device)
    loaded = load_model(model_dir, device=device, context_length=512, **options)
    model, row = loaded.model, {"model": name}
    graphs = model.graphs
    if graphs is None:
        loaded.close()
        return {"model": name, "skipped": graph_decode.refusal(model) or "no graphs"}
    cache = loaded.new_cache()  # one cache for both modes, so the graphs are captured once
    step = torch.tensor([[PROMPT[-1]]], device=device)
    for mode in ("eager", "graph"):
        model.graphs = graphs if mode == "graph" else None
        greedy_decode(loaded, cache, backend)  # warm-up: allocator, kernels, graph capture
        tokens, elapsed = greedy_decode(loaded, cache, backend)
        row[f"{mode}_tokens_per_s"] = (STEPS - 1) / elapsed
        row[f"{mode}_tokens"] = tokens
        row[f"{mode}_per_token"] = launch_counts(lambda: model.forward(step, cache), backend)
    row["tokens_equal"] = row["eager_tokens"] == row["graph_tokens"]
    row["graphs_captured"] = sorted(f"rows {r}, span {s}" for r, s, _ in graphs.steps)
    loaded.close()
    return row


def launch_counts(run_step, backend) -> dict:
    """Host launch calls and device kernels (memcpys included) of one decode step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_step()
        backend.synchronize()
    events = prof.events()
    return {
        "launch_calls": sum(1 for e in events if e.name.startswith(LAUNCH_CALLS)),
        "device_kernels": sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
    }


def print_graph_row(row: dict) -> None:
    if "skipped" in row:
        print(f"graphs {row['model']}: skipped ({row['skipped']})")
        return
    eager, graph = row["eager_per_token"], row["graph_per_token"]
    print(f"graphs {row['model']}: eager {row['eager_tokens_per_s']:.1f} tok/s, graph "
          f"{row['graph_tokens_per_s']:.1f} tok/s ({row['graph_tokens_per_s'] / row['eager_tokens_per_s']:.2f}x); "
          f"tokens equal {row['tokens_equal']}; per token: launch calls {eager['launch_calls']} -> "
          f"{graph['launch_calls']}, device kernels {eager['device_kernels']} -> {graph['device_kernels']}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--workdir", type=Path, default=None, help="where the 7B artifact is written")
    parser.add_argument("--layers", type=int, default=32, help="fewer for a quick dry run")
    args = parser.parse_args()

    import torch

    from tierlm.cache.synthetic import write_synthetic_artifact
    from tierlm.device.backend import backend_for
    from tierlm.device.resolve import resolve_device

    device = resolve_device(args.device)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tierlm-gpu-check-"))
    report: dict = {"device": str(device), "name": backend_for(device).name(), "torch": torch.__version__}
    report["parity"] = parity(device, workdir)
    print(json.dumps(report, indent=1), flush=True)
    shape = dict(LLAMA2_7B, num_hidden_layers=args.layers)
    started = time.perf_counter()
    artifact = write_synthetic_artifact(shape, workdir / f"llama2-7b-{args.layers}l-int8")
    report["artifact_write_s"] = time.perf_counter() - started
    runs = [decode(artifact, name, device) for name in ("24gb", "4gb")]
    report["decode"] = runs
    report["streamed_tokens_equal_resident"] = runs[0]["tokens"] == runs[1]["tokens"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    for run in runs:
        tiers = ", ".join(f"{t} {n / 2**30:.1f} GiB" for t, n in run["bytes_by_tier"].items())
        print(f"{run['profile']}: {run['decode_tokens_per_s']:.2f} tok/s (predicted "
              f"{run['predicted_tokens_per_s']:.2f}, {run['binding_limit']}); {tiers}; device peak "
              f"{run['device_peak'] / 2**30:.2f} of {run['device_budget'] / 2**30:.2f} GiB")  # fmt: skip
    print("streamed tokens equal resident:", report["streamed_tokens_equal_resident"])
    from tierlm.profile import load_profile
    from tierlm.weights.embedded import ensure_embedded_model

    report["graphs"] = graph_rows(device, [
        ("smollm2 (embedded, int8)", ensure_embedded_model, {"quant": "int8"}),
        (f"llama2-7b-shaped {args.layers}l int8 (24gb)", artifact, {"profile": load_profile("24gb")}),
    ])  # fmt: skip
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    for row in report["graphs"]:
        print_graph_row(row)


if __name__ == "__main__":
    main()
