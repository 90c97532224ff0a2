"""ModelConfig: a checkpoint's settings, read from its config.json and nothing else."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from tierlm.errors import TierlmError

# model_type -> module that implements the family; imported lazily by `family_module`.
FAMILIES: Mapping[str, str] = MappingProxyType(
    {
        "llama": "tierlm.models.llama",
        "mistral": "tierlm.models.llama",
        "qwen2": "tierlm.models.qwen2",
    }
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; `rope_type` selects how frequencies are scaled."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The shape and numerics of a decoder-only transformer."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    sliding_window: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        """Build from a parsed config.json; unknown keys are ignored, missing ones are errors."""
        model_type = raw.get("model_type")
        if model_type not in FAMILIES:
            raise TierlmError(
                f"unsupported model_type {model_type!r} in config.json",
                f"tierlm supports: {', '.join(sorted(FAMILIES))}",
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            config = cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                rope=_rope_config(raw),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_tuple(raw.get("eos_token_id")),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                sliding_window=_sliding_window(raw),
            )
        except KeyError as missing:
            raise TierlmError(
                f"config.json lacks the required key {missing.args[0]!r}",
                "is this a complete Hugging Face checkpoint?",
            ) from None
        if config.num_attention_heads % config.num_key_value_heads:
            raise TierlmError(
                "config.json: num_attention_heads must be a multiple of num_key_value_heads"
            )
        return config

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise TierlmError(
                f"no config.json in {model_dir}",
                "pass --model a Hugging Face model directory, or import a GGUF with `tierlm import-gguf`",
            )
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise TierlmError(f"{path} is not valid JSON: {err}") from None
        return cls.from_dict(raw)


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _sliding_window(raw: Mapping[str, Any]) -> int | None:
    # Qwen2 configs carry a sliding_window that is inactive unless use_sliding_window is set.
    if raw.get("model_type") == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _rope_config(raw: Mapping[str, Any]) -> RopeConfig:
    # transformers >= 5 nests everything under rope_parameters; older configs use
    # rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise TierlmError(
            f"unsupported rope scaling {rope_type!r} in config.json",
            f"tierlm supports: {', '.join(SUPPORTED_ROPE_TYPES)}",
        )
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", 8192)
        ),
    )

