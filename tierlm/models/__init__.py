"""Model families: one module per family over the shared layers in base.py."""

from __future__ import annotations

import importlib

from tierlm.config import FAMILIES, ModelConfig


def family_class(config: ModelConfig):
    """The model class implementing `config.model_type` (imported on first use)."""
    return importlib.import_module(FAMILIES[config.model_type]).Model
