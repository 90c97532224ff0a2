"""The byte, FLOP, link and disk probes behind `Bandwidths` (tierlm/offload/bandwidths.py); the
child process that runs them all and caches the record is tierlm/runtime/measure_machine.py."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np
import torch

from tierlm.device.backend import DeviceBackend
from tierlm.device.resolve import resolve_device
from tierlm.offload.bandwidths import MATRIX
from tierlm.quant.int8 import Int8Weight, quantize_int8

# The short-row probe's weight: 576-wide rows (a ~100M model's), 16 MiB as the long-row one.
SHORT_ROW = 576
# Weights cycled: twice the CPU's last-level cache, so each pass streams from memory as a
# model's layers do; at least 64 MiB, at most 1 GiB (accelerators: 256 MiB, beyond any L2).
MIN_WEIGHT_BYTES, MAX_WEIGHT_BYTES, ACCELERATOR_WEIGHT_BYTES = 64 << 20, 1 << 30, 256 << 20
# The format probe's working set at most: 13 weight types, each timed in one regime as int8 is.
FORMAT_WEIGHT_BYTES = 128 << 20
COPY_BYTES = 64 << 20  # link probe: one 64 MiB host -> device copy
DISK_BYTES = 128 << 20  # disk probe: a 128 MiB temporary file, read cold
DISK_READS = 3  # cold reads of it; the fastest counts
READ_CHUNK = 16 << 20


def int8_bytes_per_s(device, dtype, cols: int = MATRIX) -> float:
    """Weight bytes/s of `quantize_int8(W).linear(x)` at batch 1, W [16 MiB / cols, cols]
    (4096 x 4096 by default), copies cycled (see MIN_WEIGHT_BYTES)."""
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


def format_factors(device, dtype) -> tuple[tuple[str, float], ...]:
    """Each carried GGUF type's weight bytes/s at batch 1 relative to per-channel int8's, as
    (mode, factor) pairs: a format's bytes cost what its kernel's unpacking makes them cost
    (Q6_K's 6.56 bits widen slower than Q8_0's 8.5; Q4_K's 4.5 bits may stream faster). CPUs
    only: accelerators dequantize every format to the compute dtype alike, so none is timed
    there (empty: every mode at int8's rate).

    Each type and int8 are timed alike: 4096-wide rows, 16 MiB a copy, copies cycled past the
    last cache up to FORMAT_WEIGHT_BYTES (the factor is a ratio in one regime, so a smaller set
    than `int8_bytes_per_s`'s serves). The blocks are filled with one byte: the kernels' time
    does not depend on the values, and 0x11 makes every fp16 scale a finite number."""
    if device.type != "cpu":
        return ()
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from tierlm.quant.modes import CARRIED_SOURCE_TYPES, own_mode
    from tierlm.weights.gguf_carry import carry_weight, fused_rows

    working = min(max(2 * last_level_cache_bytes(), MIN_WEIGHT_BYTES), FORMAT_WEIGHT_BYTES)
    x = torch.randn(1, MATRIX, generator=torch.Generator().manual_seed(0)).to(dtype)

    def rate(base, nbytes: int) -> float:
        # Copies by concatenating the parts (a fresh tensor each): cheaper than building anew.
        weights = [base] + [fused_rows((base,)) for _ in range(-(-working // nbytes) - 1)]

        def sweep():
            for weight in weights:
                weight.linear(x)

        return len(weights) * nbytes / _best_seconds(sweep, device, reps=3)

    int8 = quantize_int8(torch.randn(MATRIX, MATRIX, generator=torch.Generator().manual_seed(0)))  # 16 MiB
    int8_rate = rate(int8, int8.qweight.nbytes)
    factors = []
    for kind in sorted(CARRIED_SOURCE_TYPES):
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        row_bytes = MATRIX // block * size
        rows = (16 << 20) // row_bytes
        base = carry_weight(kind, np.full((rows, row_bytes), 0x11, dtype=np.uint8))
        factors.append((own_mode(kind), rate(base, rows * row_bytes) / int8_rate))
    return tuple(factors)


def gemm_flops(device, dtype) -> float:
    """FLOP/s of one [M, K] @ [K, N] GEMM in `dtype` (M = 512 tokens on CPUs, 4096 on GPUs)."""
    m, k = (512, 2048) if device.type == "cpu" else (4096, 8192)
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, k, device=device).to(dtype)
    seconds = _best_seconds(lambda: a @ b, device, reps=3)
    return 2 * m * k * k / seconds


def link_bytes_per_s(device) -> float:
    """Host -> device copy bytes/s: pinned H2D on accelerators, RAM-to-RAM `copy_` on CPUs."""
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
    return device if isinstance(device, torch.device) else resolve_device(device)


def _best_seconds(run, device, reps: int) -> float:
    """The fastest of `reps` timed runs: the machine's capability, not its momentary load."""
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
