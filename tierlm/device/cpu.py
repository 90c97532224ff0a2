"""What the CPU offers the INT8 kernels: its model name and SIMD features, from /proc/cpuinfo."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

# Reported name -> /proc/cpuinfo flag. VNNI and BF16 decide which int8/bf16 paths are fast.
FEATURES = {
    "AVX2": "avx2",
    "AVX-512": "avx512f",
    "AVX512-VNNI": "avx512_vnni",
    "AVX512-BF16": "avx512_bf16",
    "AVX-VNNI": "avx_vnni",
    "AMX-INT8": "amx_int8",
}


@dataclass(frozen=True)
class CpuInfo:
    model: str
    logical_cores: int
    features: dict[str, bool] = field(default_factory=dict)  # empty when unknown
    reason: str | None = None  # why features are unknown


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    """The first processor's model name and feature flags (Linux; elsewhere features are unknown)."""
    cores = os.cpu_count() or 1
    try:
        text = cpuinfo.read_text()
    except OSError:
        return CpuInfo(platform.processor() or platform.machine(), cores, reason=f"{cpuinfo} is not readable")
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor is enough: flags are uniform across cores
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", fields.get("Features", "")).split())
    model = fields.get("model name") or fields.get("Hardware") or platform.machine()
    return CpuInfo(model, cores, {name: flag in flags for name, flag in FEATURES.items()})


def usable_cpus(
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    affinity: int | None = None,
) -> int:
    """The CPUs this process may really use: its affinity mask, capped by the tightest cgroup CPU
    quota on its group and the groups above (os.cpu_count() counts the host's, which a container
    or `taskset` does not get). `affinity` and the paths are for tests."""
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    # A fractional quota rounds down: a thread more than the quota only waits out its throttling.
    return max(1, min(affinity, int(quota) if quota is not None else affinity))


def cgroup_cpu_quota(
    cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """CPUs' worth of time per period the cgroups allow (quota / period), None when unlimited.

    cgroup v2: `cpu.max` ("max 100000" or "150000 100000"); v1: `cpu.cfs_quota_us` (-1 = none) over
    `cpu.cfs_period_us` under the cpu controller's mount. Each group from this process's own up to
    the root is read.
    """
    limits = [_quota(folder) for folder in _cpu_groups(cgroup_root, proc_cgroup)]
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None


def _cpu_groups(root: Path, proc_cgroup: Path) -> list[Path]:
    """Folders that may hold this process's CPU limits: its groups and their ancestors."""
    # The mounts' roots first: a container sees its own group there.
    groups = [(root, ""), (root / "cpu", "")]
    try:
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            relative = path.strip().lstrip("/")
            if controllers == "":  # v2: one unified hierarchy
                groups.append((root, relative))
            elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
                groups += [(root / controllers, relative), (root / "cpu", relative)]
    except (OSError, ValueError):
        pass
    folders = []
    for mount, relative in groups:
        parts = Path(relative).parts
        folders += [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return list(dict.fromkeys(folders))


def _quota(folder: Path) -> float | None:
    """One group's CPU limit in CPUs, None when it sets none (or the files are absent)."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (folder / "cpu.cfs_quota_us").read_text().strip()
            period = (folder / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # "max": unlimited
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def resolve_threads(requested: int | None = None) -> int:
    """Threads for compute: `requested` when positive, else `usable_cpus()`."""
    return requested if requested and requested > 0 else usable_cpus()


def torch_threads() -> int:
    """torch's intra-op thread count: its own once torch is loaded, else the count `apply_threads()`
    sets by default, which every command sets before it computes. Records keyed on the thread
    count (the probe's, the baseline's) are named through this without loading torch."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else resolve_threads()


def fused_decode_enabled() -> bool:
    """Whether a CPU decode step may run fused (models/fused_decode.py); TIERLM_FUSED=0 runs it
    eagerly. Read here, without torch, because the probe's record is keyed on it."""
    return os.environ.get("TIERLM_FUSED", "1") != "0"


def apply_threads(requested: int | None = None) -> int:
    """Set torch's intra-op thread count (call before the INT8 kernels are calibrated: their choice
    is keyed on it) and return it."""
    # This module is torch-free (`tierlm list` and `--help` read the CPU through it); torch loads
    # when a command sets its threads.
    import torch

    threads = resolve_threads(requested)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
