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
        "qwen3": "tierlm.models.qwen3",
        "glm": "tierlm.models.glm",
        "chatglm": "tierlm.models.chatglm",
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
    # Share of each head's channels that rotate; only the GLM families read it, as transformers does.
    partial_rotary_factor: float = 1.0


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
            if model_type == "chatglm":
                raw = _chatglm_as_glm(raw)
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


# ChatGLM2/3 switches tierlm cannot honour: (key, ChatGLMConfig's default, the value it needs).
_CHATGLM_REQUIRED = (
    ("multi_query_attention", False, True),
    ("rmsnorm", True, True),
    ("post_layer_norm", True, True),
    ("apply_residual_connection_post_layernorm", False, False),
    ("add_bias_linear", False, False),
)


def _chatglm_as_glm(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A ChatGLM2/3 (or GLM-4 in ChatGLM layout) config.json under the keys GlmConfig uses.

    ChatGLM keeps its own names (num_layers, padded_vocab_size, ffn_hidden_size, kv_channels,
    multi_query_group_num, add_qkv_bias, layernorm_epsilon, seq_length); its RoPE is GLM's with
    half of each head rotating and base 10000 * rope_ratio (models/chatglm.py says why).
    """
    if "position_encoding_2d" in raw or "padded_vocab_size" not in raw:
        raise TierlmError(
            "config.json describes the first ChatGLM-6B (2-D positions, GELU), which tierlm does not run",
            "tierlm runs ChatGLM2/3 and GLM-4 checkpoints",
        )
    for key, default, needed in _CHATGLM_REQUIRED:
        if bool(raw.get(key, default)) != needed:
            raise TierlmError(
                f"config.json sets {key} = {str(not needed).lower()}, which tierlm does not support",
                f"tierlm runs ChatGLM checkpoints with {key} = {str(needed).lower()} (as ChatGLM2/3 ship)",
            )
    heads = int(raw["num_attention_heads"])
    return {
        "model_type": "chatglm",
        "vocab_size": raw["padded_vocab_size"],
        "hidden_size": raw["hidden_size"],
        "intermediate_size": raw["ffn_hidden_size"],
        "num_hidden_layers": raw["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": raw.get("multi_query_group_num", 1),
        "head_dim": raw.get("kv_channels") or int(raw["hidden_size"]) // heads,
        "rms_norm_eps": raw.get("layernorm_epsilon", 1e-5),
        "max_position_embeddings": raw.get("seq_length", 2048),
        # ChatGLM never ties: output_layer is its own tensor whatever the config says.
        "tie_word_embeddings": False,
        "attention_bias": raw.get("add_qkv_bias", False),
        "rope_theta": 10000.0 * float(raw.get("rope_ratio", 1)),
        "partial_rotary_factor": 0.5,
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_id": raw.get("eos_token_id"),
        "torch_dtype": raw.get("torch_dtype") or raw.get("dtype"),
    }


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _sliding_window(raw: Mapping[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    qwen = raw.get("model_type") in ("qwen2", "qwen3")
    # Qwen configs carry a sliding_window that is inactive unless use_sliding_window is set.
    if not window or (qwen and not raw.get("use_sliding_window", False)):
        return None
    layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types")
    if not kinds and qwen:
        # ...and then it applies only to the layers from max_window_layers on.
        first = int(raw.get("max_window_layers", 28))  # Qwen2Config's and Qwen3Config's default
        kinds = ["full_attention"] * min(first, layers) + ["sliding_attention"] * max(layers - first, 0)
    sliding = sum(kind == "sliding_attention" for kind in kinds) if kinds else layers
    if sliding == 0:
        return None
    if sliding < layers:
        raise TierlmError(
            f"config.json slides the attention window in {sliding} of {layers} layers",
            "tierlm applies one sliding window to every layer or to none",
        )
    return int(window)


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
    # GlmConfig rotates half of each head unless told otherwise.
    partial = 0.5 if raw.get("model_type") == "glm" else 1.0
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", 8192)
        ),
        partial_rotary_factor=float(merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", partial))),
    )

