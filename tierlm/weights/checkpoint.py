"""Lazy reader over a Hugging Face checkpoint's safetensors files (single or sharded).

Only safetensors are read: `.bin` checkpoints are pickles, and unpickling can run code.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from tierlm.errors import TierlmError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class Checkpoint:
    """Maps tensor names to safetensors files and reads one tensor at a time."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.file_of = _tensor_files(self.model_dir)
        for path in sorted(set(self.file_of.values())):
            _validate_file(path)
        self._handles: dict[Path, object] = {}

    def names(self) -> list[str]:
        return list(self.file_of)

    def get(self, name: str):
        """The tensor `name` as stored (dtype unchanged), read from its file."""
        from safetensors import SafetensorError

        path = self.file_of.get(name)
        if path is None:
            raise TierlmError(
                f"checkpoint {self.model_dir} has no tensor {name!r}",
                "the weights do not match config.json; is the checkpoint complete?",
            )
        try:
            return self._handle(path).get_tensor(name)
        except SafetensorError as err:
            raise TierlmError(f"cannot read {name!r} from {path.name}: {err}") from None

    def close(self) -> None:
        self._handles.clear()

    def _handle(self, path: Path):
        from safetensors import safe_open

        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]


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


def _validate_file(path: Path) -> None:
    """Refuse a truncated file before any tensor is read: the data must reach the last offset."""
    header, size = _header(path)
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    needed = 8 + size + end
    actual = path.stat().st_size
    if actual < needed:
        raise _corrupt(path, f"{actual} bytes on disk, {needed} expected: truncated")


def _corrupt(path: Path, why: str) -> TierlmError:
    return TierlmError(
        f"checkpoint file {path} is corrupt ({why})",
        "re-download or re-import the model",
    )
