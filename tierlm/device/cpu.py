"""What the CPU offers the INT8 kernels: its model name and SIMD features, from /proc/cpuinfo."""

from __future__ import annotations

import os
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
    import platform

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
