"""Lazy reader over a Hugging Face checkpoint's safetensors files (single or sharded).

Only safetensors are read: `.bin` checkpoints are pickles, and unpickling can run code.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from tierlm.errors import TierlmError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


# safetensors dtype codes -> torch dtype names (resolved lazily to keep torch out of imports).
_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


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
        """Tensors concatenated along dim 0, read straight into one buffer (no extra copy)."""
        import torch

        entries = [self.entry(n) for n in names]
        first = entries[0]
        for other in entries[1:]:
            if other.dtype != first.dtype or other.shape[1:] != first.shape[1:]:
                raise TierlmError(
                    f"tensors {names[0]!r} and {names[entries.index(other)]!r} cannot be fused: "
                    f"{first.dtype}{list(first.shape)} vs {other.dtype}{list(other.shape)}",
                    "the checkpoint does not match its config.json",
                )
        dtype = getattr(torch, _DTYPES[first.dtype])
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
                raise TierlmError(f"checkpoint file {path} ended early", "re-download or re-import the model")
            done += count


def _entries(model_dir: Path) -> dict[str, TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    files = _tensor_files(model_dir)
    for path in sorted(set(files.values())):
        header, size = _header(path)
        data_start = 8 + size
        try:
            for name, meta in header.items():
                begin, end = (int(x) for x in meta["data_offsets"])
                if meta["dtype"] not in _DTYPES:
                    raise _corrupt(path, f"tensor {name!r} has unsupported dtype {meta['dtype']}")
                entries[name] = TensorEntry(
                    path, data_start + begin, data_start + end, meta["dtype"], tuple(meta["shape"])
                )
        except (KeyError, TypeError, ValueError):
            raise _corrupt(path, "malformed header") from None
        needed = max((e.end for e in entries.values() if e.path == path), default=data_start)
        actual = path.stat().st_size
        if actual < needed:
            raise _corrupt(path, f"{actual} bytes on disk, {needed} expected: truncated")
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
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as err:
            raise TierlmError(f"{index} is not a valid safetensors index: {err}") from None
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise TierlmError(
                    f"checkpoint shard {shard.name} listed in {INDEX_NAME} is missing",
                    "the download is incomplete; fetch the missing file",
                )
        return files
    single = model_dir / SINGLE_NAME
    if single.is_file():
        return {name: single for name in _header(single)[0]}
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


def _header(path: Path) -> tuple[dict, int]:
    """The safetensors JSON header (tensor name -> dtype/shape/offsets, no metadata) and its size."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise _corrupt(path, "file shorter than its header")
        (size,) = struct.unpack("<Q", prefix)
        raw = handle.read(size)
    if len(raw) < size:
        raise _corrupt(path, "header cut short")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _corrupt(path, "header is not valid JSON") from None
    header.pop("__metadata__", None)
    return header, size


def _corrupt(path: Path, why: str) -> TierlmError:
    return TierlmError(
        f"checkpoint file {path} is corrupt ({why})",
        "re-download or re-import the model",
    )
