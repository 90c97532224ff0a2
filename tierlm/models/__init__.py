"""Model families: the registry (model_type -> the family's torch-free description, families.py),
reading a config.json through it, and one torch module per family over the shared layers in base.py.

This module and families.py never import torch, so `tierlm list`, `show` and `plan` parse configs
and size blocks without it; `family_class` imports a family's torch module on first use.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from tierlm.config import ModelConfig, config_json_path, parse_model_config, read_config_json
from tierlm.models.families import (
    ChatGLMFamily,
    GlmFamily,
    LlamaFamily,
    MixtralFamily,
    Qwen2Family,
    Qwen2MoeFamily,
    Qwen3Family,
    Qwen3MoeFamily,
)

# model_type -> the family's description; its `model_module` names the torch implementation.
FAMILIES: Mapping[str, type[LlamaFamily]] = MappingProxyType(
    {
        "llama": LlamaFamily,
        "mistral": LlamaFamily,
        "qwen2": Qwen2Family,
        "qwen3": Qwen3Family,
        "glm": GlmFamily,
        "chatglm": ChatGLMFamily,
        "mixtral": MixtralFamily,
        "qwen2_moe": Qwen2MoeFamily,
        "qwen3_moe": Qwen3MoeFamily,
    }
)


def family_description(config: ModelConfig) -> type[LlamaFamily]:
    """What `config.model_type`'s family means and how its blocks are laid out (no torch)."""
    return FAMILIES[config.model_type]


def family_class(config: ModelConfig):
    """The model class implementing `config.model_type` (a subclass of its description); its
    module, and torch with it, is imported on first use, not with this one."""
    return importlib.import_module(family_description(config).model_module).Model


def config_from_dict(raw: Any, source: str = "config.json") -> ModelConfig:
    """A ModelConfig from a parsed config.json (config.parse_model_config, with the families here);
    a bad value is a TierlmError naming `source`."""
    return parse_model_config(raw, source, FAMILIES)


def read_config(model_dir: Path) -> ModelConfig:
    """`model_dir`/config.json as a ModelConfig; a missing or bad file is a TierlmError."""
    path = config_json_path(model_dir)
    return config_from_dict(read_config_json(path), str(path))
