"""INT8 fidelity on the embedded SmolLM2: perplexity and top-1 agreement against fp32.

Text: the Python language reference's topic pages shipped in the standard library
(`pydoc_data.topics`), real English documentation written by the CPython authors. The first
`--tokens` tokens (default 4096) are scored in non-overlapping windows of `--window` tokens
(default 1024); every position predicts the next token. For each quant mode we report perplexity,
its change against fp32, and how often the int8 model's most likely next token equals fp32's.

Run from the repo root: `.venv/bin/python benchmarks/bench_int8_fidelity.py`.
"""

from __future__ import annotations

import argparse
import math

import torch


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--modes", default="int8,int8-g128")
    args = parser.parse_args()
    torch.set_num_threads(2)

    from tierlm.runtime.loader import load_model
    from tierlm.runtime.tokenizer import Tokenizer
    from tierlm.weights.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    ids = corpus_ids(Tokenizer.from_dir(model_dir), args.tokens)
    reference = load_model(model_dir, device="cpu", dtype=torch.float32, context_length=args.window + 1)
    ref_nll, ref_top = score(reference, ids, args.window)
    del reference
    print(f"text: pydoc_data.topics (CPython docs), {len(ids)} tokens, windows of {args.window}\n")
    print("| weights | perplexity | vs fp32 | top-1 agreement with fp32 |")
    print("|---|---|---|---|")
    print(f"| fp32 | {math.exp(ref_nll):.3f} | — | — |")
    for mode in args.modes.split(","):
        loaded = load_model(model_dir, device="cpu", dtype=torch.float32, quant=mode, context_length=args.window + 1)
        nll, top = score(loaded, ids, args.window)
        agree = sum(int((a == b).sum()) for a, b in zip(top, ref_top)) / sum(a.numel() for a in top)
        change = math.exp(nll) / math.exp(ref_nll) - 1
        print(f"| {mode} | {math.exp(nll):.3f} | {change:+.2%} | {agree:.2%} |")


if __name__ == "__main__":
    main()
