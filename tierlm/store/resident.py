"""The resident store: every block in memory on the compute device, read from a compiled artifact
(`load_resident_artifact`) or built from a checkpoint (`load_resident`)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from tierlm.cache import codec
from tierlm.cache.artifact import Artifact
from tierlm.blocks import CheckpointLayout, expert_block
from tierlm.progress import Progress
from tierlm.weights.checkpoint import Checkpoint
from tierlm.weights.store import WeightStore


class ResidentStore(WeightStore):
    """Every block lives on the compute device for the life of the store."""

    def __init__(self, blocks: Mapping[str, Mapping[str, torch.Tensor]]):
        self._blocks = {name: dict(tensors) for name, tensors in blocks.items()}

    def acquire(self, block: str) -> Mapping[str, torch.Tensor]:
        return self._blocks[block]

    def release(self, block: str) -> None:
        pass

    @contextmanager
    def experts(self, layer: int, uses: Mapping[int, int]) -> Iterator[Mapping[int, Mapping[str, torch.Tensor]]]:
        blocks = self._blocks
        yield {expert: blocks[expert_block(layer, expert)] for expert in uses}

    def peek(self, block: str) -> Mapping[str, torch.Tensor] | None:
        return self._blocks.get(block)

    def resident_block(self, block: str) -> Mapping[str, torch.Tensor] | None:
        return self._blocks.get(block)

    def block_names(self) -> list[str]:
        return list(self._blocks)

    def nbytes(self) -> int:
        # Tied tensors appear in two blocks but occupy memory once.
        unique = {id(t): t for tensors in self._blocks.values() for t in tensors.values()}
        return sum(t.nbytes for t in unique.values())


def load_resident(
    checkpoint: Checkpoint,
    layout: CheckpointLayout,
    *,
    device="cpu",
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
) -> ResidentStore:
    """Build every block from the checkpoint, fusing multi-tensor entries, cast to `dtype`.

    Tensors read from the same checkpoint names (tied embedding and head) are shared.
    Peak memory is the model plus one tensor (when a cast is needed).
    """
    built: dict[tuple[str, ...], torch.Tensor] = {}
    blocks: dict[str, dict[str, torch.Tensor]] = {}
    for done, (block, entries) in enumerate(layout.items(), start=1):
        blocks[block] = {}
        for name, sources in entries.items():
            if sources not in built:
                built[sources] = _assemble(checkpoint, sources, device, dtype)
            blocks[block][name] = built[sources]
        if progress:
            progress(done, len(layout))
    return ResidentStore(blocks)


def _assemble(checkpoint: Checkpoint, sources: tuple[str, ...], device, dtype) -> torch.Tensor:
    return checkpoint.read_concat(sources).to(device=device, dtype=dtype)


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
