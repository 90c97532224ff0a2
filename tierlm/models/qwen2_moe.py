"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder whose sparse layers route each token
to top-k experts (models/moe.py) plus a shared expert every token uses, scaled by
sigmoid(shared_expert_gate · h). `qkv_bias` (default true) says whether q/k/v carry biases;
`decoder_sparse_step` and `mlp_only_layers` say which layers keep a dense MLP.
"""

from __future__ import annotations

from typing import Any, Mapping

from tierlm.blocks import BlockLayout
from tierlm.config import ModelConfig, read_moe
from tierlm.models.moe import MoeLayers
from tierlm.models.qwen2 import Qwen2Model


class Qwen2MoeModel(MoeLayers, Qwen2Model):
    @staticmethod
    def translate_config(fields) -> Mapping[str, Any]:
        return {**fields.raw, "attention_bias": fields.flag("qkv_bias", True)}

    @staticmethod
    def bias_layout(config: ModelConfig, attn: str, mlp: str) -> BlockLayout:
        # Biases on q/k/v only, as Qwen2's, but switchable by qkv_bias (read as attention_bias).
        return {"bqkv": tuple(f"{attn}{p}_proj.bias" for p in "qkv")} if config.attention_bias else {}

    @staticmethod
    def default_layer_types(fields, layers: int) -> list[str]:
        # Qwen2MoeConfig's rule: even-indexed layers below max_window_layers slide.
        first = fields.integer("max_window_layers", 28, low=0, limit="num_hidden_layers")
        return ["sliding_attention" if i % 2 == 0 and i < first else "full_attention" for i in range(layers)]

    @staticmethod
    def moe_config(fields, layers: int):
        return read_moe(fields, layers, expert_intermediate="moe_intermediate_size", shared=True,
                        norm_topk_prob=None, sparse_rule=True)  # fmt: skip

    @staticmethod
    def router_layout(config: ModelConfig, i: int) -> BlockLayout:
        mlp = f"model.layers.{i}.mlp."
        shared = f"{mlp}shared_expert."
        return {
            "router": (f"{mlp}gate.weight",),
            "shared_w13": (f"{shared}gate_proj.weight", f"{shared}up_proj.weight"),
            "shared_w2": (f"{shared}down_proj.weight",),
            "shared_gate": (f"{mlp}shared_expert_gate.weight",),
        }


Model = Qwen2MoeModel
