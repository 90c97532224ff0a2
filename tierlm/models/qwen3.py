"""Qwen3 (dense): the Llama decoder plus an RMSNorm over each query and key head before RoPE.

q_norm / k_norm are [head_dim] weights shared by every head; Qwen3 has no q/k/v bias (unless
attention_bias says so, then o_proj has one too, as in Llama) and states head_dim explicitly
(Hq * head_dim need not equal hidden_size). Its sliding-window rule is Qwen2's (families.py).
"""

from __future__ import annotations

import torch

from tierlm.models import base
from tierlm.models.families import Qwen3Family
from tierlm.models.llama import LlamaModel


class Qwen3Model(Qwen3Family, LlamaModel):
    def position_encode(self, w, qk: torch.Tensor, cos, sin) -> torch.Tensor:
        """Normalize each head over head_dim, then rotate: qk [B, T, Hq+Hkv, D]."""
        n_q, eps = self.config.num_attention_heads, self.config.rms_norm_eps
        q = base.rms_norm(qk[:, :, :n_q], w["q_norm"], eps)
        k = base.rms_norm(qk[:, :, n_q:], w["k_norm"], eps)
        return super().position_encode(w, torch.cat((q, k), dim=2), cos, sin)


Model = Qwen3Model
