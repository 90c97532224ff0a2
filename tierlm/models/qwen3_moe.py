"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder (q/k head norms) whose sparse
layers route each token to top-k experts (models/moe.py), no shared expert. `decoder_sparse_step`
and `mlp_only_layers` say which layers keep a dense MLP (intermediate_size; models/families.py
Qwen3MoeFamily reads them).
"""

from __future__ import annotations

from tierlm.models.families import Qwen3MoeFamily
from tierlm.models.moe import MoeLayers
from tierlm.models.qwen3 import Qwen3Model


class Qwen3MoeModel(MoeLayers, Qwen3MoeFamily, Qwen3Model):
    """Qwen3-MoE's description over the Qwen3 forward with routed MLPs."""


Model = Qwen3MoeModel
