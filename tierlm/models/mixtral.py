"""Mixtral: the Mistral decoder whose every MLP is top-k of `num_local_experts` SwiGLU experts
(models/moe.py). The router's top-k probabilities are always renormalized; `intermediate_size` is
each expert's width (there is no dense MLP). Tensors live under `block_sparse_moe`: `gate` is the
router, expert `w1` the gate, `w3` the up and `w2` the down projection.
"""

from __future__ import annotations

from tierlm.blocks import BlockLayout
from tierlm.config import ModelConfig, read_moe
from tierlm.models.llama import LlamaModel
from tierlm.models.moe import MoeLayers


class MixtralModel(MoeLayers, LlamaModel):
    @staticmethod
    def moe_config(fields, layers: int):
        return read_moe(fields, layers, expert_intermediate="intermediate_size", shared=False,
                        norm_topk_prob=True, sparse_rule=False)  # fmt: skip

    @staticmethod
    def router_layout(config: ModelConfig, i: int) -> BlockLayout:
        return {"router": (f"model.layers.{i}.block_sparse_moe.gate.weight",)}

    @staticmethod
    def expert_layout(config: ModelConfig, i: int, e: int) -> BlockLayout:
        expert = f"model.layers.{i}.block_sparse_moe.experts.{e}."
        return {"ew13": (f"{expert}w1.weight", f"{expert}w3.weight"), "ew2": (f"{expert}w2.weight",)}


Model = MixtralModel
