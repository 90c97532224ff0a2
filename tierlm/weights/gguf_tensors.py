"""One GGUF tensor as an HF tensor: where its bytes lie, read with plain reads and dequantized to
float32 on demand, and the check an import makes of its scales without dequantizing anything.

An import keeps no float copy of the model (tierlm/weights/gguf_checkpoint.py reads the GGUF
itself), so the only full pass an import makes over the weights is `check_finite_scales`: in a
quantized block only the fp16 scale fields can hold NaN or Inf (the rest are integer codes), so
reading those fields decides what dequantizing the whole tensor would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from tierlm.errors import TierlmError
from tierlm.weights.file_reads import read_into

# Byte offsets of the fp16 fields (d, and dmin/m where the type has one) inside one block of each
# quantized type, from ggml's block layouts (ggml-common.h).
SCALE_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}  # fmt: skip
FLOAT_TYPES = ("F32", "F16", "BF16")
# Scanned this many bytes at a time (whole blocks), so a check's memory is bounded whatever the tensor.
SCAN_BYTES = 64 << 20
CORRUPT_HINT = "the file is corrupt; download or convert it again"


@dataclass(frozen=True)
class PlannedTensor:
    """One GGUF tensor (or one expert's slice of a merged MoE tensor) and the HF tensor it becomes."""

    tensor: Any  # gguf ReaderTensor: name, tensor_type, n_bytes, data_offset (from the file's start)
    hf_name: str
    hf_shape: tuple[int, ...]
    unpermute_heads: int  # 0: as stored; n: undo llama.cpp's Q/K permutation over n heads
    # A merged MoE tensor [experts, rows, cols] is read one slice at a time: this one's index.
    expert: int | None = None
    slices: int = 1  # how many planned items share `tensor` (its experts)

    @property
    def source_type(self) -> str:
        return self.tensor.tensor_type.name

    @property
    def source_bytes(self) -> int:
        return int(self.tensor.n_bytes) // self.slices

    @property
    def byte_range(self) -> tuple[int, int]:
        start = int(self.tensor.data_offset) + (self.expert or 0) * self.source_bytes
        return start, start + self.source_bytes


def read_tensor(item: PlannedTensor, path: Path) -> np.ndarray:
    """`item` as a contiguous float32 array in HF shape and row order, read from the GGUF at `path`.

    The tensor's bytes are read with plain reads (no mapping of the file stays resident) and
    dequantized by the `gguf` package, the reference transformers' GGUF loader uses too.
    """
    raw = read_raw(item, path).reshape(-1)
    kind = item.tensor.tensor_type
    try:
        if item.source_type == "F32":
            array = raw.view(np.float32)
        elif item.source_type == "F16":
            array = raw.view(np.float16).astype(np.float32)
        else:
            with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf is refused below, by name
                array = dequantize(raw.reshape(-1, row_bytes(item)), kind)
        array = np.ascontiguousarray(array, dtype=np.float32).reshape(item.hf_shape)
    except Exception as err:  # damaged sizes or a type gguf cannot dequantize
        raise TierlmError(f"{path}: cannot dequantize tensor {item.tensor.name} ({item.source_type}): {err}",
                          hint=CORRUPT_HINT) from None  # fmt: skip
    if not np.isfinite(array).all():  # a scale the import did not see (the file changed since): refused
        raise non_finite(path, item)
    if item.unpermute_heads:
        array = np.ascontiguousarray(unpermute_rope_rows(array, item.unpermute_heads))
    return array


def read_raw(item: PlannedTensor, path: Path) -> np.ndarray:
    """`item`'s bytes as stored, uint8 [rows, bytes per row] (rows: every dimension but the last)."""
    start, end = item.byte_range
    return _read_bytes(path, start, end).reshape(-1, row_bytes(item))


def row_bytes(item: PlannedTensor) -> int:
    """Bytes one HF row (the last dimension) takes in the tensor's GGUF type."""
    block, size = GGML_QUANT_SIZES[item.tensor.tensor_type]
    return item.hf_shape[-1] // block * size


def check_finite_scales(tensor, path: Path, on_bytes: Callable[[int], None] | None = None) -> None:
    """Refuse a GGUF tensor whose dequantized values would hold NaN or Inf, without dequantizing:
    float tensors are checked whole, quantized ones by their fp16 scale fields, SCAN_BYTES at a time.
    `on_bytes(n)` is told of each piece scanned."""
    kind = tensor.tensor_type.name
    block_bytes = GGML_QUANT_SIZES[tensor.tensor_type][1]
    step = max(block_bytes, SCAN_BYTES // block_bytes * block_bytes)
    start, end = int(tensor.data_offset), int(tensor.data_offset) + int(tensor.n_bytes)
    for offset in range(start, end, step):
        raw = _read_bytes(path, offset, min(offset + step, end))
        if not _finite(raw, kind, block_bytes):
            raise TierlmError(f"{path}: tensor {tensor.name} ({kind}) holds NaN or Inf values", hint=CORRUPT_HINT)
        if on_bytes is not None:
            on_bytes(len(raw))


def non_finite(path: Path, item: PlannedTensor) -> TierlmError:
    return TierlmError(f"{path}: tensor {item.tensor.name} ({item.source_type}) holds NaN or Inf values",
                       hint=CORRUPT_HINT)  # fmt: skip


def unpermute_rope_rows(weight, n_head: int):
    """Undo llama.cpp's Q/K permutation: rows [n_head*head_dim, ...] back to HF's half-split order.

    llama.cpp's convert_hf_to_gguf.py views rows as (n_head, 2, head_dim/2) and swaps the two inner
    axes, so each head's rotary pairs sit next to each other (interleaved RoPE); the inverse views rows
    as (n_head, head_dim/2, 2) and swaps back. Works for 2-D weights and 1-D biases.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise TierlmError(f"cannot un-permute a tensor with {rows} rows into {n_head} rotary heads")
    grouped = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def parameter_count(plan: list[PlannedTensor]) -> int:
    return sum(math.prod(item.hf_shape) for item in plan)


def _finite(raw: np.ndarray, kind: str, block_bytes: int) -> bool:
    if kind == "F32":
        return bool(np.isfinite(raw.view(np.float32)).all())
    if kind == "F16":
        return bool(np.isfinite(raw.view(np.float16)).all())
    if kind == "BF16":  # exponent bits all set: Inf or NaN
        return not bool(((raw.view(np.uint16) & 0x7F80) == 0x7F80).any())
    blocks = raw.reshape(-1, block_bytes)
    for offset in SCALE_FIELDS[kind]:
        scales = np.ascontiguousarray(blocks[:, offset : offset + 2]).view(np.float16)
        if not np.isfinite(scales).all():
            return False
    return True


def _read_bytes(path: Path, start: int, end: int) -> np.ndarray:
    out = np.empty(end - start, dtype=np.uint8)
    if read_into(path, start, memoryview(out)) < len(out):
        raise TierlmError(f"{path} ended early, inside its tensor data", hint=CORRUPT_HINT)
    return out
