"""Operations per decode token of the embedded model: torch ops and native library calls.

One fresh process per decode path (eager: `TIERLM_FUSED=0`; default: the fused per-layer step
where it applies), the `24gb` profile's INT8 weights on the CPU. After a 16-token prefill and
two warm-up steps, one decode step (`model.forward` of one token plus the greedy argmax) is
counted twice over:

- torch ops: `torch.profiler` events named `aten::*` with no parent event (top level: what
  Python dispatched, not what an op calls inside itself);
- native calls: every call into the compiled library (quant/native.py's ctypes handle), counted
  by wrapping the handle's entry points as each `NativeKernel` is made.

Run from the repo root: `.venv/bin/python benchmarks/bench_ops_per_token.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

PATHS = (("eager", {"TIERLM_FUSED": "0"}), ("default", {}))
PROMPT_TOKENS = 16


def count_native_calls() -> dict[str, int]:
    """Start counting calls into the native library; the returned dict fills as they happen.

    Wraps each `tierlm_*` entry point of every NativeKernel's ctypes handle made from now on
    (a wrapper set on the CDLL object shadows its cached function pointer)."""
    from tierlm.quant import native

    counts: dict[str, int] = {}
    made = native.NativeKernel.__init__

    def counting_init(self, library):
        made(self, library)
        for name in _entry_points(self.library) or [n for n in vars(self.lib) if n.startswith("tierlm_")]:
            function = getattr(self.lib, name)

            def counted(*args, _name=name, _function=function):
                counts[_name] = counts.get(_name, 0) + 1
                return _function(*args)

            setattr(self.lib, name, counted)

    native.NativeKernel.__init__ = counting_init
    return counts


def _entry_points(library) -> list[str]:
    """The library's exported `tierlm_*` functions (from its dynamic symbol table; empty without
    binutils' `nm`, and the caller wraps the entry points NativeKernel resolved)."""
    if shutil.which("nm") is None:
        return []
    listed = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True)
    names = {line.split()[-1] for line in listed.stdout.splitlines() if " T " in line}
    return sorted(n for n in names if n.startswith("tierlm_"))


def measure() -> dict:
    """Ops of one decode step in this process (its TIERLM_FUSED as set by the parent)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    counts = count_native_calls()
    from tierlm.profile import load_profile
    from tierlm.runtime.session import open_session

    session = open_session(None, load_profile("24gb"), device="cpu")
    model, loaded = session.loaded.model, session.loaded
    cache = loaded.new_cache()
    ids = torch.arange(100, 100 + PROMPT_TOKENS).unsqueeze(0)

    def step(token: int) -> int:
        return int(model.forward(torch.tensor([[token]]), cache, logits="last")[0, -1].argmax())

    with torch.inference_mode():
        token = int(model.forward(ids, cache, logits="last")[0, -1].argmax())
        for _ in range(2):
            token = step(token)
        counts.clear()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(token)
    native_calls = dict(counts)
    top = [e.name for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    by_name: dict[str, int] = {}
    for name in top:
        by_name[name] = by_name.get(name, 0) + 1
    session.close()
    return {
        "layers": loaded.config.num_hidden_layers,
        "weights": loaded.formats,
        "torch_ops": len(top),
        "native_calls": sum(native_calls.values()),
        "native_by_name": native_calls,
        "torch_by_name": dict(sorted(by_name.items(), key=lambda kv: -kv[1])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    rows = {}
    for name, env in PATHS:
        done = subprocess.run([sys.executable, __file__, "--child"], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=900)  # fmt: skip
        if done.returncode != 0:
            sys.exit(f"{name}: {done.stderr.strip()[-2000:]}")
        rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    first = next(iter(rows.values()))
    print(f"Embedded SmolLM2 ({first['layers']} layers, {first['weights']}), one decode step\n")
    print("| path | torch ops | native calls | total | per layer |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        total = row["torch_ops"] + row["native_calls"]
        print(f"| {name} | {row['torch_ops']} | {row['native_calls']} | {total} | {total / row['layers']:.1f} |")
    for name, row in rows.items():
        top = ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in list(row["torch_by_name"].items())[:8])
        print(f"\n{name}: native {row['native_by_name']}; torch: {top}")


if __name__ == "__main__":
    main()
