"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from tierlm.blocks import BlockLayout
from tierlm.config import ModelConfig
from tierlm.models.llama import LlamaModel


class QwenWindow:
    """Qwen2's and Qwen3's sliding-window rule (their configs' keys; shared by both classes)."""

    @staticmethod
    def sliding_window_in_force(fields) -> bool:
        # Qwen configs carry a sliding_window that is inactive unless use_sliding_window is set...
        return fields.flag("use_sliding_window", False)

    @staticmethod
    def default_layer_types(fields, layers: int) -> list[str]:
        # ...and then it applies only to the layers from max_window_layers on.
        first = fields.integer("max_window_layers", 28, low=0, limit="num_hidden_layers")  # Qwen2/3Config's default
        return ["full_attention"] * min(first, layers) + ["sliding_attention"] * max(layers - first, 0)


class Qwen2Model(QwenWindow, LlamaModel):
    @staticmethod
    def bias_layout(config: ModelConfig, attn: str, mlp: str) -> BlockLayout:
        # Qwen2 checkpoints always carry q/k/v biases; config.json does not announce them.
        return {"bqkv": tuple(f"{attn}{p}_proj.bias" for p in "qkv")}


Model = Qwen2Model
