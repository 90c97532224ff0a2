"""Reading a PEFT LoRA adapter directory: adapter_config.json + adapter_model.safetensors.

The adapter is small next to the model, so its tensors are read whole and kept as stored; the
merger casts one module's factors to fp32 when it merges that module. Only safetensors are read:
an `adapter_model.bin` is a pickle, and unpickling can run code.

Tensor names are peft's saved names, `base_model.model.<module>.<field>`:

    <module>.lora_A.weight          (r, in)             Linear LoRA down-projection
    <module>.lora_B.weight          (out, r)            Linear LoRA up-projection
    <module>.lora_B.bias            (out,)              lora_bias=True: added to the base bias
    <module>.lora_embedding_A       (r, num_embeddings) Embedding LoRA (note: B @ A is transposed)
    <module>.lora_embedding_B       (embedding_dim, r)
    <module>.lora_magnitude_vector  (out,) or (embedding_dim,)  DoRA magnitude
    <module>.base_layer.<param>     a base tensor peft saved with the adapter (save_embedding_layers,
                                    bias="all"/"lora_only"); peft loads it over the base weight
    <module>.<param>                a modules_to_save copy that replaces the base module whole
    <module>(.base_layer)*.lora_A.weight / lora_B.weight
                                    LoRA on a parameter (target_parameters), e.g. the fused 3-D
                                    experts of transformers 5 MoE models: see tierlm.lora.experts
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierlm.errors import TierlmError
from tierlm.lora.experts import ParameterLora, parameter_for_depth, strip_base_layers, targeted_parameters
from tierlm.lora.patterns import in_modules_to_save, pattern_value
from tierlm.weights.checkpoint import MAX_WEIGHT, check_finite, read_safetensors

if TYPE_CHECKING:
    import torch

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLED_NAMES = ("adapter_model.bin", "adapter_model.pt")
PREFIX = "base_model.model."
# The output head peft ties to the input embedding (ensure_weight_tying).
TIED_HEAD = "lm_head"

# LoRA variants whose merge is not plain LoRA or DoRA: refused rather than merged wrongly.
UNSUPPORTED_FIELDS = {
    "velora_config": "VeLoRA",
    "alora_invocation_tokens": "aLoRA (activated LoRA)",
    "monteclora_config": "MonteCLoRA",
    "use_bdlora": "BD-LoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "trainable_token_indices": "trainable tokens",
    "layer_replication": "layer replication",
}

ADAPTER_HINT = "the adapter is damaged or was not trained properly; re-save it with peft"
PICKLE_HINT = (
    "unpickling can run code; load the adapter with peft and call "
    "save_pretrained(dir, safe_serialization=True) to write safetensors"
)
_LINEAR_FIELDS = {"lora_A.weight": "A", "lora_B.weight": "B", "lora_B.bias": "bias"}
_EMBEDDING_FIELDS = {"lora_embedding_A": "A", "lora_embedding_B": "B"}
_MAGNITUDE_FIELDS = ("lora_magnitude_vector", "lora_magnitude_vector.weight")


@dataclass(frozen=True)
class AdapterConfig:
    """The adapter_config.json fields that decide how LoRA merges (peft's LoraConfig names)."""

    r: int = 8
    lora_alpha: float = 8
    use_rslora: bool = False
    # Saved for the record only: every module tierlm merges is an nn.Linear / nn.Embedding, and
    # peft resets fan_in_fan_out to False for nn.Linear when it loads the adapter.
    fan_in_fan_out: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    target_modules: str | list[str] | None = None
    # Parameters adapted directly (peft's ParamWrapper), e.g. "mlp.experts.gate_up_proj".
    target_parameters: list[str] | None = None
    exclude_modules: str | list[str] | None = None
    layers_to_transform: int | list[int] | None = None
    layers_pattern: str | list[str] | None = None
    modules_to_save: list[str] | None = None
    lora_bias: bool = False
    use_dora: bool = False
    bias: str = "none"
    ensure_weight_tying: bool = False
    # What the adapter was trained on, for hints when it does not fit.
    base_model: str | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: Path) -> "AdapterConfig":
        try:
            config = cls(
                r=int(raw.get("r", 8)),
                lora_alpha=float(raw.get("lora_alpha", 8)),
                use_rslora=bool(raw.get("use_rslora", False)),
                fan_in_fan_out=bool(raw.get("fan_in_fan_out", False)),
                rank_pattern={str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
                alpha_pattern={str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
                target_modules=_str_or_list(raw.get("target_modules")),
                target_parameters=_str_or_list(raw.get("target_parameters"), as_list=True),
                exclude_modules=_str_or_list(raw.get("exclude_modules")),
                layers_to_transform=raw.get("layers_to_transform"),
                layers_pattern=raw.get("layers_pattern"),
                modules_to_save=_str_or_list(raw.get("modules_to_save"), as_list=True),
                lora_bias=bool(raw.get("lora_bias", False)),
                use_dora=bool(raw.get("use_dora", False)),
                bias=str(raw.get("bias") or "none"),
                ensure_weight_tying=bool(raw.get("ensure_weight_tying", False)),
                base_model=raw.get("base_model_name_or_path") or None,
            )
        except (TypeError, ValueError, AttributeError, OverflowError) as err:
            raise TierlmError(
                f"{source} has a malformed LoRA setting: {err}", "re-save the adapter with peft"
            ) from None
        config.check(source)
        return config

    def check(self, source: Path) -> None:
        """Ranks positive and alphas finite, so every scaling is a usable number."""
        ranks = {"r": self.r, **{f"rank_pattern[{k!r}]": v for k, v in self.rank_pattern.items()}}
        alphas = {"lora_alpha": self.lora_alpha, **{f"alpha_pattern[{k!r}]": v for k, v in self.alpha_pattern.items()}}
        for key, rank in ranks.items():
            if rank < 1:
                raise TierlmError(
                    f"{source}: {key} is {rank}; a LoRA rank must be at least 1", "re-save the adapter with peft"
                )
        for key, alpha in alphas.items():
            if not math.isfinite(alpha):
                raise TierlmError(f"{source}: {key} is {alpha}, not a finite number", "re-save the adapter with peft")

    def rank(self, module: str) -> int:
        return int(pattern_value(self.rank_pattern, module, self.r))

    def alpha(self, module: str) -> float:
        return float(pattern_value(self.alpha_pattern, module, self.lora_alpha))

    def scaling(self, module: str) -> float:
        """peft's LoRA scale for `module`: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        r, alpha = self.rank(module), self.alpha(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


@dataclass(frozen=True, eq=False)
class ModuleLora:
    """The LoRA factors of one adapted module, as stored (any float dtype).

    kind "linear": lora_A (r, in), lora_B (out, r); delta = (B @ A) * scaling, shape (out, in).
    kind "embedding": lora_A (r, num_embeddings), lora_B (embedding_dim, r);
    delta = (B @ A).T * scaling, shape (num_embeddings, embedding_dim).
    bias (out,) is lora_B's bias (lora_bias=True); magnitude is DoRA's, (out,) for linear and
    (embedding_dim,) for embedding.
    """

    module: str
    kind: str
    lora_A: "torch.Tensor"
    lora_B: "torch.Tensor"
    scaling: float
    bias: "torch.Tensor | None" = None
    magnitude: "torch.Tensor | None" = None

    @property
    def rank(self) -> int:
        return int(self.lora_A.shape[0])

    @property
    def weight_shape(self) -> tuple[int, int]:
        """The shape of the base weight this module's delta adds to."""
        if self.kind == "embedding":
            return int(self.lora_A.shape[1]), int(self.lora_B.shape[0])
        return int(self.lora_B.shape[0]), int(self.lora_A.shape[1])


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A PEFT LoRA adapter read from disk.

    modules: module name -> LoRA factors, in the order the file stores them.
    parameters: "module.parameter" -> LoRA on a parameter (target_parameters), as saved.
    base_weights: tensor name -> a base tensor saved with the adapter (peft loads it over the base).
    saved_modules: tensor name -> a modules_to_save copy (replaces the base tensor).
    digest: sha256 over the config and weight files' bytes.
    """

    path: Path
    config: AdapterConfig
    modules: dict[str, ModuleLora]
    base_weights: dict[str, "torch.Tensor"]
    saved_modules: dict[str, "torch.Tensor"]
    digest: str
    parameters: dict[str, ParameterLora] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> "LoraAdapter":
        """Read and check `path` (a directory saved by peft's save_pretrained)."""
        path = Path(path)
        if not path.is_dir():
            raise TierlmError(
                f"LoRA adapter {path} is not a directory",
                f"pass the directory that holds {CONFIG_NAME} and {WEIGHTS_NAME}",
            )
        config_path, weights_path = path / CONFIG_NAME, path / WEIGHTS_NAME
        if not config_path.is_file():
            raise TierlmError(
                f"LoRA adapter {path} has no {CONFIG_NAME}",
                "pass a directory written by peft's save_pretrained",
            )
        raw = _read_config(config_path)
        config = AdapterConfig.from_dict(raw, config_path)
        if not weights_path.is_file():
            pickled = [name for name in PICKLED_NAMES if (path / name).is_file()]
            if pickled:
                raise TierlmError(
                    f"LoRA adapter {path} holds only {pickled[0]}, a pickle; "
                    f"tierlm requires {WEIGHTS_NAME}",
                    PICKLE_HINT,
                )
            raise TierlmError(
                f"LoRA adapter {path} has no {WEIGHTS_NAME}", "the adapter directory is incomplete"
            )
        tensors = _read_tensors(weights_path)
        digest = hashlib.sha256(
            b"config:" + _file_sha256(config_path) + b"weights:" + _file_sha256(weights_path)
        ).hexdigest()
        modules, base_weights, saved_modules, wrapped = _sort_tensors(tensors, config, path)
        parameters = _parameter_loras(wrapped, config, path)
        if not (modules or base_weights or saved_modules or parameters):
            raise TierlmError(f"LoRA adapter {path} holds no tensors", "the adapter file is empty")
        return cls(path, config, modules, base_weights, saved_modules, digest, parameters)


def _read_config(config_path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TierlmError(f"{config_path} is not valid JSON: {err}") from None
    if not isinstance(raw, dict) or "peft_type" not in raw:
        raise TierlmError(
            f"{config_path} is not a PEFT adapter config (no peft_type)",
            "pass a directory written by peft's save_pretrained",
        )
    peft_type = str(raw["peft_type"]).upper()
    if peft_type != "LORA":
        raise TierlmError(
            f"{config_path.parent} is a {raw['peft_type']} adapter; tierlm merges only LoRA adapters "
            "(peft_type LORA, DoRA included)",
            "pass a LoRA adapter, or merge this one with peft and use the merged model",
        )
    if raw.get("use_dora") and raw.get("lora_bias"):
        # peft refuses this pair too: DoRA's merge has no place for a LoRA bias.
        raise TierlmError(
            f"LoRA adapter {config_path.parent} sets both use_dora and lora_bias, "
            "which peft does not support",
            "re-save the adapter with peft",
        )
    for name, what in UNSUPPORTED_FIELDS.items():
        if raw.get(name):
            raise TierlmError(
                f"LoRA adapter {config_path.parent} uses {what} ({name}), which tierlm cannot merge",
                "merge it with peft's merge_and_unload and pass the merged model",
            )
    return raw


def _str_or_list(value: Any, as_list: bool = False) -> str | list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value] if as_list else value
    return [str(v) for v in value]


def _file_sha256(path: Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.digest()


def _read_tensors(weights_path: Path) -> dict[str, "torch.Tensor"]:
    """Every tensor, after the header is validated whole; each must be a finite float tensor
    within ±MAX_WEIGHT, so a bad value is refused here, by name, before any merge."""
    try:
        tensors = read_safetensors(weights_path)
    except OSError as err:
        raise TierlmError(f"LoRA adapter file {weights_path} cannot be read: {err}", ADAPTER_HINT) from None
    except TierlmError as err:
        # The reader's hint speaks of model checkpoints; an adapter is re-saved, not re-downloaded.
        raise TierlmError(err.message.replace("checkpoint file", "LoRA adapter file"),
                          PICKLE_HINT if "pickle" in err.message else ADAPTER_HINT) from None
    for name, tensor in tensors.items():
        check_finite(tensor, f"LoRA adapter {weights_path.parent}: tensor {name!r}", ADAPTER_HINT, limit=MAX_WEIGHT)
    return tensors


def _sort_tensors(
    tensors: dict[str, "torch.Tensor"], config: AdapterConfig, path: Path
) -> tuple[dict[str, ModuleLora], dict[str, "torch.Tensor"], dict[str, "torch.Tensor"], dict[str, dict[str, Any]]]:
    """Split peft's flat state dict into per-module LoRA factors, whole base-tensor copies, and
    the raw parts of target_parameters wrappers (saved name -> {"A", "B", ...})."""
    parts: dict[str, dict[str, Any]] = {}
    base_weights: dict[str, torch.Tensor] = {}
    saved_modules: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PREFIX)
        module, kind, part = _classify(name)
        if kind is not None:
            entry = parts.setdefault(module, {})
            if kind != "any":
                if entry.setdefault("kind", kind) != kind:
                    raise _bad_adapter(path, f"{module} mixes Linear and Embedding LoRA tensors")
            entry[part] = tensor
        elif ".base_layer." in name:
            owner, _, param = name.rpartition(".base_layer.")
            base_weights[f"{owner}.{param}"] = tensor
        elif in_modules_to_save(config.modules_to_save, name) or (
            # ensure_weight_tying saves the tied head's copy too, outside modules_to_save.
            config.ensure_weight_tying and name.startswith(TIED_HEAD + ".")
        ):
            saved_modules[name] = tensor
        elif name.endswith(".bias") and config.bias in ("all", "lora_only"):
            # bias="all" trains every bias; peft saves them and loads them over the base.
            base_weights[name] = tensor
        else:
            raise TierlmError(
                f"LoRA adapter {path}: tensor {key!r} is not a LoRA tensor tierlm understands",
                "tierlm merges LoRA and DoRA adapters (peft_type LORA) saved by peft",
            )
    wrapped = {
        m: parts.pop(m) for m in list(parts)
        if config.target_parameters and targeted_parameters(strip_base_layers(m)[0], config.target_parameters)
    }
    modules = {m: _module(m, p, config, path) for m, p in parts.items()}
    return modules, base_weights, saved_modules, wrapped


def _classify(name: str) -> tuple[str, str | None, str]:
    """(module, kind, part) for a LoRA tensor name; kind None when it is not one."""
    for suffix, part in _LINEAR_FIELDS.items():
        if name.endswith("." + suffix):
            return name[: -len(suffix) - 1], "linear", part
    for suffix, part in _EMBEDDING_FIELDS.items():
        if name.endswith("." + suffix):
            return name[: -len(suffix) - 1], "embedding", part
    for suffix in _MAGNITUDE_FIELDS:
        if name.endswith("." + suffix):
            return name[: -len(suffix) - 1], "any", "magnitude"
    return name, None, ""


def _module(module: str, parts: dict[str, Any], config: AdapterConfig, path: Path) -> ModuleLora:
    kind = parts.get("kind")
    if kind is None or "A" not in parts or "B" not in parts:
        raise _bad_adapter(path, f"{module} lacks lora_A or lora_B")
    lora_A, lora_B = parts["A"], parts["B"]
    if lora_A.dim() != 2 or lora_B.dim() != 2 or lora_A.shape[0] != lora_B.shape[1]:
        raise _bad_adapter(
            path,
            f"{module}: lora_A {list(lora_A.shape)} and lora_B {list(lora_B.shape)} do not form a "
            "rank-r product",
        )
    rank = config.rank(module)
    scaling = config.scaling(module)
    if not abs(scaling) <= MAX_WEIGHT:
        raise _bad_adapter(
            path,
            f"{module}: lora_alpha {config.alpha(module):g} over rank {rank} gives a scale of "
            f"{scaling:.3g}, beyond any usable weight",
        )
    if lora_A.shape[0] != rank:
        raise _bad_adapter(
            path,
            f"{module}: adapter_config.json gives rank {rank} (r / rank_pattern) but the weights "
            f"have rank {lora_A.shape[0]}",
        )
    magnitude = parts.get("magnitude")
    if magnitude is not None and not config.use_dora:
        raise _bad_adapter(path, f"{module} has a DoRA magnitude but use_dora is false")
    bias = parts.get("bias")
    if bias is not None and not config.lora_bias:
        raise _bad_adapter(path, f"{module} has a lora_B bias but lora_bias is false")
    return ModuleLora(module, kind, lora_A, lora_B, scaling, bias, magnitude)


def _parameter_loras(wrapped: dict[str, dict[str, Any]], config: AdapterConfig, path: Path) -> dict[str, ParameterLora]:
    """ParameterLora records, keyed by "module.parameter", from the target_parameters wrappers'
    parts (saved under `<module>(.base_layer)*`, one level per parameter wrapped before)."""
    out: dict[str, ParameterLora] = {}
    for name, parts in wrapped.items():
        if parts.get("kind") != "linear" or "A" not in parts or "B" not in parts or len(parts) != 3:
            raise _bad_adapter(path, f"{name}: LoRA on a parameter (target_parameters) needs lora_A and "
                               "lora_B and nothing else (no DoRA, no lora_bias)")
        module, depth = strip_base_layers(name)
        parameter = parameter_for_depth(module, depth, config.target_parameters, path)
        key = f"{module}.{parameter}"
        lora_A, lora_B, rank = parts["A"], parts["B"], config.rank(key)  # peft's patterns name the parameter
        if lora_A.dim() != 2 or lora_B.dim() != 2 or lora_A.shape[0] != lora_B.shape[1] or lora_A.shape[0] % rank:
            raise _bad_adapter(path, f"{name}: lora_A {list(lora_A.shape)} and lora_B {list(lora_B.shape)} are "
                               f"not rank {rank} × experts factors")
        scaling = config.scaling(key)
        if not abs(scaling) <= MAX_WEIGHT:
            raise _bad_adapter(path, f"{key}: LoRA scale {scaling:.3g} is beyond any usable weight")
        if key in out:
            raise _bad_adapter(path, f"{key} is adapted twice")
        out[key] = ParameterLora(module, parameter, lora_A, lora_B, rank, scaling)
    return out


def _bad_adapter(path: Path, why: str) -> TierlmError:
    return TierlmError(
        f"LoRA adapter {path} is inconsistent: {why}", "re-save the adapter with peft"
    )
