"""Where each tensor of a safetensors checkpoint lies, from headers validated whole.

Bytes from disk are untrusted until their sizes, offsets and dtypes add up (see `file_entries`).
No tensor is read here and torch is not imported: `tierlm list` counts parameters with this
module; tierlm/weights/checkpoint.py reads the tensors.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tierlm.errors import TierlmError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CHECKPOINT_HINT = "re-download or re-import the model"
# The safetensors library refuses larger headers too; a real one is a few hundred KB.
MAX_HEADER_BYTES = 100 << 20

# safetensors dtype codes -> (torch dtype name, bytes per element)
DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U8": ("uint8", 1), "BOOL": ("bool", 1),
}  # fmt: skip
FLOAT_CODES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: file, absolute byte range, dtype code, shape."""

    path: Path
    start: int
    end: int
    dtype: str
    shape: tuple[int, ...]


def checkpoint_entries(model_dir: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint in `model_dir` (single file or sharded), by name."""
    entries: dict[str, TensorEntry] = {}
    files = _tensor_files(model_dir)
    for path in sorted(set(files.values())):
        for name, entry in file_entries(path).items():
            if name in entries:
                raise corrupt_file(path, f"tensor {name!r} is also in {entries[name].path.name}")
            entries[name] = entry
    missing = sorted(set(files) - set(entries))
    if missing:
        raise TierlmError(
            f"{INDEX_NAME} lists {missing[0]!r} but its shard does not contain it",
            "the checkpoint is inconsistent; re-download it",
        )
    return entries


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    index = model_dir / INDEX_NAME
    if index.is_file():
        files = {name: _shard_path(model_dir, shard) for name, shard in _weight_map(index).items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise TierlmError(
                    f"checkpoint shard {shard.name} listed in {INDEX_NAME} is missing",
                    "the download is incomplete; fetch the missing file",
                )
        return files
    single = model_dir / SINGLE_NAME
    if single.is_file():
        return {name: single for name in file_entries(single)}
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise TierlmError(
            f"{model_dir} holds only pickled (.bin/.pt) weights",
            "tierlm reads safetensors only, since unpickling can run code; convert the "
            "checkpoint to safetensors first",
        )
    raise TierlmError(
        f"no {SINGLE_NAME} or {INDEX_NAME} in {model_dir}",
        "pass --model a Hugging Face model directory with safetensors weights",
    )


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise TierlmError(f"{index} is not a valid safetensors index: {err!r}", CHECKPOINT_HINT) from None
    valid = isinstance(weight_map, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    )
    if not valid:
        raise TierlmError(
            f"{index} is not a valid safetensors index: weight_map must map names to file names", CHECKPOINT_HINT
        )
    return weight_map


def _shard_path(model_dir: Path, shard: str) -> Path:
    """`shard` inside `model_dir`; a path that climbs out (`..`, absolute) is refused.

    Judged on the name, not on the resolved file: Hugging Face's cache links shards to blobs
    outside the snapshot directory, and those links are the user's own.
    """
    parts = PurePosixPath(shard.replace("\\", "/")).parts
    if not parts or shard.startswith(("/", "\\")) or ".." in parts or ":" in parts[0]:
        raise TierlmError(
            f"{model_dir / INDEX_NAME} names shard {shard!r}, which lies outside the model directory",
            "a checkpoint's shards must be files inside its directory; the index is corrupt or malicious",
        )
    return model_dir.joinpath(*parts)


def file_entries(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, each checked against the file before any is read.

    Offsets must cover exactly shape x dtype size, lie inside the data section, and not overlap;
    shapes are lists of non-negative ints; dtypes are known.
    """
    header, data_start, data_len = _header(path)
    entries = {name: _entry(path, name, meta, data_start, data_len) for name, meta in header.items()}
    spans = sorted((e.start, e.end, n) for n, e in entries.items() if e.end > e.start)
    for (_, end, before), (start, _, after) in zip(spans, spans[1:]):
        if start < end:
            raise corrupt_file(path, f"tensors {before!r} and {after!r} overlap")
    return entries


def _entry(path: Path, name: str, meta, data_start: int, data_len: int) -> TensorEntry:
    if not isinstance(meta, dict):
        raise corrupt_file(path, f"tensor {name!r} has no dtype/shape/data_offsets record")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if dtype not in DTYPES:
        raise corrupt_file(path, f"tensor {name!r} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise corrupt_file(path, f"tensor {name!r} has shape {shape!r}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets):
        raise corrupt_file(path, f"tensor {name!r} has data_offsets {offsets!r}, not two non-negative integers")
    begin, end = offsets
    want = math.prod(shape) * DTYPES[dtype][1]
    if end - begin != want:
        raise corrupt_file(
            path, f"tensor {name!r} spans bytes {begin}..{end} but {dtype}{shape} needs {want} bytes"
        )
    if end > data_len:
        raise corrupt_file(path, f"tensor {name!r} ends at byte {end} of a {data_len}-byte data section: truncated")
    return TensorEntry(path, data_start + begin, data_start + end, dtype, tuple(shape))


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _header(path: Path) -> tuple[dict, int, int]:
    """The JSON header (tensor name -> record, no metadata), where the data starts, its length."""
    size_on_disk = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            _refuse_other_formats(path, prefix)
            raise corrupt_file(path, "file shorter than its header")
        (size,) = struct.unpack("<Q", prefix)
        if size > min(MAX_HEADER_BYTES, size_on_disk - 8):
            _refuse_other_formats(path, prefix)
            raise corrupt_file(path, f"header length {size} does not fit a {size_on_disk}-byte file")
        raw = handle.read(size)
    if len(raw) < size:
        raise corrupt_file(path, "header cut short")
    if not raw.startswith(b"{"):
        _refuse_other_formats(path, prefix)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise corrupt_file(path, "header is not valid JSON") from None
    if not isinstance(header, dict):
        raise corrupt_file(path, f"header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    return header, 8 + size, size_on_disk - 8 - size


def _refuse_other_formats(path: Path, prefix: bytes) -> None:
    """Called once the bytes are known not to be safetensors: a pickle or zip (torch.save) or a
    GGUF under a .safetensors name is named for what it is."""
    if prefix.startswith(b"PK\x03\x04") or (len(prefix) > 1 and prefix[0] == 0x80 and 2 <= prefix[1] <= 5):
        raise TierlmError(
            f"{path} is a pickle/zip checkpoint (torch.save), not safetensors; tierlm refuses it",
            "unpickling can run code; convert the checkpoint to safetensors with a trusted tool first",
        )
    if prefix.startswith(b"GGUF"):
        raise TierlmError(f"{path} is a GGUF file, not safetensors", "pass the .gguf file itself as --model")


def corrupt_file(path: Path, why: str) -> TierlmError:
    """The error for a safetensors file whose bytes do not add up."""
    return TierlmError(f"checkpoint file {path} is corrupt ({why})", CHECKPOINT_HINT)
