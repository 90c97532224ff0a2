"""Which compute device: `cuda`, `npu` (through torch_npu), `mps` or `cpu`, and why one is not there.

torch_npu is imported only when an NPU is asked for or looked for, never by `import torch`:
tierlm sets TORCH_DEVICE_BACKEND_AUTOLOAD=0 (tierlm/__init__.py) so a broken torch_npu
cannot break CPU users, which means nothing else loads it for us.

torch itself is imported by the functions that ask it, not with this module: `plan_device`
names the CPU without it (`tierlm plan` and `show` on a machine without an accelerator).
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import sys
import warnings
from dataclasses import dataclass

from tierlm.errors import TierlmError

KINDS = ("cuda", "npu", "mps", "cpu")  # auto-detection order
NPU_HINT = ("install torch_npu, which needs Ascend CANN: `pip install torch_npu` matching your torch, "
            "with CANN's set_env.sh sourced")
# Device files without which torch sees no accelerator: NVIDIA's (and Jetson's), WSL's GPU, ROCm's.
ACCELERATOR_FILES = ("/dev/nvidia*", "/dev/nvhost-*", "/dev/dxg", "/dev/kfd")


@dataclass(frozen=True)
class DeviceStatus:
    """One kind of device as this process sees it: how many, or why none."""

    kind: str
    count: int
    reason: str | None = None  # why the kind is unavailable; None when count > 0

    @property
    def available(self) -> bool:
        return self.count > 0


@dataclass(frozen=True)
class CpuDevice:
    """The CPU named without torch: what a plan reads of a torch.device (its `type`, its name)."""

    type: str = "cpu"

    def __str__(self) -> str:
        return self.type


def plan_device(name=None):
    """The device a plan is made for: `name` as `resolve_device` resolves it (a torch.device is
    returned as it is), except that the CPU is a CpuDevice, named without loading torch, when it
    is asked for by name or when auto-detection can find nothing else (`accelerator_possible`)."""
    if not isinstance(name, (str, type(None))):
        return name  # a torch.device already
    if name == "cpu" or (name in (None, "auto") and not accelerator_possible()):
        return CpuDevice()
    return resolve_device(name)


def accelerator_possible() -> bool:
    """Whether auto-detection might find more than the CPU: an accelerator's device file, an
    installed torch_npu, or macOS (MPS). False means torch would find the CPU alone."""
    return any(glob.glob(pattern) for pattern in ACCELERATOR_FILES) or npu_installed() or sys.platform == "darwin"


def resolve_device(name: str | None = None):
    """`cuda[:i]`, `npu[:i]`, `mps` or `cpu` -> torch.device; `None`/`auto`: the first available
    in KINDS order. An unavailable kind asked for by name is a TierlmError that says why."""
    import torch

    if name in (None, "auto"):
        for kind in KINDS:
            status = device_status(kind, quiet=False)
            if status.available:
                return torch.device(kind)
        return torch.device("cpu")
    kind, _, index = str(name).partition(":")
    if kind not in KINDS or (index and not index.isdigit()):
        raise TierlmError(f"unknown device {name!r}", "use auto, cpu, cuda, npu or mps; cuda:1 or npu:1 pick a card")
    if kind == "npu":
        import_torch_npu()  # raises with the install hint; registers the `npu` device type
    status = device_status(kind)
    if not status.available:
        raise TierlmError(f"--device {name} was asked for but {status.reason}", _hint(kind))
    if index and int(index) >= status.count:
        raise TierlmError(f"--device {name}: torch sees only {status.count} {kind} device(s)",
                          f"use {kind}:0 … {kind}:{status.count - 1}")  # fmt: skip
    return torch.device(name)


def compute_dtype(device):
    """Activation dtype per device: bf16 where the accelerator has it, else fp16; fp32 on CPUs.

    CPUs stay fp32 even with native bf16: on an AVX512-BF16 Xeon, batch-1 decode of
    SmolLM2 measured 26.5 tok/s in bf16 against 30.9 tok/s in fp32 (torch 2.13).
    """
    import torch

    if device.type in ("cuda", "npu"):
        supported = getattr(getattr(torch, device.type, None), "is_bf16_supported", None)
        return torch.bfloat16 if supported is not None and supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def device_status(kind: str, *, quiet: bool = True) -> DeviceStatus:
    """How many `kind` devices torch sees, or the reason it sees none (never raises).

    `quiet=False` warns when an installed torch_npu fails to import, so auto-detection on an
    NPU machine does not fall back to the CPU silently.
    """
    import torch

    if kind == "cpu":
        return DeviceStatus("cpu", 1)
    if kind == "cuda":
        if torch.cuda.is_available():
            return DeviceStatus("cuda", torch.cuda.device_count())
        if torch.version.cuda is None and torch.version.hip is None:
            return DeviceStatus("cuda", 0, f"this torch ({torch.__version__}) is built without CUDA")
        return DeviceStatus("cuda", 0, "torch is built with CUDA but sees no GPU (driver, or CUDA_VISIBLE_DEVICES)")
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return DeviceStatus("mps", 1)
        built = mps is not None and mps.is_built()
        return DeviceStatus("mps", 0, "MPS is not available (needs macOS 12.3+ on Apple silicon)" if built
                            else "this torch is built without MPS (Apple silicon only)")  # fmt: skip
    if kind == "npu":
        if not npu_installed():
            return DeviceStatus("npu", 0, "torch_npu is not installed")
        try:
            import_torch_npu()
        except TierlmError as err:
            if not quiet:
                warnings.warn(f"{err.message}; not using the NPU (`tierlm doctor` says more)", RuntimeWarning,
                              stacklevel=3)  # fmt: skip
            return DeviceStatus("npu", 0, err.message)
        npu = getattr(torch, "npu", None)
        if npu is not None and npu.is_available():
            return DeviceStatus("npu", npu.device_count())
        return DeviceStatus("npu", 0, "torch_npu sees no NPU (driver, or ASCEND_RT_VISIBLE_DEVICES)")
    raise ValueError(f"unknown device kind {kind!r}")


def npu_installed() -> bool:
    """torch_npu importable or already imported, without importing it."""
    return "torch_npu" in sys.modules or importlib.util.find_spec("torch_npu") is not None


def import_torch_npu():
    """Import torch_npu, which registers `torch.npu` and the `npu` device type.

    Any failure (missing CANN libraries raise OSError or RuntimeError, not only ImportError)
    becomes a TierlmError with the install hint.
    """
    if not npu_installed():
        raise TierlmError("device npu needs torch_npu, which is not installed", NPU_HINT)
    try:
        return importlib.import_module("torch_npu")
    except Exception as err:  # noqa: BLE001 - whatever a broken install raises, say so clearly
        raise TierlmError(f"torch_npu is installed but failed to import ({type(err).__name__}: {err})",
                          NPU_HINT) from None  # fmt: skip


def _hint(kind: str) -> str:
    return {
        "cuda": "install a CUDA build of torch from pytorch.org, or use --device cpu",
        "npu": NPU_HINT,
        "mps": "use --device cpu",
    }.get(kind, "use --device auto")
