"""The cached probe: measured speeds per (device, thread count), with their history.

`bandwidths_path(device)` names the cache file under `<cache>/probe/`; tierlm/probe/machine.py
reads it or probes first (in a child process: the probe's buffers must not count against the
caller's memory budget). Tests pass fixed `Bandwidths` to the planner instead, or write the cache
file with `save_bandwidths`.

A probe taken while the machine was busy would mislead every later prediction, so the cache file
is a `ProbeRecord`: the figures, when they were probed, the last measured run beside its
prediction, and the corrections measured runs made (`record_measured_run`), one per decode path
(offload/bandwidths.py `Correction`), kept beside the probe's own figures, which they never
overwrite. `tierlm doctor --probe` probes afresh.

No torch here: a record is read, and the CPU's named, without it. Only an accelerator's file asks
torch, for the card's name.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from tierlm.atomic import directory_lock, optional_write, replace_file
from tierlm.device.cpu import fused_decode_enabled, torch_threads
from tierlm.device.resolve import plan_device
from tierlm.offload.bandwidths import Bandwidths
from tierlm.paths import cache_root

# 2: weights cycled past the last-level cache (v1's 64 MiB sat in a 260 MiB L3), best of 3
# cold disk reads. 3: the per-layer and per-token overheads timed on the real decode path, and
# the cost of a weight row (short rows stream slower). 4: each carried GGUF format's rate
# relative to int8's (Bandwidths.format_factors).
PROBE_VERSION = 4
KEPT_CORRECTIONS = 5  # the newest corrections kept in the record, for `doctor` and `plan`


def bandwidths_path(device=None, threads: int | None = None) -> Path:
    """The cache file for `device` (a torch.device, a name, None: the best available) at `threads`
    compute threads (default: torch's count, device/cpu.py `torch_threads`)."""
    device = plan_device(device)
    threads = torch_threads() if threads is None else threads
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{probe_name(device)}-{threads}t-v{PROBE_VERSION}")
    return cache_root() / "probe" / f"{key}.json"


def probe_name(device) -> str:
    """The name `device`'s probe is filed under: its kind, and the card's name or the CPU's decode path."""
    if device.type == "cpu":
        # the per-layer overhead is the decode path's: eager layers cost ~10x more
        return "cpu" if fused_decode_enabled() else "cpu-eager"
    # The card's name needs torch, which a process that resolved an accelerator has loaded already.
    from tierlm.device.backend import DeviceBackend

    return f"{device.type}-{DeviceBackend(device).name()}"


@dataclass(frozen=True)
class ProbeRecord:
    """A cached probe: the figures the planner uses and where they came from.

    bandwidths   the probe's figures, with each path's current correction (`path_corrections`)
    probed_at    epoch seconds of the probe (None: a file older than this field)
    last_run     the newest measured run: {"at", "source", "measured_tok_s", "predicted_tok_s",
                 "limit", "path", "corrected"}; predicted with the figures as they were before it
    corrections  the newest KEPT_CORRECTIONS corrections, oldest first: a last_run entry plus
                 "before" (the bandwidths and corrections it replaced)
    """

    bandwidths: Bandwidths
    probed_at: float | None = None
    last_run: dict | None = None
    corrections: tuple[dict, ...] = ()

    def to_dict(self) -> dict:
        return {**self.bandwidths.to_dict(), "probed_at": self.probed_at, "last_run": self.last_run,
                "corrections": list(self.corrections)}  # fmt: skip

    @classmethod
    def from_dict(cls, raw: dict) -> "ProbeRecord":
        return cls(Bandwidths.from_dict(raw), raw.get("probed_at"), raw.get("last_run"),
                   tuple(raw.get("corrections") or ()))  # fmt: skip


def read_probe(path: Path) -> ProbeRecord | None:
    """The record at `path`; None when there is none or it is damaged. A file from before
    `probed_at` was kept counts as probed when it was last written."""
    try:
        record = ProbeRecord.from_dict(json.loads(path.read_text()))
        return record if record.probed_at is not None else replace(record, probed_at=path.stat().st_mtime)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def save_bandwidths(bandwidths: Bandwidths, device=None, *, probed_at: float | None = None) -> Path:
    """Write `bandwidths` as a fresh probe for `device` (atomically), probed at `probed_at`
    (default: now); a fresh probe has no runs or corrections yet."""
    return save_probe(ProbeRecord(bandwidths, time.time() if probed_at is None else probed_at), device)


def save_probe(record: ProbeRecord, device=None) -> Path:
    """Write `record` as the cached probe for `device` (atomically; skipped on a read-only cache)."""
    path = bandwidths_path(device)
    with optional_write():
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, json.dumps(record.to_dict(), indent=1) + "\n")
    return path


def record_measured_run(device, assess: Callable[[Bandwidths], tuple[dict, Bandwidths | None]]) -> ProbeRecord | None:
    """Record a measured run in `device`'s probe, correcting its figures when `assess` says so.

    `assess(current figures)` returns (the run: "source", "measured_tok_s", "predicted_tok_s",
    "limit", "path"; the figures with the run's path corrected, or None when the prediction held). It runs under the
    record's lock on the figures as they are now, so concurrent runs do not undo each other.
    Returns the updated record; None (nothing written) when no probe is cached.
    """
    path = bandwidths_path(device)
    if not path.parent.is_dir():
        return None
    with directory_lock(path):
        record = read_probe(path)
        if record is None:
            return None
        run, corrected = assess(record.bandwidths)
        run = {**run, "at": time.time(), "corrected": corrected is not None}
        record = replace(record, last_run=run)
        if corrected is not None:
            entry = {**run, "before": record.bandwidths.to_dict()}
            record = replace(record, bandwidths=corrected,
                             corrections=(*record.corrections, entry)[-KEPT_CORRECTIONS:])  # fmt: skip
        save_probe(record, device)
    return record
