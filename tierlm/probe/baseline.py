"""The process baseline a profile's budget charges: what the process holds before any weight.

`tierlm plan` and the loader both call `runtime_baseline`, so a plan places the blocks the load
will. It first does what loading needs anyway (the runtime's imports, INT8 kernel calibration),
hands freed heap pages back to the OS, then reads RSS. The caller holds what it holds at that
point in a real load (a session has its tokenizer and the model's family module loaded).

RSS still differs by a few MiB from one process to the next (`plan` and `bench` differ by ~2 MiB,
a busy machine's kernel calibration by more), and at a budget's edge that moves a block between
tiers. So the charge is made deterministic: the first measurement for (device, threads, weight
format, model, versions) is recorded with TOLERANCE of slack, and a later measurement is charged
the recorded figure while it lies in the band [charge - KEEP_BELOW, charge]. The charge is never
below what was measured (a higher measurement is recorded afresh with slack); one far below the
band (an earlier process held more) is recorded afresh too, so the charge comes back down.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tierlm import __version__
from tierlm.atomic import optional_write, replace_file
from tierlm.device.memory import read_memory, trim_heap
from tierlm.paths import cache_root
from tierlm.quant.dispatch import kernel_choice

# Run-to-run RSS differences seen at this point are ~0.1 MiB; 4 MiB covers other machines'
# allocators without charging much.
TOLERANCE = 4 << 20
# How far below the charge a measurement may fall and still be charged it: a band 4x the slack,
# so processes a few MiB apart (in either order) agree.
KEEP_BELOW = 4 * TOLERANCE
GRAIN = 1 << 20  # the charge is a whole number of MiB
# What a load imports besides what the caller holds: charged by name (the probe measures the
# runtime from below it, so it names these modules rather than using them).
LOAD_IMPORTS = ("tierlm.store.resident", "tierlm.store.tiered", "tierlm.offload.planner", "tierlm.runtime.engine")


@dataclass(frozen=True)
class Baseline:
    """measured: this process's RSS now; charged: what the planner charges (>= measured)."""

    measured: int
    charged: int


def runtime_baseline(device, quant: str, model_dir: Path | None = None) -> Baseline:
    """Prepare the runtime for loading `quant` weights on `device`, then measure and charge RSS.

    `quant` is the weight format to be loaded ("int8...", "fp32", "none", ...): INT8 kernels are
    calibrated only for int8 weights. `model_dir` keys the record (tokenizers differ in size).
    """
    prepare_runtime(device, quant.startswith("int8"))
    trim_heap()
    measured = read_memory().rss
    return Baseline(measured, steady_charge(measured, record_path(device, quant, model_dir)))


def prepare_runtime(device, int8: bool) -> None:
    """What loading will need anyway, done first so the baseline includes it rather than
    meeting it later: INT8 kernel calibration (a compiler run, timing buffers) and the imports
    of the store, planner and engine."""
    for module in LOAD_IMPORTS:
        importlib.import_module(module)

    if int8:
        kernel_choice(device)


def steady_charge(measured: int, path: Path) -> int:
    """`measured` made deterministic: the recorded charge while `measured` lies in the band
    [charge - KEEP_BELOW, charge]; otherwise a new record, measured + TOLERANCE (whole MiB)."""
    recorded = _read_record(path)
    if recorded is not None and recorded["charged"] - KEEP_BELOW <= measured <= recorded["charged"]:
        return int(recorded["charged"])
    charged = -(-(measured + TOLERANCE) // GRAIN) * GRAIN
    with optional_write():  # a read-only cache: this run's charge stands, unrecorded
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, json.dumps({"measured": measured, "charged": charged, "at": time.time()}) + "\n")
    return charged


def record_path(device, quant: str, model_dir: Path | None) -> Path:
    """`<cache>/baseline/<key>.json`, keyed by what changes the baseline."""
    model = str(Path(model_dir).resolve()) if model_dir is not None else ""
    key = "|".join([str(device), str(torch.get_num_threads()), "int8" if quant.startswith("int8") else "float",
                    model, torch.__version__, __version__])  # fmt: skip
    return cache_root() / "baseline" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read_record(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
        return record if isinstance(record.get("measured"), int) and isinstance(record.get("charged"), int) else None
    except (OSError, ValueError, AttributeError):
        return None  # missing or damaged: measured afresh
