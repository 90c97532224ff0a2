"""This process's memory: resident bytes and their peak from /proc, plus the compute device's use."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tierlm.device.proc import STATUS, resident_bytes, status_bytes

try:
    import resource
except ImportError:  # Windows: no RLIMIT_AS
    resource = None


@dataclass(frozen=True)
class MemoryReading:
    """This process's memory from /proc (bytes): resident now, its peak, and device use."""

    rss: int
    peak_rss: int
    device_allocated: int = 0
    device_peak: int = 0


def read_memory(device=None) -> MemoryReading:
    """RSS and peak RSS now; with an accelerator `device`, torch's allocated and peak bytes on it."""
    rss, peak = resident_bytes()
    allocated = device_peak = 0
    if device is not None and device.type != "cpu":
        stats = _device_memory(device)
        allocated, device_peak = stats.allocated, stats.peak
    return MemoryReading(rss, peak or rss, allocated, device_peak)


@functools.lru_cache(maxsize=1)
def c_library() -> ctypes.CDLL | None:
    """This process's C library, None where none is found; looked up once (find_library runs
    ldconfig, ~2 ms)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim`; a no-op elsewhere).

    Freed buffers of a few MiB stay in glibc's heap once its mmap threshold has grown, so RSS
    keeps them: kernel calibration left ~40 MiB there. Trimming before the baseline is read
    makes the baseline what the process really needs.
    """
    library = c_library()
    trim = getattr(library, "malloc_trim", None) if library else None  # glibc only (not musl, macOS)
    if trim is not None:
        trim(0)


def cgroup_memory_limit(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> tuple[int | None, str | None]:
    """(the tightest memory limit on this process's cgroup and its ancestors, in bytes, or None
    when unlimited; the cgroup file it came from, or None where there are no cgroup files).

    cgroup v2 reads `memory.max`, v1 `memory.limit_in_bytes` (values near 2**63 mean none).
    `root` and `proc_cgroup` are for tests (a fake hierarchy).
    """
    groups = []  # (directory of this process's group, its limit file name)
    try:
        for line in proc_cgroup.read_text().splitlines():
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


@dataclass(frozen=True)
class MemoryLimits:
    """What this process may really use, whatever a profile grants; None = no limit found.

    ram: bytes of RAM (the tightest of the cgroup memory limit and RLIMIT_AS), ram_source: which
    one, in words; device_free: free memory on the accelerator (None on a CPU-only machine).
    """

    ram: int | None = None
    ram_source: str = ""
    device_free: int | None = None


def process_limits(
    device=None,
    *,
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    getrlimit: Callable[[int], tuple[int, int]] | None = None,
    proc_status: Path = STATUS,
) -> MemoryLimits:
    """The limits this process really runs under: the cgroup memory limit, RLIMIT_AS, and with an
    accelerator `device`, its free memory. The keyword arguments are for tests."""
    cgroup, _ = cgroup_memory_limit(cgroup_root, proc_cgroup)
    candidates = [(cgroup, "cgroup memory limit"), address_space_room(getrlimit, proc_status)]
    found = [(limit, source) for limit, source in candidates if limit is not None]
    ram, source = min(found, key=lambda item: item[0]) if found else (None, "")
    device_free = None
    if device is not None and device.type != "cpu":
        device_free = int(_device_memory(device).free)
    return MemoryLimits(ram, source, device_free)


def address_space_room(
    getrlimit: Callable[[int], tuple[int, int]] | None = None, proc_status: Path = STATUS
) -> tuple[int | None, str]:
    """(RAM the soft RLIMIT_AS leaves for resident memory, or None when unlimited; in words).

    The limit counts address space, not residence: what is mapped but not resident now (torch
    reserves ~400 MiB of it) is taken off, since the budgets charge resident bytes.
    """
    if resource is None:
        return None, ""
    soft, _ = (getrlimit or resource.getrlimit)(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None, ""
    status = status_bytes(proc_status)
    size, rss = status.get("VmSize"), status.get("VmRSS")
    unresident = max(size - rss, 0) if size is not None and rss is not None else 0
    return max(soft - unresident, 0), "address-space limit (RLIMIT_AS)"


def _device_memory(device):
    """The accelerator `device`'s memory figures (backend.py's DeviceMemory)."""
    # backend.py imports torch: reading RAM alone (profile.py, `tierlm list`) must not load it, and
    # a device other than the CPU means the caller has loaded it already.
    from tierlm.device.backend import DeviceBackend

    return DeviceBackend(device).memory()
