"""Streams, events, pinned host buffers and memory statistics for one device, behind one interface.

`backend_for(device)` is what the tiered store and the ledger use:
- cuda, npu (and any device torch.accelerator drives): side streams and events from
  torch.Stream/torch.Event, the current stream and memory figures from torch.accelerator,
  falling back to the backend module (torch.cuda, torch.npu) where this torch lacks them;
  host buffers are pinned so host->device copies can run asynchronously;
- cpu and mps: copies run synchronously (the CPU has no second memory, MPS one command queue
  and unified memory), with torch's CPU stream/event stand-ins, which complete immediately,
  so callers keep a single code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from tierlm.device.cpu import cpu_info
from tierlm.device.proc import resident_bytes
from tierlm.device.resolve import resolve_device

SYNC_KINDS = ("cpu", "mps")  # no side streams; host memory stays unpinned


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes on one device: allocated by torch now, its peak, the device's total and free.

    On the CPU: this process's RSS and peak RSS, and the machine's RAM total and available.
    """

    allocated: int
    peak: int
    total: int
    free: int


class DeviceBackend:
    """Device-neutral streams/events/pinning/memory for `device` (a torch.device).

    `accelerator`: the device has memory apart from host tensors, so host bytes are staged and
    copied. `pinned`: host staging buffers are page-locked. `streams`: copies may run on a side
    stream, ordered by events; otherwise `copy` is synchronous.
    """

    def __init__(self, device):
        self.device = device
        self.accelerator = device.type != "cpu"
        self.streams = device.type not in SYNC_KINDS
        self.pinned = self.streams  # pinning only pays off (and only works) with async copies

    def new_stream(self):
        if not self.streams:
            return torch.cpu.Stream()
        if hasattr(torch, "Stream"):
            return torch.Stream(device=self.device)
        return self._module().Stream(device=self.device)

    def current_stream(self):
        if not self.streams:
            return torch.cpu.current_stream()
        accelerator = _accelerator_api(self.device)
        if accelerator is not None:
            return accelerator.current_stream(self.device)
        return self._module().current_stream(self.device)

    def new_event(self):
        if not self.streams:
            return torch.cpu.Event()
        if hasattr(torch, "Event"):
            return torch.Event(device=self.device)
        return self._module().Event()

    def copy(self, dst, src, stream) -> None:
        """Enqueue dst.copy_(src) on `stream` (synchronous where the device has no side streams)."""
        if not self.streams:
            dst.copy_(src)
            return
        with _on_stream(stream, self._module()):
            dst.copy_(src, non_blocking=True)

    def empty_host(self, nbytes: int):
        """A uint8 host buffer; pinned when the device copies asynchronously from it."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def memory(self) -> DeviceMemory:
        if self.device.type == "cpu":
            return _host_memory()
        accelerator = _accelerator_api(self.device)
        if accelerator is not None:
            try:
                free, total = accelerator.get_memory_info(self.device)
                return DeviceMemory(accelerator.memory_allocated(self.device),
                                    accelerator.max_memory_allocated(self.device), total, free)  # fmt: skip
            except (AttributeError, RuntimeError, TypeError):
                pass  # an older torch, or a backend that does not report through torch.accelerator
        module = self._module()
        if self.device.type == "mps":
            allocated, total = module.current_allocated_memory(), module.recommended_max_memory()
            return DeviceMemory(allocated, allocated, total, max(total - module.driver_allocated_memory(), 0))
        free, total = module.mem_get_info(self.device)
        return DeviceMemory(module.memory_allocated(self.device), module.max_memory_allocated(self.device), total, free)

    def synchronize(self) -> None:
        """Wait for all queued work on the device: for timing measurements, never the data path."""
        if self.device.type == "cpu":
            return
        accelerator = _accelerator_api(self.device)
        if accelerator is not None:
            accelerator.synchronize(self.device)
        elif self.device.type == "mps":
            self._module().synchronize()
        else:
            self._module().synchronize(self.device)

    def name(self) -> str:
        """A human name: the CPU model, or the card's name as its backend reports it."""
        if self.device.type == "cpu":
            return cpu_info().model
        if self.device.type == "mps":
            return "Apple GPU (MPS)"
        return self._module().get_device_name(self.device.index or 0)

    def _module(self):
        return torch.get_device_module(self.device.type)


def backend_for(device) -> DeviceBackend:
    """The backend for a torch.device or a name as resolve_device accepts it."""
    if not isinstance(device, torch.device):
        device = resolve_device(device)
    return DeviceBackend(device)


def accelerator_free_bytes() -> int:
    """Free memory on the accelerator `--device auto` picks, 0 on a CPU-only machine."""
    device = resolve_device(None)
    if device.type == "cpu":
        return 0
    return int(backend_for(device).memory().free)


def _accelerator_api(device):
    """torch.accelerator when this torch has it and it drives `device`'s type, else None."""
    accelerator = getattr(torch, "accelerator", None)
    try:
        current = accelerator.current_accelerator() if accelerator is not None else None
    except RuntimeError:  # e.g. a device type renamed without its module registered
        return None
    return accelerator if current is not None and current.type == device.type else None


def _on_stream(stream, module):
    """Make `stream` current for a block: torch.Stream is a context manager, older types are not."""
    if hasattr(stream, "__enter__"):
        return stream
    return module.stream(stream)


def _host_memory() -> DeviceMemory:
    (rss, peak), machine = resident_bytes(), psutil.virtual_memory()
    return DeviceMemory(rss, peak or rss, machine.total, machine.available)
