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
        """The tensors `names` fused by rows holding their GGUF values exactly: one type with a
        layout of its own in it (`_read_own_layout`), a mix as an Int8Weight of codes, scales and offsets
        (tierlm/weights/gguf_carry.py); None where mixed:source carries them otherwise: a type
        outside INT8_FORMS, or only Q4_0/Q4_1 (kept at 4 bits as int4)."""
        from tierlm.quant.modes import CARRIED_ONLY, CARRIED_SOURCE_TYPES, FOUR_BIT_SOURCE_TYPES, combined_form, own_mode

        items = [self._item(n) for n in names]
        kinds = {item.source_type for item in items}
        if not kinds <= CARRIED_SOURCE_TYPES or kinds <= FOUR_BIT_SOURCE_TYPES or len(items[0].hf_shape) != 2:
            return None
        if len(kinds) == 1 and next(iter(kinds)) in CARRIED_ONLY.values():
            return self._read_own_layout(items)
        if len(kinds) > 1 and all(own_mode(kind) for kind in kinds):  # as modes.source_grid_mode predicts
            return self._read_stack(items)
        return self._read_int8_form(items, combined_form(kinds))

    def _read_stack(self, items):
        """Tensors of several types fused by rows as a RowStack: each run of one type in the form
        that holds it alone (its own layout, q8_0, or int4 for Q4_0/Q4_1)."""
        from itertools import groupby

        from tierlm.quant.modes import CARRIED_ONLY, INT8_FORMS
        from tierlm.quant.row_stack import RowStack

        runs = []
        for kind, group in groupby(items, key=lambda item: item.source_type):
            group = list(group)
            if kind in CARRIED_ONLY.values():
                runs.append(self._read_own_layout(group))
            elif kind in ("Q4_0", "Q4_1"):
                runs.append(self._read_int4(group))
            else:
                runs.append(self._read_int8_form(group, INT8_FORMS[kind]))
        return RowStack(runs)

    def _read_int4(self, items):
        """Q4_0 / Q4_1 tensors (one type) fused by rows as the Int4Weight holding them: GGUF's
        nibbles are int4.py's packing, d its scales, Q4_1's m its offsets (W = u d + m)."""
        from tierlm.quant.int4 import Int4Weight
        from tierlm.weights.gguf_tensors import read_raw, unpermute_rope_rows

        asymmetric = items[0].source_type == "Q4_1"
        size = 20 if asymmetric else 18
        pieces = []
        for item in items:
            blocks = read_raw(item, self.source).reshape(item.hf_shape[0], -1, size)
            parts = [blocks[..., size - 16 :], blocks[..., 0:2], blocks[..., 2:4] if asymmetric else None]
            parts = [None if p is None else np.ascontiguousarray(p).reshape(item.hf_shape[0], -1) for p in parts]
            if item.unpermute_heads:  # rows move whole: every part of a row alike
                parts = [None if p is None else unpermute_rope_rows(p, item.unpermute_heads) for p in parts]
            pieces.append(parts)
        packed, scales, offsets = (None if column[0] is None else torch.from_numpy(np.concatenate(column))
                                   for column in zip(*pieces))  # fmt: skip
        half = lambda t: None if t is None else t.view(torch.float16)  # noqa: E731
        return Int4Weight(packed, half(scales), 32, offsets=half(offsets))

    def _read_int8_form(self, items, form):
        """Tensors of carried types fused by rows as an Int8Weight in `form` (one that holds
        every one of them exactly: tierlm/weights/gguf_carry.py)."""
        from tierlm.quant.int8 import Int8Weight
        from tierlm.weights.gguf_carry import as_form, carry_rows
        from tierlm.weights.gguf_tensors import read_raw, unpermute_rope_rows

        pieces = []
        for item in items:
            rows = as_form(carry_rows(item.source_type, read_raw(item, self.source), item.hf_shape[1]), form)
            parts = [rows.codes, rows.scales] + ([rows.offsets] if rows.offsets is not None else [])
            if item.unpermute_heads:  # rows move whole: codes, scales and offsets alike
                parts = [unpermute_rope_rows(p, item.unpermute_heads) for p in parts]
            pieces.append(parts)
        fused = [torch.from_numpy(np.ascontiguousarray(np.concatenate(column))) for column in zip(*pieces)]
        return Int8Weight(fused[0], fused[1], form.group, offsets=fused[2] if form.asymmetric else None)

    def _read_own_layout(self, items):
        """Tensors of one type with a layout of its own (Q4_K, Q6_K, Q5_0, Q5_1, Q5_K, IQ4_NL,
        IQ4_XS, Q2_K, Q3_K) fused by rows: their blocks re-laid for the kernels (tierlm/quant/
        q4k.py, q6k.py, q5.py, iq4.py, low_bit_k.py), every value kept."""
        from tierlm.quant import iq4, low_bit_k, q4k, q5, q6k
        from tierlm.weights.gguf_tensors import read_raw, unpermute_rope_rows

        kind = items[0].source_type
        own = iq4 if kind.startswith("IQ4") else low_bit_k if kind in ("Q2_K", "Q3_K") else q5
        read = {"Q4_K": q4k.from_gguf_blocks, "Q6_K": q6k.from_gguf_blocks}.get(
            kind, lambda raw: own.from_gguf_blocks(raw, kind))
        pieces = []
        for item in items:
            parts = read(torch.from_numpy(read_raw(item, self.source))).tensors()
            if item.unpermute_heads:  # whole rows move: every part of a row alike
                parts = {name: unpermute_rope_rows(part, item.unpermute_heads) for name, part in parts.items()}
            pieces.append(parts)
        fused = {name: torch.cat([piece[name] for piece in pieces]) for name in pieces[0]}
        layouts = {"Q4_K": q4k.Q4KWeight, "Q6_K": q6k.Q6KWeight, "IQ4_NL": iq4.IQ4Weight, "IQ4_XS": iq4.IQ4Weight,
                   "Q2_K": low_bit_k.LowBitKWeight, "Q3_K": low_bit_k.LowBitKWeight}  # fmt: skip
        return layouts.get(kind, q5.FiveBitWeight).from_tensors(fused)

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
