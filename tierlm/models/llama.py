"""The Llama family: Llama 2/3 (incl. llama3 RoPE scaling), SmolLM2, Mistral (sliding window).

Other families subclass `LlamaModel` and change code, not flags (qwen2.py, qwen3.py, glm.py,
chatglm.py): the rotary table, what happens to q/k before attention; what a family's config.json
means and its checkpoint layout are its torch-free description's (models/families.py), which
each model class inherits.
"""

from __future__ import annotations

from typing import Literal

import torch

from tierlm.blocks import EMBED, HEAD, NORM, layer_block
from tierlm.config import ModelConfig
from tierlm.stages import StageSpan, whole_model
from tierlm.errors import TierlmError
from tierlm.models import base, fused_decode, graph_decode
from tierlm.models.families import LlamaFamily


class LlamaModel(LlamaFamily):
    """A decoder whose forward pass borrows every block's tensors from a weight store, under the
    canonical names its description (models/families.py LlamaFamily) lays out."""

    def __init__(self, config: ModelConfig, store, max_len: int, device, dtype: torch.dtype,
                 span: StageSpan | None = None):  # fmt: skip
        """`span`: the pipeline stage this model runs (tierlm/stages.py); None: the whole model."""
        self.config = config
        self.span = span or whole_model(config.num_hidden_layers)
        if self.span.end > config.num_hidden_layers:
            raise TierlmError(f"{self.span.describe()} runs past the model's {config.num_hidden_layers} layers",
                              "split the stages over the model's own layer count")  # fmt: skip
        self.store = store
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_len = max_len
        self.rotary = self.rotary_table(config, max_len, device, dtype)
        # Decode captured as a graph on an accelerator holding every block; None: eager (CPU).
        self.graphs = graph_decode.graphs_for(self)
        self.fused_words = fused_decode.LayerWords()  # resident layers' words for the fused step

    @staticmethod
    def rotary_table(config: ModelConfig, max_len: int, device, dtype) -> base.RotaryTable:
        """RoPE over all of each head, pairs (i, i + D/2)."""
        return base.RotaryTable(config.rope, config.head_dim, max_len, device, dtype)

    @torch.inference_mode()
    def forward(
        self, x: torch.Tensor, cache, logits: Literal["last", "all"] = "last", *, as_steps: bool = False
    ) -> torch.Tensor:
        """Run this model's stage at the cache's next positions and advance the cache by T.

        x is token ids [B, T] on the first stage, else the previous stage's hidden states [B, T, H]
        (left unchanged). The last stage returns logits [B, T or 1, V] (fp32); any other returns the
        hidden states [B, T, H] of every position, which the next stage needs whatever `logits` says.
        The whole model is the one-stage case. One path for prefill, decode and batched decode:
        `cache` (kv/cache.py, holding this stage's layers only) supplies the positions (as cos/sin)
        and the mask and writes the new keys/values. A `KVCache` or `PagedView` puts T tokens after
        its offset; a `PagedBatch` (kv/paged.py) puts one token per slot at that slot's own length,
        and each row gets what it would get alone. `as_steps` (speculative verification): a chunk's
        positions are computed as decode steps compute them, where the fused CPU step runs.
        """
        rows, length = x.shape[0], x.shape[1]
        if self.graphs is not None and length == 1:
            graphed = self.graphs.forward(x, cache)  # models/graph_decode.py; None: run eagerly
            if graphed is not None:
                return graphed
        # A decode step runs each layer as one native call where it can (models/fused_decode.py).
        fused = fused_decode.step_for(self, cache, x, as_steps)
        eager = None if fused else self.eager_inputs(cache, length)  # raises if tokens do not fit
        self.store.note_forward(rows * length)
        x = self.stage_input(x, in_place=fused is not None)
        first, layers = self.span.first, list(self.span.layers)
        while layers:
            # Resident dense layers run in one native call; the others one by one below.
            ran = fused.run_resident(self.store, layers, first, x) if fused is not None else 0
            if ran:
                del layers[:ran]
                continue
            i = layers.pop(0)
            with self.store.block(layer_block(i)) as w:
                if fused is not None and fused.run(w, x, i - first):
                    continue
                if fused is not None and "w13" not in w and fused.run_attention(w, x, i - first):
                    # A mixture-of-experts layer: attention native, its router and experts here.
                    h = base.rms_norm(x, w["mlp_norm"], self.config.rms_norm_eps)
                    x = x + self.mlp(w, h, i)
                    continue
                eager = eager or self.eager_inputs(cache, length)
                x = self.decoder_layer(w, x, cache, i, *eager)
        cache.advance(length)
        if not self.span.is_last:
            return x
        if logits == "last":
            x = x[:, -1:]
        with self.store.block(NORM) as w:
            x = base.rms_norm(x, w["norm"], self.config.rms_norm_eps)
        with self.store.block(HEAD) as w:
            return base.linear(x, w["head"]).float()

    def stage_input(self, x: torch.Tensor, *, in_place: bool) -> torch.Tensor:
        """The first layer's input: the embedded ids on the first stage, else the hidden states in
        the model's dtype (copied when `in_place`: the fused step overwrites its input)."""
        if self.span.is_first:
            with self.store.block(EMBED) as w:
                return base.embed(w["embed"], x).to(self.dtype)
        return x.to(device=self.device, dtype=self.dtype, copy=in_place).contiguous()

    def eager_inputs(self, cache, length: int) -> tuple:
        """(cos, sin, mask) for `length` new tokens at the cache's positions (the eager layers)."""
        cos, sin = cache.rope(self.rotary, length)  # raises first if the tokens do not fit
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        return cos, sin, cache.mask(length, groups, self.config.sliding_window)

    def forward_batch(self, x: torch.Tensor, batch) -> torch.Tensor:
        """One decode step over a `PagedBatch`: x [B, 1] ids (or [B, 1, H] hidden states) -> logits
        [B, V] on the last stage, hidden states [B, 1, H] on any other; `forward` does the work."""
        out = self.forward(x, batch)
        return out[:, -1] if self.span.is_last else out

    def decoder_layer(self, w, x, cache, index, cos, sin, mask) -> torch.Tensor:
        """One pre-norm block: x [B, T, H] -> [B, T, H]."""
        h = base.rms_norm(x, w["attn_norm"], self.config.rms_norm_eps)
        x = x + self.attention(w, h, cache, index, cos, sin, mask)
        h = base.rms_norm(x, w["mlp_norm"], self.config.rms_norm_eps)
        return x + self.mlp(w, h, index)

    def mlp(self, w, h, index) -> torch.Tensor:
        """Layer `index`'s MLP on normed h [B, T, H]; a MoE family routes its sparse layers here."""
        return base.swiglu(h, w["w13"], w["w2"], w.get("b13"), w.get("b2"))

    def attention(self, w, h, cache, index, cos, sin, mask) -> torch.Tensor:
        cfg = self.config
        batch, length, _ = h.shape
        n_q, n_kv, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = base.linear(h, w["wqkv"], w.get("bqkv")).view(batch, length, n_q + 2 * n_kv, dim)
        qk = self.position_encode(w, qkv[:, :, : n_q + n_kv], cos, sin)
        q = qk[:, :, :n_q].transpose(1, 2)
        # The cache holds this stage's layers only: global layer `index` is its index - first.
        keys, values = cache.update(index - self.span.first, qk[:, :, n_q:], qkv[:, :, n_q + n_kv :])
        out = base.grouped_attention(q, keys, values, mask)
        out = out.transpose(1, 2).reshape(batch, length, n_q * dim)
        return base.linear(out, w["wo"], w.get("bo"))

    def position_encode(self, w, qk: torch.Tensor, cos, sin) -> torch.Tensor:
        """Apply RoPE to queries and keys together: qk [B, T, Hq+Hkv, D] (w: the layer's tensors)."""
        return base.apply_rope(qk, cos, sin, self.rotary.interleaved)


Model = LlamaModel
