"""A paged KV cache: one pool of fixed-size pages, and per sequence slot a page table.

Storage is [layers, kv_heads, pages, page_tokens, width] (codes of kv/formats.py's format, and
fp16 scales when quantized), allocated once with `torch.empty`: head-major, so one head's pages
lie in their own region and a sequence on consecutive pages reads each head's rows as one run.
A slot's context is the list of pages holding its positions in order, taken from the pool as
it grows and given back when it shrinks or is freed, so sequences share one budget instead of
each reserving the whole context. A page may be in several slots' tables (`share_rows`: a prefix another sequence
computed): the pool counts its holders, and a slot about to write into a page it shares gets
its own copy first (copy on write), so shared rows are never written twice.

`slot(i)` is a single-sequence view with KVCache's interface (kv/cache.py), for prefill;
`batch(slots)` one decode step over several slots. The fused CPU decode step reads pages in
place through each row's table (csrc/fused_decode.h), a device graph gathers them by table
inside the graph (models/graph_decode.py), and the eager path gathers a layer's pages into a
contiguous span per call.
"""

from __future__ import annotations

import torch

from tierlm.kv import codec
from tierlm.kv.cache import DecodeRows, _Contiguous, _model_dims, _Storage
from tierlm.models.base import position_mask

# Positions per page: a power of two (the native read shifts) and a multiple of 4 (it reads
# four positions at a time); small enough that a shared prefix wastes at most a few rows.
PAGE_TOKENS = 16


class PoolFull(Exception):
    """No free page is left in the pool (the caller frees some, or waits)."""


class PagePool:
    """Which pages are free, and how many page tables hold each (torch-free bookkeeping).

    Pages are handed out so that a sequence's pages tend to be consecutive (its next page is the
    one after its last, when free; a first page is taken in the middle of the longest free run,
    leaving room for the sequence before it to grow too): consecutive pages are read as one run
    (csrc/attention.h, `PagedKVCache._read`)."""

    def __init__(self, pages: int):
        self.holders = [0] * pages
        self._free = set(range(pages))

    @property
    def size(self) -> int:
        return len(self.holders)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.size - self.free

    def take(self, after: int | None = None) -> int:
        """A free page (one holder): the one after page `after` if it is free."""
        if not self._free:
            raise PoolFull(f"all {self.size} KV pages are in use")
        page = after + 1 if after is not None and after + 1 in self._free else self._roomiest()
        self._free.remove(page)
        self.holders[page] = 1
        return page

    def _roomiest(self) -> int:
        """The first page of the longest free run starting the pool, else the middle of the longest."""
        free = sorted(self._free)
        best, longest, start = free[0], 0, free[0]
        for page, following in zip(free, [*free[1:], None]):
            if following != page + 1:
                if page - start + 1 > longest:
                    best, longest = start, page - start + 1
                start = following
        return best if best == 0 else best + longest // 2

    def hold(self, page: int) -> None:
        self.holders[page] += 1

    def drop(self, page: int) -> None:
        self.holders[page] -= 1
        if self.holders[page] == 0:
            self._free.add(page)

    def shared(self, page: int) -> bool:
        return self.holders[page] > 1


def pages_for(positions: int, page_tokens: int = PAGE_TOKENS) -> int:
    """Pages that hold `positions` positions."""
    return -(-positions // page_tokens)


class PagedKVCache(_Storage):
    """Keys and values of up to `slots` sequences in a pool of `pages` pages of `page_tokens`
    positions; each slot at most `max_len` positions long."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        slots: int,
        pages: int,
        *,
        page_tokens: int = PAGE_TOKENS,
        device="cpu",
        dtype: torch.dtype = torch.float32,
        kv_format=None,
    ):
        if page_tokens < 4 or page_tokens & (page_tokens - 1) or page_tokens % 4:
            raise ValueError(f"a page holds a power of two positions, at least 4 (not {page_tokens})")
        self._allocate((layers, kv_heads, pages, page_tokens), head_dim, device, dtype, kv_format)
        self.page_tokens = page_tokens
        self.max_len = max_len
        self.pool = PagePool(pages)
        self._fresh = [True] * pages  # never taken: `torch.empty` may have left NaN in it
        self.tables: list[list[int]] = [[] for _ in range(slots)]
        self._lengths = [0] * slots
        # Slots cut shorter since a pipeline last told its other stages (their twins free pages too).
        self.shrunk: dict[int, int] = {}

    @classmethod
    def for_model(cls, config, max_len: int, slots: int, pages: int, *, device="cpu", dtype=torch.float32,
                  layers: int | None = None, kv_format=None, page_tokens: int = PAGE_TOKENS):  # fmt: skip
        return cls(*_model_dims(config, layers), max_len, slots, pages, page_tokens=page_tokens, device=device,
                   dtype=dtype, kv_format=kv_format)  # fmt: skip

    @property
    def slots(self) -> int:
        return len(self.tables)

    @property
    def lengths(self) -> tuple[int, ...]:
        """Each slot's positions (read-only: `set_length` changes one)."""
        return tuple(self._lengths)

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def slot(self, index: int) -> "PagedView":
        return PagedView(self, index)

    def batch(self, slots: list[int]) -> "PagedBatch":
        return PagedBatch(self, slots)

    # -- page tables -----------------------------------------------------------------------

    def set_length(self, slot: int, length: int) -> None:
        """Make `slot` hold its first `length` positions (at most what it holds, unless a
        pipeline's other stage mirrors rank 0's lengths); pages past them go back to the pool."""
        length = max(0, length)
        table = self.tables[slot]
        if length < self._lengths[slot]:
            self.shrunk[slot] = min(length, self.shrunk.get(slot, length))
        for page in table[pages_for(length, self.page_tokens) :]:
            self.pool.drop(page)
        del table[pages_for(length, self.page_tokens) :]
        self._lengths[slot] = length

    def free(self, slot: int) -> None:
        """Forget slot `slot`'s rows and give its pages back."""
        self.set_length(slot, 0)

    def reserve(self, slot: int, end: int) -> None:
        """Make `slot`'s table cover positions [0, end) with pages it alone holds from its length
        on (taken from the pool, or copied where shared). Raises PoolFull (the table may have
        grown by the pages taken so far: they are the slot's, returned when it shrinks)."""
        if end > self.max_len:
            raise ValueError(f"{end} positions exceed the KV cache ({self.max_len})")
        table, pool, size = self.tables[slot], self.pool, self.page_tokens
        for index in range(self._lengths[slot] // size, min(len(table), pages_for(end, size))):
            if pool.shared(table[index]):  # copy on write: the other holders keep the page as it is
                copy = self._clone_page(table[index])
                pool.drop(table[index])
                table[index] = copy
        while len(table) < pages_for(end, size):
            table.append(self._take(table[-1] if table else None))

    def pages_needed(self, slot: int, end: int) -> int:
        """Pages `reserve(slot, end)` would take from the pool."""
        table, size = self.tables[slot], self.page_tokens
        shared = range(self._lengths[slot] // size, min(len(table), pages_for(end, size)))
        return max(0, pages_for(end, size) - len(table)) + sum(self.pool.shared(table[i]) for i in shared)

    def share_rows(self, source: int, target: int, length: int) -> None:
        """Make slot `target` hold slot `source`'s first `length` positions: its full pages are
        shared (held by both tables, never written by either again without a copy), the last
        partial one copied."""
        if source == target:
            self.set_length(target, min(length, self._lengths[target]))
            return
        self.free(target)
        full, size = length // self.page_tokens, self.page_tokens
        table = self.tables[target]
        for page in self.tables[source][:full]:
            self.pool.hold(page)
            table.append(page)
        if length % size:
            table.append(self._clone_page(self.tables[source][full]))
        self._lengths[target] = length

    def _take(self, after: int | None = None) -> int:
        """A page from the pool (the one after page `after` if free); zeroed on its first use, so
        that a step reading past a sequence's own rows (masked: a batch's span, a padded table)
        never meets a NaN (0 * NaN is NaN)."""
        page = self.pool.take(after)
        if self._fresh[page]:
            for part in (self.keys, self.values, self.key_scales, self.value_scales):
                if part is not None:
                    part[:, :, page].zero_()
            self._fresh[page] = False
        return page

    def _clone_page(self, page: int) -> int:
        """A new page (one holder) holding `page`'s rows, every layer."""
        copy = self._take()
        for part in (self.keys, self.values, self.key_scales, self.value_scales):
            if part is not None:
                part[:, :, copy].copy_(part[:, :, page])
        return copy

    # -- reading and writing ---------------------------------------------------------------

    def _where(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages, rows within them) of positions [start, end) of `slot`, as index tensors."""
        positions = torch.arange(start, end)
        table = torch.tensor(self.tables[slot], dtype=torch.long)
        pages = table[positions // self.page_tokens].to(self.device)
        return pages, (positions % self.page_tokens).to(self.device)

    def _write(self, layer: int, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values [T, kv_heads, D] at positions start.. of `slot` (its pages reserved)."""
        pages, rows = self._where(slot, start, start + keys.shape[0])
        self._store(layer, (slice(None), pages, rows), keys.transpose(0, 1), values.transpose(0, 1))

    def _read(self, layer: int, tables: list[list[int]], end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of each table's first `end` positions in the compute dtype
        [len(tables), kv_heads, end, D] (a gathered copy; a table shorter than `end` is padded
        with its own last page, whose rows the caller masks)."""
        count = pages_for(end, self.page_tokens)
        first = tables[0][0] if len(tables) == 1 and tables[0] else None
        if first is not None and tables[0][:count] == list(range(first, first + count)):
            return self._read_run(layer, first, count, end)  # consecutive pages: views, no gather
        index = torch.tensor([(t + t[-1:] * count)[:count] for t in tables], dtype=torch.long, device=self.device)
        out = []
        for codes, scales in ((self.keys, self.key_scales), (self.values, self.value_scales)):
            spans = [self._span(p[layer] if p is not None else None, index, end) for p in (codes, scales)]
            out.append(codec.decode(self.format, spans[0], spans[1], self.dtype))
        return out[0], out[1]

    def _read_run(self, layer: int, first: int, count: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`_read` of one table whose first `count` pages are `first`, `first` + 1, ...: each head's
        rows lie in one run, read as a view (decoded in place where the format is the compute dtype)."""
        out = []
        for codes, scales in ((self.keys, self.key_scales), (self.values, self.value_scales)):
            runs = [None if p is None else p[layer][:, first : first + count].flatten(1, 2)[None, :, :end]
                    for p in (codes, scales)]  # fmt: skip
            out.append(codec.decode(self.format, runs[0], runs[1], self.dtype))
        return out[0], out[1]

    def _span(self, part: torch.Tensor | None, index: torch.Tensor, end: int) -> torch.Tensor | None:
        """One layer's `part` [kv_heads, pages, P, w] gathered to [n, kv_heads, end, w]."""
        if part is None:
            return None
        n, count = index.shape
        pages = part[:, index]  # [kv_heads, n, count, P, w]
        return pages.transpose(0, 1).reshape(n, part.shape[0], count * self.page_tokens, part.shape[-1])[:, :, :end]

    def rows_of(self, slot: int, length: int) -> list[torch.Tensor]:
        """Copies of `slot`'s first `length` positions, every layer: keys, values and (quantized)
        their scales, each [layers, kv_heads, length, ...] (what a spilled conversation keeps)."""
        count = pages_for(length, self.page_tokens)
        index = torch.tensor(self.tables[slot][:count], dtype=torch.long, device=self.device)
        out = []
        for part in (self.keys, self.values, self.key_scales, self.value_scales):
            if part is not None:
                pages = part[:, :, index]  # [layers, kv_heads, count, P, w]
                rows = pages.reshape(part.shape[0], part.shape[1], count * self.page_tokens, part.shape[-1])
                out.append(rows[:, :, :length].contiguous())
        return out

    def empty_rows(self, length: int) -> list[torch.Tensor]:
        """Uninitialised host tensors shaped as `rows_of(slot, length)` gives them (to read into)."""
        parts = (self.keys, self.values, self.key_scales, self.value_scales)
        return [torch.empty((*p.shape[:2], length, p.shape[4]), dtype=p.dtype) for p in parts if p is not None]

    def write_rows(self, slot: int, rows: list[torch.Tensor], length: int) -> None:
        """Make `slot` hold `rows` (as `rows_of` gives them) as its first `length` positions."""
        self.free(slot)
        self.reserve(slot, length)
        pages, offsets = self._where(slot, 0, length)
        parts = [p for p in (self.keys, self.values, self.key_scales, self.value_scales) if p is not None]
        for part, held in zip(parts, rows, strict=True):
            part[:, :, pages, offsets] = held[:, :, :length].to(part.dtype)  # [layers, kv_heads, length, w]
        self._lengths[slot] = length

    def decode_rows_of(self, slots: list[int], positions: list[int]) -> DecodeRows:
        for slot, position in zip(slots, positions):
            self.reserve(slot, position + 1)
        tables = [list(self.tables[s]) for s in slots]
        return DecodeRows(self.keys, self.values, list(slots), list(positions), self.key_scales, self.value_scales,
                          self.format, tables, self.page_tokens)  # fmt: skip

    @property
    def used_bytes(self) -> int:
        """Bytes of the pages in use."""
        return self.nbytes * self.pool.used // self.pool.size


class PagedView(_Contiguous):
    """One slot of a PagedKVCache behind the single-sequence KVCache interface (batch 1)."""

    def __init__(self, parent: PagedKVCache, index: int):
        self.parent = parent
        self.index = index
        self.max_len = parent.max_len

    @property
    def offset(self) -> int:
        return self.parent.lengths[self.index]

    @property
    def device(self) -> torch.device:
        return self.parent.device

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [1, T, kv_heads, D] at the slot's offset; return [1, kv_heads, S, D]."""
        start, end = self.offset, self.offset + keys.shape[1]
        self.parent.reserve(self.index, end)
        self.parent._write(layer, self.index, start, keys[0], values[0])
        return self.parent._read(layer, [self.parent.tables[self.index]], end)

    def decode_rows(self) -> DecodeRows:
        return self.parent.decode_rows_of([self.index], [self.offset])

    def chunk_rows(self, length: int) -> DecodeRows:
        """For a fused prefill chunk: the slot's pages, reserved for `length` more positions."""
        start = self.offset
        self.parent.reserve(self.index, start + length)
        return DecodeRows(self.parent.keys, self.parent.values, [self.index], list(range(start, start + length)),
                          self.parent.key_scales, self.parent.value_scales, self.parent.format,
                          [list(self.parent.tables[self.index])], self.parent.page_tokens)  # fmt: skip

    def advance(self, length: int) -> None:
        self.parent._lengths[self.index] += length

    def trim(self, length: int) -> None:
        self.parent.set_length(self.index, min(self.offset, length))

    def reset(self) -> None:
        self.parent.set_length(self.index, 0)


class PagedBatch:
    """One decode step over `slots` of a PagedKVCache: one new token per slot at its own position."""

    def __init__(self, parent: PagedKVCache, slots: list[int]):
        if not slots:
            raise ValueError("a decode step needs at least one slot")
        lengths = [parent.lengths[s] for s in slots]
        if max(lengths) >= parent.max_len:
            raise ValueError(f"a slot is full: {max(lengths)} positions of {parent.max_len}")
        self.parent = parent
        self.slots = list(slots)
        self.max_len = parent.max_len
        self.key_len = max(lengths) + 1
        self.positions = torch.tensor(lengths, dtype=torch.long, device=parent.device)
        for slot, length in zip(self.slots, lengths):  # before the step: PoolFull leaves nothing half written
            parent.reserve(slot, length + 1)
        size = parent.page_tokens
        pages = [parent.tables[s][n // size] for s, n in zip(self.slots, lengths)]
        rows = torch.tensor([n % size for n in lengths], dtype=torch.long, device=parent.device)
        self._where = (slice(None), torch.tensor(pages, dtype=torch.long, device=parent.device), rows)

    def rope(self, table, length: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if length != 1:
            raise ValueError(f"a batched step adds one token per slot, not {length}")
        return table.at(self.positions)

    def mask(self, length: int, groups: int, window: int | None) -> torch.Tensor:
        return position_mask(self.positions, self.key_len, window)

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [n, 1, kv_heads, D] at each slot's position; return [n, kv_heads, S, D]
        (positions past a slot's own hold finite leftovers, which the mask gives no weight)."""
        parent = self.parent
        parent._store(layer, self._where, keys[:, 0].transpose(0, 1), values[:, 0].transpose(0, 1))
        return parent._read(layer, [parent.tables[s] for s in self.slots], self.key_len)

    def decode_rows(self) -> DecodeRows:
        return self.parent.decode_rows_of(self.slots, [self.parent.lengths[s] for s in self.slots])

    def advance(self, length: int = 1) -> None:
        for slot in self.slots:
            self.parent._lengths[slot] += length
