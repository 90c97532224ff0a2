"""The compiled-artifact file format: one weights file with each block contiguous, plus a manifest.

Each block (a decoder layer, the embedding, the final norm, the head) occupies one 4 KiB-aligned
byte range of `weights.bin`, so a store can load or stream a block with one sequential read into
one buffer and take its tensors as views. `manifest.json` records, per block, the byte range, a
CRC32 of every 1 MiB chunk of it, and for every tensor its parts (e.g. an INT8 weight's `qweight`
and `scales`): dtype, shape, offset. A tensor stored elsewhere (a tied head) is recorded as an
alias of another block's tensor.

Bytes from disk are untrusted: `Artifact.open` validates the whole manifest (types, ranges,
overlaps, encodings, and the model's block layout when config.json is beside it) before anything
is allocated, and every block's bytes are checked against their checksums on their first read.
This module is the only reader of `weights.bin`; stores go through `Artifact`'s public methods.
"""

from __future__ import annotations

import json
import math
import os
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from tierlm.errors import TierlmError

FORMAT_VERSION = 2  # 2: a CRC32 per chunk of every block
BLOCK_ALIGN = 4096  # page size: streamed reads start on a page, O_DIRECT-friendly
PART_ALIGN = 64  # cache line: every part is a valid view for any element size
CHECK_CHUNK = 1 << 20  # checksum granularity: an embedding row is verified by reading 1 MiB, not the block
CHECKSUM = "crc32"  # zlib's: ~1 GB/s on one core and it releases the GIL, so verifying overlaps reading
MANIFEST_NAME = "manifest.json"
WEIGHTS_NAME = "weights.bin"
ARTIFACTS_DIR = "artifacts"  # under the cache root
MAX_MANIFEST_BYTES = 64 << 20  # a 70B model's manifest is well under 1 MiB
# Part dtypes a manifest may name, with their sizes (no torch import needed to validate).
PART_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}


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
    aliases: Mapping[str, str] = field(default_factory=dict)  # name -> "block/tensor" (split_alias)
    crc32: tuple[int, ...] = ()  # one per CHECK_CHUNK bytes of the block, the last one shorter

    def alias_targets(self) -> dict[str, tuple[str, str]]:
        """{alias: (block, tensor)}: each name this block takes from an earlier block's tensor."""
        return {alias: split_alias(target) for alias, target in self.aliases.items()}

    @property
    def borrowed_from(self) -> str | None:
        """The block whose bytes this one reads when it holds only aliases (a tied head), else None."""
        if self.aliases and not self.tensors:
            return split_alias(next(iter(self.aliases.values())))[0]
        return None


def split_alias(target: str) -> tuple[str, str]:
    """An alias target as the manifest records it, "block/tensor" -> (block, tensor); the one parser."""
    block, _, tensor = target.partition("/")
    return block, tensor


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

    def begin_block(self, name: str) -> None:
        if self._current is not None:
            raise RuntimeError(f"block {self._current!r} is still open")
        self._pad_to(BLOCK_ALIGN)
        self._current, self._start = name, self._file.tell()
        self._tensors, self._aliases = {}, {}
        self._sums = _ChunkSums()

    def add_tensor(self, name: str, encoding: str, parts: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> None:
        """Write `parts` (name -> CPU tensor) of one block tensor, each at a 64-byte boundary."""
        records = {}
        for part_name, tensor in parts.items():
            self._pad_to(PART_ALIGN)
            data = tensor.detach().contiguous().cpu()
            offset = self._file.tell() - self._start
            self._write(memoryview(data.reshape(-1).view(_uint8()).numpy()))
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
        sums = tuple(self._sums.finish())
        self._blocks[self._current] = BlockRecord(self._start, nbytes, self._tensors, self._aliases, sums)
        self._current, self._sums = None, None

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
            "blocks": {name: _block_to_json(block) for name, block in self._blocks.items()},
        }
        (self.directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def _write(self, data) -> None:
        self._file.write(data)
        if self._sums is not None:
            self._sums.update(data)

    def _pad_to(self, alignment: int) -> None:
        position = self._file.tell()
        if position % alignment:
            self._write(b"\0" * (alignment - position % alignment))


class Artifact:
    """A finished artifact directory: its validated manifest, and verified block reads.

    A block's checksums are checked on its first read and remembered, so a streamed block costs
    the check once per process; an embedding served row by row is checked a chunk at a time.
    """

    def __init__(self, directory: Path, manifest: Mapping[str, Any]):
        """`manifest` as parsed from JSON; anything malformed is a TierlmError naming the fault."""
        self.directory = Path(directory)
        self.manifest = manifest
        try:
            self.blocks = _parse_manifest(manifest)
        except _Malformed as err:
            raise _corrupt(self.directory, f"manifest: {err}") from None
        self._verified: set[str] = set()
        self._verified_chunks: set[tuple[str, int]] = set()
        self._file = None
        self._file_lock = threading.Lock()

    @classmethod
    def open(cls, directory: Path) -> "Artifact":
        """Validate and open `directory`; with config.json beside the manifest, its blocks must be
        exactly the model family's layout, each tensor in the shape config.json implies."""
        directory = Path(directory)
        try:
            if (directory / MANIFEST_NAME).stat().st_size > MAX_MANIFEST_BYTES:
                raise _corrupt(directory, f"manifest larger than {MAX_MANIFEST_BYTES >> 20} MiB")
            manifest = json.loads((directory / MANIFEST_NAME).read_bytes())
        except (OSError, ValueError, RecursionError) as err:
            raise _corrupt(directory, f"unreadable manifest: {err}") from None
        if not isinstance(manifest, dict):
            raise _corrupt(directory, f"manifest is a JSON {type(manifest).__name__}, not an object")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise _corrupt(directory, f"format version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
        artifact = cls(directory, manifest)
        weights = directory / WEIGHTS_NAME
        if not weights.is_file() or weights.stat().st_size != manifest["weights_bytes"]:
            raise _corrupt(directory, "weights.bin is missing or has the wrong size")
        if (directory / "config.json").is_file():
            artifact._check_layout()
        return artifact

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
        from concurrent.futures import ThreadPoolExecutor

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
        import torch

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
        import torch

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
        import torch

        block = self.blocks[name]
        buffer = into if into is not None else torch.empty(block.nbytes, dtype=torch.uint8)
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
                raise _corrupt(self.directory, f"weights.bin ends inside block {block!r}, at byte {offset + done}")
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
        import torch

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
                _fix_hint(self.directory),
            )

    def _check_layout(self) -> None:
        """The blocks and tensors config.json's family expects, in its shapes, and nothing else."""
        from tierlm.cache import codec
        from tierlm.config import ModelConfig
        from tierlm.models import family_class

        config = ModelConfig.from_dir(self.directory)
        family = family_class(config)
        layout, shapes = family.checkpoint_layout(config), family.canonical_shapes(config)
        if set(layout) != set(self.blocks):
            missing, extra = sorted(set(layout) - set(self.blocks)), sorted(set(self.blocks) - set(layout))
            what = f"block {missing[0]!r} is missing" if missing else f"unexpected block {extra[0]!r}"
            raise _corrupt(self.directory, f"{what} for a {config.model_type} model of {config.num_hidden_layers} layers")
        for name, entries in layout.items():
            block = self.blocks[name]
            held = set(block.tensors) | set(block.aliases)
            if held != set(entries):
                missing = sorted(set(entries) - held) or sorted(held - set(entries))
                raise _corrupt(self.directory, f"block {name!r} does not hold exactly {sorted(entries)} ({missing[0]!r})")
            for tensor, record in block.tensors.items():
                problem = codec.check_record(record, shapes.get(tensor))
                if problem:
                    raise _corrupt(self.directory, f"{name}/{tensor}: {problem}")


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


class _Malformed(ValueError):
    """A manifest field that is not what the format says; becomes one TierlmError line."""


def _parse_manifest(manifest: Mapping[str, Any]) -> dict[str, BlockRecord]:
    """Every block record, checked against the manifest's own facts before any byte is read."""
    size = _count(manifest.get("weights_bytes"), "weights_bytes")
    checksum = manifest.get("checksum")
    if checksum != {"algorithm": CHECKSUM, "chunk_bytes": CHECK_CHUNK}:
        raise _Malformed(f"checksum {checksum!r}, expected {CHECKSUM} over {CHECK_CHUNK}-byte chunks")
    raw_blocks = _mapping(manifest.get("blocks"), "blocks")
    blocks = {str(name): _block(str(name), raw, size) for name, raw in raw_blocks.items()}
    if not blocks:
        raise _Malformed("no blocks")
    _no_overlap([(b.offset, b.nbytes, f"block {n!r}") for n, b in blocks.items()])
    earlier: dict[str, BlockRecord] = {}
    for name, block in blocks.items():
        for alias, target in block.aliases.items():
            source, tensor = split_alias(target)
            if alias in block.tensors or tensor not in getattr(earlier.get(source), "tensors", {}):
                raise _Malformed(f"block {name!r}: alias {alias!r} -> {target!r} does not name an earlier block's tensor")
        earlier[name] = block
    return blocks


def _block(name: str, raw: Any, weights_bytes: int) -> BlockRecord:
    from tierlm.cache import codec

    raw = _mapping(raw, f"block {name!r}")
    offset = _count(raw.get("offset"), f"block {name!r} offset")
    nbytes = _count(raw.get("nbytes"), f"block {name!r} nbytes")
    if offset + nbytes > weights_bytes:
        raise _Malformed(
            f"block {name!r} spans bytes {offset}..{offset + nbytes}, past the end of weights.bin ({weights_bytes})"
        )
    sums = raw.get("crc32")
    if not isinstance(sums, list) or len(sums) != -(-nbytes // CHECK_CHUNK):
        raise _Malformed(f"block {name!r} has no checksum per {CHECK_CHUNK}-byte chunk")
    if not all(_is_count(v) and v < 1 << 32 for v in sums):
        raise _Malformed(f"block {name!r} has checksums that are not 32-bit values")
    tensors = {}
    for tensor, t in _mapping(raw.get("tensors"), f"block {name!r} tensors").items():
        record = _tensor(f"{name}/{tensor}", t, nbytes)
        problem = codec.check_record(record)
        if problem:
            raise _Malformed(f"{name}/{tensor}: {problem}")
        tensors[str(tensor)] = record
    aliases = _mapping(raw.get("aliases", {}), f"block {name!r} aliases")
    if not all(isinstance(v, str) for v in aliases.values()):
        raise _Malformed(f"block {name!r} has aliases that are not 'block/tensor' strings")
    return BlockRecord(offset, nbytes, tensors, {str(k): v for k, v in aliases.items()}, tuple(sums))


def _tensor(what: str, raw: Any, block_bytes: int) -> TensorRecord:
    raw = _mapping(raw, what)
    encoding, meta = raw.get("encoding"), raw.get("meta", {})
    if not isinstance(encoding, str):
        raise _Malformed(f"{what} has encoding {encoding!r}")
    parts = {str(p): _part(f"{what}.{p}", r, block_bytes) for p, r in _mapping(raw.get("parts"), f"{what} parts").items()}
    _no_overlap([(p.offset, p.nbytes, f"part {what}.{n}") for n, p in parts.items()])
    return TensorRecord(encoding, parts, _mapping(meta, f"{what} meta"))


def _part(what: str, raw: Any, block_bytes: int) -> PartRecord:
    raw = _mapping(raw, what)
    offset, nbytes = _count(raw.get("offset"), f"{what} offset"), _count(raw.get("nbytes"), f"{what} nbytes")
    dtype, shape = raw.get("dtype"), raw.get("shape")
    if dtype not in PART_DTYPES:
        raise _Malformed(f"{what} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _Malformed(f"{what} has shape {shape!r}, not a list of non-negative integers")
    if nbytes != math.prod(shape) * PART_DTYPES[dtype]:
        raise _Malformed(f"{what} is {nbytes} bytes, but {dtype}{shape} needs {math.prod(shape) * PART_DTYPES[dtype]}")
    if offset % PART_ALIGN or offset + nbytes > block_bytes:
        raise _Malformed(
            f"{what} at bytes {offset}..{offset + nbytes} is misaligned or outside its {block_bytes}-byte block"
        )
    return PartRecord(offset, nbytes, dtype, tuple(shape))


def _no_overlap(spans: list[tuple[int, int, str]]) -> None:
    """(offset, nbytes, label) ranges must not share a byte (empty ones share nothing)."""
    ordered = sorted(s for s in spans if s[1])
    for (start, size, first), (next_start, _, second) in zip(ordered, ordered[1:]):
        if next_start < start + size:
            raise _Malformed(f"{first} and {second} overlap")


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise _Malformed(f"{what} is a {type(value).__name__}, not an object")
    return value


def _count(value: Any, what: str) -> int:
    if not _is_count(value):
        raise _Malformed(f"{what} is {value!r}, not a non-negative integer")
    return value


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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
        "crc32": list(block.crc32),
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


def _fix_hint(directory: Path) -> str:
    from tierlm.paths import cache_root

    cached = directory.resolve().parent == (cache_root() / ARTIFACTS_DIR).resolve()
    if cached:
        return f"remove it with `tierlm cache rm {directory.name}`; it is rebuilt on next use"
    return "delete the directory and rebuild it with `tierlm convert`"


def _corrupt(directory: Path, why: str) -> TierlmError:
    return TierlmError(f"artifact {directory} is unusable ({why})", _fix_hint(directory))
