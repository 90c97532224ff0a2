"""GGUF files as people download them, imported with `auto`: what is carried, at what size, how
close to transformers' reading of the same file, and what the import and conversion cost.

The embedded SmolLM2-135M-Instruct (a Q4_1 GGUF) is re-quantized by llama.cpp's `llama-quantize
--allow-requantize` into each type of `--types` (default Q4_K_M, Q5_K_M, Q6_K, Q3_K_M, Q2_K,
Q8_0, IQ4_XS). For each file, in a fresh TIERLM_CACHE:

- GGUF: the file's tensor bytes by GGUF type (llama.cpp falls back to other types where a row is
  no whole number of 256-value blocks: SmolLM2's hidden size is 576);
- artifact: the `auto` artifact's weight bytes by tierlm format, and their ratio to the GGUF's;
- import: the import directory's bytes (no float copy), and the import's and the conversion's wall
  time and peak RSS (each a child process, `resource.getrusage`);
- fidelity: the largest |logit| difference against transformers' GGUF loader (which dequantizes
  with the `gguf` package) over 128 tokens of `pydoc_data.topics`, and whether up to 32 greedy
  tokens after a chat prompt (to transformers' end of turn) are the same.

`llama-quantize` comes from llama.cpp built as the developers' guide says (TIERLM_LLAMA_CPP_BIN or
--llama-bin). Run from the repo root: `.venv/bin/python benchmarks/bench_gguf_formats.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int8_fidelity import machine_header  # noqa: E402

TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "Q8_0", "IQ4_XS")
MIB = 1 << 20

# One child per phase, so each phase's peak RSS is its own: import, convert, compare.
CHILD = r"""
import json, resource, sys, time
from pathlib import Path
phase, gguf = sys.argv[1], Path(sys.argv[2])
started = time.perf_counter()
result = {}
if phase == "import":
    from tierlm.weights.embedded import import_gguf_to_cache
    out = import_gguf_to_cache(gguf)
    result["dir"] = str(out)
    result["dir_bytes"] = sum(p.stat().st_size for p in out.iterdir())
elif phase == "convert":
    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.offload.sizes import resolve_auto
    from tierlm.weights.embedded import import_gguf_to_cache
    out = import_gguf_to_cache(gguf)
    quant = resolve_auto("auto", out)
    result["quant"] = quant
    result["artifact"] = str(ensure_artifact(ConversionRequest(out, (), quant)))
else:
    import torch, transformers
    from bench_int8_fidelity import corpus_ids
    from tierlm.runtime.loader import load_model
    from tierlm.weights.embedded import import_gguf_to_cache
    out = import_gguf_to_cache(gguf)
    loaded = load_model(out, device="cpu", dtype=torch.float32, quant="auto")
    reference = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                  dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([corpus_ids(tokenizer, 128)])
    with torch.no_grad():
        want = reference(ids).logits[0]
    got = loaded.model.forward(ids, loaded.new_cache(), logits="all").reshape(want.shape)
    result["max_logit_diff"] = float((got - want).abs().max())
    result["top1_equal"] = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt")
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    with torch.no_grad():
        theirs = reference.generate(prompt, max_new_tokens=32, do_sample=False)[0, prompt.shape[1]:].tolist()
    cache, ours, token = loaded.new_cache(), [], None
    logits = loaded.model.forward(prompt, cache)
    for _ in range(32):
        token = int(logits[0, -1].argmax())
        ours.append(token)
        logits = loaded.model.forward(torch.tensor([[token]]), cache)
    # transformers stops at the end-of-turn token; tierlm's loop runs on: compared up to it.
    result["greedy_equal"] = ours[: len(theirs)] == theirs
    result["greedy_text"] = tokenizer.decode(ours[: len(theirs)])
    loaded.close()
result["seconds"] = time.perf_counter() - started
result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(result))
"""


def run_phase(phase: str, gguf: Path, cache: Path) -> dict:
    env = {**os.environ, "TIERLM_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parent)}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", CHILD, phase, str(gguf)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{phase} of {gguf.name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def gguf_bytes(path: Path) -> Counter:
    import gguf

    kinds: Counter = Counter()
    for tensor in gguf.GGUFReader(path).tensors:
        kinds[tensor.tensor_type.name] += int(tensor.n_bytes)
    return kinds


def artifact_bytes(directory: Path) -> Counter:
    from tierlm.cache.artifact import Artifact
    from tierlm.cache.encodings import record_mode, stack_runs

    artifact = Artifact.open(directory)
    kinds: Counter = Counter()
    for block in artifact.blocks.values():
        for record in block.tensors.values():
            runs = stack_runs(record) if record.encoding == "stack" else [record]  # a row stack: each run's own
            for run in runs:
                kind = "f32" if run.encoding == "plain" else record_mode(run)
                kinds[kind] += sum(part.nbytes for part in run.parts.values())
    artifact.close()
    return kinds


def shown(kinds: Counter) -> str:
    return ", ".join(f"{kind} {size / MIB:.1f}" for kind, size in kinds.most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--llama-bin", default=os.environ.get("TIERLM_LLAMA_CPP_BIN"))
    parser.add_argument("--root", type=Path, default=None, help="where the files and caches go (default: a temp dir)")
    args = parser.parse_args()
    if not args.llama_bin:
        raise SystemExit("set TIERLM_LLAMA_CPP_BIN or --llama-bin to llama.cpp's build/bin")
    from tierlm.weights.embedded import embedded_gguf_path

    root = args.root or Path(tempfile.mkdtemp(prefix="tierlm-gguf-formats-"))
    source = embedded_gguf_path()
    print("\n".join(machine_header()))
    print(f"command: python benchmarks/bench_gguf_formats.py --types {args.types}\n")
    print("| file | GGUF tensors MiB (by type) | auto | artifact MiB (by format) | artifact / GGUF | import dir | "
          "import s, peak RSS | convert s, peak RSS | max |logit diff| vs transformers | top-1 equal | greedy 32 equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind in args.types.split(","):
        path = root / f"smollm2-{kind.lower()}.gguf"
        if not path.exists():
            subprocess.run([str(Path(args.llama_bin) / "llama-quantize"), "--allow-requantize", str(source), str(path),
                            kind], check=True, capture_output=True)  # fmt: skip
        cache = root / f"cache-{kind.lower()}"
        imported = run_phase("import", path, cache)
        converted = run_phase("convert", path, cache)
        compared = run_phase("compare", path, cache)
        source_kinds, stored = gguf_bytes(path), artifact_bytes(Path(converted["artifact"]))
        ratio = sum(stored.values()) / sum(source_kinds.values())
        print(f"| {path.name} | {shown(source_kinds)} | {converted['quant']} | {shown(stored)} | {ratio:.3f} | "
              f"{imported['dir_bytes'] / MIB:.1f} MiB | {imported['seconds']:.1f} s, {imported['peak_rss_mib']:.0f} MiB | "
              f"{converted['seconds']:.1f} s, {converted['peak_rss_mib']:.0f} MiB | {compared['max_logit_diff']:.2e} | "
              f"{compared['top1_equal']:.2%} | {compared['greedy_equal']} |", flush=True)  # fmt: skip
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
