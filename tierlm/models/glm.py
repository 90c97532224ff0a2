"""GLM-4 in the transformers-native layout (`GlmForCausalLM`, model_type "glm").

The Llama decoder with three differences, all in code: the rotary table here, the layout in its
description (models/families.py GlmFamily):
- RoPE rotates only the first `partial_rotary_factor` (GlmConfig's default: 0.5) of each head's
  channels, and its pairs are interleaved: (2i, 2i + 1), not (i, i + D/2).
- `attention_bias` means q/k/v biases only; o_proj never has one.
- gate and up are stored fused as `mlp.gate_up_proj` [2I, H] (gate first), which is already
  tierlm's w13.
"""

from __future__ import annotations

from tierlm.config import ModelConfig
from tierlm.models import base
from tierlm.models.families import GlmFamily
from tierlm.models.llama import LlamaModel


class GlmModel(GlmFamily, LlamaModel):
    @classmethod
    def rotary_table(cls, config: ModelConfig, max_len: int, device, dtype) -> base.RotaryTable:
        rotary_dim = cls.rotated_channels(config)
        return base.RotaryTable(
            config.rope, config.head_dim, max_len, device, dtype, rotary_dim=rotary_dim, interleaved=True
        )


Model = GlmModel
