"""LoRA on fused mixture-of-experts parameters (peft's `target_parameters`), merged per expert.

transformers 5 loads a MoE checkpoint's per-expert Linear weights into one 3-D parameter per
projection: `model.layers.N.mlp.experts.gate_up_proj` [experts, 2·inter, hidden] (gate rows, then
up rows) and `...experts.down_proj` [experts, hidden, inter]. peft 0.21 adapts such parameters
with `target_parameters` (a `ParamWrapper` per parameter), and converts adapters saved for
transformers 4's per-expert modules into that form when it loads them. A ParamWrapper saves

    <module>.lora_A.weight   [rank·experts, in]     expert e's A is rows e·rank … (e+1)·rank
    <module>.lora_B.weight   [out, rank·experts]    expert e's B is columns e, e+experts, … (rank-major)

so that ΔW[e] = scaling · B[:, e::experts-interleaved] @ A[e·rank:(e+1)·rank] (peft's
ParamWrapper.get_delta_weight, "o r e, e r i -> e o i"). Several wrapped parameters of one module
nest: the parameter registered first is innermost, and each level out drops one `.base_layer`
from the saved name (`experts.base_layer.lora_A.weight` is gate_up_proj's, `experts.lora_A.weight`
down_proj's). This module reads those wrappers (`ParameterLora`); tierlm's checkpoints and artifacts
keep experts separate, so lora/expert_slices.py cuts each expert's slice of ΔW into an ordinary
Linear LoRA on that expert's own tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tierlm.errors import TierlmError

if TYPE_CHECKING:
    import torch

# Parameters tierlm can merge, in the order transformers' modules register them (which decides
# the nesting). "weight" is a 2-D parameter such as a router's (one "expert").
PARAMETER_ORDER = ("weight", "gate_up_proj", "down_proj")
_BASE_LAYER = ".base_layer"


@dataclass(frozen=True, eq=False)
class ParameterLora:
    """peft's LoRA on one (possibly 3-D) parameter, as saved: `lora_A` [rank·experts, in],
    `lora_B` [out, rank·experts]; `experts` is 1 for a 2-D parameter."""

    module: str
    parameter: str
    lora_A: "torch.Tensor"
    lora_B: "torch.Tensor"
    rank: int
    scaling: float

    @property
    def key(self) -> str:
        return f"{self.module}.{self.parameter}"

    @property
    def experts(self) -> int:
        return int(self.lora_A.shape[0]) // self.rank


def strip_base_layers(module: str) -> tuple[str, int]:
    """("m.base_layer.base_layer", ...) -> ("m", 2): the wrapped module and how deep the wrapper sits."""
    depth = 0
    while module.endswith(_BASE_LAYER):
        module, depth = module[: -len(_BASE_LAYER)], depth + 1
    return module, depth


def targeted_parameters(module: str, target_parameters: list[str]) -> list[str]:
    """The parameters of `module` that `target_parameters` names, innermost wrapper first
    (peft matches `module.param` exactly or by a dotted suffix)."""
    found = []
    for parameter in PARAMETER_ORDER:
        key = f"{module}.{parameter}"
        if any(key == t or key.endswith(f".{t}") for t in target_parameters):
            found.append(parameter)
    return found


def parameter_for_depth(module: str, depth: int, target_parameters: list[str], path: Path) -> str:
    """Which parameter the wrapper `depth` levels inside the outermost one adapts."""
    targeted = targeted_parameters(module, target_parameters)
    if depth >= len(targeted):
        known = ", ".join(PARAMETER_ORDER)
        raise TierlmError(
            f"LoRA adapter {path}: target_parameters {target_parameters!r} wrap {len(targeted)} known "
            f"parameter(s) of {module!r}, but the file holds a wrapper {depth + 1} levels deep",
            f"tierlm merges LoRA on the parameters {known}; merge other adapters with peft's merge_and_unload",
        )
    return targeted[len(targeted) - 1 - depth]
