"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q/k/v projections (none on o_proj); the
difference is all layout (models/families.py Qwen2Family)."""

from __future__ import annotations

from tierlm.models.families import Qwen2Family
from tierlm.models.llama import LlamaModel


class Qwen2Model(Qwen2Family, LlamaModel):
    """Qwen2's description over the Llama forward."""


Model = Qwen2Model
