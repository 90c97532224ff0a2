"""Measuring this machine once: the probe's bandwidths and the decode path's fixed costs.

Runs as a child process (`python -m tierlm.runtime.measure_machine DEVICE THREADS`, started by
probe/machine.py) so the weights it cycles never land in the caller's memory. The byte
and FLOP measurements live in probe/bandwidth.py beside the record they fill; the per-layer and
per-token costs need the runtime itself (a real decode step), so they live here.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

from tierlm.cache.synthetic import write_synthetic_artifact
from tierlm.device.resolve import compute_dtype
from tierlm.offload.bandwidths import Bandwidths
from tierlm.paths import cache_root
from tierlm.probe.bandwidth import (SHORT_ROW, disk_bytes_per_s, format_factors, gemm_flops, int8_bytes_per_s,
                                    link_bytes_per_s, probe_device, row_seconds)  # fmt: skip
from tierlm.probe.record import save_bandwidths
from tierlm.runtime.engine import Engine
from tierlm.runtime.loader import load_model
from tierlm.runtime.sampling import SamplingParams
from tierlm.runtime.tokenizer import Tokenizer

# The overhead probe's model: a real family's shape at widths where weight bytes are negligible
# (a few KiB per layer), so a decode step times what a layer costs besides its bytes.
OVERHEAD_CONFIG = {
    "model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
}  # fmt: skip
OVERHEAD_LAYERS = (2, 16)  # the two depths whose difference is the per-layer cost (fused: ~30 us)
OVERHEAD_STEPS = 32  # decode steps per timed generation


def probe(device=None) -> Bandwidths:
    """Measure every speed once (a few seconds; the disk probe writes a 128 MiB temp file)."""
    device = probe_device(device)
    cpu = torch.device("cpu")
    dtype = compute_dtype(device)
    notes: list[str] = []
    device_bw = int8_bytes_per_s(device, dtype)
    short_bw = int8_bytes_per_s(device, dtype, cols=SHORT_ROW)
    host_bw = device_bw if device.type == "cpu" else int8_bytes_per_s(cpu, torch.float32)
    device_flops = gemm_flops(device, dtype)
    host_flops = device_flops if device.type == "cpu" else gemm_flops(cpu, torch.float32)
    disk_bw, dropped = disk_bytes_per_s(cache_root() / "probe")
    if not dropped:
        notes.append("the disk probe could not drop the file's pages from the page cache; "
                     "disk bandwidth may be overstated")  # fmt: skip
    per_block, per_token = decode_overheads(device, dtype)
    return Bandwidths(
        device_bytes_per_s=device_bw,
        host_bytes_per_s=host_bw,
        link_bytes_per_s=link_bytes_per_s(device),
        disk_bytes_per_s=disk_bw,
        device_flops=device_flops,
        host_flops=host_flops,
        per_block_overhead_s=per_block,
        per_token_overhead_s=per_token,
        per_row_s=row_seconds(device_bw, short_bw),
        format_factors=format_factors(device, dtype),
        device=str(device),
        notes=tuple(notes),
    )


def decode_overheads(device, dtype, depths: tuple[int, int] = OVERHEAD_LAYERS) -> tuple[float, float]:
    """(seconds per decoder layer, seconds per token besides the layers) of a decode step whose
    weight bytes are negligible.

    Times the path a real decode takes (the family's forward over a resident INT8 store and a
    KV cache, driven by the Engine with greedy sampling and detokenizing) on OVERHEAD_CONFIG at
    two depths, the best of a few generations each, alternated so that drift hits both: the
    difference per layer is the layer's fixed cost, the rest the token's. A tiny layer (the
    probe before v3) ran a fraction of a real layer's ops and under-charged small models ~2x.
    """
    with tempfile.TemporaryDirectory(prefix="tierlm-probe-") as folder:
        step = {layers: _decode_step_timer(Path(folder) / f"{layers}l", layers, device, dtype) for layers in depths}
        best = dict.fromkeys(depths, math.inf)
        for _ in range(5):
            for layers, timed in step.items():
                best[layers] = min(best[layers], timed())
    shallow, deep = depths
    per_block = max((best[deep] - best[shallow]) / (deep - shallow), 1e-7)
    return per_block, max(best[shallow] - shallow * per_block, 0.0)


def _decode_step_timer(folder: Path, layers: int, device, dtype) -> Callable[[], float]:
    """A function timing one greedy generation of OVERHEAD_STEPS decode steps on a synthetic
    `layers`-layer model written to `folder`; it returns seconds per decode step."""
    artifact = write_synthetic_artifact({**OVERHEAD_CONFIG, "num_hidden_layers": layers}, folder, quant="int8")
    loaded = load_model(artifact, device=device, dtype=dtype, context_length=64)
    engine = Engine(loaded, Tokenizer.from_dir(artifact))
    params = SamplingParams(max_new_tokens=OVERHEAD_STEPS + 1, temperature=0.0, ignore_eos=True)

    def timed() -> float:
        engine.reset()
        generation = engine.generate(list(range(3, 11)), params)
        for _ in generation:
            pass
        return generation.stats.decode_s / OVERHEAD_STEPS

    timed()  # warm-up: kernel calibration, first-touch allocations
    return timed


if __name__ == "__main__":
    # `python -m tierlm.runtime.measure_machine DEVICE [THREADS]`: probe and cache (what load_probe runs).
    if len(sys.argv) > 2:
        torch.set_num_threads(int(sys.argv[2]))
    chosen = probe_device(sys.argv[1] if len(sys.argv) > 1 else None)
    path = save_bandwidths(probe(chosen), chosen)
    print(path.read_text())
