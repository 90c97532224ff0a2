"""Directories and small files that appear whole or not at all: build beside the target, fsync, rename.

A builder holds `directory_lock(target)`, decides whether the existing target can be reused, and
otherwise writes into the temporary directory `atomic_directory(target)` yields. The temporary
lives in the target's parent (so the final rename stays on one filesystem) under a hidden name;
a killed builder leaves at most such a temporary, which the next build of that target removes.

    with directory_lock(out_dir):
        if not is_current(out_dir):
            with atomic_directory(out_dir) as tmp:
                write_json(tmp / "config.json", config)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def directory_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock for building `target`, beside it in `.<name>.lock`.

    Serialises builders of one directory across processes; the kernel drops the lock if the
    holder dies. Not re-entrant: taking it twice in one process deadlocks.
    """
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks, builds are merely not serialised
        yield
        return
    lock_path = target.parent / f".{target.name}.lock"
    with lock_path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """Yield an empty temporary directory that replaces `target` when the block completes.

    On success the temporary is fsynced and renamed to `target` (an existing `target` is moved
    aside and deleted); on any exception it is removed and `target` is left as it was. Call it
    under `directory_lock(target)`: it first deletes other builds' leftover temporaries.
    `target.parent` must exist.
    """
    _remove_stale_temporaries(target)
    tmp = _sibling(target, "partial")
    tmp.mkdir()
    try:
        yield tmp
        _swap_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write `doc` as indented UTF-8 JSON with a trailing newline (non-ASCII kept as is).

    Not atomic by itself: write into an `atomic_directory`, whose rename publishes the file.
    """
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def replace_file(path: Path, text: str) -> None:
    """Write `text` to the file `path` atomically: readers see the old content or the new, whole.

    Written beside `path` under a hidden per-process name, fsynced, then renamed over it; for
    small caches (a probe, a baseline record) rather than directories.
    """
    tmp = _sibling(path, "partial")
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_file(path: Path) -> None:
    """Flush `path`'s data to disk, e.g. a large file written by a library inside an atomic_directory."""
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _sibling(target: Path, kind: str, owner: str | None = None) -> Path:
    """A hidden path beside `target`, `.<name>.<kind>-<owner>`; the owner defaults to this process id."""
    return target.parent / f".{target.name}.{kind}-{os.getpid() if owner is None else owner}"


def _remove_stale_temporaries(target: Path) -> None:
    """Remove leftovers of killed builds; safe because the caller holds the directory lock."""
    for kind in ("partial", "old"):
        for stale in target.parent.glob(_sibling(target, kind, owner="*").name):
            shutil.rmtree(stale, ignore_errors=True)


def _swap_into_place(tmp: Path, target: Path) -> None:
    """Rename the finished `tmp` to `target`, moving an existing `target` aside first."""
    _fsync_dir(tmp)
    if target.exists():
        old = _sibling(target, "old")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
    _fsync_dir(target.parent)


def _fsync_dir(path: Path) -> None:
    # Makes the renames durable across power loss; not available on every platform.
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
