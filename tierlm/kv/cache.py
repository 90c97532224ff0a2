"""A preallocated KV cache written in place at the current offset (static shapes), holding keys
and values in one of kv/formats.py's formats (the compute dtype, fp16, bf16, q8_0, q4_0)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from tierlm.kv import codec
from tierlm.kv.formats import FORMATS, GROUP, KVFormat
from tierlm.models.base import attention_mask, position_mask


class DecodeRows(NamedTuple):
    """What a fused or captured decode step needs of a cache: the storage of every layer
    (codes [layers, rows, kv_heads, max_len, width]; fp16 scales [..., D / 32] or None), each
    row's slot and the position its new token goes to. A paged cache (kv/paged.py) holds
    [layers, pages, kv_heads, page_tokens, width] and gives each row's pages instead of a slot."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: list[int]
    positions: list[int]
    key_scales: torch.Tensor | None
    value_scales: torch.Tensor | None
    format: KVFormat
    page_tables: list[list[int]] | None = None
    page_tokens: int = 0


class _Storage:
    """Keys and values of every layer in one format: codes `keys`/`values` [layers, rows,
    kv_heads, max_len, width] and, quantized, fp16 `key_scales`/`value_scales` [..., D / 32],
    left uninitialised (`torch.empty`: memory is touched only as positions fill). Written in
    `format`, read back in `dtype` (the compute dtype)."""

    def _allocate(self, layers, rows, kv_heads, head_dim, max_len, device, dtype, kv_format):
        fmt = as_format(kv_format, dtype)
        self.format, self.dtype, self.head_dim = fmt, dtype, head_dim
        shape = (layers, rows, kv_heads, max_len, codec.code_width(fmt, head_dim))
        code = codec.code_dtype(fmt)
        self.keys = torch.empty(shape, device=device, dtype=code)
        self.values = torch.empty(shape, device=device, dtype=code)
        self.key_scales = self.value_scales = None
        if fmt.quantized:
            scale_shape = (*shape[:-1], head_dim // GROUP)
            self.key_scales = torch.empty(scale_shape, device=device, dtype=torch.float16)
            self.value_scales = torch.empty(scale_shape, device=device, dtype=torch.float16)

    def _store(self, layer: int, where: tuple, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys/values [..., D] at `where` (an index into one layer's [rows, kv_heads, max_len])."""
        for codes, scales, x in ((self.keys, self.key_scales, keys), (self.values, self.value_scales, values)):
            encoded, scale = codec.encode(self.format, x)
            codes[layer][where] = encoded
            if scales is not None:
                scales[layer][where] = scale

    def _load(self, layer: int, rows, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `rows` over positions [0, end) in the compute dtype [n, kv_heads, end, D]
        (views of the cache when it holds the compute dtype)."""
        out = []
        for codes, scales in ((self.keys, self.key_scales), (self.values, self.value_scales)):
            part = scales[layer][rows, :, :end] if scales is not None else None
            out.append(codec.decode(self.format, codes[layer][rows, :, :end], part, self.dtype))
        return out[0], out[1]

    def _zero(self, rows, start: int, end: int) -> None:
        for part in (self.keys, self.values, self.key_scales, self.value_scales):
            if part is not None:
                part[:, rows, :, start:end].zero_()

    def rows_of(self, row: int, length: int) -> list[torch.Tensor]:
        """Row `row`'s storage over its first `length` positions, every layer: keys, values and
        (quantized) their scales, each [layers, kv_heads, length, ...] (what a saved session holds)."""
        parts = (self.keys, self.values, self.key_scales, self.value_scales)
        return [p[:, row, :, :length] for p in parts if p is not None]

    @property
    def nbytes(self) -> int:
        """Bytes reserved for the whole context."""
        parts = (self.keys, self.values, self.key_scales, self.value_scales)
        return sum(p.nbytes for p in parts if p is not None)


def as_format(kv_format, dtype: torch.dtype) -> KVFormat:
    """A KVFormat from a format, its name, or None (held in the compute dtype `dtype`)."""
    if isinstance(kv_format, KVFormat):
        return kv_format
    if kv_format is None:
        return FORMATS[{torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]]
    return FORMATS[kv_format]


def _model_dims(config, layers: int | None) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim): what a cache needs from a ModelConfig. `layers`: how many
    it holds (a pipeline stage's, which the model indexes from its first); None: every layer."""
    return config.num_hidden_layers if layers is None else layers, config.num_key_value_heads, config.head_dim


class _Contiguous:
    """Positions and mask for a cache whose rows all append T tokens after one `offset`."""

    def rope(self, table, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, R] for positions offset..offset+T-1; raises if they exceed max_len."""
        if self.offset + length > self.max_len:
            raise ValueError(f"{self.offset + length} positions exceed the KV cache ({self.max_len})")
        return table.slice(self.offset, length)

    def mask(self, length: int, groups: int, window: int | None) -> torch.Tensor | None:
        """Causal (and sliding-window) mask [groups * T, offset + T] for T new queries, or None."""
        return attention_mask(length, self.offset + length, groups, window, self.device)


class KVCache(_Contiguous, _Storage):
    """Keys and values for every layer: [layers, batch, kv_heads, max_len, head_dim] each (as
    codes of its format, see _Storage).

    Allocated once with `torch.empty`, so pages are only touched as positions fill and
    resident memory grows with the conversation, not with the reserved context.
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        batch: int = 1,
        device="cpu",
        dtype: torch.dtype = torch.float32,
        kv_format: KVFormat | str | None = None,
    ):
        """`dtype`: the compute dtype keys are read back in; `kv_format`: how they are held
        (None: in `dtype`)."""
        self._allocate(layers, batch, kv_heads, head_dim, max_len, device, dtype, kv_format)
        self.max_len = max_len
        self.offset = 0

    @classmethod
    def for_model(cls, config, max_len: int, *, batch: int = 1, device="cpu", dtype=torch.float32,
                  layers: int | None = None, kv_format=None):  # fmt: skip
        return cls(*_model_dims(config, layers), max_len, batch=batch, device=device, dtype=dtype,
                   kv_format=kv_format)  # fmt: skip

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [B, T, kv_heads, D] at the offset; return all so far [B, kv_heads, S, D]."""
        end = self.offset + keys.shape[1]
        where = (slice(None), slice(None), slice(self.offset, end))
        self._store(layer, where, keys.transpose(1, 2), values.transpose(1, 2))
        return self._load(layer, slice(None), end)

    def decode_rows(self) -> DecodeRows:
        """For a fused one-token step: the storage, each row's slot and position."""
        rows = self.keys.shape[1]
        return DecodeRows(self.keys, self.values, list(range(rows)), [self.offset] * rows, self.key_scales,
                          self.value_scales, self.format)  # fmt: skip

    def advance(self, length: int) -> None:
        """Commit `length` new positions after every layer has written them."""
        self.offset += length

    def trim(self, length: int) -> None:
        """Forget everything after the first `length` positions (reuse of a shared prefix)."""
        self.offset = min(self.offset, max(0, length))

    def reset(self) -> None:
        self.offset = 0

    @property
    def used_bytes(self) -> int:
        return self.nbytes * self.offset // self.max_len


class SlotKVCache(_Storage):
    """Keys and values for `slots` independent sequences: [layers, slots, kv_heads, max_len, D].

    Each slot has its own length, so sequences of different ages share one buffer and one
    decode step (continuous batching). `slot(i)` is a single-sequence view with the KVCache
    interface, used to prefill one sequence; `batch(slots)` describes one decode step over
    several slots for `LlamaModel.forward`. Allocated with `torch.empty`, like KVCache.
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        slots: int,
        *,
        device="cpu",
        dtype: torch.dtype = torch.float32,
        kv_format: KVFormat | str | None = None,
    ):
        self._allocate(layers, slots, kv_heads, head_dim, max_len, device, dtype, kv_format)
        self.max_len = max_len
        self.lengths = [0] * slots
        # Per slot, how many leading positions hold finite numbers (written once, or zeroed).
        self.finite = [0] * slots

    @classmethod
    def for_model(cls, config, max_len: int, slots: int, *, device="cpu", dtype=torch.float32,
                  layers: int | None = None, kv_format=None):  # fmt: skip
        return cls(*_model_dims(config, layers), max_len, slots, device=device, dtype=dtype, kv_format=kv_format)

    @property
    def slots(self) -> int:
        return len(self.lengths)

    def slot(self, index: int) -> "SlotView":
        return SlotView(self, index)

    def batch(self, slots: list[int]) -> "SlotBatch":
        return SlotBatch(self, slots)

    def copy_rows(self, source: int, target: int, length: int) -> None:
        """Make slot `target` hold slot `source`'s first `length` positions (every layer, codes
        and scales): a prefix another sequence computed, taken instead of computed again."""
        for part in (self.keys, self.values, self.key_scales, self.value_scales):
            if part is not None:
                part[:, target, :, :length].copy_(part[:, source, :, :length])
        self.lengths[target] = length
        self.finite[target] = max(self.finite[target], length)

    def decode_rows_of(self, slots: list[int], positions: list[int]) -> DecodeRows:
        return DecodeRows(self.keys, self.values, list(slots), list(positions), self.key_scales, self.value_scales,
                          self.format)  # fmt: skip

    def free(self, index: int) -> None:
        """Forget slot `index` so a new sequence can start in it."""
        self.lengths[index] = 0

    def make_finite(self, slots: list[int], length: int) -> None:
        """Zero the never-written positions below `length` of `slots`.

        A batched step reads every slot up to the longest one. The mask gives the positions past
        a slot's own length weight 0, but 0 * NaN is NaN, and `torch.empty` memory may hold NaN;
        zeroing lazily touches only memory the batch reads, not the whole reserved context.
        """
        for slot in slots:
            start = self.finite[slot]
            if start < length:
                self._zero(slot, start, length)
                self.finite[slot] = length

    @property
    def used_bytes(self) -> int:
        return self.nbytes * sum(self.lengths) // (self.max_len * self.slots)


class SlotView(_Contiguous):
    """One slot of a SlotKVCache behind the single-sequence KVCache interface (batch 1)."""

    def __init__(self, parent: SlotKVCache, index: int):
        self.parent = parent
        self.index = index
        self.max_len = parent.max_len

    @property
    def offset(self) -> int:
        return self.parent.lengths[self.index]

    @property
    def device(self) -> torch.device:
        return self.parent.keys.device

    def update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [1, T, kv_heads, D] at the slot's offset; return [1, kv_heads, S, D]."""
        start, end = self.offset, self.offset + keys.shape[1]
        rows = slice(self.index, self.index + 1)
        self.parent._store(layer, (rows, slice(None), slice(start, end)), keys.transpose(1, 2), values.transpose(1, 2))
        self.parent.finite[self.index] = max(self.parent.finite[self.index], end)
        return self.parent._load(layer, rows, end)

    def decode_rows(self) -> DecodeRows:
        """For a fused one-token step: the storage, [slot], [position]; the position counts as written."""
        self.parent.finite[self.index] = max(self.parent.finite[self.index], self.offset + 1)
        return self.parent.decode_rows_of([self.index], [self.offset])

    def advance(self, length: int) -> None:
        self.parent.lengths[self.index] += length

    def trim(self, length: int) -> None:
        self.parent.lengths[self.index] = min(self.offset, max(0, length))

    def reset(self) -> None:
        self.parent.lengths[self.index] = 0


class SlotBatch:
    """One decode step over `slots` of a SlotKVCache: one new token per slot at its own position.

    `positions` [n] (long, on the cache's device) is where each slot's new token goes;
    `key_len` is how many positions the step's attention spans (the longest slot + 1);
    a slot's positions past its own length are masked out by the model.
    """

    def __init__(self, parent: SlotKVCache, slots: list[int]):
        if not slots:
            raise ValueError("a decode step needs at least one slot")
        lengths = [parent.lengths[s] for s in slots]
        if max(lengths) >= parent.max_len:
            raise ValueError(f"a slot is full: {max(lengths)} positions of {parent.max_len}")
        device = parent.keys.device
        self.parent = parent
        self.slots = list(slots)
        self.max_len = parent.max_len
        self.key_len = max(lengths) + 1
        parent.make_finite(self.slots, self.key_len)
        self.positions = torch.tensor(lengths, dtype=torch.long, device=device)
        self._index = torch.tensor(self.slots, dtype=torch.long, device=device)
        first = self.slots[0]
        # Adjacent slots are read as a view of the buffer; others are gathered (a copy per layer).
        adjacent = self.slots == list(range(first, first + len(self.slots)))
        self._rows = slice(first, first + len(self.slots)) if adjacent else self._index

    def rope(self, table, length: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, 1, 1, R], one position per slot (a step adds one token per slot)."""
        if length != 1:
            raise ValueError(f"a batched step adds one token per slot, not {length}")
        return table.at(self.positions)

    def mask(self, length: int, groups: int, window: int | None) -> torch.Tensor:
        """[n, 1, 1, key_len]: each slot sees its own keys up to its position (within the window)."""
        return position_mask(self.positions, self.key_len, window)

    def update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [n, 1, kv_heads, D] at each slot's position; return [n, kv_heads, S, D]."""
        self.parent._store(layer, (self._index, slice(None), self.positions), keys[:, 0], values[:, 0])
        return self.parent._load(layer, self._rows, self.key_len)

    def decode_rows(self) -> DecodeRows:
        """For a fused step: the storage, each row's slot and position."""
        return self.parent.decode_rows_of(self.slots, [self.parent.lengths[s] for s in self.slots])

    def advance(self, length: int = 1) -> None:
        for slot in self.slots:
            self.parent.lengths[slot] += length
