"""Memory profiles: what the process may use on each tier, read from a TOML file.

A profile is named (`24gb` = tierlm/profiles/24gb.toml, shipped in the wheel), given as a
path, or `auto` (sized from what this machine has free now). Unknown keys and impossible
values are refused with a message that names the key.

Keys (sizes take units: "7.5GiB", "800MB", or a number of bytes):

    description      one line: the machine class the profile fits
    device_memory    what the process may use on the compute device: the accelerator's memory;
                     on a machine without one, RAM. There the device and host tiers merge into
                     one RAM tier bounded by device_memory (host_memory is then unused)...
    emulate_host_tier  (optional, default false) ...unless this is true: a CPU-only machine then
                     keeps a separate host tier of host_memory, also in RAM but accounted
                     separately, and streams host blocks into the device tier through the
                     ring, so the three-tier path runs (and is tested) without an accelerator.
                     Ignored where an accelerator exists.
    host_memory      host RAM the process may use where an accelerator exists (the runtime's
                     own baseline, host-tier weights, pinned staging buffers)
    disk_offload     whether cold blocks may stay on disk and be streamed from the artifact
    headroom         kept free on each bounded tier (driver context, allocator fragmentation)
    quant            weight format (quant/modes.py): "auto" (the shipped profiles' choice: a GGUF
                     source keeps its quantized grid through int8-g32-asym, float weights get
                     int8), int8, int8-g<N>[-asym], fp16, bf16, fp32, or "none" = the weights
                     as stored, loaded in the compute dtype (fp32 on CPUs, bf16/fp16 on GPUs)
    kv_cache         how the KV cache holds keys and values (kv/formats.py): "auto" = the compute
                     dtype, f32, f16, bf16, q8_0 (8.5 bits a value) or q4_0 (4.5 bits); `kv_dtype`,
                     its older name, is still read
    context_length   tokens of context per sequence, the most a sequence may hold (capped by the
                     model's maximum); the planner charges the KV cache for all of them
    batch_size       sequences reserved for (KV cache and workspace scale with it)
    prefetch_depth   streamed blocks read ahead; the ring holds prefetch_depth + 1 blocks
    threads          (optional, default 0) CPU threads for compute; 0 = the CPUs this process may
                     use (affinity, capped by the cgroup CPU quota: device/cpu.py)

Every byte the planner charges to a tier must fit in that tier's budget: see offload/planner/charges.py.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import psutil

from tierlm.device.memory import process_limits
from tierlm.errors import TierlmError
from tierlm.kv.formats import check_kv_cache
from tierlm.quant.modes import check_mode_name, mode_choices, quant_text
from tierlm.units import format_size, parse_size  # noqa: F401 - part of this module's API

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 has no tomllib; tomli is the same parser.
    import tomli as tomllib

# Sizes are read and shown by tierlm/units.py (quant modes read them too: mixed:5.2GiB).


@dataclass(frozen=True)
class Profile:
    """A memory budget and the run settings it was sized for."""

    name: str
    description: str
    device_memory: int
    host_memory: int
    disk_offload: bool
    headroom: int
    quant: str
    kv_cache: str
    context_length: int
    batch_size: int
    prefetch_depth: int
    emulate_host_tier: bool = False
    threads: int = 0
    # Not a TOML key: the concrete mode a run resolved `quant` to (set once the model is known).
    quant_resolved: str | None = None
    # Not a TOML key: `--context N` as given (a model that holds fewer positions refuses it,
    # where the profile's own context_length is capped to the model's maximum).
    context_asked: int | None = None

    def summary(self) -> str:
        return (
            f"{self.name}: device {format_size(self.device_memory)}, "
            f"host {format_size(self.host_memory)}, context {self.context_length}, "
            f"batch {self.batch_size}, quant {self.quant_label}, kv cache {self.kv_cache}"
        )

    @property
    def quant_label(self) -> str:
        """`quant`, with the mode it resolved to when that differs: "auto → int8-g32-asym"."""
        if self.quant_resolved and self.quant_resolved != self.quant:
            return f"{quant_text(self.quant)} → {quant_text(self.quant_resolved)}"
        return quant_text(self.quant)


_SIZE_KEYS = ("device_memory", "host_memory", "headroom")
_OPTIONAL_KEYS = {"emulate_host_tier", "threads"}
_RUNTIME_FIELDS = {"name", "quant_resolved", "context_asked"}  # set by code, never read from a file
MAX_CONTEXT = 1 << 24  # tokens: past any model's positions, far below what would overflow a size
AUTO = "auto"


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name (`24gb`), `auto` (sized from this machine), or a TOML file by path."""
    if name_or_path == AUTO:
        return auto_profile()
    path = Path(name_or_path).expanduser()
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise TierlmError(f"profile file {path} does not exist")
        text, name = path.read_text(), path.stem
    else:
        shipped = resources.files("tierlm") / "profiles" / f"{name_or_path}.toml"
        if not shipped.is_file():
            raise TierlmError(
                f"unknown profile {name_or_path!r}",
                f"shipped profiles: {', '.join(shipped_profiles())}; or pass a path to a .toml file",
            )
        text, name = shipped.read_text(), name_or_path
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise TierlmError(f"profile {name!r} is not valid TOML: {err}") from None
    return profile_from_dict(name, raw)


def shipped_profiles() -> list[str]:
    """Names of the shipped profiles, largest device budget first (24gb ... 4gb)."""
    folder = resources.files("tierlm") / "profiles"
    names = [p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml")]
    return sorted(names, key=lambda name: (-load_profile(name).device_memory, name))


def auto_profile(ram_available: int | None = None, device_free: int | None = None, limits=None) -> Profile:
    """A profile sized from what this machine has free now (`--profile auto`).

    RAM: psutil's available memory, capped by the limits this process really has (cgroup memory
    limit, RLIMIT_AS: device/memory.py `process_limits`; psutil reports the host's RAM inside a
    container); device: the free memory of the accelerator `--device auto` would pick (CUDA,
    Ascend NPU, ...) through the device module (torch is imported only when it is installed).
    The process takes 85% of that RAM (90% of free device memory) and keeps 5% (at least
    256 MiB) as headroom.
    Pass the numbers (and `limits`, a MemoryLimits) to size one without asking the machine (tests).
    """
    if limits is None and ram_available is None:
        limits = process_limits()
    if ram_available is None:
        ram_available = psutil.virtual_memory().available
    if device_free is None:
        device_free = _accelerator_free_bytes()
    ram_available, source = _ram_under_limits(ram_available, limits)
    ram_share = int(ram_available * 0.85)
    if device_free:
        device, host = int(device_free * 0.90), ram_share
        described = f"{format_size(device_free)} free on the accelerator, {format_size(ram_available)} RAM {source}"
    else:
        device = host = ram_share
        described = f"CPU only, {format_size(ram_available)} RAM {source}"
    raw = {
        "description": f"sized from this machine: {described}",
        "device_memory": device,
        "host_memory": host,
        "disk_offload": True,
        "headroom": max(256 * 2**20, device // 20),
        "quant": "auto",
        "kv_cache": "auto",
        "context_length": 4096,
        "batch_size": 1,
        "prefetch_depth": 2,
    }
    if raw["headroom"] >= device:
        raise TierlmError(
            f"--profile auto: only {format_size(device)} is free on the compute device",
            "free some memory, or pass a profile sized for this machine",
        )
    return profile_from_dict(AUTO, raw)


def _ram_under_limits(available: int, limits) -> tuple[int, str]:
    """(the RAM this process may use: `available`, or a real limit when lower; how it is known)."""
    if limits is not None and limits.ram is not None and limits.ram < available:
        return limits.ram, f"allowed ({limits.ram_source})"
    return available, "available"


def _accelerator_free_bytes() -> int:
    """Free memory on the accelerator auto-detection picks, 0 on a CPU-only machine."""
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        return 0
    # Only `--profile auto` asks the accelerator: torch loads here, so reading a profile does not.
    from tierlm.device.backend import accelerator_free_bytes

    return accelerator_free_bytes()


def profile_from_dict(name: str, raw: dict[str, Any]) -> Profile:
    if "kv_dtype" in raw and "kv_cache" not in raw:  # the key's older name (fp32/fp16/bf16)
        raw = {("kv_cache" if key == "kv_dtype" else key): value for key, value in raw.items()}
    known = {f.name for f in fields(Profile)} - _RUNTIME_FIELDS
    unknown = sorted(set(raw) - known)
    if unknown:
        raise TierlmError(
            f"profile {name!r}: unknown key(s) {', '.join(unknown)}",
            f"known keys: {', '.join(sorted(known))}",
        )
    missing = sorted(known - _OPTIONAL_KEYS - set(raw))
    if missing:
        raise TierlmError(f"profile {name!r}: missing key(s) {', '.join(missing)}")
    values = dict(raw)
    for key in _SIZE_KEYS:
        values[key] = parse_size(raw[key], key)
    values["quant"] = _check_quant(name, values["quant"])
    values["kv_cache"] = check_kv_cache(values["kv_cache"], f"profile {name!r}: kv_cache =")
    for key in ("context_length", "batch_size", "prefetch_depth", "threads"):
        if key not in values:
            continue
        if not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] < 0:
            raise TierlmError(f"profile {name!r}: {key} must be a non-negative integer")
    if values["context_length"] < 16 or values["batch_size"] < 1:
        raise TierlmError(f"profile {name!r}: context_length must be ≥ 16 and batch_size ≥ 1")
    for key in ("disk_offload", "emulate_host_tier"):
        if not isinstance(values.get(key, False), bool):
            raise TierlmError(f"profile {name!r}: {key} must be true or false")
    if not isinstance(values["description"], str):
        raise TierlmError(f"profile {name!r}: description must be a string")
    if values["headroom"] >= values["device_memory"]:
        raise TierlmError(f"profile {name!r}: headroom must be smaller than device_memory")
    return Profile(name=name, **values)


def with_run_settings(profile: Profile, context: str | int | None = None, kv_cache: str | None = None) -> Profile:
    """`profile` with a run's `--context` and `--kv-cache` in place of its own (None: keep them)."""
    if context is not None:
        tokens = parse_context(context)
        profile = replace(profile, context_length=tokens, context_asked=tokens)
    if kv_cache is not None:
        profile = replace(profile, kv_cache=check_kv_cache(kv_cache))
    return profile


def parse_context(value: str | int, where: str = "--context") -> int:
    """Tokens of context from "8192", "32k" or "128K" (x 1024); one line for anything else."""
    text = str(value).strip()
    scale = 1024 if text[-1:] in ("k", "K") else 1
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit():
        raise TierlmError(f"{where} {value} is not a number of tokens", "give a whole number of tokens, e.g. 8192 or 32k")
    tokens = int(digits) * scale
    if not 16 <= tokens <= MAX_CONTEXT:
        raise TierlmError(f"{where} {value} is out of range", f"give 16 to {MAX_CONTEXT:,} tokens, e.g. 8192 or 32k")
    return tokens


def _check_quant(profile: str, value: Any) -> str:
    """The quant mode name, lower-cased; the accepted names come from quant/modes.py."""
    try:
        if isinstance(value, str):
            return check_mode_name(value)
    except TierlmError:
        pass
    raise TierlmError(f"profile {profile!r}: quant = {value!r} is not a quant mode", f"use one of: {mode_choices()}")

