"""The process baseline a profile's budget charges: what the process holds before any weight.

A load measures it (runtime/loader.py `runtime_baseline`): it first does what loading needs anyway
(the runtime's imports, INT8 kernel calibration), hands freed heap pages back to the OS, then reads
RSS here (`measured_baseline`). The caller holds what it holds at that point in a real load (a
session has its tokenizer and the model's family module loaded).

RSS still differs by a few MiB from one process to the next (`plan` and `bench` differ by ~2 MiB,
a busy machine's kernel calibration by more), and at a budget's edge that moves a block between
tiers. So the charge is made deterministic: the first measurement for (device, threads, weight
format, model, versions) is recorded with TOLERANCE of slack, and a later measurement is charged
the recorded figure while it lies in the band [charge - KEEP_BELOW, charge]. The charge is never
below what was measured (a higher measurement is recorded afresh with slack); one far below the
band (an earlier process held more) is recorded afresh too, so the charge comes back down.

`tierlm plan` charges the recorded figure without measuring (`recorded_baseline`): the charge a
load whose measurement lies in the band gets. Only without a record does it measure as a load
does. So this module, and the record's key, never load torch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import time
from dataclasses import dataclass
from pathlib import Path

from tierlm import __version__
from tierlm.atomic import optional_write, replace_file
from tierlm.device.memory import read_memory, trim_heap
from tierlm.paths import cache_root

# Run-to-run RSS differences seen at this point are ~0.1 MiB; 4 MiB covers other machines'
# allocators without charging much.
TOLERANCE = 4 << 20
# How far below the charge a measurement may fall and still be charged it: a band 4x the slack,
# so processes a few MiB apart (in either order) agree.
KEEP_BELOW = 4 * TOLERANCE
GRAIN = 1 << 20  # the charge is a whole number of MiB


@dataclass(frozen=True)
class Baseline:
    """measured: this process's RSS now (or the recorded measurement, when charged unmeasured);
    charged: what the planner charges (>= measured)."""

    measured: int
    charged: int


def measured_baseline(device, quant: str, model_dir: Path | None, threads: int) -> Baseline:
    """This process's RSS now, with freed heap pages handed back, and its charge. The key: the
    weight format `quant` is loaded in ("int8..." has its kernels calibrated), `model_dir`
    (tokenizers differ in size) and `threads`, torch's compute threads."""
    trim_heap()
    measured = read_memory().rss
    return Baseline(measured, steady_charge(measured, record_path(device, quant, model_dir, threads)))


def recorded_baseline(device, quant: str, model_dir: Path | None, threads: int) -> Baseline | None:
    """The charge recorded for this key (as `measured_baseline` keys it), with the measurement it
    was recorded for; None when there is none."""
    recorded = _read_record(record_path(device, quant, model_dir, threads))
    return Baseline(recorded["measured"], recorded["charged"]) if recorded is not None else None


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


def record_path(device, quant: str, model_dir: Path | None, threads: int) -> Path:
    """`<cache>/baseline/<key>.json`, keyed by what changes the baseline."""
    model = str(Path(model_dir).resolve()) if model_dir is not None else ""
    key = "|".join([str(device), str(threads), "int8" if quant.startswith("int8") else "float", model,
                    installed_torch(), __version__])  # fmt: skip
    return cache_root() / "baseline" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def installed_torch() -> str:
    """The installed torch's version, read from its package metadata (torch.__version__, unloaded)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # a torch built in place, without metadata
        return "unknown"


def _read_record(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
        return record if isinstance(record.get("measured"), int) and isinstance(record.get("charged"), int) else None
    except (OSError, ValueError, AttributeError):
        return None  # missing or damaged: measured afresh
