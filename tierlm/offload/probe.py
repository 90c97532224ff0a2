"""Measured speeds the planner's cost model needs, probed once per machine and cached.

`load_bandwidths(device)` returns the cached `Bandwidths` for (device, torch thread count) from
`<cache>/probe/`, probing first when there is none (a few seconds, in a child process: the
probe's buffers must not count against the caller's memory budget). Tests pass fixed
`Bandwidths` to the planner instead, or write the cache file with `save_bandwidths`.

A probe taken while the machine was busy would mislead every later prediction, so the cache file
is a `ProbeRecord`: the figures, when they were probed, the last measured run beside its
prediction, and the corrections measured runs made (`record_measured_run`). `tierlm doctor
--probe` probes afresh.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable

from tierlm.paths import cache_root

# 2: weights cycled past the last-level cache (v1's 64 MiB sat in a 260 MiB L3), best of 3
# cold disk reads. 3: the per-layer and per-token overheads timed on the real decode path, and
# the cost of a weight row (short rows stream slower).
PROBE_VERSION = 3
MATRIX = 4096  # the int8 bandwidth probe's weight: 4096 x 4096 (16 MiB), as a 7B layer's wo
# The short-row probe's weight: 576-wide rows (a ~100M model's), 16 MiB as the long-row one.
SHORT_ROW = 576
# Weights cycled: twice the CPU's last-level cache, so each pass streams from memory as a
# model's layers do; at least 64 MiB, at most 1 GiB (accelerators: 256 MiB, beyond any L2).
MIN_WEIGHT_BYTES, MAX_WEIGHT_BYTES, ACCELERATOR_WEIGHT_BYTES = 64 << 20, 1 << 30, 256 << 20
COPY_BYTES = 64 << 20  # link probe: one 64 MiB host -> device copy
DISK_BYTES = 128 << 20  # disk probe: a 128 MiB temporary file, read cold
DISK_READS = 3  # cold reads of it; the fastest counts
READ_CHUNK = 16 << 20
KEPT_CORRECTIONS = 5  # the newest corrections kept in the record, for `doctor` and `plan`


@dataclass(frozen=True)
class Bandwidths:
    """Effective speeds of this machine (bytes/s, FLOP/s, seconds).

    device_bytes_per_s    int8 weight bytes/s of a batch-1 matmul on the compute device
    host_bytes_per_s      the same computed by the CPU on host RAM (= device on CPU-only)
    link_bytes_per_s      host -> device copy (pinned H2D on CUDA; a RAM-to-RAM copy_ on CPU)
    disk_bytes_per_s      sequential read of a file whose pages were dropped from the cache
    device_flops          GEMM throughput on the compute device (prefill), compute dtype
    host_flops            fp32 GEMM throughput of the CPU (= device_flops on CPU-only)
    per_block_overhead_s  fixed cost of one decoder layer's decode step (dispatch, small ops,
                          kernel calls), besides its weight bytes
    per_token_overhead_s  fixed cost of a decode step besides its layers (embedding, final
                          norm, head call, sampling, the engine's bookkeeping)
    per_row_s             extra cost of a weight row at batch 1 on the compute device, per
                          row of 1/K of the 4096-wide probe's: a [N, K] matmul takes
                          bytes / device_bytes_per_s + N x (1 - K / 4096) x per_row_s
    """

    device_bytes_per_s: float
    host_bytes_per_s: float
    link_bytes_per_s: float
    disk_bytes_per_s: float
    device_flops: float
    host_flops: float
    per_block_overhead_s: float
    per_token_overhead_s: float = 0.0
    per_row_s: float = 0.0
    device: str = "cpu"
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {**asdict(self), "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, raw: dict) -> "Bandwidths":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        values["notes"] = tuple(values.get("notes", ()))
        return cls(**values)


def bandwidths_path(device=None) -> Path:
    """The cache file for `device` at torch's current thread count."""
    import torch

    from tierlm.device import DeviceBackend
    from tierlm.models import fused_decode

    device = probe_device(device)
    name = device.type
    if device.type != "cpu":
        name += "-" + DeviceBackend(device).name()
    if device.type == "cpu" and not fused_decode.enabled():
        name += "-eager"  # the per-layer overhead is the decode path's: eager layers cost ~10x more
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{name}-{torch.get_num_threads()}t-v{PROBE_VERSION}")
    return cache_root() / "probe" / f"{key}.json"


@dataclass(frozen=True)
class ProbeRecord:
    """A cached probe: the figures the planner uses and where they came from.

    probed_at    epoch seconds of the probe (None: a file older than this field)
    last_run     the newest measured run: {"at", "source", "measured_tok_s", "predicted_tok_s",
                 "limit", "corrected"}; predicted with the figures as they were before it
    corrections  the newest KEPT_CORRECTIONS corrections, oldest first: a last_run entry plus
                 "before" (the figures it replaced)
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
    from tierlm.atomic import optional_write, replace_file

    path = bandwidths_path(device)
    with optional_write():
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, json.dumps(record.to_dict(), indent=1) + "\n")
    return path


def record_measured_run(device, assess: Callable[[Bandwidths], tuple[dict, Bandwidths | None]]) -> ProbeRecord | None:
    """Record a measured run in `device`'s probe, correcting its figures when `assess` says so.

    `assess(current figures)` returns (the run: "source", "measured_tok_s", "predicted_tok_s",
    "limit"; the corrected figures, or None when the prediction held). It runs under the
    record's lock on the figures as they are now, so concurrent runs do not undo each other.
    Returns the updated record; None (nothing written) when no probe is cached.
    """
    from tierlm.atomic import directory_lock

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


# -- the individual probes --------------------------------------------------------------------


def int8_bytes_per_s(device, dtype, cols: int = MATRIX) -> float:
    """Weight bytes/s of `quantize_int8(W).linear(x)` at batch 1, W [16 MiB / cols, cols]
    (4096 x 4096 by default), copies cycled (see MIN_WEIGHT_BYTES)."""
    import torch

    from tierlm.quant.int8 import Int8Weight, quantize_int8

    gen = torch.Generator().manual_seed(0)
    base = quantize_int8(torch.randn(MATRIX * MATRIX // cols, cols, generator=gen))
    if device.type == "cpu":
        working = min(max(2 * last_level_cache_bytes(), MIN_WEIGHT_BYTES), MAX_WEIGHT_BYTES)
    else:
        working = ACCELERATOR_WEIGHT_BYTES
    weights = [
        Int8Weight(base.qweight.clone(), base.scales.clone(), dtype=dtype).to(device)
        for _ in range(-(-working // base.qweight.nbytes))
    ]
    x = torch.randn(1, cols, generator=gen).to(device=device, dtype=dtype)

    def sweep():
        for weight in weights:
            weight.linear(x)

    seconds = _best_seconds(sweep, device, reps=5)
    return sum(w.nbytes for w in weights) / seconds


def gemm_flops(device, dtype) -> float:
    """FLOP/s of one [M, K] @ [K, N] GEMM in `dtype` (M = 512 tokens on CPUs, 4096 on GPUs)."""
    import torch

    m, k = (512, 2048) if device.type == "cpu" else (4096, 8192)
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, k, device=device).to(dtype)
    seconds = _best_seconds(lambda: a @ b, device, reps=3)
    return 2 * m * k * k / seconds


def link_bytes_per_s(device) -> float:
    """Host -> device copy bytes/s: pinned H2D on accelerators, RAM-to-RAM `copy_` on CPUs."""
    import torch

    from tierlm.device import DeviceBackend

    backend = DeviceBackend(device)
    source = backend.empty_host(COPY_BYTES).fill_(1)  # pinned where the tiered store pins too
    target = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    seconds = _best_seconds(lambda: target.copy_(source, non_blocking=backend.pinned), device, reps=5)
    return COPY_BYTES / seconds


def disk_bytes_per_s(folder: Path, nbytes: int = DISK_BYTES) -> tuple[float, bool]:
    """(bytes/s of a cold sequential read, whether the pages could be dropped first).

    Writes a temporary file under `folder` (the cache's disk, where artifacts live), fsyncs it,
    drops its pages with posix_fadvise(DONTNEED) and reads it back in 16 MiB chunks; the fastest
    of DISK_READS such cold reads counts. A cold read no slower than a second, cached read means
    the drop did not take (tmpfs, some overlays).
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"disk-probe-{os.getpid()}.tmp"
    block = os.urandom(1 << 20)  # incompressible, so a compressing filesystem cannot cheat
    buffer = bytearray(READ_CHUNK)
    try:
        with open(path, "wb") as handle:
            for _ in range(nbytes // len(block)):
                handle.write(block)
            handle.flush()
            os.fsync(handle.fileno())
        fd = os.open(path, os.O_RDONLY)
        try:
            # The fastest of a few cold reads: a virtual disk's speed swings 3-4x from read to
            # read (490-1900 MB/s measured here), and the planner wants what it can deliver.
            colds = []
            for _ in range(DISK_READS):
                dropped = drop_pages(fd)
                colds.append(_timed_read(fd, buffer))
            cold = min(colds)
            hot = _timed_read(fd, buffer)
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return nbytes / cold, dropped and cold > 1.3 * hot


def row_seconds(long_bytes_per_s: float, short_bytes_per_s: float) -> float:
    """`per_row_s` from the two int8 probes: the same bytes in SHORT_ROW-wide rows took longer
    than in MATRIX-wide ones by (rows_short - rows_long) x per_row_s (never negative)."""
    nbytes = MATRIX * MATRIX
    extra = nbytes / short_bytes_per_s - nbytes / long_bytes_per_s
    return max(extra / (nbytes / SHORT_ROW - nbytes / MATRIX), 0.0)


# -- helpers ----------------------------------------------------------------------------------


def last_level_cache_bytes() -> int:
    """The largest CPU cache (bytes) sysfs reports for cpu0; 0 where it cannot be read."""
    largest = 0
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        match = re.fullmatch(r"(\d+)([KMG]?)", entry.read_text().strip())
        if match:
            largest = max(largest, int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[match.group(2)])
    return largest


def probe_device(device):
    import torch

    from tierlm.device import resolve_device

    return device if isinstance(device, torch.device) else resolve_device(device)


def _best_seconds(run, device, reps: int) -> float:
    """The fastest of `reps` timed runs: the machine's capability, not its momentary load."""
    from tierlm.device import DeviceBackend

    sync = DeviceBackend(device).synchronize  # a whole-device wait: this is a measurement
    run()  # warm-up: kernel calibration, first-touch page faults, thread pools
    sync()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        sync()
        samples.append(time.perf_counter() - start)
    return max(min(samples), 1e-9)


def drop_pages(fd: int) -> bool:
    """Evict the open file's clean pages from the page cache; False where that is unsupported."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except (AttributeError, OSError):
        return False


def _timed_read(fd: int, buffer: bytearray) -> float:
    view = memoryview(buffer)
    offset = 0
    start = time.perf_counter()
    while count := os.preadv(fd, [view], offset):
        offset += count
    return max(time.perf_counter() - start, 1e-9)
