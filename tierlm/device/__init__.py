"""The compute device: which one, its dtype, streams/events/pinned memory, memory readings.

`resolve` picks the device (cuda, npu through torch_npu, mps, cpu) and says why one is
unavailable; `backend` gives streams, events, pinned host buffers and device memory figures
behind one interface; `memory` reads this process's memory and limits; `proc` parses
/proc/self/status for both, so `memory` sits above `backend` and no import runs in a circle.
None of them imports torch before it is needed.
"""

from tierlm.device.backend import DeviceBackend, DeviceMemory, backend_for
from tierlm.device.memory import MemoryReading, read_memory, trim_heap
from tierlm.device.resolve import DeviceStatus, compute_dtype, device_status, import_torch_npu, resolve_device

__all__ = [
    "DeviceBackend",
    "DeviceMemory",
    "DeviceStatus",
    "MemoryReading",
    "backend_for",
    "compute_dtype",
    "device_status",
    "import_torch_npu",
    "read_memory",
    "resolve_device",
    "trim_heap",
]
