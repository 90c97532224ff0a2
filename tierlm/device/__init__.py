"""The compute device: which one, its dtype, streams/events/pinned memory, memory readings.

`resolve` picks the device (cuda, npu through torch_npu, mps, cpu) and says why one is
unavailable; `backend` gives streams, events, pinned host buffers and device memory figures
behind one interface; `graphs` captures a step and replays it. Those three hold tensors and
import torch. `memory` reads this process's memory and limits, `proc` parses /proc/self/status,
`cpu` the CPU and its usable threads, `threads` the OpenMP defaults `import tierlm` sets: these
four are torch-free, so importing one of them (tierlm/__init__, profile.py) loads no torch.

Import from the submodules. The names below are also offered here, loaded on first use so that
importing this package stays torch-free, for callers that still name the package.
"""

from __future__ import annotations

import importlib

# name -> the submodule that defines it
_OFFERED = {
    "DeviceBackend": "backend",
    "DeviceMemory": "backend",
    "backend_for": "backend",
    "MemoryReading": "memory",
    "read_memory": "memory",
    "trim_heap": "memory",
    "DeviceStatus": "resolve",
    "compute_dtype": "resolve",
    "device_status": "resolve",
    "import_torch_npu": "resolve",
    "resolve_device": "resolve",
}

__all__ = sorted(_OFFERED)


def __getattr__(name: str):
    if name not in _OFFERED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_OFFERED[name]}"), name)
