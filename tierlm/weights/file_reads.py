"""Reading a byte range of a weight file into memory tierlm owns, with plain reads (never a mapping
of the file, so bytes no longer needed are not left resident). No torch, no numpy."""

from __future__ import annotations

from pathlib import Path


def read_into(path: Path, start: int, target: memoryview) -> int:
    """Fill `target` from byte `start` of `path`; returns how many bytes were read (fewer: the
    file ended early, which the caller reports in its own terms)."""
    with open(path, "rb", buffering=0) as handle:
        handle.seek(start)
        done = 0
        while done < len(target):
            count = handle.readinto(target[done:])
            if not count:
                break
            done += count
    return done
