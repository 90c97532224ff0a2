"""The calibration forward of `mixed:SIZE` (tierlm/cache/sensitivity.py): the model runs once over
a calibration text on a `CalibrationStore`, which builds each block from the source when the forward
asks for it, drops it after, and records what every 2-D weight meets."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from tierlm.cache import codec
from tierlm.cache.sensitivity import CALIBRATION_TOKENS
from tierlm.kv.cache import KVCache
from tierlm.models import family_class
from tierlm.progress import Progress
from tierlm.weights.store import WeightStore


def calibration_ids(tokenizer_path, count: int = CALIBRATION_TOKENS) -> list[int]:
    """`count` token ids from the end of the pydoc topics text (the benchmarks score its start)."""
    from pydoc_data.topics import topics  # ~700 KB of text: only a conversion that calibrates holds it

    text = "\n\n".join(topics[key] for key in sorted(topics, reverse=True))
    ids = Tokenizer.from_file(str(tokenizer_path)).encode(text[: 16 * count], add_special_tokens=False).ids
    return ids[:count]


def activation_stats(config, model_dir, layout, tensor_for, progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """"block/tensor" -> mean square of each input column over the calibration tokens; the
    embedding's entry also weighs its rows by how often the tokens used them (head use, when tied,
    adds the columns' mean square). `progress` counts the blocks the forward has reached."""
    report = progress or (lambda done, total: None)
    report(0, len(layout))
    ids = calibration_ids(Path(model_dir) / "tokenizer.json")
    store = CalibrationStore(layout, tensor_for, report)
    model = family_class(config)(config, store, len(ids), "cpu", torch.float32)
    with torch.no_grad():
        model.forward(torch.tensor([ids]), KVCache.for_model(config, len(ids)), logits="last")
    report(len(layout), len(layout))  # a tied head, or an expert no token chose, is never built
    return store.statistics()


class CalibrationStore(WeightStore):
    """Builds each block from the source when acquired, with its 2-D weights wrapped in recorders;
    holds only the block in use. `progress(done, total)` as each block is built: how many of the
    layout's blocks the forward is past."""

    def __init__(self, layout, tensor_for, progress: Progress | None = None):
        self._layout, self._tensor_for = layout, tensor_for
        self._progress, self._reached = progress, set()
        self._columns: dict[str, torch.Tensor] = {}  # sums of x^2 per column
        self._rows: dict[str, int] = {}  # activation rows seen
        self._tokens: dict[str, torch.Tensor] = {}  # embedding lookups per row
        self._owner = {sources: f"{block}/{name}" for block, entries in reversed(list(layout.items()))
                       for name, sources in entries.items()}  # fmt: skip  (a tied head -> the embedding's key)

    def acquire(self, block: str):
        if self._progress is not None:  # the blocks before this one are done
            self._reached.add(block)
            self._progress(len(self._reached) - 1, len(self._layout))
        tensors = {}
        for name, sources in self._layout[block].items():
            tensor = self._tensor_for(block, name, sources)
            keep = codec.keeps_float(name, tuple(tensor.shape))
            tensors[name] = tensor if keep else _Recorder(tensor, self._owner[sources], self)
        return tensors

    def release(self, block: str) -> None:
        pass  # the forward drops the block's tensors when it lets them go

    def block_names(self) -> list[str]:
        return list(self._layout)

    def nbytes(self) -> int:
        return 0

    def note_columns(self, key: str, x: torch.Tensor) -> None:
        flat = x.detach().reshape(-1, x.shape[-1]).float()
        sums = flat.square().sum(0)
        self._columns[key] = self._columns.get(key, 0) + sums
        self._rows[key] = self._rows.get(key, 0) + flat.shape[0]

    def note_rows(self, key: str, ids: torch.Tensor, vocab: int) -> None:
        counts = torch.bincount(ids.reshape(-1), minlength=vocab).float()
        self._tokens[key] = self._tokens.get(key, 0) + counts

    def statistics(self) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Per key (column weights [in]: each input column's mean square activation, row weights
        [out]: each row's share of the embedding lookups); either is None where the weight was
        not used that way (a tied embedding is used both ways)."""
        keys = set(self._columns) | set(self._tokens)
        out = {}
        for key in keys:
            columns = self._columns[key] / self._rows[key] if key in self._columns else None
            rows = self._tokens[key] / self._tokens[key].sum().clamp(min=1) if key in self._tokens else None
            out[key] = (columns, rows)
        return out


class _Recorder:
    """A weight that records what the forward feeds it and computes as the plain tensor does."""

    def __init__(self, tensor: torch.Tensor, key: str, store: CalibrationStore):
        self.tensor, self.key, self.store = tensor, key, store
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.store.note_columns(self.key, x)
        return F.linear(x, self.tensor.to(x.dtype), bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        self.store.note_rows(self.key, ids, self.tensor.shape[0])
        return F.embedding(ids, self.tensor).to(dtype or self.tensor.dtype)
