"""ModelConfig: a checkpoint's settings, read from its config.json and nothing else; and
GenerationDefaults: the sampling settings its generation_config.json recommends.

`parse_model_config` is handed the family descriptions, which say what a family's keys mean; the
registry that holds them sits above this module, so callers read a config through it
(`tierlm.models.read_config`, `config_from_dict`).

Every value is checked for type and range before anything is sized from it: a config.json is
untrusted input, and one that claims 10^9 layers or 0 heads must be refused in one line, not
met later as an exhausted memory or a ZeroDivisionError. The ceilings (`LIMITS`) are several
times the largest released checkpoints, so no real model is refused by them.
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from tierlm.errors import TierlmError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Largest accepted value of each integer setting (inclusive). Llama-3.1-405B has 126 layers,
# hidden 16384, intermediate 53248, 128 heads; Llama 4 reaches 10M positions.
LIMITS: Mapping[str, int] = MappingProxyType(
    {
        "vocab_size": 1 << 24,
        "hidden_size": 1 << 17,
        "intermediate_size": 1 << 20,
        "num_hidden_layers": 1024,
        "num_attention_heads": 4096,
        "num_key_value_heads": 4096,
        "head_dim": 4096,
        "max_position_embeddings": 1 << 24,
        "token_id": (1 << 24) - 1,
        # Mixture of experts: DeepSeek-V3 routes over 256 experts, Qwen3-235B-A22B 8 of 128.
        "num_experts": 1 << 12,
    }
)
MAX_ROPE_THETA = 1e30  # rope_inv_freq raises theta to a power in fp32 (max ~3.4e38)
MAX_CONFIG_BYTES = 16 << 20  # a real config.json is a few KiB; this bounds what is read


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
class MoeConfig:
    """A mixture-of-experts decoder's routing: each sparse layer's MLP is `top_k` of `experts`
    SwiGLU experts (intermediate `expert_intermediate`), chosen per token by a softmax router;
    the other layers keep the dense MLP (intermediate_size)."""

    experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int = 0  # Qwen2-MoE's always-on shared expert; 0: none
    norm_topk_prob: bool = True  # renormalize the chosen top-k probabilities to sum to 1
    sparse_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


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
    moe: MoeConfig | None = None  # None: a dense model

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def parse_model_config(raw: Any, source: str, families: Mapping[str, Any]) -> ModelConfig:
    """Build from a parsed config.json; unknown keys are ignored, missing ones are errors.

    `families` maps each supported model_type to its family's description, which says what its
    config.json means (the registry in tierlm/models/ hands it in: `tierlm.models.read_config`).
    Every value read is checked (type, range, heads against hidden size) first; a bad one is a
    TierlmError naming `source`, the key, the value and what is expected.
    """
    if not isinstance(raw, Mapping):
        raise TierlmError(f"{source} must hold a JSON object, not {_json_kind(raw)}",
                          "is this a Hugging Face config.json?")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in families:
        raise TierlmError(
            f"unsupported model_type {shown_value(model_type)} in {source}",
            f"tierlm supports: {', '.join(sorted(families))}",
        )
    family = families[model_type]
    fields = _Fields(family.translate_config(_Fields(raw, source)), source)
    hidden = fields.integer("hidden_size")
    heads = fields.integer("num_attention_heads")
    layers = fields.integer("num_hidden_layers")
    vocab = fields.integer("vocab_size")
    config = ModelConfig(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=fields.integer("intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=fields.integer("num_key_value_heads", heads),
        head_dim=_head_dim(fields, hidden, heads),
        rms_norm_eps=fields.number("rms_norm_eps", 1e-6, low=0.0, high=1.0, open_low=True),
        max_position_embeddings=fields.integer("max_position_embeddings", 2048),
        tie_word_embeddings=fields.flag("tie_word_embeddings", False),
        attention_bias=fields.flag("attention_bias", False),
        mlp_bias=fields.flag("mlp_bias", False),
        rope=_rope_config(fields, family),
        bos_token_id=fields.integer("bos_token_id", None, low=0, limit="token_id"),
        eos_token_ids=fields.token_ids("eos_token_id"),
        torch_dtype=fields.text("torch_dtype", None) or fields.text("dtype", None) or "float32",
        sliding_window=_sliding_window(fields, family, layers),
        moe=family.moe_config(fields, layers),
    )
    _check_shapes(config, family, source)
    return config


def config_json_path(model_dir: Path) -> Path:
    """`model_dir`/config.json, which must exist (else a TierlmError that says what to pass)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise TierlmError(
            f"no config.json in {model_dir}",
            "pass --model a Hugging Face model directory, or import a GGUF with `tierlm import-gguf`",
        )
    return path


def read_config_json(path: Path) -> Any:
    """The parsed JSON in `path`; unreadable, oversized, invalid or absurdly nested files are TierlmError."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise TierlmError(f"{path} is {size / 2**20:.0f} MiB; a config.json is a few KiB (at most "
                              f"{MAX_CONFIG_BYTES >> 20} MiB is read)")
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        # ValueError covers JSONDecodeError and integers past Python's digit limit.
        raise TierlmError(f"{path} is not valid JSON: {_one_line(err)}") from None
    except OSError as err:
        raise TierlmError(f"cannot read {path}: {err.strerror or err}") from None


# ---------------------------------------------------------------------------- checked reads

_REQUIRED = object()


@dataclass(frozen=True)
class _Fields:
    """Typed reads from one JSON object: a bad value is a TierlmError naming the key, the value
    (truncated) and what was expected. A key set to null reads as absent."""

    raw: Mapping[str, Any]
    source: str
    labels: Mapping[str, str] = field(default_factory=dict)  # key -> name shown, e.g. "rope_scaling.factor"

    def read(self, key: str, default: Any = _REQUIRED) -> tuple[bool, Any]:
        """(True, value) when `key` holds a value; (False, default) when absent or null, unless required."""
        value = self.raw.get(key)
        if value is not None:
            return True, value
        if default is not _REQUIRED:
            return False, default
        if key in self.raw:
            raise self.bad(key, value, "a value")
        raise TierlmError(f"{self.source} lacks the required key {self.label(key)!r}",
                          "is this a complete Hugging Face checkpoint?")

    def integer(self, key: str, default: Any = _REQUIRED, *, low: int = 1, limit: str | None = None) -> Any:
        """An integer in [low, LIMITS[limit or key]]; an integral float (2048.0) counts, true does not."""
        given, value = self.read(key, default)
        if not given:
            return value
        high = LIMITS.get(limit or key)
        integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not integral or value < low or (high is not None and value > high):
            span = f"in [{low}, {high}]" if high is not None else f"≥ {low}"
            raise self.bad(key, value, f"an integer {span}")
        return int(value)

    def number(self, key: str, default: Any, *, low: float, high: float = math.inf, open_low: bool = False) -> float:
        """A finite number in [low, high] ((low, high] with `open_low`); NaN and Infinity are refused."""
        given, value = self.read(key, default)
        number = _finite(value)
        if number is None or number < low or (open_low and number == low) or number > high:
            raise self.bad(key, value, f"a finite number {_span(low, high, open_low)}")
        return number

    def flag(self, key: str, default: bool) -> bool:
        given, value = self.read(key, default)
        if not isinstance(value, bool):
            raise self.bad(key, value, "true or false")
        return value

    def text(self, key: str, default: Any = _REQUIRED) -> Any:
        given, value = self.read(key, default)
        if given and not isinstance(value, str):
            raise self.bad(key, value, "a string")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        given, value = self.read(key, {})
        if not isinstance(value, Mapping):
            raise self.bad(key, value, "an object ({...}) or null")
        return dict(value)

    def token_ids(self, key: str) -> tuple[int, ...]:
        """A token id or a list of them (eos_token_id's two forms); absent is ()."""
        given, value = self.read(key, None)
        items = value if isinstance(value, list) else [value] if given else []
        top = LIMITS["token_id"]
        for item in items:
            if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= top:
                raise self.bad(key, value, f"a token id in [0, {top}] or a list of them")
        return tuple(items)

    def label(self, key: str) -> str:
        return self.labels.get(key, key)

    def bad(self, key: str, value: Any, expected: str) -> TierlmError:
        return TierlmError(f"{self.source}: {self.label(key)} = {shown_value(value)} is not valid; expected {expected}",
                           "the checkpoint's configuration is damaged or was edited by hand")


def _finite(value: Any) -> float | None:
    """`value` as a finite float, or None for non-numbers, bools, NaN, ±Infinity and huge integers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _span(low: float, high: float, open_low: bool) -> str:
    if high == math.inf:
        return f"{'>' if open_low else '≥'} {low:g}"
    return f"in {'(' if open_low else '['}{low:g}, {high:g}]"


def shown_value(value: Any) -> str:
    """A short one-line rendering of a (JSON or GGUF metadata) value for an error message."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"
    shorten = reprlib.Repr()
    shorten.maxstring, shorten.maxother, shorten.maxlist, shorten.maxdict, shorten.maxlevel = 40, 40, 4, 3, 2
    return _one_line(shorten.repr(value))


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _json_kind(value: Any) -> str:
    kinds = ((list, "a list"), (str, "a string"), (bool, "a boolean"), (int, "a number"), (float, "a number"))
    return next((name for kind, name in kinds if isinstance(value, kind)), "null" if value is None else "a value")


# ---------------------------------------------------------------------------- derived checks


def _head_dim(fields: _Fields, hidden: int, heads: int) -> int:
    """head_dim as given, else hidden_size / num_attention_heads, which must then divide evenly."""
    given = fields.integer("head_dim", None)
    if given is not None:
        return given
    if hidden % heads:
        raise TierlmError(
            f"{fields.source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}",
            "set head_dim, or correct the two counts",
        )
    return hidden // heads


def _check_shapes(config: ModelConfig, family, source: str) -> None:
    """Relations between values that are each in range on their own."""
    if config.num_attention_heads % config.num_key_value_heads:
        raise TierlmError(
            f"{source}: num_attention_heads ({config.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})"
        )
    # RoPE rotates channel pairs, so the rotated width must be even and not empty.
    rotated = family.rotated_channels(config)
    if rotated < 2 or rotated % 2:
        raise TierlmError(
            f"{source}: RoPE would rotate {rotated} of each head's {config.head_dim} channels; "
            "expected an even number of at least 2"
        )
    rope = config.rope
    if rope.rope_type == "llama3" and not rope.high_freq_factor > rope.low_freq_factor:
        raise TierlmError(
            f"{source}: llama3 RoPE scaling needs high_freq_factor ({rope.high_freq_factor:g}) "
            f"> low_freq_factor ({rope.low_freq_factor:g})"
        )


# ---------------------------------------------------------------------------- mixture of experts


def read_moe(fields: _Fields, layers: int, *, expert_intermediate: str, shared: bool,
             norm_topk_prob: bool | None, sparse_rule: bool) -> MoeConfig:
    """A MoE family's routing settings (the families in models/ say which keys apply).

    The expert count is `num_experts` or `num_local_experts` (Mixtral's name, and what
    transformers 5 writes for Qwen3-MoE); `norm_topk_prob` None reads the key (default false),
    else it is fixed (Mixtral always renormalizes). With `sparse_rule`, a layer is sparse unless
    listed in `mlp_only_layers` or off the `decoder_sparse_step` (Qwen-MoE); else every layer is.
    """
    experts_key = "num_experts" if fields.read("num_experts", None)[0] else "num_local_experts"
    experts = fields.integer(experts_key, limit="num_experts")
    top_k = fields.integer("num_experts_per_tok", limit="num_experts")
    if top_k > experts:
        raise TierlmError(f"{fields.source}: num_experts_per_tok ({top_k}) exceeds {experts_key} ({experts})",
                          "each token chooses top_k of the experts; top_k must not exceed their number")
    sparse = tuple(range(layers))
    if sparse_rule:
        step = fields.integer("decoder_sparse_step", 1, limit="num_hidden_layers")
        _, dense = fields.read("mlp_only_layers", [])
        if not isinstance(dense, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in dense):
            raise fields.bad("mlp_only_layers", dense, f"a list of layer indices in [0, {layers - 1}]")
        sparse = tuple(i for i in sparse if i not in dense and (i + 1) % step == 0)
    return MoeConfig(
        experts=experts,
        top_k=top_k,
        expert_intermediate=fields.integer(expert_intermediate, limit="intermediate_size"),
        shared_intermediate=fields.integer("shared_expert_intermediate_size", limit="intermediate_size") if shared else 0,
        norm_topk_prob=fields.flag("norm_topk_prob", False) if norm_topk_prob is None else norm_topk_prob,
        sparse_layers=sparse,
    )


# ---------------------------------------------------------------------------- windows and RoPE


def _sliding_window(fields: _Fields, family, layers: int) -> int | None:
    """The window every layer slides over, or None; the family says whether a given window is in
    force and which layers slide when layer_types does not say."""
    window = fields.integer("sliding_window", None, low=0, limit="max_position_embeddings")
    if not window or not family.sliding_window_in_force(fields):
        return None
    _, kinds = fields.read("layer_types", None)
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != layers
                              or not all(isinstance(kind, str) for kind in kinds)):
        raise fields.bad("layer_types", kinds, f"a list of {layers} strings, one per layer")
    if not kinds:
        kinds = family.default_layer_types(fields, layers)
    sliding = sum(kind == "sliding_attention" for kind in kinds) if kinds else layers
    if sliding == 0:
        return None
    if sliding < layers:
        raise TierlmError(
            f"config.json slides the attention window in {sliding} of {layers} layers",
            "tierlm applies one sliding window to every layer or to none",
        )
    return window


def _rope_config(fields: _Fields, family) -> RopeConfig:
    # transformers >= 5 nests everything under rope_parameters; older configs use
    # rope_theta + rope_scaling.
    params = fields.mapping("rope_parameters")
    scaling = fields.mapping("rope_scaling")
    merged = {**scaling, **params}
    labels = {key: f"{'rope_parameters' if key in params else 'rope_scaling'}.{key}" for key in merged}
    rope = _Fields(merged, fields.source, labels)
    theta = rope.number("rope_theta", fields.number("rope_theta", 10000.0, low=1.0, high=MAX_ROPE_THETA),
                       low=1.0, high=MAX_ROPE_THETA)
    rope_type = rope.text("rope_type", None) or rope.text("type", None) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise TierlmError(
            f"unsupported rope scaling {rope_type!r} in {fields.source}",
            f"tierlm supports: {', '.join(SUPPORTED_ROPE_TYPES)}",
        )
    partial = fields.number("partial_rotary_factor", family.partial_rotary_default, low=0.0, high=1.0, open_low=True)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        # A factor below 1 is refused as transformers' rope validation does; 0 would divide by zero.
        factor=rope.number("factor", 1.0, low=1.0),
        low_freq_factor=rope.number("low_freq_factor", 1.0, low=0.0, open_low=True),
        high_freq_factor=rope.number("high_freq_factor", 4.0, low=0.0, open_low=True),
        original_max_position_embeddings=rope.integer(
            "original_max_position_embeddings", 8192, limit="max_position_embeddings"
        ),
        partial_rotary_factor=rope.number("partial_rotary_factor", partial, low=0.0, high=1.0, open_low=True),
    )


# Where a GenerationDefaults value came from, for `tierlm show`: these two, or a label its caller gives.
GENERATION_CONFIG = "generation_config.json"
FALLBACK_ORIGIN = "tierlm's fallback"


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling settings a run uses where the user (flag, request field) gives none.

    Layered, highest first: the model's own generation_config.json (where a GGUF import writes
    the file's general.sampling.* keys), then what tierlm ships for that model (the embedded
    one decodes greedily: tierlm.weights.embedded), then the fallback below: temperature 0.7, top-p 0.9, top-k 40, min-p off, and
    Ollama's repetition penalty 1.1 over the last 64 tokens. An explicit `do_sample: false`
    means greedy (temperature 0), as transformers reads it. `origins` says where each field not
    at the fallback came from (`origin`), for `tierlm show`.
    """

    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 40
    min_p: float = 0.0
    repetition_penalty: float = 1.1
    repeat_last_n: int = 64  # tokens the penalty looks back over; 0 = off, -1 = the whole context
    origins: tuple[tuple[str, str], ...] = ()  # (field, where its value came from)

    def origin(self, name: str) -> str:
        """Where the value of field `name` came from."""
        return dict(self.origins).get(name, FALLBACK_ORIGIN)

    def overridden(self, values: Mapping[str, Any], origin: str) -> "GenerationDefaults":
        """These defaults with `values` (field -> value) in place, each credited to `origin`."""
        kept = tuple((name, where) for name, where in self.origins if name not in values)
        return replace(self, **values, origins=kept + tuple((name, origin) for name in sorted(values)))

    @classmethod
    def from_dir(cls, model_dir: Path, base: "GenerationDefaults | None" = None,
                 labels: Mapping[str, str] | None = None) -> "GenerationDefaults":  # fmt: skip
        """`base` (else the fallback) under `model_dir`/generation_config.json's values; a missing
        or unreadable file leaves `base`. `labels`: field -> origin for values the file holds on
        behalf of another source (a GGUF's sampling keys)."""
        try:
            raw = json.loads((Path(model_dir) / "generation_config.json").read_text())
        except (OSError, ValueError):
            return base or cls()
        return cls.from_dict(raw if isinstance(raw, dict) else {}, base, GENERATION_CONFIG, labels)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], base: "GenerationDefaults | None" = None,
                  origin: str = GENERATION_CONFIG,
                  labels: Mapping[str, str] | None = None) -> "GenerationDefaults":  # fmt: skip
        """`base` (else the fallback) with `raw`'s usable values in place, credited to `origin`;
        out-of-range or mistyped ones are ignored, since a stray value in a model's file should
        not stop it from running."""
        values = {key: cast(raw[key]) for key, (cast, ok) in _GENERATION_FIELDS.items()
                  if _number(raw.get(key)) and ok(raw[key])}  # fmt: skip
        labels = dict(labels or {})
        if raw.get("do_sample") is False:
            values["temperature"] = 0.0
            labels["temperature"] = f"{origin} (do_sample: false)"
        defaults = base or cls()
        for key, value in values.items():
            defaults = defaults.overridden({key: value}, labels.get(key, origin))
        return defaults


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# generation_config.json fields read: (cast, whether a value is usable: SamplingParams' ranges).
# repeat_last_n is no transformers key: a GGUF import writes it from general.sampling.penalty_last_n.
_GENERATION_FIELDS: Mapping[str, tuple[Any, Any]] = MappingProxyType(
    {
        "temperature": (float, lambda v: v >= 0),
        "top_p": (float, lambda v: 0 < v <= 1),
        "top_k": (int, lambda v: v >= 0 and float(v).is_integer()),
        "min_p": (float, lambda v: 0 <= v <= 1),
        "repetition_penalty": (float, lambda v: v > 0),
        "repeat_last_n": (int, lambda v: v >= -1 and float(v).is_integer()),
    }
)
# The sampling settings a model has defaults for: what a flag or request field left unset takes
# from GenerationDefaults (runtime/sampling.py resolve_sampling).
MODEL_SAMPLING_FIELDS: tuple[str, ...] = tuple(_GENERATION_FIELDS)
