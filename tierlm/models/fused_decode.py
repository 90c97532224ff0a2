"""A decode step's decoder layers as one native call each, instead of ~15 eager torch ops.

`LlamaModel.forward` asks `step_for` whether this step can be fused: one token per row (T == 1,
batch 1 or a server `PagedBatch`), or a prefill chunk of one sequence (batch 1, a `KVCache` or
`PagedView`, reaching no further than FUSED_CHUNK_SPAN positions: its rows' keys and values are
stored first, then each row attends over the cache; its products run as the integer GEMM,
csrc/gemm_a16.h), fp32 activations on the CPU, a KV cache of CPU buffers in any
of kv/formats.py's formats (read as stored: csrc/kv_formats.h; a paged cache through each row's
page table), and the native library loaded
(csrc/fused_decode.h). Then each layer whose weights are INT8
(`Int8Weight`, any group size, symmetric or not), INT4 (`Int4Weight`: packed nibbles with fp16
scales, symmetric or not, read as stored), GGUF Q4_K, Q6_K, Q5_0/Q5_1/Q5_K, IQ4_NL/IQ4_XS
and Q2_K/Q3_K (`Q4KWeight`, `Q6KWeight`, `FiveBitWeight`, `IQ4Weight`, `LowBitKWeight`: codes
with their scales, read as stored) or fp32 tensors on the CPU, in any mix, runs as
`tierlm_decode_layer`: RMSNorm, QKV (+ bias), Qwen3's q/k head norms (when the block has
`q_norm`/`k_norm`), RoPE from the model's `RotaryTable` (rotate-half or interleaved, partial
rotary_dim), the K/V write at each row's slot and position, single-query grouped attention
over the row's span (causal, sliding window), Wo + residual, RMSNorm, W13 with SiLU(gate) * up,
W2 + residual. A mixture-of-experts layer runs its attention half natively the same way
(`run_attention`), then its router and experts in torch. Any other layer runs the eager
reference (`run` returns False).

Consecutive dense layers whose blocks the store holds resident (`WeightStore.resident_block`:
nothing to read, nothing to release) run as one `tierlm_decode_layers` call, their words built
once per block (`LayerWords`); a streamed layer is held through the store and runs alone. The
weight-store contract is unchanged: the caller holds each block while its call runs.
`TIERLM_FUSED=0` forces the eager path (tests and benchmarks compare both).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tierlm.blocks import layer_block
from tierlm.device.cpu import fused_decode_enabled
from tierlm.quant.kernel_api import KernelUnavailable
from tierlm.quant.native import WeightArg, describe_weight, is_cpu_fp32, load_native

_c_ptr, _c_i64, _c_i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


# tl::KVType (csrc/kv_formats.h): how the KV cache holds keys and values.
KV_TYPES = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4}
# The weights a dense layer's call reads, and an attention-only call's.
DENSE, ATTENTION = ("wqkv", "wo", "w13", "w2"), ("wqkv", "wo")
# A layer's words (csrc/library.cpp kWordsPerLayer): 4 weights of 9, 4 norms, 4 cache pointers.
WORDS_PER_LAYER = 44
# The furthest position a fused prefill chunk reaches. Past it the chunk runs eagerly: torch's
# attention outpaced the native blocks (csrc/prefill_attention.h) beyond ~2k positions on the
# embedded model (0.96x at 2048, 0.89x at 4096, prefill tok/s of the whole prompt; RESULTS.md).
FUSED_CHUNK_SPAN = 2048


class LayerArgs(ctypes.Structure):
    """tl::LayerArgs (csrc/fused_decode.h), filled once per step; the native entry fills its
    weight, norm and cache fields per layer from a flat array of words (see `FusedStep.run`)."""

    _fields_ = [("qkv", WeightArg), ("o", WeightArg), ("w13", WeightArg), ("w2", WeightArg),
                ("attn_norm", _c_ptr), ("mlp_norm", _c_ptr), ("q_norm", _c_ptr), ("k_norm", _c_ptr),
                ("cos", _c_ptr), ("sin", _c_ptr), ("keys", _c_ptr), ("values", _c_ptr),
                ("key_scales", _c_ptr), ("value_scales", _c_ptr),
                ("slots", _c_ptr), ("positions", _c_ptr), ("page_tables", _c_ptr),
                ("batch", _c_i64), ("hidden", _c_i64), ("n_q", _c_i64), ("n_kv", _c_i64),
                ("head_dim", _c_i64), ("inter", _c_i64), ("rotary_dim", _c_i64), ("max_len", _c_i64),
                ("window", _c_i64), ("table_width", _c_i64), ("eps", ctypes.c_float), ("interleaved", _c_i32),
                ("threads", _c_i32), ("kv_type", _c_i32), ("page_shift", _c_i32), ("sequence", _c_i32),
                ("integer_rows", _c_i32)]  # fmt: skip


@functools.lru_cache(maxsize=None)
def native_library():
    """The native library's ctypes handle, or None where it cannot load (the eager path runs)."""
    try:
        kernel = load_native()
    except KernelUnavailable:
        return None
    if kernel.lib.tierlm_decode_args_size() != ctypes.sizeof(LayerArgs):
        return None  # a layout mismatch would corrupt memory: refuse rather than guess
    return kernel.lib


# Activation rows up to which the products take the integer decode kernels (csrc/gemv_a16.h):
# in decode batches and verification passes, each row computed as it is alone (a verified
# position's logits are a decode step's), up to 16; a prompt chunk's rows past 4 keep the fp32 tiles.
INTEGER_ROWS_AS_STEPS, INTEGER_ROWS = 16, 4


def step_for(model, cache, x: torch.Tensor, as_steps: bool = False) -> FusedStep | None:
    """The fused step for this forward call (x: ids [B, 1] or a later stage's hidden states
    [B, 1, H]; or a prefill chunk of one sequence, [1, T] / [1, T, H]), or None when the eager
    path must run. `as_steps`: the chunk's positions are computed as decode steps compute them
    (a verification pass)."""
    if model.device.type != "cpu" or model.dtype != torch.float32 or not fused_decode_enabled():
        return None
    rows = _rows_for(cache, x)
    if rows is None:
        return None
    keys, values, slots, positions = rows.keys, rows.values, rows.slots, rows.positions
    if not _is_cpu_storage(rows):
        return None
    cfg = model.config
    layout = (len(model.span.layers), cfg.num_key_value_heads, cfg.head_dim)  # a stage caches its layers only
    heads = keys.shape[1] if rows.page_tables is not None else keys.shape[2]  # paged: head-major
    if (keys.shape[0], heads, rows.format.row_bytes(cfg.head_dim)) != (*layout[:2], _row_bytes(rows)):
        return None  # the native code trusts the cache layout: anything else runs eagerly
    if rows.page_tables is None and not all(0 <= s < keys.shape[1] for s in slots):
        return None
    if max(positions) >= cache.max_len:  # what cache.rope raises on the eager path
        raise ValueError(f"{max(positions) + 1} positions exceed the KV cache ({cache.max_len})")
    if max(positions) >= model.rotary.cos.shape[0]:
        return None  # past the rotary table: the eager path reports it
    lib = native_library()
    if lib is None:
        return None
    return FusedStep(lib, model, rows, as_steps)


def _rows_for(cache, x: torch.Tensor):
    """The cache rows this call writes (kv/cache.py DecodeRows): one new token per row, or a
    chunk of one sequence's positions; None where the cache offers neither for x."""
    if x.shape[1] == 1:
        rows = cache.decode_rows() if hasattr(cache, "decode_rows") else None
        return rows if rows is not None and len(rows.slots) == x.shape[0] else None
    if x.shape[0] != 1 or not hasattr(cache, "chunk_rows"):
        return None
    end = cache.offset + x.shape[1]
    if end > cache.max_len:  # what cache.rope raises on the eager path
        raise ValueError(f"{end} positions exceed the KV cache ({cache.max_len})")
    if end > FUSED_CHUNK_SPAN:
        return None  # past it the eager path's blocked attention is faster (RESULTS.md)
    return cache.chunk_rows(x.shape[1])


def _is_cpu_storage(rows) -> bool:
    """Every part of the cache's storage contiguous on the CPU, codes in the format's dtype."""
    parts = [rows.keys, rows.values] + ([rows.key_scales, rows.value_scales] if rows.format.quantized else [])
    if rows.format.name not in KV_TYPES or any(p is None or not (p.is_cpu and p.is_contiguous()) for p in parts):
        return False
    return rows.keys.shape == rows.values.shape and (not rows.format.quantized or rows.key_scales.dtype == torch.float16)


def _row_bytes(rows) -> int:
    """Bytes of one position's codes and scales as the storage lays them out."""
    codes = rows.keys.shape[-1] * rows.keys.element_size()
    return codes + (rows.key_scales.shape[-1] * 2 if rows.format.quantized else 0)


class FusedStep:
    """One decode step's per-layer native calls; the step-wide arguments are filled once."""

    def __init__(self, lib, model, rows, as_steps: bool = False):
        cfg, rotary = model.config, model.rotary
        keys, slots, positions = rows.keys, rows.slots, rows.positions
        self._lib = lib
        self._words = model.fused_words
        self._rows = rows  # held for the step: its tensors' pointers are used
        # Per part (keys, values, key scales, value scales): its pointer and the bytes of one layer.
        parts = (rows.keys, rows.values, rows.key_scales, rows.value_scales)
        self._parts = [(p.data_ptr(), p.stride(0) * p.element_size()) if p is not None else (0, 0) for p in parts]
        self._slots = (_c_i64 * len(slots))(*slots)
        self._positions = (_c_i64 * len(positions))(*positions)
        a = self._args = LayerArgs()
        a.cos, a.sin = rotary.cos.data_ptr(), rotary.sin.data_ptr()
        a.slots, a.positions = ctypes.addressof(self._slots), ctypes.addressof(self._positions)
        if rows.page_tables is not None:  # paged: each row's pages, padded to one width
            width = max(len(t) for t in rows.page_tables)
            padded = [page for table in rows.page_tables for page in table + [0] * (width - len(table))]
            self._tables = (_c_i64 * len(padded))(*padded)
            a.page_tables, a.table_width = ctypes.addressof(self._tables), width
            a.page_shift = rows.page_tokens.bit_length() - 1
        # A prefill chunk: one slot (or page table) and a position per token.
        a.batch, a.hidden, a.sequence = len(positions), cfg.hidden_size, int(len(positions) > len(slots))
        a.integer_rows = INTEGER_ROWS if a.sequence and not as_steps else INTEGER_ROWS_AS_STEPS
        a.n_q, a.n_kv, a.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        a.inter, a.rotary_dim, a.max_len = cfg.intermediate_size, rotary.rotary_dim, keys.shape[3]
        if rows.page_tables is not None:  # one head's region: every page's positions
            a.max_len = keys.shape[2] * keys.shape[3]
        a.window = cfg.sliding_window or 0
        a.eps, a.interleaved = cfg.rms_norm_eps, int(rotary.interleaved)
        a.threads = torch.get_num_threads()
        a.kv_type = KV_TYPES[rows.format.name]
        self._rotary = rotary  # keeps cos/sin alive for the step
        hidden, q_size, inter = cfg.hidden_size, a.n_q * a.head_dim, cfg.intermediate_size
        self._shapes = {"wqkv": (q_size + 2 * a.n_kv * a.head_dim, hidden), "wo": (hidden, q_size),
                        "w13": (2 * inter, hidden), "w2": (hidden, inter)}  # fmt: skip

    def run(self, w, x: torch.Tensor, layer: int) -> bool:
        """Run the layer whose keys/values are the cache's layer `layer` (its index in the stage)
        on x [B, 1, H] in place; False (nothing done) if its weights do not fit."""
        if "w13" not in w:
            return False  # a mixture-of-experts layer: `run_attention`, then its experts in torch
        return self._call(self._lib.tierlm_decode_layer, w, x, layer, DENSE)

    def run_attention(self, w, x: torch.Tensor, layer: int) -> bool:
        """x += the layer's attention (RMSNorm, QKV, RoPE, the cache, Wo) in place; False (nothing
        done) if its weights do not fit."""
        return self._call(self._lib.tierlm_decode_attention, w, x, layer, ATTENTION)

    def run_resident(self, store, layers, first: int, x: torch.Tensor) -> int:
        """Run the leading `layers` (model indices) that are dense and resident in `store` as one
        native call on x [B, 1, H] in place; how many ran (0: none, x untouched). One call keeps
        Python out of the step and the pool's helpers busy from one layer to the next."""
        if not self._fits(x):
            return 0
        words: list[int] = []
        for index in layers:
            w = store.resident_block(layer_block(index))
            if w is None or "w13" not in w:
                break
            described = self._words.get(w, lambda w=w: self._layer_words(w, DENSE))
            if described is None:
                break
            words += described[0] + self._cache_words(index - first)
        count = len(words) // WORDS_PER_LAYER
        if count == 0:
            return 0
        block = (_c_i64 * len(words))(*words)
        done = self._lib.tierlm_decode_layers(ctypes.addressof(self._args), ctypes.addressof(block), count, x.data_ptr())
        return count if done == 0 else 0

    def _call(self, entry, w, x: torch.Tensor, layer: int, names: tuple[str, ...]) -> bool:
        described = self._layer_words(w, names)
        if described is None or not self._fits(x):
            return False
        words, _keep = described  # the converted biases in _keep live until the call returns
        block = (_c_i64 * WORDS_PER_LAYER)(*words, *self._cache_words(layer))
        # Nonzero: a weight the native code does not implement (x untouched): run eagerly.
        return entry(ctypes.addressof(self._args), ctypes.addressof(block), x.data_ptr()) == 0

    def _fits(self, x: torch.Tensor) -> bool:
        return is_cpu_fp32(x) and x.numel() == self._args.batch * self._args.hidden

    def _cache_words(self, layer: int) -> list[int]:
        """The KV cache's four pointers (keys, values, key scales, value scales) at `layer`."""
        return [ptr + layer * stride if ptr else 0 for ptr, stride in self._parts]

    def _layer_words(self, w, names: tuple[str, ...]) -> tuple[list[int], list] | None:
        """A layer's weight and norm words (all but the cache's) and the converted tensors they
        point into; None if the native code cannot run it."""
        a, keep, shapes = self._args, [], self._shapes
        words = []
        for name, bias in (("wqkv", "bqkv"), ("wo", "bo"), ("w13", "b13"), ("w2", "b2")):
            if name not in names:
                words += [0] * 9  # not read by an attention-only call
                continue
            described = describe_weight(w[name], w.get(bias), shapes[name], keep)
            if described is None:
                return None
            words += described
        # The native code trusts every size: anything unexpected runs the eager path instead.
        for name, size in (("attn_norm", a.hidden), ("mlp_norm", a.hidden), ("q_norm", a.head_dim),
                           ("k_norm", a.head_dim)):  # fmt: skip
            norm = w.get(name)
            if norm is None and (name in ("q_norm", "k_norm") or (name == "mlp_norm" and "w13" not in names)):
                words.append(0)
            elif is_cpu_fp32(norm) and norm.numel() == size:
                words.append(norm.data_ptr())
            else:
                return None
        return words, keep


class LayerWords:
    """Resident layers' weight and norm words, built once per block: a resident block's tensors
    never move, so from one step to the next only the KV cache's pointers change."""

    def __init__(self):
        self._by_block: dict[int, tuple] = {}

    def get(self, tensors, build):
        """`build()`'s result for this block's tensors (None: unsupported), remembered."""
        found = self._by_block.get(id(tensors))
        if found is not None and found[0] is tensors:
            return found[1]
        built = build()
        self._by_block[id(tensors)] = (tensors, built)  # holding the block keeps its id unique
        return built
