"""Fused-expert LoRA (lora/experts.py's `ParameterLora`) cut per expert: each expert's slice of ΔW
becomes an ordinary Linear LoRA (`ModuleLora`) on that expert's own checkpoint tensors, which
tierlm's checkpoints and artifacts keep separate; lora/merge.py merges them like any other.
"""

from __future__ import annotations

import re
from pathlib import Path

from tierlm.errors import TierlmError
from tierlm.lora.adapter import ModuleLora
from tierlm.lora.experts import ParameterLora

# Per-expert checkpoint names: (module holding the experts, {fused parameter: per-expert projections}).
_EXPERT_NAMING = (
    ("mlp", {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}),  # Qwen-MoE
    ("block_sparse_moe", {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),  # Mixtral
)
_EXPERTS_MODULE = re.compile(r"(?P<layer>.+)\.mlp\.experts")


def per_expert_loras(lora: ParameterLora, shapes: dict[str, tuple[int, ...]], path: Path) -> dict[str, ModuleLora]:
    """{checkpoint tensor: its Linear LoRA} for every expert `lora` adapts in the base `shapes`.

    A mismatch (another expert count, another width, no such experts) is a TierlmError that names
    what the adapter was made for and what the base holds.
    """
    if lora.parameter == "weight":
        return {_two_d_target(lora, shapes, path): ModuleLora(lora.module, "linear", lora.lora_A, lora.lora_B,
                                                               lora.scaling)}
    names = _expert_names(lora, shapes, path)
    if lora.experts != len(names):
        raise _misfit(path, lora, f"it adapts {lora.experts} experts (rank {lora.rank} × experts = "
                      f"{lora.lora_A.shape[0]} rows of lora_A), the base has {len(names)}")
    in_features, out_features = int(lora.lora_A.shape[1]), int(lora.lora_B.shape[0])
    # [rank·experts, in] -> [experts, rank, in]; [out, rank·experts] -> [out, rank, experts] (peft's views).
    a = lora.lora_A.reshape(lora.experts, lora.rank, in_features)
    b = lora.lora_B.reshape(out_features, lora.rank, lora.experts)
    out: dict[str, ModuleLora] = {}
    for expert, targets in enumerate(names):
        row = 0
        for target in targets:
            rows, cols = shapes[target]
            if cols != in_features:
                raise _misfit(path, lora, f"its inputs are {in_features} wide, {target!r} takes {cols}")
            module = target.removesuffix(".weight")
            out[target] = ModuleLora(module, "linear", a[expert], b[row : row + rows, :, expert], lora.scaling)
            row += rows
        if row != out_features:
            parts = " + ".join(f"{shapes[t][0]}" for t in targets)
            raise _misfit(path, lora, f"its outputs are {out_features} rows, the base expert has {parts}")
    return out


def _expert_names(lora: ParameterLora, shapes: dict[str, tuple[int, ...]], path: Path) -> list[tuple[str, ...]]:
    """Per expert, the checkpoint tensors `lora.parameter` fuses (gate then up for gate_up_proj)."""
    match = _EXPERTS_MODULE.fullmatch(lora.module)
    if match is None:
        raise _misfit(path, lora, "tierlm merges fused expert parameters only under '<layer>.mlp.experts'")
    for module, projections in _EXPERT_NAMING:
        if lora.parameter not in projections:
            continue
        prefix = f"{match['layer']}.{module}.experts."
        names = []
        while all(f"{prefix}{len(names)}.{p}.weight" in shapes for p in projections[lora.parameter]):
            names.append(tuple(f"{prefix}{len(names)}.{p}.weight" for p in projections[lora.parameter]))
        if names:
            return names
    raise TierlmError(
        f"LoRA adapter {path} adapts the experts' {lora.parameter} of {lora.module!r}, but the base model "
        "has no per-expert tensors there",
        "the adapter was trained for a different model; pass that model with --model",
    )


def _two_d_target(lora: ParameterLora, shapes: dict[str, tuple[int, ...]], path: Path) -> str:
    """The checkpoint tensor of a 2-D parameter (a router: Mixtral's is saved under block_sparse_moe)."""
    candidates = [lora.key, lora.key.replace(".mlp.gate.", ".block_sparse_moe.gate.")]
    for name in candidates:
        if name in shapes:
            wanted = (int(lora.lora_B.shape[0]), int(lora.lora_A.shape[1]))
            if tuple(shapes[name]) != wanted:
                raise _misfit(path, lora, f"it needs {name!r} to be {list(wanted)}, the base has {list(shapes[name])}")
            return name
    raise TierlmError(f"LoRA adapter {path} adapts {lora.key!r}, which the base model does not have",
                      "the adapter was trained for a different model; pass that model with --model")


def _misfit(path: Path, lora: ParameterLora, why: str) -> TierlmError:
    return TierlmError(
        f"LoRA adapter {path} does not fit the base model at {lora.key!r}: {why}",
        "the adapter was trained for a different model; pass that model with --model",
    )
