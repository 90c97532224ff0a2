"""What the cache holds: imported models and compiled artifacts, listed and removed by directory name.

Beside the entries lie the builders' lock files (`.<name>.lock`, and `.<key>.lock` for a GGUF
content key) and, after a killed build, hidden temporaries; removing entries sweeps those that
no build holds, so `cache rm --all` leaves no lock files behind. `usage/` holds one empty file per
model used, whose mtime is its last use (see tierlm.cache.catalog).
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tierlm.errors import TierlmError
from tierlm.paths import cache_root

KINDS = {"models": "model", "artifacts": "artifact"}
USAGE_DIR = "usage"


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


def usage_stamp(model_dir: Path) -> Path:
    """The empty file whose mtime says when `model_dir` was last opened for a session."""
    key = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:24]
    return cache_root() / USAGE_DIR / key


def remove_entries(names: list[str], everything: bool = False) -> list[Path]:
    """Remove the named entries (or all), then unheld locks and leftovers of killed builds.

    Unknown names, or an entry another process is building right now, are an error and nothing
    is removed.
    """
    entries = {e.path.name: e for e in cache_entries()}
    if not everything:
        unknown = [n for n in names if n not in entries]
        if unknown or not names:
            raise TierlmError(
                f"no cache entry named {unknown[0]!r}" if unknown else "name the entries to remove",
                "see `tierlm cache list`, or pass --all",
            )
    chosen = list(entries.values()) if everything else [entries[n] for n in dict.fromkeys(names)]
    with contextlib.ExitStack() as held:
        for entry in chosen:
            if held.enter_context(_try_lock(_lock_path(entry.path))) is None:
                raise TierlmError(
                    f"{entry.path.name} is being built by another tierlm process; nothing was removed",
                    "try again when it has finished",
                )
        for entry in chosen:
            shutil.rmtree(entry.path)
            usage_stamp(entry.path).unlink(missing_ok=True)
    for folder in KINDS:
        _sweep(cache_root() / folder)
    if everything:
        shutil.rmtree(cache_root() / USAGE_DIR, ignore_errors=True)
    return [e.path for e in chosen]


def _lock_path(target: Path) -> Path:
    # The name tierlm.atomic.directory_lock uses.
    return target.parent / f".{target.name}.lock"


@contextlib.contextmanager
def _try_lock(lock: Path) -> Iterator[IO | None]:
    """Hold `lock` if no one else does (yields its handle), else yield None. On the way out the
    file is unlinked, while still held, if the directory it guards no longer exists."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks, builds are merely not serialised
        fcntl = None
    with open(lock, "a") as handle:
        if fcntl is not None:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield None
                return
        try:
            yield handle
        finally:
            if not (lock.parent / lock.name[1:].removesuffix(".lock")).exists():
                with contextlib.suppress(OSError):  # Windows cannot unlink an open file
                    lock.unlink(missing_ok=True)


def _sweep(folder: Path) -> None:
    """Remove leftovers of killed builds and lock files whose build is over; held ones stay."""
    if not folder.is_dir():
        return
    for temp in sorted(folder.glob(".*.partial-*")) + sorted(folder.glob(".*.old-*")):
        target = folder / temp.name[1:].rsplit(".", 1)[0]
        with _try_lock(_lock_path(target)) as handle:
            if handle is not None:
                shutil.rmtree(temp, ignore_errors=True)
    for lock in sorted(folder.glob(".*.lock")):
        with _try_lock(lock):
            pass  # unlinks it if free and its target is gone
