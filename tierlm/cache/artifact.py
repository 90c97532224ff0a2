"""The compiled-artifact file format: one weights file with each block contiguous, plus a manifest.

Each block (a decoder layer, the embedding, the final norm, the head) occupies one 4 KiB-aligned
byte range of `weights.bin`, so a store can load or stream a block with one sequential read into
one buffer and take its tensors as views. `manifest.json` records, per block, the byte range and
for every tensor its parts (e.g. an INT8 weight's `qweight` and `scales`): dtype, shape, offset.
A tensor stored elsewhere (a tied head) is recorded as an alias of another block's tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from tierlm.errors import TierlmError

FORMAT_VERSION = 1
BLOCK_ALIGN = 4096  # page size: streamed reads start on a page, O_DIRECT-friendly
PART_ALIGN = 64  # cache line: every part is a valid view for any element size
MANIFEST_NAME = "manifest.json"
WEIGHTS_NAME = "weights.bin"


@dataclass(frozen=True)
class PartRecord:
    """One raw tensor inside a block: offset is relative to the block's start."""

    offset: int
    nbytes: int
    dtype: str  # torch dtype name, e.g. "int8", "float32"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorRecord:
    """A block tensor as stored: its encoding (`plain`, `int8`, ...), parts and encoding metadata."""

    encoding: str
    parts: Mapping[str, PartRecord]
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BlockRecord:
    offset: int
    nbytes: int
    tensors: Mapping[str, TensorRecord]
    aliases: Mapping[str, str] = field(default_factory=dict)  # name -> "block/tensor"


class ArtifactWriter:
    """Appends blocks to `weights.bin`; `finish` writes the manifest that makes them readable."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._file = open(self.directory / WEIGHTS_NAME, "wb")
        self._blocks: dict[str, BlockRecord] = {}
        self._current: str | None = None
        self._start = 0
        self._tensors: dict[str, TensorRecord] = {}
        self._aliases: dict[str, str] = {}

    def begin_block(self, name: str) -> None:
        if self._current is not None:
            raise RuntimeError(f"block {self._current!r} is still open")
        self._pad_to(BLOCK_ALIGN)
        self._current, self._start = name, self._file.tell()
        self._tensors, self._aliases = {}, {}

    def add_tensor(self, name: str, encoding: str, parts: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> None:
        """Write `parts` (name -> CPU tensor) of one block tensor, each at a 64-byte boundary."""
        records = {}
        for part_name, tensor in parts.items():
            self._pad_to(PART_ALIGN)
            data = tensor.detach().contiguous().cpu()
            offset = self._file.tell() - self._start
            self._file.write(memoryview(data.reshape(-1).view(_uint8()).numpy()))
            records[part_name] = PartRecord(
                offset, data.nbytes, str(data.dtype).removeprefix("torch."), tuple(data.shape)
            )
        self._tensors[name] = TensorRecord(encoding, records, dict(meta or {}))

    def add_alias(self, name: str, block: str, tensor: str) -> None:
        """`name` in this block is the tensor `tensor` of the earlier block `block` (tied weights)."""
        if tensor not in self._blocks.get(block, BlockRecord(0, 0, {})).tensors:
            raise RuntimeError(f"alias target {block}/{tensor} has not been written")
        self._aliases[name] = f"{block}/{tensor}"

    def end_block(self) -> None:
        nbytes = self._file.tell() - self._start
        self._blocks[self._current] = BlockRecord(self._start, nbytes, self._tensors, self._aliases)
        self._current = None

    def finish(self, header: Mapping[str, Any]) -> None:
        """Flush the weights and write the manifest (`header` adds model/source facts)."""
        import os

        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.tell()
        self._file.close()
        manifest = {
            "format_version": FORMAT_VERSION,
            **header,
            "weights_bytes": size,
            "blocks": {name: _block_to_json(block) for name, block in self._blocks.items()},
        }
        (self.directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def _pad_to(self, alignment: int) -> None:
        position = self._file.tell()
        if position % alignment:
            self._file.write(b"\0" * (alignment - position % alignment))


class Artifact:
    """A finished artifact directory: its manifest, and block reads into owned buffers."""

    def __init__(self, directory: Path, manifest: Mapping[str, Any]):
        self.directory = Path(directory)
        self.manifest = manifest
        self.blocks = {name: _block_from_json(raw) for name, raw in manifest["blocks"].items()}

    @classmethod
    def open(cls, directory: Path) -> "Artifact":
        directory = Path(directory)
        try:
            manifest = json.loads((directory / MANIFEST_NAME).read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
            raise _corrupt(directory, f"unreadable manifest: {err}") from None
        if manifest.get("format_version") != FORMAT_VERSION:
            raise _corrupt(directory, f"format version {manifest.get('format_version')}, expected {FORMAT_VERSION}")
        weights = directory / WEIGHTS_NAME
        if not weights.is_file() or weights.stat().st_size != manifest.get("weights_bytes"):
            raise _corrupt(directory, "weights.bin is missing or has the wrong size")
        return cls(directory, manifest)

    @property
    def weights_path(self) -> Path:
        return self.directory / WEIGHTS_NAME

    def read_block(self, name: str, into=None) -> dict[str, tuple[TensorRecord, dict]]:
        """Read block `name` with one sequential read; returns {tensor: (record, {part: view})}.

        `into`: an optional preallocated uint8 buffer of at least the block's size (a streaming
        ring slot); by default a fresh buffer owned by the returned views.
        """
        import torch

        block = self.blocks[name]
        buffer = into if into is not None else torch.empty(block.nbytes, dtype=torch.uint8)
        view = memoryview(buffer[: block.nbytes].numpy())
        with open(self.weights_path, "rb", buffering=0) as handle:
            handle.seek(block.offset)
            done = 0
            while done < block.nbytes:
                count = handle.readinto(view[done:])
                if not count:
                    raise _corrupt(self.directory, f"weights.bin ends inside block {name!r}")
                done += count
        return {
            tensor: (record, {part: _part_view(buffer, p) for part, p in record.parts.items()})
            for tensor, record in block.tensors.items()
        }


def _part_view(buffer, part: PartRecord):
    import torch

    raw = buffer[part.offset : part.offset + part.nbytes]
    return raw.view(getattr(torch, part.dtype)).reshape(part.shape)


def _uint8():
    import torch

    return torch.uint8


def _block_to_json(block: BlockRecord) -> dict:
    return {
        "offset": block.offset,
        "nbytes": block.nbytes,
        "tensors": {
            name: {
                "encoding": t.encoding,
                "meta": dict(t.meta),
                "parts": {
                    p: {"offset": r.offset, "nbytes": r.nbytes, "dtype": r.dtype, "shape": list(r.shape)}
                    for p, r in t.parts.items()
                },
            }
            for name, t in block.tensors.items()
        },
        "aliases": dict(block.aliases),
    }


def _block_from_json(raw: Mapping[str, Any]) -> BlockRecord:
    tensors = {
        name: TensorRecord(
            t["encoding"],
            {p: PartRecord(r["offset"], r["nbytes"], r["dtype"], tuple(r["shape"])) for p, r in t["parts"].items()},
            t.get("meta", {}),
        )
        for name, t in raw["tensors"].items()
    }
    return BlockRecord(raw["offset"], raw["nbytes"], tensors, raw.get("aliases", {}))


def _corrupt(directory: Path, why: str) -> TierlmError:
    return TierlmError(
        f"artifact {directory} is unusable ({why})",
        f"remove it with `tierlm cache rm {directory.name}`; it is rebuilt on next use",
    )
