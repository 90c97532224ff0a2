"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder (q/k head norms) whose sparse
layers route each token to top-k experts (models/moe.py), no shared expert. `decoder_sparse_step`
and `mlp_only_layers` say which layers keep a dense MLP (intermediate_size).
"""

from __future__ import annotations

from tierlm.config import read_moe
from tierlm.models.moe import MoeLayers
from tierlm.models.qwen3 import Qwen3Model


class Qwen3MoeModel(MoeLayers, Qwen3Model):
    @staticmethod
    def default_layer_types(fields, layers: int) -> None:
        return None  # Qwen3MoeConfig: with use_sliding_window, every layer slides

    @staticmethod
    def moe_config(fields, layers: int):
        return read_moe(fields, layers, expert_intermediate="moe_intermediate_size", shared=False,
                        norm_topk_prob=None, sparse_rule=True)  # fmt: skip


Model = Qwen3MoeModel
