"""`tierlm doctor`: what this machine offers tierlm, and for each missing option, why.

`collect()` gathers a plain dict (what `--json` prints); `render()` turns it into lines. Every
probe catches its own failure and reports it as a reason, so the doctor itself never fails.
`collect(probe=True)` (`tierlm doctor --probe`) measures the planner's bandwidths afresh and
caches them, replacing a probe taken while the machine was busy.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
import warnings
from pathlib import Path

# module -> (distribution, what tierlm uses it for, how to get it)
OPTIONAL_PACKAGES = {
    "numba": ("numba", "INT8 CPU kernel when no C++ compiler is found", "pip install 'tierlm[cpu]'"),
    "torch_npu": ("torch_npu", "Ascend NPUs", "pip install torch_npu, needs Ascend CANN"),
    "transformers": ("transformers", "reference logits in tests and benchmarks", "pip install transformers"),
    "peft": ("peft", "LoRA merge reference in tests", "pip install peft"),
    "accelerate": ("accelerate", "offload benchmark baseline", "pip install accelerate"),
}


def collect(probe: bool = False) -> dict:
    """Everything the doctor reports, as JSON-ready values (bytes as integers). `probe`: run the
    bandwidth probe again (in a child, a minute or so) instead of showing the cached one."""
    import torch

    from tierlm import __version__
    from tierlm.device.resolve import resolve_device
    from tierlm.device.cpu import apply_threads

    apply_threads()  # what every command runs with unless told: the kernel choice and probe are keyed on it
    report = {
        "tierlm": __version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "torch": _torch(torch),
        "devices": [_device(kind) for kind in ("cuda", "npu", "mps", "cpu")],
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # auto-detection's warnings are in the device list
            chosen = resolve_device("auto")
        report["device"] = str(chosen)
    except Exception as err:  # noqa: BLE001 - reported, not raised
        chosen, report["device"] = None, None
        report["device_error"] = str(err)
    report["cpu"] = _cpu()
    report["int8_kernel"] = _kernel(chosen)
    report["packages"] = {module: _package(module) for module in OPTIONAL_PACKAGES}
    report["cgroup"] = _cgroup()
    report["cache"] = _cache()
    report["probe"] = _probe(chosen, probe)
    return report


def render(report: dict) -> str:
    from tierlm.profile import format_size

    t = report["torch"]
    build = ", ".join(filter(None, [
        f"CUDA {t['cuda']}" if t["cuda"] else None,
        f"HIP {t['hip']}" if t["hip"] else None,
        "CPU-only build" if not (t["cuda"] or t["hip"]) else None,
        f"CPU capability {t['cpu_capability']}" if t["cpu_capability"] else None,
        f"{t['threads']} threads",
        f"TORCH_DEVICE_BACKEND_AUTOLOAD={t['backend_autoload']}",
    ]))  # fmt: skip
    lines = [
        f"tierlm    {report['tierlm']}, python {report['python']}, {report['platform']}",
        f"torch     {t['version']} ({build})",
    ]
    for i, dev in enumerate(report["devices"]):
        label = "devices" if i == 0 else ""
        if not dev["available"]:
            lines.append(f"{label:9} {dev['kind']:5} unavailable: {dev['reason']}")
            continue
        for unit in dev["units"]:
            memory = (f"{format_size(unit['total'])} total, {format_size(unit['free'])} free"
                      if unit.get("total") is not None else f"memory unknown: {unit.get('reason')}")  # fmt: skip
            chosen = "  <- auto" if unit["device"] in (report["device"], f"{report['device']}:0") else ""
            lines.append(f"{label:9} {unit['device']:5} {unit['name']}; {memory}{chosen}")
            label = ""
    if report.get("device_error"):
        lines.append(f"{'':9} auto-detection failed: {report['device_error']}")
    cpu = report["cpu"]
    features = ", ".join(f"{name} {'yes' if has else 'no'}" for name, has in cpu["features"].items())
    lines.append(f"cpu       {cpu['model']}, {cpu['logical_cores']} logical cores; "
                 f"{features or 'features unknown: ' + str(cpu['reason'])}")  # fmt: skip
    kernel = report["int8_kernel"]
    if kernel.get("error"):
        lines.append(f"int8      unavailable: {kernel['error']}")
    else:
        skipped = "; skipped " + "; ".join(kernel["skipped"]) if kernel["skipped"] else ""
        chosen = (f"{kernel['gemv']} at every batch size" if kernel["gemv"] == kernel["gemm"] else
                  f"{kernel['gemv']} up to {kernel['crossover']} rows, {kernel['gemm']} above")  # fmt: skip
        lines.append(f"int8      on {kernel['device']}: {chosen}{skipped}")
    for i, (module, found) in enumerate(report["packages"].items()):
        shown = found["version"] or "absent"
        shown += f": {found['reason']}" if found["reason"] else ""
        lines.append(f"{'packages' if i == 0 else '':9} {module:12} {shown}")
    group = report["cgroup"]
    if group["source"] is None:
        lines.append("cgroup    no cgroup memory files (no memory limit from a container)")
    else:
        limit = format_size(group["memory_limit"]) if group["memory_limit"] else "none"
        lines.append(f"cgroup    memory limit {limit} ({group['source']})")
    cache = report["cache"]
    lines.append(f"cache     {cache['path']}, {format_size(cache['bytes'])}")
    lines += _probe_lines(report["probe"])
    return "\n".join(lines)


def _torch(torch) -> dict:
    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "git": getattr(torch.version, "git_version", None),
        "debug": bool(getattr(torch.version, "debug", False)),
        "cpu_capability": capability() if capability else None,
        "threads": torch.get_num_threads(),
        # tierlm sets 0 so a broken device plugin cannot break `import torch` (tierlm/__init__.py)
        "backend_autoload": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1"),
    }


def _device(kind: str) -> dict:
    """One kind: available units with name and memory, or the reason there are none."""
    import torch

    from tierlm.device.backend import DeviceBackend
    from tierlm.device.resolve import device_status

    status = device_status(kind)
    found = {"kind": kind, "available": status.available, "count": status.count, "reason": status.reason}
    if not status.available:
        found["reason"] = _with_hint(kind, status.reason)
        return found
    units = []
    for index in range(status.count):
        device = torch.device(kind) if kind in ("cpu", "mps") else torch.device(kind, index)
        backend = DeviceBackend(device)
        unit = {"device": str(device), "name": _name(backend)}
        try:
            memory = backend.memory()
            unit.update(total=memory.total, free=memory.free)
        except Exception as err:  # noqa: BLE001 - reported, not raised
            unit["reason"] = f"{type(err).__name__}: {err}"
        units.append(unit)
    found["units"] = units
    return found


def _name(backend) -> str:
    try:
        return backend.name()
    except Exception as err:  # noqa: BLE001 - a name is nice to have
        return f"unnamed ({type(err).__name__})"


def _with_hint(kind: str, reason: str | None) -> str:
    from tierlm.device.resolve import NPU_HINT

    if kind == "npu" and reason == "torch_npu is not installed":
        return f"{reason} ({OPTIONAL_PACKAGES['torch_npu'][2]})"
    if kind == "npu" and "failed to import" in str(reason):
        return f"{reason}; {NPU_HINT}"
    return str(reason)


def _cpu() -> dict:
    from tierlm.device.cpu import cpu_info

    info = cpu_info()
    return {"model": info.model, "logical_cores": info.logical_cores, "features": info.features, "reason": info.reason}


def _kernel(device) -> dict:
    """The INT8 kernels the dispatcher picks for the auto-detected device (calibrates on the CPU)."""
    if device is None:
        return {"error": "no compute device resolved"}
    try:
        from tierlm.quant.dispatch import kernel_choice

        kernels = kernel_choice(device)
    except Exception as err:  # noqa: BLE001 - reported, not raised
        return {"device": str(device), "error": f"{type(err).__name__}: {err}"}
    return {
        "device": str(device),
        "gemv": kernels.gemv.name,
        "gemm": kernels.gemm.name,
        "crossover": kernels.crossover,
        "skipped": list(kernels.skipped),
    }


def _package(module: str) -> dict:
    """Version from the installed metadata (nothing is imported), or why the package is absent."""
    dist, purpose, install = OPTIONAL_PACKAGES[module]
    try:
        present = module in sys.modules or importlib.util.find_spec(module) is not None
    except (ImportError, ValueError) as err:
        return {"version": None, "purpose": purpose, "reason": f"cannot be located ({err})"}
    if not present:
        return {"version": None, "purpose": purpose, "reason": f"not installed ({install}); used for {purpose}"}
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = getattr(sys.modules.get(module), "__version__", None) or "unknown version"
    found = {"version": version, "purpose": purpose, "reason": None}
    if module == "torch_npu":
        from tierlm.device.resolve import device_status

        status = device_status("npu")  # installed is not enough: it must import and see an NPU
        if not status.available:
            found["reason"] = status.reason
    return found


def _cgroup() -> dict:
    from tierlm.device.memory import cgroup_memory_limit

    limit, source = cgroup_memory_limit()
    return {"memory_limit": limit, "source": source}


def _probe(device, refresh: bool) -> dict:
    """The cached bandwidth probe for `device` (probed afresh when `refresh`), or why there is none."""
    if device is None:
        return {"error": "no compute device resolved"}
    try:
        from tierlm.probe.record import bandwidths_path, read_probe
        from tierlm.probe.machine import load_probe

        path = bandwidths_path(device)
        record = load_probe(device, refresh=True) if refresh else read_probe(path)
    except Exception as err:  # noqa: BLE001 - reported, not raised
        return {"error": f"{type(err).__name__}: {err}"}
    if record is None:
        return {"path": str(path), "error": "not probed yet: the first plan or load probes, or `tierlm doctor --probe`"}
    return {"path": str(path), "refreshed": refresh, **record.to_dict()}


def _probe_lines(found: dict) -> list[str]:
    from tierlm.cli.plan_view import last_run_text, probe_age_text
    from tierlm.probe.record import ProbeRecord

    if found.get("error"):
        return [f"probe     {found['error']}"]
    record = ProbeRecord.from_dict(found)
    bw = record.bandwidths
    figures = (f"int8 {bw.device_bytes_per_s / 1e9:.2f} GB/s (host {bw.host_bytes_per_s / 1e9:.2f}), "
               f"link {bw.link_bytes_per_s / 1e9:.2f} GB/s, disk {bw.disk_bytes_per_s / 1e9:.2f} GB/s, "
               f"{bw.device_flops / 1e9:.1f} GFLOP/s, {bw.per_block_overhead_s * 1e3:.2f} ms per layer, "
               f"{bw.per_token_overhead_s * 1e3:.2f} ms per token, {bw.per_row_s * 1e9:.0f} ns per row")  # fmt: skip
    name = Path(found["path"]).stem
    lines = [f"probe     {name}: {figures}"]
    if bw.format_factors:  # each carried format's weight bytes/s, as the planner prices it
        rates = ", ".join(f"{mode} {bw.device_bytes_per_s * factor / 1e9:.1f}" for mode, factor in bw.format_factors)
        lines.append(f"{'':9} formats (GB/s): {rates}")
    lines.append(f"{'':9} {'probed just now' if found['refreshed'] else probe_age_text(record)}")
    last = last_run_text(record)
    return lines + ([f"{'':9} {last}"] if last and not found["refreshed"] else [])


def _cache() -> dict:
    from tierlm.paths import cache_root

    root = cache_root()
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass  # a build finishing or removed while we walk
    return {"path": str(root), "bytes": total}
