"""This process's memory: resident bytes and their peak from /proc, plus the compute device's use."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MemoryReading:
    """This process's memory from /proc (bytes): resident now, its peak, and device use."""

    rss: int
    peak_rss: int
    device_allocated: int = 0
    device_peak: int = 0


def read_memory(device=None) -> MemoryReading:
    """RSS and peak RSS now; with an accelerator `device`, torch's allocated and peak bytes on it."""
    rss, peak = _proc_status_bytes("VmRSS"), _proc_status_bytes("VmHWM")
    if rss is None:
        import psutil

        rss = psutil.Process(os.getpid()).memory_info().rss
        peak = rss
    allocated = device_peak = 0
    if device is not None and device.type != "cpu":
        from tierlm.device.backend import DeviceBackend

        stats = DeviceBackend(device).memory()
        allocated, device_peak = stats.allocated, stats.peak
    return MemoryReading(rss, peak or rss, allocated, device_peak)


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim`; a no-op elsewhere).

    Freed buffers of a few MiB stay in glibc's heap once its mmap threshold has grown, so RSS
    keeps them: kernel calibration left ~40 MiB there. Trimming before the baseline is read
    makes the baseline what the process really needs.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None  # not glibc (musl, macOS): nothing to trim this way
    if trim is not None:
        trim(0)


def _proc_status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cgroup_memory_limit() -> tuple[int | None, str | None]:
    """(the tightest memory limit on this process's cgroup and its ancestors, in bytes, or None
    when unlimited; the cgroup file it came from, or None where there are no cgroup files).

    cgroup v2 reads `memory.max`, v1 `memory.limit_in_bytes` (values near 2**63 mean none).
    """
    root = Path("/sys/fs/cgroup")
    groups = []  # (directory of this process's group, its limit file name)
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                groups.append((root / path.lstrip("/"), "memory.max"))
            elif "memory" in controllers.split(","):
                groups.append((root / "memory" / path.lstrip("/"), "memory.limit_in_bytes"))
    except (OSError, ValueError):
        pass
    groups += [(root, "memory.max"), (root / "memory", "memory.limit_in_bytes")]
    for group, name in groups:
        found, limit, source = False, None, None
        for folder in (group, *group.parents):
            try:
                raw = (folder / name).read_text().strip()
            except OSError:
                continue
            found, source = True, source or str(folder / name)
            if raw.isdigit() and int(raw) < 2**62 and (limit is None or int(raw) < limit):
                limit, source = int(raw), str(folder / name)
            if folder == root or folder == root / "memory":
                break
        if found:
            return limit, source
    return None, None
