"""Content hashes of checkpoints, remembered per file so a multi-GB model is hashed once.

A file's sha256 is stored under the cache root keyed by its absolute path, together with the
size, mtime and inode it had; while those are unchanged the stored hash is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tierlm.paths import cache_root

HASH_CHUNK = 8 << 20


def file_digest(path: Path) -> str:
    """sha256 of the file's bytes (hex), recomputed only when its size/mtime/inode change."""
    path = Path(path).resolve()
    stat = path.stat()
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
    memo = cache_root() / "digests" / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")
    try:
        saved = json.loads(memo.read_text())
        if saved.get("stamp") == stamp:
            return saved["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    result = digest.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"path": str(path), "stamp": stamp, "sha256": result}))
    os.replace(tmp, memo)
    return result


def checkpoint_digest(model_dir: Path) -> str:
    """One hash over a checkpoint's config.json and weight files (names and contents)."""
    model_dir = Path(model_dir)
    names = ["config.json", "model.safetensors.index.json"] + sorted(
        p.name for p in model_dir.glob("*.safetensors")
    )
    digest = hashlib.sha256()
    for name in names:
        path = model_dir / name
        if path.is_file():
            digest.update(f"{name}\0{file_digest(path)}\n".encode())
    return digest.hexdigest()
