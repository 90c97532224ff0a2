"""One content hash over a checkpoint directory: its config.json and weight files.

Each file's digest comes from tierlm.digests, which remembers it per file under the cache root.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tierlm.digests import file_digest
from tierlm.weights.import_record import read_import_record, weights_in_gguf

__all__ = ["checkpoint_digest", "file_digest"]


def checkpoint_digest(model_dir: Path) -> str:
    """One hash over a checkpoint's config.json and weight files (names and contents); a GGUF
    import's weight file is its GGUF, hashed already in the import's content key."""
    model_dir = Path(model_dir)
    record = read_import_record(model_dir)
    if weights_in_gguf(record):
        return hashlib.sha256(f"config.json\0{file_digest(model_dir / 'config.json')}\n"
                              f"gguf\0{record.get('source_key')}\n".encode()).hexdigest()  # fmt: skip
    names = ["config.json", "model.safetensors.index.json"] + sorted(
        p.name for p in model_dir.glob("*.safetensors")
    )
    digest = hashlib.sha256()
    for name in names:
        path = model_dir / name
        if path.is_file():
            digest.update(f"{name}\0{file_digest(path)}\n".encode())
    return digest.hexdigest()
