"""The compiled artifact's manifest: its format constants, block/tensor/part records, and the
validation every manifest passes before a byte of weights.bin is read (`read_manifest`,
`parse_manifest`), and the error an unusable artifact gives (tierlm/cache/artifact.py describes
the format and reads the blocks).

No torch here: the catalogue and the planner read manifests without loading any weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from tierlm.cache.encodings import check_record
from tierlm.errors import TierlmError
from tierlm.paths import cache_root

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
    digest: str | None = None  # sha256 of the block's bytes; None in manifests written before it

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


class Malformed(ValueError):
    """A manifest field that is not what the format says; becomes one TierlmError line."""


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest in `directory` as JSON, checked to be one of this format within its size
    bound (its records are `parse_manifest`'s to check); an `unusable` error otherwise. Reads
    nothing else: the planner sizes an artifact from it, `Artifact.open` goes on to the weights."""
    directory = Path(directory)
    try:
        if (directory / MANIFEST_NAME).stat().st_size > MAX_MANIFEST_BYTES:
            raise unusable(directory, f"manifest larger than {MAX_MANIFEST_BYTES >> 20} MiB")
        manifest = json.loads((directory / MANIFEST_NAME).read_bytes())
    except (OSError, ValueError, RecursionError) as err:
        raise unusable(directory, f"unreadable manifest: {err}") from None
    if not isinstance(manifest, dict):
        raise unusable(directory, f"manifest is a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise unusable(directory, f"format version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
    return manifest


def base_directory(directory: Path, manifest: Mapping[str, Any]) -> Path:
    """Where the base of the variant artifact in `directory` lies: the sibling its manifest names."""
    name = manifest.get("base")
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
        raise unusable(directory, f"manifest: base {name!r} is not an artifact directory name")
    return Path(directory).parent / name


def artifacts_root() -> Path:
    """The cache's artifacts directory: each conversion's artifact is a directory in it."""
    return cache_root() / ARTIFACTS_DIR


def fix_hint(directory: Path) -> str:
    """How to mend a damaged artifact: a cached one is removed and rebuilt on next use."""
    cached = directory.resolve().parent == artifacts_root().resolve()
    if cached:
        return f"remove it with `tierlm cache rm {directory.name}`; it is rebuilt on next use"
    return "delete the directory and rebuild it with `tierlm convert`"


def unusable(directory: Path, why: str) -> TierlmError:
    """The one error for an artifact that cannot be read as its format says."""
    return TierlmError(f"artifact {directory} is unusable ({why})", fix_hint(directory))


def parse_manifest(manifest: Mapping[str, Any], variant: bool = False) -> dict[str, BlockRecord]:
    """Every block record, checked against the manifest's own facts before any byte is read
    (a variant's own blocks: it may have none, when its adapters change nothing)."""
    size = _count(manifest.get("weights_bytes"), "weights_bytes")
    checksum = manifest.get("checksum")
    if checksum != {"algorithm": CHECKSUM, "chunk_bytes": CHECK_CHUNK}:
        raise Malformed(f"checksum {checksum!r}, expected {CHECKSUM} over {CHECK_CHUNK}-byte chunks")
    raw_blocks = _mapping(manifest.get("blocks"), "blocks")
    blocks = {str(name): _block(str(name), raw, size) for name, raw in raw_blocks.items()}
    if not blocks and not variant:
        raise Malformed("no blocks")
    _no_overlap([(b.offset, b.nbytes, f"block {n!r}") for n, b in blocks.items()])
    earlier: dict[str, BlockRecord] = {}
    for name, block in blocks.items():
        for alias, target in block.aliases.items():
            source, tensor = split_alias(target)
            if alias in block.tensors or tensor not in getattr(earlier.get(source), "tensors", {}):
                raise Malformed(f"block {name!r}: alias {alias!r} -> {target!r} does not name an earlier block's tensor")
        earlier[name] = block
    return blocks


def _block(name: str, raw: Any, weights_bytes: int) -> BlockRecord:
    raw = _mapping(raw, f"block {name!r}")
    offset = _count(raw.get("offset"), f"block {name!r} offset")
    nbytes = _count(raw.get("nbytes"), f"block {name!r} nbytes")
    if offset + nbytes > weights_bytes:
        raise Malformed(
            f"block {name!r} spans bytes {offset}..{offset + nbytes}, past the end of weights.bin ({weights_bytes})"
        )
    sums = raw.get("crc32")
    if not isinstance(sums, list) or len(sums) != -(-nbytes // CHECK_CHUNK):
        raise Malformed(f"block {name!r} has no checksum per {CHECK_CHUNK}-byte chunk")
    if not all(_is_count(v) and v < 1 << 32 for v in sums):
        raise Malformed(f"block {name!r} has checksums that are not 32-bit values")
    digest = raw.get("digest")
    if digest is not None and not _is_digest(digest):
        raise Malformed(f"block {name!r} has digest {digest!r}, not a sha256 in hex")
    tensors = {}
    for tensor, t in _mapping(raw.get("tensors"), f"block {name!r} tensors").items():
        record = _tensor(f"{name}/{tensor}", t, nbytes)
        problem = check_record(record)
        if problem:
            raise Malformed(f"{name}/{tensor}: {problem}")
        tensors[str(tensor)] = record
    aliases = _mapping(raw.get("aliases", {}), f"block {name!r} aliases")
    if not all(isinstance(v, str) for v in aliases.values()):
        raise Malformed(f"block {name!r} has aliases that are not 'block/tensor' strings")
    return BlockRecord(offset, nbytes, tensors, {str(k): v for k, v in aliases.items()}, tuple(sums), digest)


def _tensor(what: str, raw: Any, block_bytes: int) -> TensorRecord:
    raw = _mapping(raw, what)
    encoding, meta = raw.get("encoding"), raw.get("meta", {})
    if not isinstance(encoding, str):
        raise Malformed(f"{what} has encoding {encoding!r}")
    parts = {str(p): _part(f"{what}.{p}", r, block_bytes) for p, r in _mapping(raw.get("parts"), f"{what} parts").items()}
    _no_overlap([(p.offset, p.nbytes, f"part {what}.{n}") for n, p in parts.items()])
    return TensorRecord(encoding, parts, _mapping(meta, f"{what} meta"))


def _part(what: str, raw: Any, block_bytes: int) -> PartRecord:
    raw = _mapping(raw, what)
    offset, nbytes = _count(raw.get("offset"), f"{what} offset"), _count(raw.get("nbytes"), f"{what} nbytes")
    dtype, shape = raw.get("dtype"), raw.get("shape")
    if dtype not in PART_DTYPES:
        raise Malformed(f"{what} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise Malformed(f"{what} has shape {shape!r}, not a list of non-negative integers")
    if nbytes != math.prod(shape) * PART_DTYPES[dtype]:
        raise Malformed(f"{what} is {nbytes} bytes, but {dtype}{shape} needs {math.prod(shape) * PART_DTYPES[dtype]}")
    if offset % PART_ALIGN or offset + nbytes > block_bytes:
        raise Malformed(
            f"{what} at bytes {offset}..{offset + nbytes} is misaligned or outside its {block_bytes}-byte block"
        )
    return PartRecord(offset, nbytes, dtype, tuple(shape))


def _no_overlap(spans: list[tuple[int, int, str]]) -> None:
    """(offset, nbytes, label) ranges must not share a byte (empty ones share nothing)."""
    ordered = sorted(s for s in spans if s[1])
    for (start, size, first), (next_start, _, second) in zip(ordered, ordered[1:]):
        if next_start < start + size:
            raise Malformed(f"{first} and {second} overlap")


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise Malformed(f"{what} is a {type(value).__name__}, not an object")
    return value


def _count(value: Any, what: str) -> int:
    if not _is_count(value):
        raise Malformed(f"{what} is {value!r}, not a non-negative integer")
    return value


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_variant(manifest: Mapping[str, Any], stored: Mapping[str, BlockRecord],
                  base_blocks: Mapping[str, BlockRecord]) -> None:
    """A variant's own blocks (`stored`) against its base's: every stored tensor fits its place
    in the base's block exactly; the manifest's "shared" names the rest, with the base's digests."""
    for name, own in stored.items():
        block = base_blocks.get(name)
        if block is None:
            raise Malformed(f"block {name!r} is not a block of the base")
        for tensor, record in own.tensors.items():
            place = block.tensors.get(tensor)
            if place is None or place.encoding != record.encoding or dict(place.meta) != dict(record.meta):
                raise Malformed(f"{name}/{tensor} is not stored as the base stores it")
            if _part_shapes(place) != _part_shapes(record):
                raise Malformed(f"{name}/{tensor} has other parts than the base's")
        for alias, target in own.aliases.items():
            if block.aliases.get(alias) != target:
                raise Malformed(f"block {name!r}: alias {alias!r} is not the base's")
    shared = _mapping(manifest.get("shared"), "shared")
    expected = [name for name in base_blocks if name not in stored]
    if sorted(shared) != sorted(expected):
        odd = sorted(set(shared) ^ set(expected))
        raise Malformed(f"block {odd[0]!r} is not exactly one of stored or shared")
    for name, digest in shared.items():
        recorded = base_blocks[name].digest
        if digest is not None and not _is_digest(digest):
            raise Malformed(f"shared block {name!r} has digest {digest!r}, not a sha256 in hex")
        if digest and recorded and digest != recorded:
            raise Malformed(f"shared block {name!r} has other bytes in the base than the variant was built over")


def _part_shapes(record: TensorRecord) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (part.dtype, part.shape) for name, part in record.parts.items()}


def block_to_json(block: BlockRecord) -> dict:
    return {
        "offset": block.offset,
        "nbytes": block.nbytes,
        "crc32": list(block.crc32),
        **({"digest": block.digest} if block.digest else {}),
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
