"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from tierlm.blocks import BlockLayout
from tierlm.config import ModelConfig
from tierlm.models.llama import LlamaModel


class Qwen2Model(LlamaModel):
    @staticmethod
    def bias_layout(config: ModelConfig, attn: str, mlp: str) -> BlockLayout:
        # Qwen2 checkpoints always carry q/k/v biases; config.json does not announce them.
        return {"bqkv": tuple(f"{attn}{p}_proj.bias" for p in "qkv")}


Model = Qwen2Model
