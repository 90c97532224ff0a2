"""Directories and small files that appear whole or not at all: build beside the target, fsync, rename.

A builder holds `directory_lock(target)`, decides whether the existing target can be reused, and
otherwise writes into the temporary directory `atomic_directory(target)` yields. The temporary
lives in the target's parent (so the final rename stays on one filesystem) under a hidden name;
a killed builder leaves at most such a temporary (`.<name>.partial-<pid>`), which the next build in
that folder removes once its process is gone (`stale_temporaries`).

A disk that refuses a write (full, read-only, not ours) is a one-line TierlmError from a build,
with nothing partial left; writes that only warm a cache go through `optional_write` and are
skipped instead.

    with directory_lock(out_dir):
        if not is_current(out_dir):
            with atomic_directory(out_dir) as tmp:
                write_json(tmp / "config.json", config)
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import psutil

from tierlm.errors import TierlmError
from tierlm.paths import cache_root

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; builds are merely not serialised
    fcntl = None

# errno values of a disk refusing a write: full, or read-only / not ours.
_FULL = frozenset(filter(None, (errno.ENOSPC, getattr(errno, "EDQUOT", None))))
_READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
# Rust-backed writers (safetensors, tokenizers) raise their own type carrying io::Error's text.
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
_TEMPORARY = re.compile(r"\.(?P<target>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)")


@contextlib.contextmanager
def directory_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock for building `target`, beside it in `.<name>.lock`.

    Serialises builders of one directory across processes; the kernel drops the lock if the
    holder dies. Not re-entrant: taking it twice in one process deadlocks.
    """
    if fcntl is None:
        yield
        return
    handle = _open_lock(target.parent / f".{target.name}.lock")
    if handle is None:  # a read-only folder: nothing can be built here, a finished target still reused
        yield
        return
    with handle:
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
    under `directory_lock(target)`: it first deletes this target's leftover temporaries and
    those of killed builds of its neighbours. `target.parent` must exist. A disk that refuses
    the writes (full, read-only) becomes a one-line TierlmError once the temporary is gone.
    """
    _remove_stale_temporaries(target)
    remove_stale_temporaries(target.parent)
    tmp = _sibling(target, "partial")
    try:
        tmp.mkdir()
        yield tmp
        _swap_into_place(tmp, target)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        refusal = refused_write_error(err, target.parent)
        if refusal is not None:
            raise refusal from None
        raise


def make_dirs(path: Path) -> Path:
    """`path` and its parents, created where missing; a refusal is refused_write_error's message."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise refused_write_error(err, Path(path)) or err from None
    return Path(path)


@contextlib.contextmanager
def optional_write() -> Iterator[None]:
    """Wrap a write that only warms a cache (a digest, a probe, a last-used time): when the disk
    refuses it (full, read-only, not ours) the rest of the block is skipped and the run goes on."""
    try:
        yield
    except Exception as err:
        if refused_errno(err) is None:
            raise


def refused_errno(err: BaseException) -> int | None:
    """The errno if `err` is a disk refusing a write (an OSError, or a Rust library's error
    carrying `(os error N)`), else None."""
    code = err.errno if isinstance(err, OSError) else None
    if code is None and not isinstance(err, OSError):
        found = _RUST_OS_ERROR.search(str(err))
        code = int(found.group(1)) if found else None
    return code if code in _FULL | _READ_ONLY else None


def refused_write_error(err: BaseException, where: Path) -> TierlmError | None:
    """One line for a refused write under `where` (None if `err` is something else): a full disk,
    or a read-only/foreign directory, naming the cache and $TIERLM_CACHE when it is the cache."""
    code = refused_errno(err)
    filename = getattr(err, "filename", None)
    if code is None or (code in (errno.EACCES, errno.EPERM) and filename and not _inside(Path(filename), where)):
        return None  # e.g. an unreadable source file: its own error says more
    root = cache_root()
    in_cache = _inside(where, root)
    reason = os.strerror(code)
    if code in _FULL:
        return TierlmError(
            f"no space left to write {where} ({reason}); nothing was kept",
            "free some space" + (", or point TIERLM_CACHE at a disk with room" if in_cache else ""),
        )
    if in_cache:
        return TierlmError(
            f"the cache directory {root} is not writable ({reason})",
            "point TIERLM_CACHE at a writable directory, e.g. `export TIERLM_CACHE=~/tierlm-cache`",
        )
    return TierlmError(f"{where} is not writable ({reason})", "choose a writable directory")


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
    with atomic_file(path) as handle:
        handle.write(text.encode("utf-8"))


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[IO[bytes]]:
    """A binary handle whose bytes replace the file `path` whole when the block completes.

    It writes a hidden temporary beside `path` (`.<name>.partial-<pid>`, which
    `stale_temporaries` knows once its process is gone), fsynced and renamed over `path`; on any
    exception the temporary is removed and `path` left as it was.
    """
    tmp = _sibling(path, "partial")
    try:
        with tmp.open("wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def fsync_file(path: Path) -> None:
    """Flush `path`'s data to disk, e.g. a large file written by a library inside an atomic_directory."""
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _sibling(target: Path, kind: str, owner: str | None = None) -> Path:
    """A hidden path beside `target`, `.<name>.<kind>-<owner>`; the owner defaults to this process id."""
    return target.parent / f".{target.name}.{kind}-{os.getpid() if owner is None else owner}"


def stale_temporaries(folder: Path) -> list[Path]:
    """Leftovers of killed builds directly in `folder`: hidden partial/old temporaries whose
    process is gone and whose target no build holds (another PID namespace may share the cache).

    Reads only (a held lock is probed read-only), so it works on a read-only cache.
    """
    found = []
    for path in sorted(Path(folder).glob(".*-*")) if Path(folder).is_dir() else ():
        name = _TEMPORARY.fullmatch(path.name)
        if name and not _process_alive(int(name["pid"])) and not _lock_held(folder / f".{name['target']}.lock"):
            found.append(path)
    return found


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Remove `stale_temporaries(folder)` (directories or files); returns what was removed."""
    removed = []
    for stale in stale_temporaries(folder):
        with contextlib.suppress(OSError):
            shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink()
            removed.append(stale)
    return removed


def _remove_stale_temporaries(target: Path) -> None:
    """Remove leftovers of killed builds; safe because the caller holds the directory lock."""
    for kind in ("partial", "old"):
        for stale in target.parent.glob(_sibling(target, kind, owner="*").name):
            shutil.rmtree(stale, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    # psutil's pid_exists is safe on Windows, where os.kill(pid, 0) would signal the process.
    return pid == os.getpid() or psutil.pid_exists(pid)


def _open_lock(lock_path: Path):
    """The lock file opened for flock; read-only when the folder refuses writes, None when it
    refuses them and holds no lock file yet."""
    try:
        return lock_path.open("a")
    except OSError as err:
        if refused_errno(err) is None:
            raise
    try:
        return lock_path.open("r")
    except FileNotFoundError:
        return None


def _lock_held(lock_path: Path) -> bool:
    """Whether a process holds `lock_path` now (probed without creating or writing it)."""
    if fcntl is None:  # Windows: the process check alone decides
        return False
    try:
        handle = lock_path.open("r")
    except OSError:
        return False  # no lock file: no build holds one
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return False


def _inside(path: Path, folder: Path) -> bool:
    try:
        Path(os.path.abspath(path)).relative_to(os.path.abspath(folder))
        return True
    except ValueError:
        return False


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
