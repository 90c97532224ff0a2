"""Mixtral: the Mistral decoder whose every MLP is top-k of `num_local_experts` SwiGLU experts
(models/moe.py). The router's top-k probabilities are always renormalized; `intermediate_size` is
each expert's width (there is no dense MLP). Tensors live under `block_sparse_moe`: `gate` is the
router, expert `w1` the gate, `w3` the up and `w2` the down projection (models/families.py
MixtralFamily lays them out).
"""

from __future__ import annotations

from tierlm.models.families import MixtralFamily
from tierlm.models.llama import LlamaModel
from tierlm.models.moe import MoeLayers


class MixtralModel(MoeLayers, MixtralFamily, LlamaModel):
    """Mixtral's description over the Llama forward with routed MLPs."""


Model = MixtralModel
