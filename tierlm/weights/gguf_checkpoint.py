"""A GGUF import's checkpoint: the GGUF file itself, read one HF tensor at a time.

Same interface as tierlm.weights.checkpoint.Checkpoint (names, entry(name).shape, get,
read_concat), so conversion, LoRA merges, variants and float loads read an imported GGUF exactly
as they read safetensors, while the cache holds no float copy of it. Each read dequantizes one
tensor (or one expert of a merged MoE tensor) with the `gguf` package, so a read's memory is that
tensor in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierlm.errors import TierlmError
from tierlm.weights.import_record import gguf_content_key

_MOVED_HINT = (
    "artifacts already converted from it still run; to convert another quantization or a LoRA "
    "variant, put the GGUF back or run `tierlm import-gguf FILE` on it where it is now"
)


@dataclass(frozen=True)
class GgufEntry:
    """One HF tensor of an imported GGUF: its shape (float32 once read) and its stored type."""

    shape: tuple[int, ...]
    source_type: str
    dtype: str = "F32"


class GgufCheckpoint:
    """Maps HF tensor names to the GGUF tensors of an import and reads them as float32."""

    def __init__(self, model_dir: Path, record: dict[str, Any]):
        from tierlm.weights.gguf_import import read_plan  # numpy and gguf: only when weights are read

        self.model_dir = Path(model_dir)
        self.source = _source_of(self.model_dir, record)
        self._planned = {item.hf_name: item for item in read_plan(self.source).plan}

    def names(self) -> list[str]:
        return list(self._planned)

    def entry(self, name: str) -> GgufEntry:
        item = self._item(name)
        return GgufEntry(item.hf_shape, item.source_type)

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` dequantized to float32, in HF shape and row order."""
        return self.read_concat((name,))

    def read_concat(self, names: tuple[str, ...]) -> torch.Tensor:
        """Tensors dequantized and concatenated along dim 0 into one float32 buffer."""
        from tierlm.weights.gguf_tensors import read_tensor

        items = [self._item(n) for n in names]
        first = items[0]
        for other in items[1:]:
            if other.hf_shape[1:] != first.hf_shape[1:]:
                raise TierlmError(
                    f"tensors {names[0]!r} and {other.hf_name!r} cannot be fused: "
                    f"{list(first.hf_shape)} vs {list(other.hf_shape)}",
                    "the GGUF does not match its config",
                )
        if len(items) == 1:
            out = torch.from_numpy(read_tensor(first, self.source))
        else:  # each part written into its rows, so at most one part's float copy exists beside `out`
            out = torch.empty((sum(i.hf_shape[0] for i in items), *first.hf_shape[1:]), dtype=torch.float32)
            row = 0
            for item in items:
                out[row : row + item.hf_shape[0]] = torch.from_numpy(read_tensor(item, self.source))
                row += item.hf_shape[0]
        return out  # each part was checked finite as it was dequantized (gguf_tensors.read_tensor)

    def read_carried(self, names: tuple[str, ...]):
        """The tensors `names` fused by rows holding their GGUF values exactly at their own size
        (tierlm/weights/gguf_carry.py): one type as its form, several as a RowStack of each run's
        form (modes.source_grid_mode names it); None where mixed:source carries them otherwise: a
        type outside CARRIED_SOURCE_TYPES, or only Q4_0/Q4_1 (read as floats onto int4's grid)."""
        from itertools import groupby

        from tierlm.quant.modes import CARRIED_SOURCE_TYPES, FOUR_BIT_SOURCE_TYPES
        from tierlm.quant.row_stack import RowStack
        from tierlm.weights.gguf_carry import carry_weight, fused_rows
        from tierlm.weights.gguf_tensors import read_raw, unpermute_rope_rows

        items = [self._item(n) for n in names]
        kinds = {item.source_type for item in items}
        if not kinds <= CARRIED_SOURCE_TYPES or kinds <= FOUR_BIT_SOURCE_TYPES or len(items[0].hf_shape) != 2:
            return None

        def carried(item):
            raw = read_raw(item, self.source)
            if item.unpermute_heads:  # a row's blocks move whole
                raw = unpermute_rope_rows(raw, item.unpermute_heads)
            return carry_weight(item.source_type, raw)

        runs = [fused_rows([carried(item) for item in run]) for _, run in groupby(items, key=lambda i: i.source_type)]
        return runs[0] if len(runs) == 1 else RowStack(runs)

    def _item(self, name: str):
        found = self._planned.get(name)
        if found is None:
            raise TierlmError(
                f"the GGUF {self.source} has no tensor for {name!r}",
                "the weights do not match config.json; import the GGUF again",
            )
        return found


def _source_of(model_dir: Path, record: dict[str, Any]) -> Path:
    """The GGUF an import reads, if it is still there with the content it was imported from."""
    path = Path(str(record.get("source_path", "")))
    gone = f"{model_dir.name} was imported from {path}, which "
    if not path.is_file():
        raise TierlmError(gone + "is no longer there", _MOVED_HINT)
    if path.stat().st_size != record.get("source_bytes") or gguf_content_key(path) != record.get("source_key"):
        raise TierlmError(gone + "has changed since", _MOVED_HINT)
    return path
