"""`mixed:SIZE`'s choice of int8 or int4 per weight, measured while converting.

Two passes over the source, one block at a time (the model is never held in float as a whole):

1. Activation statistics. The model runs one forward over `CALIBRATION_TOKENS` tokens of a
   calibration text (CPython's pydoc topics, shipped with Python itself; taken from the end of
   the text, so the fidelity benchmark, which scores its beginning, never sees them) on a
   `CalibrationStore`: each block is built from the source when the forward asks for it and
   dropped after, and every 2-D weight records the mean square of each input column it met
   (and the embedding how often each token was looked up).
2. Damage. Each weight is quantized in every option of `quant.mixed.OPTIONS`; an option's damage
   is its squared error weighted by those column statistics (quant/mixed.py says why).

`quant.mixed.allocate` then picks the options within the size target. Where the forward cannot
run (a family whose layers use their weights in ways the recorder does not follow), the damage is
weighted by weights alone and the manifest says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tierlm.cache import codec
from tierlm.quant import mixed
from tierlm.quant.modes import QuantMode, parse_quant_mode
from tierlm.weights.store import WeightStore

CALIBRATION_TOKENS = 512
SAMPLE_ROWS = 2048  # rows of a weight whose quantization error is measured (module doc)
ACTIVATIONS = "activations"  # the manifest's word for a measured choice
WEIGHTS_ONLY = "weights only"


@dataclass(frozen=True)
class MixedChoice:
    """The per-weight modes ("block/tensor" -> mode name) and how their damage was weighed."""

    modes: Mapping[str, str]
    sensitivity: str  # ACTIVATIONS (with the token count) or WEIGHTS_ONLY (with the reason)


def choose_modes(config, model_dir, layout, tensor_for, mode: QuantMode, part_bytes: Callable,
                 block_padding: int = 0) -> MixedChoice:  # fmt: skip
    """The modes `mode` (mixed:SIZE) gives each 2-D weight of `layout` (block -> {tensor:
    sources}); `tensor_for(block, name, sources)` makes its fp32 tensor; `part_bytes(shape,
    mode, name) -> int` its stored bytes; `block_padding` the most a block's alignment adds."""
    try:
        stats, how = activation_stats(config, model_dir, layout, tensor_for), f"{ACTIVATIONS} ({CALIBRATION_TOKENS} tokens)"
    except Exception as err:  # noqa: BLE001 - any failure of the calibration forward: weigh by weights
        stats, how = {}, f"{WEIGHTS_ONLY} (the calibration forward failed: {type(err).__name__})"
    candidates, fixed, seen = [], block_padding * len(layout), set()
    for block, entries in layout.items():
        for name, sources in entries.items():
            if sources in seen:
                continue  # a tied head: the embedding's tensor
            seen.add(sources)
            tensor = tensor_for(block, name, sources)
            if codec.keeps_float(name, tuple(tensor.shape)):
                fixed += part_bytes(tuple(tensor.shape), mode, name)
                continue
            key = f"{block}/{name}"
            candidates.append(_candidate(key, tensor, stats.get(key), part_bytes))
            del tensor
    chosen = mixed.allocate(candidates, mode.target_bytes - fixed)
    return MixedChoice(chosen, how)


def _candidate(key: str, tensor: torch.Tensor, stats, part_bytes) -> mixed.Candidate:
    """Bytes and squared error of each option for one weight [out, in], weighted by `stats`
    (column weights, row weights) where measured, else uniformly.

    Groups lie within rows, so each row's error is its own: the column-weighted error is measured
    on every k-th row (at most `SAMPLE_ROWS` of them) and scaled by k, the row-weighted one on
    the rows the text looked up."""
    shape = tuple(tensor.shape)
    columns, rows = stats if stats is not None else (torch.ones(shape[1]), None)
    stride = -(-shape[0] // SAMPLE_ROWS)
    sampled = tensor[::stride].contiguous()
    used = rows.nonzero().squeeze(1) if rows is not None else None
    sizes, damage = {}, {}
    for option in mixed.OPTIONS:
        option_mode = parse_quant_mode(option)
        sizes[option] = part_bytes(shape, option_mode, None)
        total = 0.0
        if columns is not None:  # output error of a linear use
            total += stride * float((_squared_error(sampled, option_mode) @ columns).sum())
        if used is not None and used.numel():  # hidden-state error of the lookups
            total += float(rows[used] @ _squared_error(tensor[used], option_mode).sum(1))
        damage[option] = total
    return mixed.Candidate(key, sizes, damage)


def _squared_error(weight: torch.Tensor, mode: QuantMode) -> torch.Tensor:
    """(stored - weight)^2 elementwise for `weight` stored in the concrete `mode`."""
    encoding, parts, meta = codec.encode(weight, mode)
    return (codec.decode(_Record(encoding, meta), parts).dequantize() - weight).square_()


@dataclass(frozen=True)
class _Record:
    """What `codec.decode` reads of a record: its encoding and metadata."""

    encoding: str
    meta: Mapping


def estimated_modes(blocks: Mapping[str, Mapping[str, tuple[int, ...]]], mode: QuantMode,
                    part_bytes: Callable, block_padding: int = 0) -> dict[str, str]:  # fmt: skip
    """"block/tensor" -> mode for mixed:SIZE with no weights at hand (a plan from config.json, a
    synthetic artifact): damage estimated per element (`quant.mixed.GAUSSIAN_ERROR`).
    `blocks`: block -> {tensor: shape}; `part_bytes(shape, mode, name) -> int` as in `choose_modes`."""
    weights, fixed = [], block_padding * len(blocks)
    for block, tensors in blocks.items():
        for name, shape in tensors.items():
            if codec.keeps_float(name, shape):
                fixed += part_bytes(shape, mode, name)
            else:
                weights.append(mixed.estimated_candidate(f"{block}/{name}", shape, lambda s, m: part_bytes(s, parse_quant_mode(m), None)))
    return mixed.allocate(weights, mode.target_bytes - fixed)


# -- the calibration forward ----------------------------------------------------------------------


def calibration_ids(tokenizer_path, count: int = CALIBRATION_TOKENS) -> list[int]:
    """`count` token ids from the end of the pydoc topics text (the benchmarks score its start)."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer

    text = "\n\n".join(topics[key] for key in sorted(topics, reverse=True))
    ids = Tokenizer.from_file(str(tokenizer_path)).encode(text[: 16 * count], add_special_tokens=False).ids
    return ids[:count]


def activation_stats(config, model_dir, layout, tensor_for) -> dict[str, torch.Tensor]:
    """"block/tensor" -> mean square of each input column over the calibration tokens; the
    embedding's entry also weighs its rows by how often the tokens used them (head use, when tied,
    adds the columns' mean square)."""
    from pathlib import Path

    from tierlm.cache.kv import KVCache
    from tierlm.models import family_class

    ids = calibration_ids(Path(model_dir) / "tokenizer.json")
    store = CalibrationStore(layout, tensor_for)
    model = family_class(config)(config, store, len(ids), "cpu", torch.float32)
    with torch.no_grad():
        model.forward(torch.tensor([ids]), KVCache.for_model(config, len(ids)), logits="last")
    return store.statistics()


class CalibrationStore(WeightStore):
    """Builds each block from the source when acquired, with its 2-D weights wrapped in recorders;
    holds only the block in use."""

    def __init__(self, layout, tensor_for):
        self._layout, self._tensor_for = layout, tensor_for
        self._columns: dict[str, torch.Tensor] = {}  # sums of x^2 per column
        self._rows: dict[str, int] = {}  # activation rows seen
        self._tokens: dict[str, torch.Tensor] = {}  # embedding lookups per row
        self._owner = {sources: f"{block}/{name}" for block, entries in reversed(list(layout.items()))
                       for name, sources in entries.items()}  # fmt: skip  (a tied head -> the embedding's key)

    def acquire(self, block: str):
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
