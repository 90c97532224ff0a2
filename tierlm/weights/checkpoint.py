"""Lazy reader over a Hugging Face checkpoint's safetensors files (single or sharded).

Only safetensors are read: `.bin` checkpoints are pickles, and unpickling can run code. Every
file's header is validated whole before any tensor is read (see `file_entries`): bytes from
disk are untrusted until their sizes, offsets and dtypes add up.
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
# Largest finite float16. Adapter factors and merged weights beyond it overflow half-precision
# compute, and no trained weight comes near it.
MAX_WEIGHT = 65504.0

# safetensors dtype codes -> (torch dtype name, bytes per element); torch is resolved lazily.
_DTYPES = {
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


class Checkpoint:
    """Maps tensor names to byte ranges of safetensors files and reads them with plain reads.

    Reads go through the page cache into memory tierlm owns, never through a mapping of
    the file, so bytes no longer needed (parts of a fused tensor) are not left resident.
    """

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.entries = _entries(self.model_dir)

    def names(self) -> list[str]:
        return list(self.entries)

    def entry(self, name: str) -> TensorEntry:
        found = self.entries.get(name)
        if found is None:
            raise TierlmError(
                f"checkpoint {self.model_dir} has no tensor {name!r}",
                "the weights do not match config.json; is the checkpoint complete?",
            )
        return found

    def get(self, name: str):
        """The tensor `name` as stored (dtype unchanged)."""
        return self.read_concat((name,))

    def read_concat(self, names: tuple[str, ...]):
        """Tensors concatenated along dim 0, read straight into one buffer (no extra copy).

        Model weights only: an integer dtype (a float tensor relabelled) or NaN/Inf is refused.
        """
        import torch

        entries = [self.entry(n) for n in names]
        first = entries[0]
        for name, entry in zip(names, entries):
            if entry.dtype not in FLOAT_CODES:
                raise TierlmError(
                    f"checkpoint tensor {name!r} in {entry.path} is stored as {entry.dtype}; "
                    "model weights must be floating point",
                    f"the file is corrupt or not this model's checkpoint; {CHECKPOINT_HINT}",
                )
        for other in entries[1:]:
            if other.dtype != first.dtype or other.shape[1:] != first.shape[1:]:
                raise TierlmError(
                    f"tensors {names[0]!r} and {names[entries.index(other)]!r} cannot be fused: "
                    f"{first.dtype}{list(first.shape)} vs {other.dtype}{list(other.shape)}",
                    "the checkpoint does not match its config.json",
                )
        out = _read_entries(entries, getattr(torch, _DTYPES[first.dtype][0]))
        check_finite(out, f"checkpoint tensor {'+'.join(names)!r}", CHECKPOINT_HINT)
        return out


def read_safetensors(path: Path, *, floating: bool = True) -> dict:
    """Every tensor of one safetensors file (name -> tensor as stored), header validated first.

    floating: refuse integer dtypes (for files that hold only weights, e.g. LoRA adapters).
    """
    import torch

    out = {}
    for name, entry in file_entries(Path(path)).items():
        if floating and entry.dtype not in FLOAT_CODES:
            raise _corrupt(path, f"tensor {name!r} is {entry.dtype}, weights must be floating point")
        out[name] = _read_entries([entry], getattr(torch, _DTYPES[entry.dtype][0]))
    return out


def check_finite(tensor, what: str, hint: str, limit: float | None = None) -> None:
    """Refuse a float tensor holding NaN or Inf (or, with `limit`, a value beyond ±limit).

    One min/max pass (NaN propagates through both), no temporary the size of the tensor.
    """
    import torch

    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    low, high = (float(x) for x in torch.aminmax(tensor if tensor.element_size() > 1 else tensor.float()))
    if not (math.isfinite(low) and math.isfinite(high)):
        raise TierlmError(f"{what} holds NaN or Inf values", hint)
    peak = max(-low, high)
    if limit is not None and peak > limit:
        raise TierlmError(f"{what} holds values as large as {peak:.3g}, beyond any usable weight", hint)


def _read_entries(entries: list[TensorEntry], dtype):
    import torch

    first = entries[0]
    rows = sum(e.shape[0] for e in entries) if first.shape else 1
    out = torch.empty((rows, *first.shape[1:]) if first.shape else (), dtype=dtype)
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    offset = 0
    for entry in entries:
        size = entry.end - entry.start
        _read_into(entry.path, entry.start, view[offset : offset + size])
        offset += size
    return out


def _read_into(path: Path, start: int, target: memoryview) -> None:
    with open(path, "rb", buffering=0) as handle:
        handle.seek(start)
        done = 0
        while done < len(target):
            count = handle.readinto(target[done:])
            if not count:
                raise TierlmError(f"checkpoint file {path} ended early", CHECKPOINT_HINT)
            done += count


def _entries(model_dir: Path) -> dict[str, TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    files = _tensor_files(model_dir)
    for path in sorted(set(files.values())):
        for name, entry in file_entries(path).items():
            if name in entries:
                raise _corrupt(path, f"tensor {name!r} is also in {entries[name].path.name}")
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
            raise _corrupt(path, f"tensors {before!r} and {after!r} overlap")
    return entries


def _entry(path: Path, name: str, meta, data_start: int, data_len: int) -> TensorEntry:
    if not isinstance(meta, dict):
        raise _corrupt(path, f"tensor {name!r} has no dtype/shape/data_offsets record")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if dtype not in _DTYPES:
        raise _corrupt(path, f"tensor {name!r} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise _corrupt(path, f"tensor {name!r} has shape {shape!r}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets):
        raise _corrupt(path, f"tensor {name!r} has data_offsets {offsets!r}, not two non-negative integers")
    begin, end = offsets
    want = math.prod(shape) * _DTYPES[dtype][1]
    if end - begin != want:
        raise _corrupt(
            path, f"tensor {name!r} spans bytes {begin}..{end} but {dtype}{shape} needs {want} bytes"
        )
    if end > data_len:
        raise _corrupt(path, f"tensor {name!r} ends at byte {end} of a {data_len}-byte data section: truncated")
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
            raise _corrupt(path, "file shorter than its header")
        (size,) = struct.unpack("<Q", prefix)
        if size > min(MAX_HEADER_BYTES, size_on_disk - 8):
            _refuse_other_formats(path, prefix)
            raise _corrupt(path, f"header length {size} does not fit a {size_on_disk}-byte file")
        raw = handle.read(size)
    if len(raw) < size:
        raise _corrupt(path, "header cut short")
    if not raw.startswith(b"{"):
        _refuse_other_formats(path, prefix)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise _corrupt(path, "header is not valid JSON") from None
    if not isinstance(header, dict):
        raise _corrupt(path, f"header is a JSON {type(header).__name__}, not an object")
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


def _corrupt(path: Path, why: str) -> TierlmError:
    return TierlmError(f"checkpoint file {path} is corrupt ({why})", CHECKPOINT_HINT)
