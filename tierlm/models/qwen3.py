"""Qwen3 (dense): the Llama decoder plus an RMSNorm over each query and key head before RoPE.

q_norm / k_norm are [head_dim] weights shared by every head; Qwen3 has no q/k/v bias (unless
attention_bias says so, then o_proj has one too, as in Llama) and states head_dim explicitly
(Hq * head_dim need not equal hidden_size). Its sliding-window rule is Qwen2's (qwen2.py).
"""

from __future__ import annotations

import torch

from tierlm.blocks import BlockLayout
from tierlm.config import ModelConfig
from tierlm.models import base
from tierlm.models.llama import LlamaModel
from tierlm.models.qwen2 import QwenWindow


class Qwen3Model(QwenWindow, LlamaModel):
    @classmethod
    def layer_layout(cls, config: ModelConfig, i: int) -> BlockLayout:
        block = super().layer_layout(config, i)
        attn = f"model.layers.{i}.self_attn."
        block["q_norm"] = (f"{attn}q_norm.weight",)
        block["k_norm"] = (f"{attn}k_norm.weight",)
        return block

    @staticmethod
    def canonical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = LlamaModel.canonical_shapes(config)
        return {**shapes, "q_norm": (config.head_dim,), "k_norm": (config.head_dim,)}

    def position_encode(self, w, qk: torch.Tensor, cos, sin) -> torch.Tensor:
        """Normalize each head over head_dim, then rotate: qk [B, T, Hq+Hkv, D]."""
        n_q, eps = self.config.num_attention_heads, self.config.rms_norm_eps
        q = base.rms_norm(qk[:, :, :n_q], w["q_norm"], eps)
        k = base.rms_norm(qk[:, :, n_q:], w["k_norm"], eps)
        return super().position_encode(w, torch.cat((q, k), dim=2), cos, sin)


Model = Qwen3Model
