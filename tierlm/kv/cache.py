"""A preallocated KV cache written in place at the current offset (static shapes), holding keys
and values in one of kv/formats.py's formats (the compute dtype, fp16, bf16, q8_0, q4_0)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from tierlm.kv import codec
from tierlm.kv.formats import FORMATS, GROUP, KVFormat
from tierlm.models.base import attention_mask


class DecodeRows(NamedTuple):
    """What a fused or captured decode step needs of a cache: the storage of every layer
    (codes [layers, rows, kv_heads, max_len, width]; fp16 scales [..., D / 32] or None), each
    row's slot and the position its new token goes to. A paged cache (kv/paged.py) holds
    [layers, kv_heads, pages, page_tokens, width] and gives each row's pages instead of a slot.
    A prefill chunk (`chunk_rows`) is one slot (one page table) and one position per token."""

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
    """Keys and values of every layer in one format: codes `keys`/`values` (KVCache: [layers,
    rows, kv_heads, max_len, width]) and, quantized, fp16 `key_scales`/`value_scales` [..., D / 32],
    left uninitialised (`torch.empty`: memory is touched only as positions fill). Written in
    `format`, read back in `dtype` (the compute dtype)."""

    def _allocate(self, dims: tuple[int, int, int, int], head_dim, device, dtype, kv_format):
        """Codes (and scales) of shape [*dims, width]: KVCache's dims are (layers, rows, kv_heads,
        max_len), a paged cache's (layers, kv_heads, pages, page_tokens)."""
        fmt = as_format(kv_format, dtype)
        self.format, self.dtype, self.head_dim = fmt, dtype, head_dim
        shape = (*dims, codec.code_width(fmt, head_dim))
        code = codec.code_dtype(fmt)
        self.keys = torch.empty(shape, device=device, dtype=code)
        self.values = torch.empty(shape, device=device, dtype=code)
        self.key_scales = self.value_scales = None
        if fmt.quantized:
            scale_shape = (*shape[:-1], head_dim // GROUP)
            self.key_scales = torch.empty(scale_shape, device=device, dtype=torch.float16)
            self.value_scales = torch.empty(scale_shape, device=device, dtype=torch.float16)

    def _store(self, layer: int, where: tuple, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys/values [..., D] at `where` (an index into one layer's codes, all but the width)."""
        for codes, scales, x in ((self.keys, self.key_scales, keys), (self.values, self.value_scales, values)):
            encoded, scale = codec.encode(self.format, x)
            codes[layer][where] = encoded
            if scales is not None:
                scales[layer][where] = scale

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
        self._allocate((layers, batch, kv_heads, max_len), head_dim, device, dtype, kv_format)
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

    def _load(self, layer: int, rows, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `rows` over positions [0, end) in the compute dtype [n, kv_heads, end, D]
        (views of the cache when it holds the compute dtype)."""
        out = []
        for codes, scales in ((self.keys, self.key_scales), (self.values, self.value_scales)):
            part = scales[layer][rows, :, :end] if scales is not None else None
            out.append(codec.decode(self.format, codes[layer][rows, :, :end], part, self.dtype))
        return out[0], out[1]

    def rows_of(self, row: int, length: int) -> list[torch.Tensor]:
        """Row `row`'s storage over its first `length` positions, every layer: keys, values and
        (quantized) their scales, each [layers, kv_heads, length, ...] (what a saved session holds)."""
        parts = (self.keys, self.values, self.key_scales, self.value_scales)
        return [p[:, row, :, :length] for p in parts if p is not None]

    def decode_rows(self) -> DecodeRows:
        """For a fused one-token step: the storage, each row's slot and position."""
        rows = self.keys.shape[1]
        return DecodeRows(self.keys, self.values, list(range(rows)), [self.offset] * rows, self.key_scales,
                          self.value_scales, self.format)  # fmt: skip

    def chunk_rows(self, length: int) -> DecodeRows | None:
        """For a fused prefill chunk of a batch-1 cache: its slot and the chunk's `length` positions
        after the offset (None for a batch of several rows: the eager path runs)."""
        if self.keys.shape[1] != 1:
            return None
        return DecodeRows(self.keys, self.values, [0], list(range(self.offset, self.offset + length)),
                          self.key_scales, self.value_scales, self.format)  # fmt: skip

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
