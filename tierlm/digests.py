"""Content hashes of source files (checkpoints, GGUFs), remembered so a multi-GB model is hashed once.

A file's sha256 over all of its bytes is remembered in `<cache>/digests/`, keyed by its resolved
path, together with the stamp it had when hashed: size, mtime, ctime and inode. While the stamp
is unchanged the remembered digest is reused; any write to the file changes its mtime and ctime,
so an in-place edit is hashed afresh. A file modified within SETTLE_NS of being hashed is not
remembered (a later write within one timestamp tick could keep the stamp), nor is one that
changed while it was read. A read-only cache simply remembers nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from tierlm.atomic import optional_write
from tierlm.paths import cache_root

HASH_CHUNK = 8 << 20
DIGESTS_DIR = "digests"
# Coarsest file timestamp tick in use (FAT: 2 s; ext4/tmpfs: one kernel tick).
SETTLE_NS = 2_000_000_000
_MEMO_FORMAT = 2  # 2: the stamp holds ctime_ns; format-1 memos are simply recomputed


def file_digest(path: Path) -> str:
    """sha256 of the file's bytes (hex), recomputed only when its stamp has changed."""
    path = Path(path).resolve()
    stamp = _stamp(path)
    memo = digest_memo_path(path)
    remembered = _recall(memo, stamp)
    if remembered is not None:
        return remembered
    started = time.time_ns()
    result = hash_file(path)
    if _stamp(path) == stamp and started - stamp["mtime_ns"] >= SETTLE_NS:
        _remember(memo, path, stamp, result)
    return result


def hash_file(path: Path) -> str:
    """sha256 (hex) of every byte of `path`, read in HASH_CHUNK pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def digest_memo_path(path: Path) -> Path:
    """Where the digest of the file at `path` (resolved) is remembered."""
    name = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:32]
    return cache_root() / DIGESTS_DIR / f"{name}.json"


def _stamp(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns, "inode": stat.st_ino}


def _recall(memo: Path, stamp: dict[str, int]) -> str | None:
    try:
        saved = json.loads(memo.read_text())
        if saved.get("format") == _MEMO_FORMAT and saved.get("stamp") == stamp:
            return str(saved["sha256"])
    except (OSError, ValueError, KeyError, AttributeError):
        pass  # none yet, or damaged: hash again
    return None


def _remember(memo: Path, path: Path, stamp: dict[str, int], digest: str) -> None:
    """Write the memo whole or not at all; the temporary's name is one stale sweeps know."""
    doc = {"format": _MEMO_FORMAT, "path": str(path), "stamp": stamp, "sha256": digest}
    tmp = memo.with_name(f".{memo.name}.partial-{os.getpid()}")
    with optional_write():
        memo.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, memo)
        finally:
            tmp.unlink(missing_ok=True)
