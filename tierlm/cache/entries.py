"""What the cache holds: imported models and compiled artifacts, listed and removed by directory name.

Beside the entries lie the builders' lock files (`.<name>.lock`, and `.<key>.lock` for a GGUF
content key) and, after a killed build, hidden temporaries (`.<name>.partial-<pid>`, up to an
entry's size). Removing entries sweeps the lock files no build holds and the temporaries whose
process is gone (tierlm.atomic.stale_temporaries), so `cache rm --all` leaves no lock files behind;
`stale_builds` counts those temporaries for the listings. `usage/` holds one empty file per
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

try:
    import fcntl
except ImportError:  # Windows: no advisory locks, builds are merely not serialised
    fcntl = None

from tierlm.atomic import refused_write_error, remove_stale_temporaries, stale_temporaries
from tierlm.errors import TierlmError
from tierlm.paths import cache_root

KINDS = {"models": "model", "artifacts": "artifact"}
USAGE_DIR = "usage"
# Other folders whose files are written through a hidden per-process temporary (`sessions/`:
# saved chats, runtime/saved_chat.py; conversations, not rebuildable, so never removed as entries).
RECORD_DIRS = ("digests", "probe", "baseline", "sessions")


@dataclass(frozen=True)
class CacheEntry:
    kind: str
    path: Path
    nbytes: int


@dataclass(frozen=True)
class StaleBuilds:
    """Leftovers of killed builds: how many, and the bytes they hold."""

    count: int
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


def stale_builds() -> StaleBuilds:
    """The temporaries killed imports and conversions left in the cache (only reads: fine on a
    read-only cache)."""
    found = [path for folder in KINDS for path in stale_temporaries(cache_root() / folder)]
    return StaleBuilds(len(found), sum(_size(path) for path in found))


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
        require_known(names, entries)
    chosen = list(entries.values()) if everything else [entries[n] for n in dict.fromkeys(names)]
    try:
        _remove_chosen(chosen, everything)
    except OSError as err:  # a read-only cache: one line, not a traceback
        raise refused_write_error(err, cache_root()) or err from None
    return [e.path for e in chosen]


def require_known(names: list[str], known) -> None:
    """TierlmError unless `names` is not empty and every one is a directory name in `known`."""
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise TierlmError(
            f"no cache entry named {unknown[0]!r}" if unknown else "name the entries to remove",
            "see `tierlm cache list`, or pass --all",
        )


def _remove_chosen(chosen: list[CacheEntry], everything: bool) -> None:
    """Lock every chosen entry (none is removed if one is being built), remove them, then sweep."""
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
    for folder in _swept_folders():
        _sweep(folder)
    if everything:
        shutil.rmtree(cache_root() / USAGE_DIR, ignore_errors=True)


def _lock_path(target: Path) -> Path:
    # The name tierlm.atomic.directory_lock uses.
    return target.parent / f".{target.name}.lock"


@contextlib.contextmanager
def _try_lock(lock: Path) -> Iterator[IO | None]:
    """Hold `lock` if no one else does (yields its handle), else yield None. On the way out the
    file is unlinked, while still held, if the directory it guards no longer exists."""
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


def _swept_folders() -> list[Path]:
    return [cache_root() / folder for folder in (*KINDS, *RECORD_DIRS)]


def _size(path: Path) -> int:
    """Bytes under `path` (a file or a directory); what vanishes meanwhile counts nothing."""
    files = [path] if not path.is_dir() else [f for f in path.rglob("*") if f.is_file()]
    total = 0
    for file in files:
        with contextlib.suppress(OSError):
            total += file.stat().st_size
    return total


def _sweep(folder: Path) -> None:
    """Remove leftovers of killed builds and lock files whose build is over; held ones stay."""
    if not folder.is_dir():
        return
    remove_stale_temporaries(folder)
    for lock in sorted(folder.glob(".*.lock")):
        with _try_lock(lock):
            pass  # unlinks it if free and its target is gone
