"""Real limits: a profile is a promise about the process, so its budgets are first capped at what
the process really has (`limits`: the cgroup memory limit, RLIMIT_AS, free accelerator memory,
read by the caller with device/memory.py `process_limits`; `cap_profile`). Within the cap the
plan streams what no longer fits and says so in a note (`_cap_notes`); when even that cannot
hold the model, the refusal (refusal.py `_limit_refusal`) names the limit, what the profile
allows and the least limit that would do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tierlm.device.memory import MemoryLimits
from tierlm.profile import Profile

GiB = 2**30


RAM, DEVICE_MEMORY = "RAM", "device memory"


@dataclass(frozen=True)
class Cap:
    """A resource the profile grants more of than the process really has."""

    resource: str  # RAM or DEVICE_MEMORY
    allowed: int  # what the profile lets it hold
    limit: int  # what the process may really use
    source: str  # where the limit comes from: "cgroup memory limit", "RLIMIT_AS", ...


def cap_profile(profile: Profile, limits: MemoryLimits | None, accelerator: bool) -> tuple[Profile, tuple[Cap, ...]]:
    """(`profile` with its budgets lowered to `limits`, the caps applied; none: `profile` as is).

    RAM bounds the host tier (with an accelerator) or both RAM tiers (CPU-only; with
    emulate_host_tier the two are scaled alike so that together they fit); free accelerator
    memory bounds the device tier. The headroom is a share of the device tier's budget (the RAM
    tier's on CPU-only) and shrinks with it, else a small limit would be all headroom.
    """
    allowed = _allowances(profile, accelerator)
    caps = tuple(
        Cap(resource, allowed[resource], limit, source)
        for resource, (limit, source) in _limit_values(limits, accelerator).items()
        if limit < allowed[resource]
    )
    if not caps:
        return profile, caps
    by_resource = {cap.resource: cap for cap in caps}
    device, host = by_resource.get(DEVICE_MEMORY if accelerator else RAM), by_resource.get(RAM)
    lowered = replace(profile, device_memory=_lowered(profile.device_memory, device),
                      host_memory=_lowered(profile.host_memory, host), headroom=_lowered(profile.headroom, device))  # fmt: skip
    return lowered, caps


def _lowered(nbytes: int, cap: Cap | None) -> int:
    """`nbytes` lowered as `cap` lowers its resource (integer arithmetic: a lone budget becomes
    the limit exactly)."""
    return nbytes if cap is None else nbytes * cap.limit // cap.allowed


def _allowances(profile: Profile, accelerator: bool) -> dict[str, int]:
    """What the profile lets each real resource hold (CPU-only: both tiers are RAM)."""
    if accelerator:
        return {DEVICE_MEMORY: profile.device_memory, RAM: profile.host_memory}
    return {RAM: profile.device_memory + (profile.host_memory if profile.emulate_host_tier else 0)}


def _limit_values(limits: MemoryLimits | None, accelerator: bool) -> dict[str, tuple[int, str]]:
    found: dict[str, tuple[int, str]] = {}
    if limits is not None and limits.ram is not None:
        found[RAM] = (limits.ram, limits.ram_source or "memory limit")
    if limits is not None and accelerator and limits.device_free is not None:
        found[DEVICE_MEMORY] = (limits.device_free, "free accelerator memory")
    return found


def _cap_notes(caps: tuple[Cap, ...], profile: Profile, effective: Profile) -> tuple[str, ...]:
    notes = [f"{cap.resource} budget capped at the {cap.source} {_size(cap.limit)} "
             f"(profile {profile.name!r} allows {_size(cap.allowed)})" for cap in caps]  # fmt: skip
    if effective.headroom != profile.headroom:
        notes.append(f"headroom scaled with the budget: {_size(effective.headroom)} (the profile's {_size(profile.headroom)})")
    return tuple(notes)


def _size(nbytes: int, *, up: bool = False) -> str:
    """250 MiB, 3.25 GiB: as a person would write a limit; `up`: rounded up (an "at least")."""
    unit, scale, places = ("GiB", GiB, 2) if nbytes >= GiB else ("MiB", 2**20, 0)
    value = nbytes / scale
    if up:
        value = math.ceil(value * 10**places - 1e-9) / 10**places
    text = f"{value:.{places}f}"
    return (text.rstrip("0").rstrip(".") if places else text) + f" {unit}"
