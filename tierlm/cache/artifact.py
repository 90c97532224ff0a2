"""The compiled-artifact file format: one weights file with each block contiguous, plus a manifest.

Each block (a decoder layer, the embedding, the final norm, the head) occupies one 4 KiB-aligned
byte range of `weights.bin`, so a store can load or stream a block with one sequential read into
one buffer and take its tensors as views. `manifest.json` records, per block, the byte range, a
CRC32 of every 1 MiB chunk of it, and for every tensor its parts (e.g. an INT8 weight's `qweight`
and `scales`): dtype, shape, offset. A tensor stored elsewhere (a tied head) is recorded as an
alias of another block's tensor. Each block also records the sha256 of its bytes ("digest"), its
content address: blocks of equal digest are the same bytes, wherever they are stored (manifests
written before it lack it and stay readable).

A variant artifact (a base plus LoRA adapters) stores, per block its adapters change, only the
changed tensors; its manifest names its base artifact ("base", "base_key", a sibling directory
in the cache) and the blocks it shares whole ("shared": {block: digest}). `Artifact.open` on it
gives a `VariantArtifact`, which reads every block as a full conversion with those adapters
stores it: the base's bytes with the variant's tensors over their places, each part checked
against the checksums of the file it lives in.

Bytes from disk are untrusted: `Artifact.open` validates the whole manifest (types, ranges,
overlaps, encodings, and the model's block layout when config.json is beside it) before anything
is allocated (tierlm/cache/manifest.py: the records and their checks), and every block's bytes
are checked against their checksums on their first read. This module is the only reader of `weights.bin`; stores go through `Artifact`'s public methods.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

import torch

from tierlm.cache.encodings import check_record
# split_alias is re-exported: the artifact's readers parse alias targets with it.
from tierlm.cache.manifest import (  # noqa: F401
    BLOCK_ALIGN,
    CHECK_CHUNK,
    CHECKSUM,
    FORMAT_VERSION,
    MANIFEST_NAME,
    PART_ALIGN,
    WEIGHTS_NAME,
    BlockRecord,
    Malformed,
    PartRecord,
    TensorRecord,
    base_directory,
    block_to_json,
    check_variant,
    fix_hint,
    parse_manifest,
    read_manifest,
    split_alias,
    unusable,
)
from tierlm.device.host_pages import block_buffer
from tierlm.errors import TierlmError
from tierlm.models import family_description, read_config


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
        self._sums: _ChunkSums | None = None
        self._sha = None

    def begin_block(self, name: str) -> None:
        if self._current is not None:
            raise RuntimeError(f"block {self._current!r} is still open")
        self._pad_to(BLOCK_ALIGN)
        self._current, self._start = name, self._file.tell()
        self._tensors, self._aliases = {}, {}
        self._sums, self._sha = _ChunkSums(), hashlib.sha256()

    def add_tensor(self, name: str, encoding: str, parts: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> None:
        """Write `parts` (name -> CPU tensor) of one block tensor, each at a 64-byte boundary."""
        records = {}
        for part_name, tensor in parts.items():
            self._pad_to(PART_ALIGN)
            data = tensor.detach().contiguous().cpu()
            offset = self._file.tell() - self._start
            self._write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
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
        sums, digest = tuple(self._sums.finish()), self._sha.hexdigest()
        self._blocks[self._current] = BlockRecord(self._start, nbytes, self._tensors, self._aliases, sums, digest)
        self._current, self._sums, self._sha = None, None, None

    @property
    def blocks(self) -> Mapping[str, BlockRecord]:
        """The blocks written so far (a variant's manifest names their digests)."""
        return dict(self._blocks)

    def finish(self, header: Mapping[str, Any]) -> None:
        """Flush the weights and write the manifest (`header` adds model/source facts)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.tell()
        self._file.close()
        manifest = {
            "format_version": FORMAT_VERSION,
            **header,
            "weights_bytes": size,
            "checksum": {"algorithm": CHECKSUM, "chunk_bytes": CHECK_CHUNK},
            "blocks": {name: block_to_json(block) for name, block in self._blocks.items()},
        }
        (self.directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def _write(self, data) -> None:
        self._file.write(data)
        if self._sums is not None:
            self._sums.update(data)
            self._sha.update(data)

    def _pad_to(self, alignment: int) -> None:
        position = self._file.tell()
        if position % alignment:
            self._write(b"\0" * (alignment - position % alignment))


class Artifact:
    """A finished artifact directory: its validated manifest, and verified block reads.

    A block's checksums are checked on its first read and remembered, so a streamed block costs
    the check once per process; an embedding served row by row is checked a chunk at a time.
    """

    base: "Artifact | None" = None  # a variant's base artifact; None for a complete artifact

    def __init__(self, directory: Path, manifest: Mapping[str, Any]):
        """`manifest` as parsed from JSON; anything malformed is a TierlmError naming the fault."""
        self.directory = Path(directory)
        self.manifest = manifest
        try:
            self.blocks = parse_manifest(manifest, variant="base" in manifest)
        except Malformed as err:
            raise unusable(self.directory, f"manifest: {err}") from None
        self._verified: set[str] = set()
        self._verified_chunks: set[tuple[str, int]] = set()
        self._file = None
        self._file_lock = threading.Lock()

    @classmethod
    def open(cls, directory: Path, base: "Artifact | None" = None) -> "Artifact":
        """Validate and open `directory`; with config.json beside the manifest, its blocks must be
        exactly the model family's layout, each tensor in the shape config.json implies.

        A variant artifact opens as a VariantArtifact over its base: `base` when given (an open
        Artifact of that directory, so its reads and checks are shared), else opened here.
        """
        directory = Path(directory)
        manifest = read_manifest(directory)
        weights = directory / WEIGHTS_NAME
        artifact = VariantArtifact(directory, manifest, base) if "base" in manifest else cls(directory, manifest)
        if not weights.is_file() or weights.stat().st_size != manifest["weights_bytes"]:
            artifact.close()
            raise unusable(directory, "weights.bin is missing or has the wrong size")
        if (directory / "config.json").is_file():
            artifact._check_layout()
        return artifact

    @property
    def variant(self) -> bool:
        """Whether the manifest is a variant's (its blocks complete only over its base)."""
        return "base" in self.manifest

    @property
    def own_blocks(self) -> tuple[str, ...]:
        """The blocks stored in this directory's weights.bin (every block, but for a variant)."""
        return tuple(self.blocks)

    @property
    def own_bytes(self) -> int:
        """Bytes of weights this directory adds (all of them, but for a variant)."""
        return sum(self.blocks[name].nbytes for name in self.own_blocks)

    @property
    def weights_path(self) -> Path:
        return self.directory / WEIGHTS_NAME

    def source_block(self, name: str) -> str:
        """The block whose bytes block `name` uses: itself, or the one a tied head borrows from."""
        return self.blocks[name].borrowed_from or name

    # -- reading ------------------------------------------------------------------------------

    def read_bytes(self, name: str, into=None):
        """Block `name`'s bytes, uint8 [nbytes], checked against its checksums on the first read.

        `into`: an optional preallocated uint8 buffer of at least the block's size (a streaming
        ring slot, a pinned host buffer); by default a fresh buffer.
        """
        buffer = self._read_raw(name, into)
        if name not in self._verified:
            self._verify(name, buffer)
        return buffer

    def views(self, name: str, buffer) -> dict[str, tuple[TensorRecord, dict]]:
        """{tensor: (record, {part: view})} over `buffer`, which holds block `name`'s bytes."""
        return {
            tensor: (record, {part: _part_view(buffer, p) for part, p in record.parts.items()})
            for tensor, record in self.blocks[name].tensors.items()
        }

    def read_block(self, name: str, into=None) -> dict[str, tuple[TensorRecord, dict]]:
        """Read block `name` with one sequential read; returns {tensor: (record, {part: view})}."""
        return self.views(name, self.read_bytes(name, into))

    def read_blocks(self, names) -> Iterator[tuple[str, dict[str, tuple[TensorRecord, dict]]]]:
        """(name, views) for each block in order, each already checked against its checksums.

        Worker threads read and check blocks ahead of the caller (reads and zlib's CRC both
        release the GIL), so checking overlaps reading and the caller's decoding.
        """
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            futures = [(name, pool.submit(self.read_bytes, name)) for name in names]
            try:
                for name, future in futures:
                    yield name, self.views(name, future.result())
            finally:
                for _, future in futures:
                    future.cancel()

    def read_rows(self, block: str, tensor: str, rows: list[int], host=None) -> dict:
        """{part: rows of that part} of tensor `tensor`, e.g. embedding rows for token ids.

        `host`: the block's (already verified) bytes in memory; otherwise each row is read from
        disk after the chunks holding it are verified.
        """
        record = self.blocks[block].tensors[tensor]
        out = {}
        for part_name, part in record.parts.items():
            count = part.shape[0]
            bad = next((r for r in rows if not 0 <= r < count), None)
            if bad is not None:
                raise TierlmError(
                    f"row {bad} of {block}/{tensor} requested, but it has {count} rows",
                    "the tokenizer produces ids the model does not have; it does not match the model",
                )
            size = part.nbytes // count
            buffer = torch.empty(len(rows) * size, dtype=torch.uint8)
            for i, row in enumerate(rows):
                start, target = part.offset + row * size, buffer[i * size : (i + 1) * size]
                if host is not None:
                    target.copy_(host[start : start + size])
                else:
                    self._verify_range(block, start, size)
                    self._pread(target, self.blocks[block].offset + start, block)
            out[part_name] = buffer.view(getattr(torch, part.dtype)).reshape(len(rows), *part.shape[1:])
        return out

    def verify(self, progress=None) -> None:
        """Check every block against its checksums (TierlmError on the first mismatch).

        One reusable buffer of the largest block; `progress(done, total)` after each block.
        """
        largest = max((b.nbytes for b in self.blocks.values()), default=0)
        buffer = torch.empty(largest, dtype=torch.uint8)
        for done, name in enumerate(self.blocks, start=1):
            self._verify(name, self._read_raw(name, buffer))
            if progress:
                progress(done, len(self.blocks))

    def close(self) -> None:
        with self._file_lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    # -- internals ----------------------------------------------------------------------------

    def _read_raw(self, name: str, into=None):
        block = self.blocks[name]
        buffer = into if into is not None else block_buffer(block.nbytes)
        self._pread(buffer[: block.nbytes], block.offset, name)
        return buffer[: block.nbytes]

    def _pread(self, target, offset: int, block: str) -> None:
        """Fill the uint8 tensor `target` from weights.bin at `offset`, inside `block` (thread-safe:
        positional reads on one descriptor)."""
        view = memoryview(target.numpy())
        fd = self._fd()
        done = 0
        while done < len(view):
            count = os.preadv(fd, [view[done:]], offset + done)
            if count <= 0:
                raise unusable(self.directory, f"weights.bin ends inside block {block!r}, at byte {offset + done}")
            done += count

    def _fd(self) -> int:
        with self._file_lock:
            if self._file is None:
                self._file = open(self.weights_path, "rb", buffering=0)
            return self._file.fileno()

    def _verify(self, name: str, buffer) -> None:
        view = memoryview(buffer.numpy())
        for index, expected in enumerate(self.blocks[name].crc32):
            self._check_chunk(name, index, view[index * CHECK_CHUNK : (index + 1) * CHECK_CHUNK], expected)
        self._verified.add(name)

    def _verify_range(self, name: str, start: int, length: int) -> None:
        """Verify the chunks of block `name` that bytes [start, start + length) touch, once each."""
        if name in self._verified or length == 0:
            return
        block = self.blocks[name]
        for index in range(start // CHECK_CHUNK, (start + length - 1) // CHECK_CHUNK + 1):
            if (name, index) in self._verified_chunks:
                continue
            begin = index * CHECK_CHUNK
            chunk = torch.empty(min(CHECK_CHUNK, block.nbytes - begin), dtype=torch.uint8)
            self._pread(chunk, block.offset + begin, name)
            self._check_chunk(name, index, memoryview(chunk.numpy()), block.crc32[index])
            self._verified_chunks.add((name, index))

    def _check_chunk(self, name: str, index: int, data: memoryview, expected: int) -> None:
        if zlib.crc32(data) != expected:
            begin = index * CHECK_CHUNK
            raise TierlmError(
                f"artifact {self.directory} is corrupt: block {name!r} fails its checksum "
                f"(bytes {begin}..{begin + len(data)} of the block)",
                fix_hint(self.directory),
            )

    def _check_layout(self) -> None:
        """The blocks and tensors config.json's family expects, in its shapes, and nothing else."""
        config = read_config(self.directory)
        family = family_description(config)
        layout, shapes = family.checkpoint_layout(config), family.canonical_shapes(config)
        if set(layout) != set(self.blocks):
            missing, extra = sorted(set(layout) - set(self.blocks)), sorted(set(self.blocks) - set(layout))
            what = f"block {missing[0]!r} is missing" if missing else f"unexpected block {extra[0]!r}"
            raise unusable(self.directory, f"{what} for a {config.model_type} model of {config.num_hidden_layers} layers")
        for name, entries in layout.items():
            block = self.blocks[name]
            held = set(block.tensors) | set(block.aliases)
            if held != set(entries):
                missing = sorted(set(entries) - held) or sorted(held - set(entries))
                raise unusable(self.directory, f"block {name!r} does not hold exactly {sorted(entries)} ({missing[0]!r})")
            for tensor, record in block.tensors.items():
                problem = check_record(record, shapes.get(tensor))
                if problem:
                    raise unusable(self.directory, f"{name}/{tensor}: {problem}")


class VariantArtifact(Artifact):
    """A variant over its base artifact: every block of the model as a full conversion with its
    adapters would store it, from the base's blocks and the variant's own tensors.

    The variant's weights.bin holds, per block its adapters change, only the changed tensors,
    each encoded exactly as in a full `--lora` conversion (same parts, dtypes, shapes). Reading
    such a block reads the base's block (under the base's checksums) and writes the changed
    tensors' bytes (under the variant's) over their places in it, which gives the full
    conversion's block byte for byte; so `blocks` are the base's records. The manifest's
    "shared" {block: digest} names the base's untouched blocks with the digests the base records,
    and "base_key" must be the base manifest's key: a base rebuilt from other weights is refused.
    """

    def __init__(self, directory: Path, manifest: Mapping[str, Any], base: Artifact | None = None):
        # Not Artifact.__init__: every read goes to the base or to `_own`, this directory's file.
        self.directory, self.manifest = Path(directory), manifest
        self._own = Artifact(directory, manifest)
        self.stored = self._own.blocks  # the variant's own (partial) blocks, as its weights.bin holds them
        self.base = None
        self._closes_base = base is None
        self.base = self._open_base(base)
        try:
            check_variant(manifest, self.stored, self.base.blocks)
        except Malformed as err:
            self.close()
            raise unusable(self.directory, f"manifest: {err}") from None
        # The base's records: a changed block composes to the same layout, though not its digest.
        self.blocks = {
            name: replace(record, digest=None) if name in self.stored else record
            for name, record in self.base.blocks.items()
        }

    @property
    def own_blocks(self) -> tuple[str, ...]:
        return tuple(name for name in self.blocks if name in self.stored)

    @property
    def own_bytes(self) -> int:
        return sum(block.nbytes for block in self.stored.values())

    @property
    def shared_blocks(self) -> tuple[str, ...]:
        return tuple(name for name in self.blocks if name not in self.stored)

    def changed_tensors(self, block: str) -> tuple[str, ...]:
        """The tensors (and aliases) of `block` that differ from the base's; none for a shared block."""
        stored = self.stored.get(block)
        return (*stored.tensors, *stored.aliases) if stored is not None else ()

    def read_stored(self, name: str) -> dict[str, tuple[TensorRecord, dict]]:
        """Only the changed tensors of block `name`, {tensor: (record, {part: view})}, read from
        this directory alone (a store holding the base's block needs nothing else); {} if shared."""
        return self._own.read_block(name) if name in self.stored else {}

    def read_bytes(self, name: str, into=None):
        """Block `name`'s bytes as the full conversion stores them: the base's, with the
        variant's changed tensors written over their places (both checked on their reads)."""
        buffer = self.base.read_bytes(name, into)
        stored = self.stored.get(name)
        if stored is None or not stored.tensors:
            return buffer
        own = self._own.read_bytes(name)
        for tensor, record in stored.tensors.items():
            for part, source in record.parts.items():
                target = self.blocks[name].tensors[tensor].parts[part]
                span = slice(source.offset, source.offset + source.nbytes)
                buffer[target.offset : target.offset + target.nbytes].copy_(own[span])
        return buffer

    def read_rows(self, block: str, tensor: str, rows: list[int], host=None) -> dict:
        if host is not None:
            return super().read_rows(block, tensor, rows, host)
        holder = self._own if tensor in getattr(self.stored.get(block), "tensors", {}) else self.base
        return holder.read_rows(block, tensor, rows)

    def verify(self, progress=None) -> None:
        for done, name in enumerate(self.blocks, start=1):
            self.read_bytes(name)
            if progress:
                progress(done, len(self.blocks))

    def close(self) -> None:
        self._own.close()
        if self._closes_base and self.base is not None:
            self.base.close()

    def _open_base(self, base: Artifact | None) -> Artifact:
        key = self.manifest.get("base_key")
        where = base_directory(self.directory, self.manifest)
        if base is None:
            if not (where / MANIFEST_NAME).is_file():
                raise TierlmError(
                    f"variant artifact {self.directory} needs its base artifact {where}, which is gone",
                    "building the variant again (the same --lora) rebuilds its base; "
                    f"or remove it with `tierlm cache rm {self.directory.name}`",
                )
            try:
                base = Artifact.open(where)
            except TierlmError as err:
                why = f"variant artifact {self.directory}: its base is unusable: {err.message}"
                raise TierlmError(why, err.hint) from None
        elif Path(base.directory).resolve() != where.resolve():
            raise ValueError(f"{self.directory} is a variant of {where}, not of {base.directory}")
        if base.variant or base.manifest.get("key") != key:
            if self._closes_base:
                base.close()
            raise TierlmError(
                f"variant artifact {self.directory} was built over another {where} (base key {key!r})",
                f"remove it with `tierlm cache rm {self.directory.name}`; it is rebuilt on next use",
            )
        return base


class _ChunkSums:
    """CRC32 of each CHECK_CHUNK bytes of a block, fed the block's bytes in order."""

    def __init__(self):
        self.values: list[int] = []
        self._crc = 0
        self._filled = 0

    def update(self, data) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            take = min(len(data), CHECK_CHUNK - self._filled)
            self._crc = zlib.crc32(data[:take], self._crc)
            self._filled += take
            data = data[take:]
            if self._filled == CHECK_CHUNK:
                self.values.append(self._crc)
                self._crc, self._filled = 0, 0

    def finish(self) -> list[int]:
        if self._filled:
            self.values.append(self._crc)
            self._crc, self._filled = 0, 0
        return self.values


def _part_view(buffer, part: PartRecord):
    raw = buffer[part.offset : part.offset + part.nbytes]
    return raw.view(getattr(torch, part.dtype)).reshape(part.shape)
