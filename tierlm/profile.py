"""Memory profiles: what the process may use on each tier, read from a TOML file.

A profile is named (`24gb` = tierlm/profiles/24gb.toml, shipped in the wheel) or given as a
path. Unknown keys and impossible values are refused with a message that names the key.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from tierlm.errors import TierlmError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 has no tomllib; tomli is the same parser.
    import tomli as tomllib

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")

QUANT_MODES = ("none", "int8", "int8-g128", "fp16", "bf16", "fp32")
KV_DTYPES = ("auto", "fp32", "fp16", "bf16")


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from an int or a string such as "7.5GiB", "800MB", "4096"."""
    if isinstance(value, bool):
        raise TierlmError(f"profile key {key!r}: expected a size like '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise TierlmError(f"profile key {key!r}: size must not be negative")
        return value
    match = _SIZE.match(str(value))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise TierlmError(
            f"profile key {key!r}: cannot read {value!r} as a size",
            "write it like '7.5GiB', '800MB' or a number of bytes",
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


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
    kv_dtype: str
    context_length: int
    batch_size: int
    prefetch_depth: int

    def summary(self) -> str:
        return (
            f"{self.name}: device {format_size(self.device_memory)}, "
            f"host {format_size(self.host_memory)}, context {self.context_length}, "
            f"batch {self.batch_size}, quant {self.quant}"
        )


_SIZE_KEYS = ("device_memory", "host_memory", "headroom")


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name (`24gb`), or a TOML file by path."""
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
    folder = resources.files("tierlm") / "profiles"
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def profile_from_dict(name: str, raw: dict[str, Any]) -> Profile:
    known = {f.name for f in fields(Profile)} - {"name"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise TierlmError(
            f"profile {name!r}: unknown key(s) {', '.join(unknown)}",
            f"known keys: {', '.join(sorted(known))}",
        )
    missing = sorted(known - set(raw))
    if missing:
        raise TierlmError(f"profile {name!r}: missing key(s) {', '.join(missing)}")
    values = dict(raw)
    for key in _SIZE_KEYS:
        values[key] = parse_size(raw[key], key)
    _check_choice(name, "quant", values["quant"], QUANT_MODES)
    _check_choice(name, "kv_dtype", values["kv_dtype"], KV_DTYPES)
    for key in ("context_length", "batch_size", "prefetch_depth"):
        if not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] < 0:
            raise TierlmError(f"profile {name!r}: {key} must be a non-negative integer")
    if values["context_length"] < 16 or values["batch_size"] < 1:
        raise TierlmError(f"profile {name!r}: context_length must be ≥ 16 and batch_size ≥ 1")
    if not isinstance(values["disk_offload"], bool):
        raise TierlmError(f"profile {name!r}: disk_offload must be true or false")
    if values["headroom"] >= values["device_memory"]:
        raise TierlmError(f"profile {name!r}: headroom must be smaller than device_memory")
    return Profile(name=name, **values)


def _check_choice(profile: str, key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise TierlmError(
            f"profile {profile!r}: {key} = {value!r} is not one of {', '.join(choices)}"
        )
