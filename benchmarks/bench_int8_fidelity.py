"""Quantization fidelity on the embedded SmolLM2: perplexity and top-1 agreement against fp32, for
every weight mode (int8, int4, mixed 4/8-bit and auto), with each mode's artifact size.

Text: the Python language reference's topic pages shipped in the standard library
(`pydoc_data.topics`), real English documentation written by the CPython authors. The first
`--tokens` tokens (default 4096) are scored in non-overlapping windows of `--window` tokens
(default 1024); every position predicts the next token. For each quant mode we report:

- MiB: the weight bytes as stored, the artifact's weights.bin (each mode converts once into
  $TIERLM_CACHE/artifacts). The fp32 reference runs on the checkpoint as stored (no artifact);
  its row gives the checkpoint's parameter bytes (every tensor at 4 bytes).
- tensors: the stored 2-D weight tensors counted by concrete mode (the artifact manifest's
  records; for mixed:SIZE the same as its `mixed.tensor_modes`), e.g. "150 int4-g32, 61 int8".
- perplexity, its change against fp32, and how often the mode's most likely next token equals
  fp32's (top-1 agreement).

Read the numbers with the source in mind: the embedded model is itself a 4-bit GGUF (Q4_1
projections, Q8_0 embedding), so "fp32" is that 4-bit model dequantized. Modes that keep the
source grid (int4-g32-asym, int8-g32-asym, mixed:source, which `auto` picks) reproduce it and show
~0 loss; only a float source would show each mode's own loss.

`--modes` (comma-separated) defaults to every mode; `mixed:SIZE` sizes should lie between the
int4-g128 and int8 artifact sizes (~66 and ~133 MiB here).

Run from the repo root: `.venv/bin/python benchmarks/bench_int8_fidelity.py`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import struct
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

DEFAULT_MODES = ("fp32,int8,int8-g128,int8-g32-asym,int4-g32,int4-g32-asym,int4-g64,int4-g128,"
                 "int4-g128-asym,mixed:85MiB,mixed:110MiB,auto")  # fmt: skip
MIB = 1 << 20


def corpus_ids(tokenizer, count: int) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids = tokenizer.encode(text)
    if len(ids) < count:
        raise SystemExit(f"corpus has only {len(ids)} tokens")
    return ids[:count]


def score(loaded, ids: list[int], window: int) -> tuple[float, list[torch.Tensor]]:
    """Mean negative log-likelihood per predicted token, and the argmax predictions per window."""
    total_nll, predicted, argmaxes = 0.0, 0, []
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start : start + window + 1]])
        if chunk.shape[1] < 2:
            break
        logits = loaded.model.forward(chunk[:, :-1], loaded.new_cache(), logits="all")[0]
        targets = chunk[0, 1:]
        total_nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        predicted += targets.numel()
        argmaxes.append(logits.argmax(-1))
    return total_nll / predicted, argmaxes


def checkpoint_param_bytes(model_dir: Path) -> int:
    """Elements x 4 over every tensor of the checkpoint's safetensors files (the fp32 size)."""
    elements = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                elements += math.prod(info["shape"])
    return elements * 4


def record_mode(record: dict) -> str | None:
    """The concrete mode of one manifest tensor record (None: a float tensor, e.g. a norm)."""
    if record["encoding"] not in ("int4", "int8"):
        return None
    group = record.get("meta", {}).get("group_size")
    asym = "-asym" if "offsets" in record["parts"] else ""
    return f"{record['encoding']}{'' if group is None else f'-g{group}'}{asym}"


def artifact_facts(directory: Path | None) -> tuple[int | None, Counter]:
    """(weights.bin bytes, stored 2-D tensors counted by mode) of an artifact directory."""
    if directory is None:
        return None, Counter()
    manifest = json.loads((Path(directory) / "manifest.json").read_text())
    counts = Counter()
    for block in manifest["blocks"].values():
        for record in block["tensors"].values():
            mode = record_mode(record)
            if mode is not None:
                counts[mode] += 1
    chosen = (manifest.get("mixed") or {}).get("tensor_modes")
    if chosen and Counter(chosen.values()) != counts:  # the allocation as chosen and as stored must agree
        print(f"warning: {directory.name}: tensor_modes {dict(Counter(chosen.values()))} vs records {dict(counts)}",
              file=sys.stderr)  # fmt: skip
    return (Path(directory) / "weights.bin").stat().st_size, counts


def describe(counts: Counter) -> str:
    return ", ".join(f"{n} {mode}" for mode, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def machine_header() -> list[str]:
    cpu = platform.processor() or "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return [f"cpu: {cpu}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}",
            f"load average (1/5/15 min) at start: {load}"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated (default: {DEFAULT_MODES})")
    args = parser.parse_args()
    torch.set_num_threads(2)

    from tierlm.runtime.loader import load_model
    from tierlm.runtime.tokenizer import Tokenizer
    from tierlm.weights.embedded import ensure_embedded_model

    started = time.strftime("%Y-%m-%d %H:%M")
    header = machine_header()
    model_dir = ensure_embedded_model()
    ids = corpus_ids(Tokenizer.from_dir(model_dir), args.tokens)
    clock = time.perf_counter()
    reference = load_model(model_dir, device="cpu", dtype=torch.float32, context_length=args.window + 1)
    ref_nll, ref_top = score(reference, ids, args.window)
    reference.close()
    del reference
    print(f"fp32 scored in {time.perf_counter() - clock:.0f} s", file=sys.stderr, flush=True)

    rows = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode == "fp32":
            rows.append(f"| fp32 (checkpoint as stored) | {checkpoint_param_bytes(model_dir) / MIB:.1f} | — "
                        f"| {math.exp(ref_nll):.3f} | — | — |")  # fmt: skip
            continue
        clock = time.perf_counter()
        loaded = load_model(model_dir, device="cpu", dtype=torch.float32, quant=mode, context_length=args.window + 1)
        loaded_s = time.perf_counter() - clock
        nll, top = score(loaded, ids, args.window)
        size, counts = artifact_facts(loaded.artifact_dir)
        label = mode if mode != "auto" else f"auto (= {loaded.weight_format})"
        loaded.close()
        del loaded
        agree = sum(int((a == b).sum()) for a, b in zip(top, ref_top)) / sum(a.numel() for a in top)
        change = math.exp(nll) / math.exp(ref_nll) - 1
        mib = f"{size / MIB:.1f}" if size is not None else "—"
        tensors = describe(counts) if len(counts) > 1 or "mixed" in mode or mode == "auto" else f"all {describe(counts)}"
        rows.append(f"| {label} | {mib} | {tensors} | {math.exp(nll):.3f} | {change:+.2%} | {agree:.2%} |")
        print(f"{mode}: load/convert {loaded_s:.0f} s, total {time.perf_counter() - clock:.0f} s, "
              f"weights.bin {size} bytes", file=sys.stderr, flush=True)  # fmt: skip
        print(rows[-1], file=sys.stderr, flush=True)

    print(f"date: {started}; " + "; ".join(header))
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"text: pydoc_data.topics (CPython docs), {len(ids)} tokens, windows of {args.window}\n")
    print("| weights | MiB | tensors by mode | perplexity | vs fp32 | top-1 agreement with fp32 |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
