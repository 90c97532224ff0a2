"""What the cache holds: imported models and compiled artifacts, listed and removed by name."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from tierlm.errors import TierlmError
from tierlm.paths import cache_root

KINDS = {"models": "model", "artifacts": "artifact"}


@dataclass(frozen=True)
class CacheEntry:
    kind: str
    path: Path
    nbytes: int


def cache_entries() -> list[CacheEntry]:
    """Finished entries only: hidden names are temporaries and locks of builds in progress."""
    entries = []
    for folder, kind in KINDS.items():
        root = cache_root() / folder
        if not root.is_dir():
            continue
        for path in sorted(root.iterdir()):
            if path.is_dir() and not path.name.startswith("."):
                size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                entries.append(CacheEntry(kind, path, size))
    return entries


def remove_entries(names: list[str], everything: bool = False) -> list[Path]:
    """Remove the named entries (or all); unknown names are an error and nothing is removed."""
    entries = {e.path.name: e for e in cache_entries()}
    if not everything:
        unknown = [n for n in names if n not in entries]
        if unknown or not names:
            raise TierlmError(
                f"no cache entry named {unknown[0]!r}" if unknown else "name the entries to remove",
                "see `tierlm cache list`, or pass --all",
            )
    chosen = list(entries.values()) if everything else [entries[n] for n in names]
    for entry in chosen:
        shutil.rmtree(entry.path)
    return [e.path for e in chosen]
