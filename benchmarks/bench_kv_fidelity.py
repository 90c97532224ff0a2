"""KV cache formats on the embedded SmolLM2: perplexity and top-1 agreement against an f32 KV
cache, for every format (f16, bf16, q8_0, q4_0), at 512 and 4096 tokens of context, with each
format's KV bytes per token.

Text: the Python language reference's topic pages (`pydoc_data.topics`), tokenized as in
benchmarks/bench_int8_fidelity.py (its `corpus_ids`). The first N tokens are fed teacher-forced
through one cache, in chunks of PREFILL_CHUNK (512) as the engine prefills, so each later chunk
reads the earlier chunks' keys and values back from the cache in its format; every position
predicts the next token. Weights: the embedded model at the default `auto` quant (the same
weights for every format), so only the cache's format differs. For each format and N:

- perplexity, its change against the f32 cache, and how often its most likely next token equals
  the f32 cache's (top-1 agreement), over all N - 1 predictions and over the last 256 (the
  positions with the most quantized history);
- KV bytes per token: the cache's `nbytes / max_len` (keys and values of every layer, scales included).

Run from the repo root: `.venv/bin/python benchmarks/bench_kv_fidelity.py [--contexts 512,4096]`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int8_fidelity import corpus_ids, machine_header  # noqa: E402

FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_0")
TAIL = 256  # the last positions of a window, scored on their own


def teacher_forced(loaded, ids: list[int], chunk: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per predicted position: the negative log-likelihood of the next token and the argmax
    token (both [len(ids) - 1]), running `ids` through one fresh cache `chunk` tokens at a time;
    and the cache's bytes per position."""
    from tierlm.runtime.sequence import PREFILL_CHUNK

    chunk = chunk or PREFILL_CHUNK
    cache = loaded.new_cache()
    nll, top = [], []
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            piece = torch.tensor([ids[start : start + chunk]])
            logits = loaded.model.forward(piece, cache, logits="all")[0]
            targets = torch.tensor(ids[start + 1 : start + chunk + 1])
            logits = logits[: len(targets)]  # the window's last token has no next token in it
            nll.append(torch.nn.functional.cross_entropy(logits, targets, reduction="none"))
            top.append(logits.argmax(-1))
    assert cache.offset == len(ids)
    return torch.cat(nll), torch.cat(top), cache.nbytes // cache.max_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="512,4096", help="window lengths in tokens, comma-separated")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated; f32 is the reference")
    parser.add_argument("--quant", default="auto", help="the weights (the same for every format)")
    parser.add_argument("--chunk", type=int, default=0, help="prefill chunk (default: the engine's)")
    args = parser.parse_args()
    torch.set_num_threads(2)

    from tierlm.runtime.loader import load_model
    from tierlm.runtime.sequence import PREFILL_CHUNK
    from tierlm.runtime.source import resolve_model_dir
    from tierlm.runtime.tokenizer import Tokenizer

    started = time.strftime("%Y-%m-%d %H:%M")
    header = machine_header()
    model_dir = resolve_model_dir("smollm2")
    contexts = [int(n) for n in args.contexts.split(",")]
    formats = [f.strip() for f in args.formats.split(",") if f.strip() and f.strip() != "f32"]
    ids = corpus_ids(Tokenizer.from_dir(model_dir), max(contexts))

    rows, weights = [], None
    for context in contexts:
        window = ids[:context]
        loaded = {}
        for name in ("f32", *formats):
            clock = time.perf_counter()
            model = load_model(model_dir, device="cpu", dtype=torch.float32, quant=args.quant,
                               context_length=context, kv_cache=name)  # fmt: skip
            weights = model.weight_format
            nll, top, per_token = teacher_forced(model, window, args.chunk)
            model.close()
            loaded[name] = (nll, top, per_token)
            print(f"{context} {name}: {time.perf_counter() - clock:.0f} s", file=sys.stderr, flush=True)
        ref_nll, ref_top, _ = loaded["f32"]
        for name in ("f32", *formats):
            nll, top, per_token = loaded[name]
            cells = []
            for part in (slice(None), slice(-TAIL, None)):
                ppl = math.exp(nll[part].mean().item())
                change = ppl / math.exp(ref_nll[part].mean().item()) - 1
                agree = (top[part] == ref_top[part]).float().mean().item()
                cells += [f"{ppl:.3f}", "—" if name == "f32" else f"{change:+.2%}",
                          "—" if name == "f32" else f"{agree:.2%}"]  # fmt: skip
            rows.append(f"| {context} | {name} | {per_token:,} | " + " | ".join(cells) + " |")
            print(rows[-1], file=sys.stderr, flush=True)

    print(f"date: {started}; torch {torch.__version__}; " + "; ".join(header))
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"model: {model_dir.name}, weights {args.quant} (= {weights}); text: pydoc_data.topics (CPython docs), "
          f"first N tokens, prefilled in chunks of {args.chunk or PREFILL_CHUNK}\n")  # fmt: skip
    print(f"| N | KV cache | KV bytes/token | perplexity | vs f32 | top-1 agreement with f32 "
          f"| last {TAIL}: perplexity | vs f32 | top-1 agreement |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
