"""Reading a Hugging Face checkpoint's tensors (single or sharded safetensors files).

Only safetensors are read: `.bin` checkpoints are pickles, and unpickling can run code. Every
file's header is validated whole before any tensor is read (tierlm/weights/safetensors_index.py
says where each tensor lies).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tierlm.errors import TierlmError
from tierlm.weights.file_reads import read_into
from tierlm.weights.import_record import read_import_record, weights_in_gguf
from tierlm.weights.safetensors_index import (
    CHECKPOINT_HINT,
    DTYPES,
    FLOAT_CODES,
    TensorEntry,
    checkpoint_entries,
    corrupt_file,
    file_entries,
)

# Largest finite float16. Adapter factors and merged weights beyond it overflow half-precision
# compute, and no trained weight comes near it.
MAX_WEIGHT = 65504.0


def open_checkpoint(model_dir: Path):
    """The checkpoint in `model_dir`: its safetensors, or for a GGUF import the GGUF it reads
    (tierlm/weights/gguf_checkpoint.py); both offer names, entry, get and read_concat."""
    record = read_import_record(model_dir)
    if weights_in_gguf(record):
        from tierlm.weights.gguf_checkpoint import GgufCheckpoint

        return GgufCheckpoint(model_dir, record)
    return Checkpoint(model_dir)


class Checkpoint:
    """Maps tensor names to byte ranges of safetensors files and reads them with plain reads.

    Reads go through the page cache into memory tierlm owns, never through a mapping of
    the file, so bytes no longer needed (parts of a fused tensor) are not left resident.
    """

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.entries = checkpoint_entries(self.model_dir)

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
        out = _read_entries(entries, getattr(torch, DTYPES[first.dtype][0]))
        check_finite(out, f"checkpoint tensor {'+'.join(names)!r}", CHECKPOINT_HINT)
        return out


def read_safetensors(path: Path, *, floating: bool = True) -> dict:
    """Every tensor of one safetensors file (name -> tensor as stored), header validated first.

    floating: refuse integer dtypes (for files that hold only weights, e.g. LoRA adapters).
    """
    out = {}
    for name, entry in file_entries(Path(path)).items():
        if floating and entry.dtype not in FLOAT_CODES:
            raise corrupt_file(path, f"tensor {name!r} is {entry.dtype}, weights must be floating point")
        out[name] = _read_entries([entry], getattr(torch, DTYPES[entry.dtype][0]))
    return out


def check_finite(tensor, what: str, hint: str, limit: float | None = None) -> None:
    """Refuse a float tensor holding NaN or Inf (or, with `limit`, a value beyond ±limit).

    One min/max pass (NaN propagates through both), no temporary the size of the tensor.
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    low, high = (float(x) for x in torch.aminmax(tensor if tensor.element_size() > 1 else tensor.float()))
    if not (math.isfinite(low) and math.isfinite(high)):
        raise TierlmError(f"{what} holds NaN or Inf values", hint)
    peak = max(-low, high)
    if limit is not None and peak > limit:
        raise TierlmError(f"{what} holds values as large as {peak:.3g}, beyond any usable weight", hint)


def _read_entries(entries: list[TensorEntry], dtype):
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
    if read_into(path, start, target) < len(target):
        raise TierlmError(f"checkpoint file {path} ended early", CHECKPOINT_HINT)
