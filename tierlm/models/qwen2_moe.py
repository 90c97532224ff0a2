"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder whose sparse layers route each token
to top-k experts (models/moe.py) plus a shared expert every token uses, scaled by
sigmoid(shared_expert_gate · h). `qkv_bias` (default true) says whether q/k/v carry biases;
`decoder_sparse_step` and `mlp_only_layers` say which layers keep a dense MLP (models/families.py
Qwen2MoeFamily reads them).
"""

from __future__ import annotations

from tierlm.models.families import Qwen2MoeFamily
from tierlm.models.moe import MoeLayers
from tierlm.models.qwen2 import Qwen2Model


class Qwen2MoeModel(MoeLayers, Qwen2MoeFamily, Qwen2Model):
    """Qwen2-MoE's description over the Qwen2 forward with routed MLPs."""


Model = Qwen2MoeModel
