"""GLM-4 in the transformers-native layout (`GlmForCausalLM`, model_type "glm").

The Llama decoder with three differences, all in code here:
- RoPE rotates only the first `partial_rotary_factor` (GlmConfig's default: 0.5) of each head's
  channels, and its pairs are interleaved: (2i, 2i + 1), not (i, i + D/2).
- `attention_bias` means q/k/v biases only; o_proj never has one.
- gate and up are stored fused as `mlp.gate_up_proj` [2I, H] (gate first), which is already
  tierlm's w13.
"""

from __future__ import annotations

from tierlm.blocks import BlockLayout
from tierlm.config import ModelConfig
from tierlm.models import base
from tierlm.models.llama import LlamaModel


class GlmModel(LlamaModel):
    partial_rotary_default = 0.5  # GlmConfig's

    @staticmethod
    def rotated_channels(config: ModelConfig) -> int:
        return int(config.head_dim * config.rope.partial_rotary_factor)

    @classmethod
    def rotary_table(cls, config: ModelConfig, max_len: int, device, dtype) -> base.RotaryTable:
        rotary_dim = cls.rotated_channels(config)
        return base.RotaryTable(
            config.rope, config.head_dim, max_len, device, dtype, rotary_dim=rotary_dim, interleaved=True
        )

    @classmethod
    def layer_layout(cls, config: ModelConfig, i: int) -> BlockLayout:
        block = super().layer_layout(config, i)
        block["w13"] = (f"model.layers.{i}.mlp.gate_up_proj.weight",)
        return block

    @staticmethod
    def bias_layout(config: ModelConfig, attn: str, mlp: str) -> BlockLayout:
        if not config.attention_bias:
            return {}
        return {"bqkv": tuple(f"{attn}{p}_proj.bias" for p in "qkv")}


Model = GlmModel
