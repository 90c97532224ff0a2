"""The decode step with static shapes and addresses, captured once and replayed per token.

`LlamaModel.forward` hands a one-token step to `GraphedDecode.forward` when the model has one
(`graphs_for`: an accelerator that captures graphs, every layer, the norm and the head resident
on it, `TIERLM_GRAPHS` not 0). A pipeline stage captures its own layers; only the last stage's
graph ends with the norm and head, the others' with the hidden states the next stage takes. The captured step is the family's own `decoder_layer` fed from
device tensors instead of Python ints: cos/sin are `index_select`ed from the rotary table at a
positions tensor, the mask is built from it over a fixed key span, and keys/values are written
with `index_put_` at (slot, position) tensors and read over the same span (`StaticRows`).
Unwritten positions inside the span are zeroed once (masked keys still enter SDPA: 0 * NaN).

One graph per (rows, key span, KV buffers): spans are powers of two from `min_span` up to the
cache's max_len, so early tokens do not pay attention over the whole reserved context. The
embedding lookup stays eager (a streamed embedding reads rows on the host); the logits (or hidden
states) come back as a copy of the static output, so a later replay cannot overwrite what a caller holds.
"""

from __future__ import annotations

import logging

import torch

from tierlm.blocks import EMBED, HEAD, NORM, layer_block
from tierlm.device.graphs import DecodeGraph, GraphUnavailable, graph_factory, graph_kind
from tierlm.models import base

MIN_SPAN = 256


def graphs_for(model) -> GraphedDecode | None:
    """The model's graphed decode, or None (logged with the reason) when decode stays eager."""
    reason = refusal(model)
    if reason is not None:
        level = logging.DEBUG if model.device.type == "cpu" else logging.INFO
        logging.getLogger("tierlm.graphs").log(level, "decode graphs off: %s", reason)
        return None
    kind, _ = graph_kind(model.device)
    return GraphedDecode(model, graph_factory(kind))


def refusal(model) -> str | None:
    """Why `model`'s decode cannot be captured as a graph, or None when it can."""
    kind, why = graph_kind(model.device)
    if kind is None:
        return why
    if model.config.moe is not None:
        return "mixture-of-experts layers choose their experts per token on the host (no static graph)"
    return streamed_refusal(model.store)


def streamed_refusal(store) -> str | None:
    """A block the graph would read that is not resident on the device, or None.

    The embedding is looked up outside the graph, so it may live anywhere; any other block
    streamed through the ring (host syncs, changing buffers) or computed on the host refuses.
    """
    placement = getattr(store, "placement", None)
    if placement is None:
        return None  # a resident store: every block lives on the compute device
    for placed in placement.blocks:
        if placed.name == EMBED:
            continue
        if placed.tier != "device":
            how = "streamed through the ring" if placed.streamed else "computed on the host"
            return f"block {placed.name} lives on {placed.tier} ({how}); graphs need every block resident"
    return None


class StaticRows:
    """The KV cache as a captured step sees it (the `update` that `LlamaModel.attention` calls).

    keys/values are the cache's buffers: a KVCache's [layers, rows, kv_heads, max_len, D] (every
    row in the step), or paged (kv/paged.py) [layers, kv_heads, pages, page_tokens, D];
    `slots` [B] and `positions` [B] (long, on the device) say where each row's new token goes,
    and a paged cache's `tables` [B, span / page_tokens] which pages hold each row's span (read
    with index_select: a copy).
    """

    def __init__(self, keys, values, slots, positions, span: int, tables=None):
        self.keys, self.values = keys, values
        self.slots, self.positions, self.tables = slots, positions, tables
        self.span = span
        self.heads = torch.arange(keys.shape[1 if tables is not None else 2], device=keys.device)

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """Write keys/values [B, 1, kv_heads, D] at each row's (slot, position); return the
        rows' keys/values over the span [B, kv_heads, span, D]."""
        if self.tables is not None:
            size = self.keys.shape[3]
            page = self.tables.gather(1, torch.div(self.positions, size, rounding_mode="floor")[:, None])
            where = (self.heads[None, :], page, torch.remainder(self.positions, size)[:, None])
        else:
            where = (self.slots[:, None], self.heads[None, :], self.positions[:, None])
        self.keys[layer].index_put_(where, keys[:, 0])
        self.values[layer].index_put_(where, values[:, 0])
        return self._read(self.keys[layer]), self._read(self.values[layer])

    def _read(self, buffer: torch.Tensor) -> torch.Tensor:
        if self.tables is not None:  # each row's pages in order: [kv_heads, B, count, P, D] -> [B, kv_heads, span, D]
            rows, count = self.tables.shape
            pages = buffer.index_select(1, self.tables.reshape(-1))
            pages = pages.reshape(buffer.shape[0], rows, count, *buffer.shape[2:])
            return pages.transpose(0, 1).reshape(rows, buffer.shape[0], self.span, buffer.shape[-1])
        return buffer[:, :, : self.span]


class StaticStep:
    """One captured shape: its static inputs (hidden, slots, positions), output and graph. The
    output is the logits [B, 1, V] on the last pipeline stage, else the hidden states [B, 1, H]."""

    def __init__(self, model, rows: int, span: int, keys, values, graph: DecodeGraph, page_tokens: int = 0):
        cfg, device = model.config, model.device
        self.model = model
        self.hidden = torch.zeros(rows, 1, cfg.hidden_size, dtype=model.dtype, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        tables = torch.zeros(rows, span // page_tokens, dtype=torch.long, device=device) if page_tokens else None
        self.tables = tables
        if model.span.is_last:
            self.output = torch.zeros(rows, 1, cfg.vocab_size, dtype=torch.float32, device=device)
        else:
            self.output = torch.zeros(rows, 1, cfg.hidden_size, dtype=model.dtype, device=device)
        self.rows = StaticRows(keys, values, self.slots, self.positions, span, tables)
        self.graph = graph
        self.captured = False

    def __call__(self) -> None:
        """The step the graph captures: reads hidden/slots/positions, writes the output."""
        model, cfg, rotary = self.model, self.model.config, self.model.rotary
        cos = rotary.cos.index_select(0, self.positions)[:, None, None, :]
        sin = rotary.sin.index_select(0, self.positions)[:, None, None, :]
        mask = base.position_mask(self.positions, self.rows.span, cfg.sliding_window)
        x = self.hidden
        for i in model.span.layers:
            with model.store.block(layer_block(i)) as w:
                x = model.decoder_layer(w, x, self.rows, i, cos, sin, mask)
        if not model.span.is_last:
            self.output.copy_(x)
            return
        with model.store.block(NORM) as w:
            x = base.rms_norm(x, w["norm"], cfg.rms_norm_eps)
        with model.store.block(HEAD) as w:
            self.output.copy_(base.linear(x, w["head"]))

    def run(self, hidden: torch.Tensor, slots: list[int], positions: list[int], tables=None) -> torch.Tensor:
        """Copy the inputs in (`tables`: each row's pages, paged), replay (capturing on first
        use); the static output."""
        self.hidden.copy_(hidden)
        self.slots.copy_(torch.tensor(slots, dtype=torch.long))
        self.positions.copy_(torch.tensor(positions, dtype=torch.long))
        if self.tables is not None:  # padded with each row's last page: past its position, masked
            width = self.tables.shape[1]
            padded = [(t + t[-1:] * width)[:width] for t in tables]
            self.tables.copy_(torch.tensor(padded, dtype=torch.long))
        if not self.captured:
            self.graph.capture(self)
            self.captured = True
        self.graph.replay()
        return self.output


class GraphedDecode:
    """A model's one-token decode steps through captured graphs; `forward` or None (run eager)."""

    def __init__(self, model, new_graph, *, min_span: int = MIN_SPAN):
        self.model = model
        self.new_graph = new_graph
        self.min_span = min_span
        self.steps: dict[tuple, StaticStep] = {}
        self.buffers = None  # the KV buffers the steps were captured over
        self.zeroed = 0  # a plain KVCache: positions below this inside the span hold finite numbers
        self.failed: str | None = None

    def forward(self, x: torch.Tensor, cache) -> torch.Tensor | None:
        """The stage's output (`LlamaModel.forward`'s) for ids [B, 1] (or a later stage's hidden
        states [B, 1, H]) at the cache's positions, advancing it; None when this call must run
        eagerly (the cache is not a preallocated one in the compute dtype, or capture failed)."""
        if self.failed is not None or x.shape[1] != 1 or not hasattr(cache, "decode_rows"):
            return None
        if getattr(self.model.store, "switched", False):
            return None  # rows on LoRA variants (store/variants.py): a graph replays the base's weights
        rows = cache.decode_rows()
        keys, values, slots, positions = rows.keys, rows.values, rows.slots, rows.positions
        if len(slots) != x.shape[0] or rows.format.quantized or keys.dtype != self.model.dtype:
            return None  # a graph writes and reads keys in the compute dtype: other formats run eagerly
        if max(positions) >= cache.max_len:  # what cache.rope raises on the eager path
            raise ValueError(f"{max(positions) + 1} positions exceed the KV cache ({cache.max_len})")
        paged = rows.page_tokens
        span = self.span_for(max(positions) + 1, cache.max_len)
        if paged:  # whole pages (a paged cache has no uninitialised rows to zero: kv/paged.py)
            span = -(-span // paged) * paged
        step = self._step(len(slots), span, keys, values, paged)
        if not paged:
            self._make_finite(cache, keys, values, slots, positions, span)
        model = self.model
        model.store.note_forward(x.shape[0])
        if model.span.is_first:
            with model.store.block(EMBED) as w:
                x = base.embed(w["embed"], x)
        try:
            output = step.run(x, slots, positions, rows.page_tables)
        except GraphUnavailable as err:
            self.failed = str(err)
            logging.getLogger("tierlm.graphs").warning("decode graphs off: %s", err)
            self.steps.clear()
            return None
        cache.advance(1)
        return output.clone()

    def span_for(self, needed: int, max_len: int) -> int:
        """The key span a step attends over: a power of two from min_span, at most max_len."""
        span = self.min_span
        while span < needed:
            span *= 2
        return min(span, max_len)

    def _step(self, rows: int, span: int, keys, values, page_tokens: int) -> StaticStep:
        if self.buffers is None or self.buffers[0] is not keys or self.buffers[1] is not values:
            self.steps.clear()  # a new cache: graphs over the old buffers would write into them
            self.buffers, self.zeroed = (keys, values), 0
        key = (rows, span, bool(page_tokens))  # a paged step reads through page tables
        if key not in self.steps:
            self.steps[key] = StaticStep(self.model, rows, span, keys, values, self.new_graph(), page_tokens)
        return self.steps[key]

    def _make_finite(self, cache, keys, values, slots, positions, span: int) -> None:
        """Zero the positions in the span no sequence has written (torch.empty may hold NaN)."""
        start = max(self.zeroed, min(positions))  # past the offset nothing belongs to the sequence
        if start < span:
            keys[:, :, :, start:span].zero_()
            values[:, :, :, start:span].zero_()
        self.zeroed = max(self.zeroed, span)
