"""This process's memory figures from /proc/self/status, parsed in this one place.

The lowest layer of `device`: the memory readings, the device backend's CPU figures, the
ledger and the server's metrics all take VmRSS/VmHWM/VmSize/RssAnon/RssFile from here.
"""

from __future__ import annotations

from pathlib import Path

import psutil

STATUS = Path("/proc/self/status")


def status_bytes(path: Path = STATUS) -> dict[str, int]:
    """Every `kB` field of a /proc/<pid>/status file, in bytes; empty where it cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return {}  # not Linux, or no /proc
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        number, _, unit = value.strip().partition(" ")
        if unit.strip() == "kB" and number.isdigit():
            fields[key] = int(number) * 1024
    return fields


def resident_bytes() -> tuple[int, int | None]:
    """(this process's resident bytes now, their peak or None where unknown): /proc, else psutil."""
    fields = status_bytes()
    if "VmRSS" in fields:
        return fields["VmRSS"], fields.get("VmHWM")
    return psutil.Process().memory_info().rss, None  # psutil has no portable peak
