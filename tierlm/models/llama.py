"""The Llama family: Llama 2/3 (incl. llama3 RoPE scaling), SmolLM2, Mistral (sliding window).

Other families subclass `LlamaModel` and change code, not flags (qwen2.py, qwen3.py, glm.py,
chatglm.py): the checkpoint layout, the rotary table, what happens to q/k before attention.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

import torch

from tierlm.blocks import EMBED, HEAD, NORM, BlockLayout, CheckpointLayout, layer_block
from tierlm.config import ModelConfig
from tierlm.stages import StageSpan, whole_model
from tierlm.errors import TierlmError
from tierlm.models import base, fused_decode, graph_decode


class LlamaModel:
    """A decoder whose forward pass borrows every block's tensors from a weight store.

    Block tensors use tierlm's canonical names: per layer `attn_norm`, `wqkv` [(Hq+2Hkv)*D, H]
    (`bqkv`), `wo` (`bo`), `mlp_norm`, `w13` [2I, H] (`b13`), `w2` (`b2`), and Qwen3's
    `q_norm`, `k_norm` [D]; `embed`, `norm`, `head` for the other blocks.
    """

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

    @staticmethod
    def rotary_table(config: ModelConfig, max_len: int, device, dtype) -> base.RotaryTable:
        """RoPE over all of each head, pairs (i, i + D/2)."""
        return base.RotaryTable(config.rope, config.head_dim, max_len, device, dtype)

    @classmethod
    def checkpoint_layout(cls, config: ModelConfig) -> CheckpointLayout:
        """Map each block's canonical tensors to the checkpoint tensors they are built from.

        A tuple of several names is concatenated along the output dimension (fused q/k/v,
        fused gate/up), so one matmul replaces two or three.
        """
        layout: CheckpointLayout = {EMBED: {"embed": ("model.embed_tokens.weight",)}}
        for i in range(config.num_hidden_layers):
            layout[layer_block(i)] = cls.layer_layout(config, i)
        layout[NORM] = {"norm": ("model.norm.weight",)}
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        layout[HEAD] = {"head": (head,)}
        return layout

    @classmethod
    def layer_layout(cls, config: ModelConfig, i: int) -> BlockLayout:
        """Layer `i`'s canonical tensors and their checkpoint sources (HF Llama names)."""
        attn = f"model.layers.{i}.self_attn."
        mlp = f"model.layers.{i}.mlp."
        block = {
            "attn_norm": (f"model.layers.{i}.input_layernorm.weight",),
            "wqkv": tuple(f"{attn}{p}_proj.weight" for p in "qkv"),
            "wo": (f"{attn}o_proj.weight",),
            "mlp_norm": (f"model.layers.{i}.post_attention_layernorm.weight",),
            "w13": (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"),
            "w2": (f"{mlp}down_proj.weight",),
        }
        block.update(cls.bias_layout(config, attn, mlp))
        return block

    @staticmethod
    def canonical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The shape of every canonical block tensor this family may use."""
        hidden, inter, qkv = config.hidden_size, config.intermediate_size, config.q_size + 2 * config.kv_size
        return {
            "embed": (config.vocab_size, hidden),
            "head": (config.vocab_size, hidden),
            "norm": (hidden,),
            "attn_norm": (hidden,),
            "mlp_norm": (hidden,),
            "wqkv": (qkv, hidden),
            "bqkv": (qkv,),
            "wo": (hidden, config.q_size),
            "bo": (hidden,),
            "w13": (2 * inter, hidden),
            "b13": (2 * inter,),
            "w2": (hidden, inter),
            "b2": (hidden,),
        }

    @staticmethod
    def bias_layout(config: ModelConfig, attn: str, mlp: str) -> BlockLayout:
        biases: BlockLayout = {}
        if config.attention_bias:
            biases["bqkv"] = tuple(f"{attn}{p}_proj.bias" for p in "qkv")
            biases["bo"] = (f"{attn}o_proj.bias",)
        if config.mlp_bias:
            biases["b13"] = (f"{mlp}gate_proj.bias", f"{mlp}up_proj.bias")
            biases["b2"] = (f"{mlp}down_proj.bias",)
        return biases

    @classmethod
    def block_shapes(cls, config: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
        """Each block's canonical tensors and their shapes, in the order conversion stores them
        (offload/sizes.py predicts an artifact's block sizes from this; no tensor is made)."""
        shapes = cls.canonical_shapes(config)
        return {block: {name: shapes[name] for name in tensors} for block, tensors in cls.checkpoint_layout(config).items()}

    # -- what this family's config.json means: config.py asks while it parses -------------------

    partial_rotary_default = 1.0  # share of each head's channels RoPE rotates unless config.json says

    @staticmethod
    def translate_config(fields) -> Mapping[str, Any]:
        """config.json under the keys ModelConfig reads (`fields`: config.py's checked reads of it)."""
        return fields.raw

    @staticmethod
    def sliding_window_in_force(fields) -> bool:
        """Whether a sliding_window that config.json sets applies (else attention is full)."""
        return True

    @staticmethod
    def default_layer_types(fields, layers: int) -> list[str] | None:
        """Each layer's attention kind when config.json has no layer_types; None: every layer slides."""
        return None

    @staticmethod
    def rotated_channels(config: ModelConfig) -> int:
        """How many of each head's channels RoPE rotates: all of them."""
        return config.head_dim

    @staticmethod
    def moe_config(fields, layers: int):
        """The mixture-of-experts routing config.json sets (config.MoeConfig); None: a dense model."""
        return None

    @torch.inference_mode()
    def forward(
        self, x: torch.Tensor, cache, logits: Literal["last", "all"] = "last"
    ) -> torch.Tensor:
        """Run this model's stage at the cache's next positions and advance the cache by T.

        x is token ids [B, T] on the first stage, else the previous stage's hidden states [B, T, H]
        (left unchanged). The last stage returns logits [B, T or 1, V] (fp32); any other returns the
        hidden states [B, T, H] of every position, which the next stage needs whatever `logits` says.
        The whole model is the one-stage case. One path for prefill, decode and batched decode:
        `cache` (kv/cache.py, holding this stage's layers only) supplies the positions (as cos/sin)
        and the mask and writes the new keys/values. A `KVCache` or `SlotView` puts T tokens after
        its offset; a `SlotBatch` puts one token per slot at that slot's own length, and each row
        gets what it would get alone.
        """
        rows, length = x.shape[0], x.shape[1]
        if self.graphs is not None and length == 1:
            graphed = self.graphs.forward(x, cache)  # models/graph_decode.py; None: run eagerly
            if graphed is not None:
                return graphed
        # A decode step runs each layer as one native call where it can (models/fused_decode.py).
        fused = fused_decode.step_for(self, cache, x)
        eager = None if fused else self.eager_inputs(cache, length)  # raises if tokens do not fit
        self.store.note_forward(rows * length)
        x = self.stage_input(x, in_place=fused is not None)
        first = self.span.first
        for i in self.span.layers:
            with self.store.block(layer_block(i)) as w:
                if fused is not None and fused.run(w, x, i - first):
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
        """One decode step over a `SlotBatch`: x [B, 1] ids (or [B, 1, H] hidden states) -> logits
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
