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

Against a cgroup memory limit the charge is lower (`Baseline.under_cgroup`): about a third of the
baseline's RSS is file-backed (the shared libraries' pages, torch's mostly), which the kernel
reclaims under the cgroup's pressure and reads again when touched, so the cgroup needs only the
ones in use. The record keeps that file-backed part beside the charge.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tierlm import __version__
from tierlm.atomic import optional_write, replace_file
from tierlm.device.memory import read_memory, trim_heap
from tierlm.device.proc import status_bytes
from tierlm.paths import cache_root

# Run-to-run RSS differences seen at this point are ~0.1 MiB; 4 MiB covers other machines'
# allocators without charging much.
TOLERANCE = 4 << 20
# How far below the charge a measurement may fall and still be charged it: a band 4x the slack,
# so processes a few MiB apart (in either order) agree.
KEEP_BELOW = 4 * TOLERANCE
GRAIN = 1 << 20  # the charge is a whole number of MiB
# The share of the baseline's file-backed pages a cgroup keeps resident while running. Measured:
# smollm2 under 4gb, a full-context bench streamed from disk in a cgroup it pressed against, with
# torch's libraries read cold into that cgroup: 26-33 MiB of the baseline's 82-87 MiB stayed
# resident (at 375 MiB it ran at full speed; at 350 MiB it thrashed, 15x slower). Half is charged.
FILE_KEPT_SHARE = 0.5


@dataclass(frozen=True)
class Baseline:
    """measured: this process's RSS now (or the recorded measurement, when charged unmeasured);
    charged: what the planner charges (>= measured, except `under_cgroup`); file_backed: the
    part of the measured RSS mapped from files (RssFile: the shared libraries); reclaimed: the
    part of them not charged (`under_cgroup`)."""

    measured: int
    charged: int
    file_backed: int = 0
    reclaimed: int = 0

    def under_cgroup(self) -> "Baseline":
        """The charge against a cgroup memory limit, which reclaims file-backed pages: the share
        of them not kept resident (FILE_KEPT_SHARE) is taken off, in whole MiB."""
        reclaimed = int(self.file_backed * (1 - FILE_KEPT_SHARE)) // GRAIN * GRAIN
        return replace(self, charged=self.charged - reclaimed, reclaimed=reclaimed)


def measured_baseline(device, quant: str, model_dir: Path | None, threads: int) -> Baseline:
    """This process's RSS now, with freed heap pages handed back, and its charge. The key: the
    weight format `quant` is loaded in ("int8..." has its kernels calibrated), `model_dir`
    (tokenizers differ in size) and `threads`, torch's compute threads."""
    trim_heap()
    measured = read_memory().rss
    file_backed = status_bytes().get("RssFile", 0)
    path = record_path(device, quant, model_dir, threads)
    charged = steady_charge(measured, path, file_backed)
    recorded = _read_record(path)
    # The charge kept from the record keeps its file-backed part too: plan and load charge alike.
    # A record from before that part was kept gets this measurement's.
    if recorded is not None and recorded["charged"] == charged:
        if "file_backed" in recorded:
            file_backed = int(recorded["file_backed"])
        else:
            with optional_write():
                replace_file(path, json.dumps({**recorded, "file_backed": file_backed}) + "\n")
    return Baseline(measured, charged, file_backed)


def recorded_baseline(device, quant: str, model_dir: Path | None, threads: int) -> Baseline | None:
    """The charge recorded for this key (as `measured_baseline` keys it), with the measurement it
    was recorded for; None when there is none."""
    recorded = _read_record(record_path(device, quant, model_dir, threads))
    if recorded is None:
        return None
    return Baseline(recorded["measured"], recorded["charged"], int(recorded.get("file_backed", 0)))


def steady_charge(measured: int, path: Path, file_backed: int = 0) -> int:
    """`measured` made deterministic: the recorded charge while `measured` lies in the band
    [charge - KEEP_BELOW, charge]; otherwise a new record, measured + TOLERANCE (whole MiB), with
    the `file_backed` part of `measured`."""
    recorded = _read_record(path)
    if recorded is not None and recorded["charged"] - KEEP_BELOW <= measured <= recorded["charged"]:
        return int(recorded["charged"])
    charged = -(-(measured + TOLERANCE) // GRAIN) * GRAIN
    with optional_write():  # a read-only cache: this run's charge stands, unrecorded
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"measured": measured, "charged": charged, "file_backed": file_backed, "at": time.time()}
        replace_file(path, json.dumps(record) + "\n")
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
