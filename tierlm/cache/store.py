"""Weight stores over a compiled artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from tierlm.cache import codec
from tierlm.cache.artifact import Artifact
from tierlm.progress import Progress
from tierlm.weights.store import ResidentStore


def load_resident_artifact(
    directory: Path, *, device="cpu", dtype=None, progress: Progress | None = None,
    only: Callable[[str], bool] | None = None,
) -> ResidentStore:
    """Every block of the artifact read once (one read per block) and decoded for `device`;
    `only`: just the blocks it accepts (a pipeline stage's), the others never read.

    Checksums are verified on worker threads while later blocks are read; the store is returned
    only once every block has passed. Aliased tensors (a tied head) are the same object as their
    target, so they cost nothing.
    """
    artifact = Artifact.open(directory)
    blocks: dict[str, dict] = {}
    names = [name for name in artifact.blocks if only is None or only(name)]
    try:
        for done, (name, raw) in enumerate(artifact.read_blocks(names), start=1):
            blocks[name] = {
                tensor: codec.decode(record, parts, device=device, dtype=dtype)
                for tensor, (record, parts) in raw.items()
            }
            for alias, (source_block, source_tensor) in artifact.blocks[name].alias_targets().items():
                blocks[name][alias] = blocks[source_block][source_tensor]
            if progress and done < len(names):
                progress(done, len(names))
    finally:
        artifact.close()
    if progress:  # "done" only once the last checksum has passed
        progress(len(names), len(names))
    return ResidentStore(blocks)
