"""peft's rules for matching module names: target_modules, modules_to_save, rank/alpha patterns.

Module names are Hugging Face module names as peft sees them inside the base model, e.g.
`model.layers.0.self_attn.q_proj` (no `base_model.model.` prefix). The rules follow peft 0.21
(`check_target_module_exists`, `get_pattern_key`); written here so tierlm never imports peft.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# peft's shorthand for "every linear layer but the output head".
ALL_LINEAR = "all-linear"
# Input and output embeddings, which peft never counts as "linear" for all-linear.
EMBEDDING_MODULES = ("embed_tokens", "lm_head")


def pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """The value of the first key of `patterns` (rank_pattern / alpha_pattern) that matches `module`.

    Each key is a regex that must match a whole dotted suffix of the module name, so "q_proj"
    matches `model.layers.0.self_attn.q_proj` and `layers.0.self_attn.q_proj` matches only layer 0.
    Keys are tried in the order the config lists them, as peft does.
    """
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


def in_modules_to_save(modules_to_save: Sequence[str] | None, key: str) -> bool:
    """True when `key` (a module or tensor name) lies inside one of modules_to_save."""
    return any(re.match(rf"(^|.*\.){m}($|\..*)", key) for m in modules_to_save or ())


def is_target(
    module: str,
    target_modules: str | Sequence[str] | None,
    *,
    exclude_modules: str | Sequence[str] | None = None,
    modules_to_save: Sequence[str] | None = None,
    layers_to_transform: int | Sequence[int] | None = None,
    layers_pattern: str | Sequence[str] | None = None,
) -> bool:
    """Whether peft would put a LoRA layer on `module` for these config fields.

    A string target is a regex matched against the full name; a list matches a name exactly or
    as a dotted suffix, optionally restricted to the layer indexes in layers_to_transform.
    """
    if exclude_modules:
        if isinstance(exclude_modules, str):
            if re.fullmatch(exclude_modules, module):
                return False
        elif module in exclude_modules or any(module.endswith(f".{e}") for e in exclude_modules):
            return False
    # peft never adapts a module it also saves whole: the two would fight over one weight.
    if in_modules_to_save(modules_to_save, module):
        return False
    if target_modules is None:
        return False
    if isinstance(target_modules, str):
        if target_modules.lower() == ALL_LINEAR:
            return module.rsplit(".", 1)[-1] not in EMBEDDING_MODULES
        return re.fullmatch(target_modules, module) is not None
    if module in target_modules:
        return True
    if not any(module.endswith(f".{t}") for t in target_modules):
        return False
    return _in_layers(module, layers_to_transform, layers_pattern)


def _in_layers(
    module: str, layers: int | Sequence[int] | None, patterns: str | Sequence[str] | None
) -> bool:
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    match = None
    if not patterns:
        # The first numbered segment is the layer index; nested indexes (experts) come later.
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)
            if match is not None:
                break
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers


def any_target(names: Iterable[str], **fields: Any) -> bool:
    """Whether any of the module `names` is a target under the config `fields` of `is_target`."""
    return any(is_target(name, **fields) for name in names)
