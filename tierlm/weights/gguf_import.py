"""Import a GGUF checkpoint as an HF-layout model directory.

A GGUF holds (usually quantized) weights under llama.cpp's tensor names, with the Q/K rows of
llama-family models permuted into llama.cpp's interleaved-RoPE order, and describes its tokenizer
as metadata. `import_gguf` turns one into what transformers and tierlm's own loader read:

    config.json              Llama / Qwen2 / Mixtral / Qwen2-MoE / Qwen3-MoE config, float32
    tokenizer.json           built from the GGUF vocabulary (byte-level BPE or SentencePiece BPE)
    tokenizer_config.json    special tokens, add_bos_token, chat_template
    generation_config.json   bos/eos ids, and the sampling settings the GGUF recommends
                             (general.sampling.*: temperature, top_k, top_p, min_p,
                             repetition_penalty, repeat_last_n)
    tierlm-import.json       what was imported from (the GGUF's path and content key), incl. the
                             GGUF tensor types the weights are stored in, per HF tensor too
                             (written last; the directory's receipt)

No weights are written: the directory's checkpoint is the GGUF itself, read tensor by tensor
(one expert of a merged MoE tensor at a time) and dequantized when a conversion asks
(tierlm/weights/gguf_checkpoint.py; `read_plan` says where each HF tensor lies), so an import costs
kilobytes of disk, never a float copy of the model. The import reads every tensor's scales once,
to refuse NaN/Inf before anything is cached.

The directory appears atomically (tierlm.atomic): it is built under a temporary name beside
`out_dir` and renamed into place only when complete, under a per-directory lock, so a killed import
leaves at most a temporary directory that the next import removes. The tokenizer files come from
tierlm.weights.gguf_tokenizer.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
from gguf import Keys

from tierlm.atomic import atomic_directory, directory_lock, make_dirs, write_json
from tierlm.config import LIMITS, MAX_ROPE_THETA, shown_value
from tierlm.errors import TierlmError
from tierlm.models import config_from_dict
from tierlm.progress import Progress
from tierlm.weights.gguf_reader import GgufMetadata, open_gguf
# SUPPORTED_TOKENIZERS is re-exported: it is part of this module's public API.
from tierlm.weights.gguf_tokenizer import SUPPORTED_TOKENIZERS, build_tokenizer  # noqa: F401
from tierlm.weights.gguf_tensors import PlannedTensor, check_finite_scales, parameter_count
from tierlm.weights.import_record import (
    IMPORT_FORMAT_VERSION,
    RECORD_NAME,
    WEIGHTS_IN_GGUF,
    gguf_content_key,
    read_import_record,
)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen2moe", "qwen3moe")
# The GGUF tensor types people download (floats, llama.cpp's legacy and K-quants, IQ4): any other
# (IQ1-IQ3, ternary, ...) is refused by name rather than widened.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                          "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")  # fmt: skip


@dataclass(frozen=True)
class _Family:
    """How one GGUF architecture maps onto an HF model class."""

    hf_class: str
    model_type: str
    # llama.cpp permutes Q/K rows for archs it runs with "normal" (interleaved) RoPE.
    permute_qk: bool
    qk_norm: bool = False  # attn_q_norm / attn_k_norm (Qwen3)
    # Mixture of experts: the HF module holding router and experts ("mlp", Mixtral's
    # "block_sparse_moe"; None for dense families) and the expert projections' HF names for
    # GGUF's gate, up and down.
    moe_module: str | None = None
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


# llama.cpp writes Mixtral as arch "llama" with {arch}.expert_count set (LlamaModel converts it).
_MIXTRAL = _Family("MixtralForCausalLM", "mixtral", permute_qk=True, moe_module="block_sparse_moe",
                   expert_projections=("w1", "w3", "w2"))
_FAMILIES = MappingProxyType(
    {
        "llama": _Family("LlamaForCausalLM", "llama", permute_qk=True),
        "qwen2": _Family("Qwen2ForCausalLM", "qwen2", permute_qk=False),
        "qwen2moe": _Family("Qwen2MoeForCausalLM", "qwen2_moe", permute_qk=False, moe_module="mlp"),
        "qwen3moe": _Family("Qwen3MoeForCausalLM", "qwen3_moe", permute_qk=False, qk_norm=True, moe_module="mlp"),
    }
)

_GLOBAL_TENSORS = MappingProxyType(
    {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
    }
)
_BLOCK_TENSORS = MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
)
_QK_NORM_TENSORS = MappingProxyType({"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"})
# Qwen2-MoE's shared expert and its sigmoid gate.
_SHARED_EXPERT_TENSORS = MappingProxyType(
    {
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    }
)
_EXPERT_PARTS = ("gate", "up", "down")
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Mixtral GGUFs written before llama.cpp merged the experts (early 2024): one tensor per expert.
_SPLIT_EXPERT_NAME = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
_LAYER_PREFIX = re.compile(r"blk\.(\d+)\.")


# ----------------------------------------------------------------------------- public API


def import_gguf(gguf_path: Path, out_dir: Path, progress: Progress | None = None) -> Path:
    """Import `gguf_path` into the HF-layout directory `out_dir` and return `out_dir`.

    `progress(done, total)` is called after each tensor with source tensor bytes processed so far.
    If `out_dir` already holds a complete import of the same file (same content key and importer
    version), it is returned untouched; any other existing `out_dir` is replaced.
    Raises TierlmError for unreadable files and unsupported architectures or tokenizers.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    key = gguf_content_key(gguf_path)
    make_dirs(out_dir.parent)
    with directory_lock(out_dir):
        if _record_matches(out_dir, key):
            return out_dir
        with atomic_directory(out_dir) as tmp:
            _write_model_dir(gguf_path, tmp, key, progress)
    return out_dir


# ----------------------------------------------------------------------------- reusing a finished import


def _record_matches(out_dir: Path, key: str) -> bool:
    record = read_import_record(out_dir)
    return bool(record) and record.get("source_key") == key and record.get("format") == IMPORT_FORMAT_VERSION


# ----------------------------------------------------------------------------- reading the GGUF


def _per_layer_scalar(meta: GgufMetadata, key: str, limit: str) -> int:
    """A count that GGUF may store per layer (a list); HF llama/qwen2 need it uniform. It is
    checked against LIMITS[limit] before anything is sized from it."""
    value = meta.require(key)
    if isinstance(value, list) and value:
        if any(v != value[0] for v in value):
            raise TierlmError(f"{meta.path}: {meta.arch}.{key} differs between layers; tierlm needs one value")
        value = value[0]
    return _checked_int(meta, key, value, limit)


def _checked_int(meta: GgufMetadata, key: str, value: Any, limit: str) -> int:
    """`value` (read from {arch}.`key`) if it is an integer in [1, LIMITS[limit]]."""
    high = LIMITS[limit]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise _bad_value(meta, f"{meta.arch}.{key}", value, f"an integer in [1, {high}]")
    return value


def _checked_float(meta: GgufMetadata, key: str, value: Any, low: float, high: float = math.inf) -> float:
    """`value` (read from {arch}.`key`) if it is a finite number in [low, high], above 0 when low is 0."""
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    if not (math.isfinite(number) and low <= number <= high and (low > 0 or number > 0)):
        span = f"in [{low:g}, {high:g}]" if math.isfinite(high) else (f"≥ {low:g}" if low > 0 else "> 0")
        raise _bad_value(meta, f"{meta.arch}.{key}", value, f"a finite number {span}")
    return float(number)


def _token_id(meta: GgufMetadata, key: str) -> int | None:
    """A special token id (tokenizer.ggml.*_token_id), or None when absent or llama.cpp's "no token"."""
    value = meta.get(key)
    if value is None or (type(value) is int and value in (-1, 2**32 - 1)):  # LLAMA_TOKEN_NULL, signed or not
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= LIMITS["token_id"]:
        raise _bad_value(meta, key, value, f"a token id in [0, {LIMITS['token_id']}]")
    return value


def _bad_value(meta: GgufMetadata, key: str, value: Any, expected: str) -> TierlmError:
    return TierlmError(f"{meta.path}: {key} = {shown_value(value)} is not valid; expected {expected}",
                       hint="the GGUF's metadata is damaged or was written by an unfamiliar tool")


def _f32(value: float) -> float:
    """GGUF stores float32: print the shortest decimal that round-trips, e.g. 1e-05 not 9.99e-06."""
    return float(str(np.float32(value)))


# ----------------------------------------------------------------------------- config


def _build_config(meta: GgufMetadata, family: _Family, tensors: dict) -> dict[str, Any]:
    """The HF config.json for this GGUF (shape fields, norms, RoPE, tying, special ids)."""
    hidden = _checked_int(meta, "embedding_length", meta.require("embedding_length"), "hidden_size")
    n_head = _per_layer_scalar(meta, "attention.head_count", "num_attention_heads")
    has_kv = meta.arch_get("attention.head_count_kv") is not None
    n_kv = _per_layer_scalar(meta, "attention.head_count_kv", "num_key_value_heads") if has_kv else n_head
    head_dim = _head_dim(meta, hidden, n_head)
    rope_dim = meta.arch_get("rope.dimension_count")
    if rope_dim is not None and rope_dim != head_dim:
        raise TierlmError(f"{meta.path}: partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported")
    if meta.arch_get("expert_count") and family.moe_module is None:
        raise TierlmError(f"{meta.path} is a mixture-of-experts {meta.arch} model, which tierlm cannot import")
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise TierlmError(f"{meta.path} has no token_embd.weight tensor; it is not a complete model")
    eps = _checked_float(meta, "attention.layer_norm_rms_epsilon", meta.require("attention.layer_norm_rms_epsilon"),
                         0.0, 1.0)
    theta = _checked_float(meta, "rope.freq_base", meta.arch_get("rope.freq_base", 10000.0), 1.0, MAX_ROPE_THETA)

    config: dict[str, Any] = {
        "architectures": [family.hf_class],
        "model_type": family.model_type,
        "vocab_size": int(embed.shape[-1]),  # GGUF shapes are (cols, rows)
        "hidden_size": hidden,
        "intermediate_size": _intermediate_size(meta, family, tensors),
        "num_hidden_layers": _layer_count(meta, tensors),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _checked_int(
            meta, "context_length", meta.require("context_length"), "max_position_embeddings"
        ),
        "rms_norm_eps": _f32(eps),
        "rope_theta": _f32(theta),
        "rope_scaling": _rope_scaling(meta, tensors, head_dim),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    if family.model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = False
        config["pretraining_tp"] = 1
    elif family.model_type == "mixtral":
        config["sliding_window"] = None
    else:  # qwen2 (q/k/v biases implied by the class), qwen2_moe, qwen3_moe
        config["use_sliding_window"] = False
        config["sliding_window"] = None
        config["max_window_layers"] = config["num_hidden_layers"]
        if family.model_type == "qwen2_moe":
            config["qkv_bias"] = "blk.0.attn_q.bias" in tensors
        elif family.model_type == "qwen3_moe":
            config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if family.moe_module is not None:
        config.update(_moe_config(meta, family, tensors, config["num_hidden_layers"]))
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        token_id = _token_id(meta, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{name}_token_id"] = token_id
    # Every check config.json gets (ranges, heads against kv heads, RoPE), before any weight is written.
    config_from_dict(config, f"{meta.path} (as config.json)")
    return config


def _intermediate_size(meta: GgufMetadata, family: _Family, tensors: dict) -> int:
    """{arch}.feed_forward_length; a MoE GGUF without dense layers may lack it (then the
    experts' width, which is what Mixtral's intermediate_size means anyway)."""
    if family.moe_module is None or (family.model_type != "mixtral" and meta.arch_get("feed_forward_length")):
        return _per_layer_scalar(meta, "feed_forward_length", "intermediate_size")
    return _expert_width(meta, tensors, "ffn_gate_exps")


def _expert_width(meta: GgufMetadata, tensors: dict, part: str) -> int:
    """The intermediate width of the first `part` tensor (ffn_gate_exps: the experts', also from
    split per-expert tensors; ffn_gate_shexp: the shared expert's)."""
    for name, tensor in tensors.items():
        split = part == "ffn_gate_exps" and _SPLIT_EXPERT_NAME.fullmatch(name) and ".ffn_gate." in name
        if name.endswith(f".{part}.weight") or split:
            return int(tensor.shape[1])  # GGUF dims (hidden, intermediate[, experts])
    raise TierlmError(f"{meta.path}: a mixture-of-experts {meta.arch} model without {part} tensors",
                      hint="the GGUF is incomplete")


def _moe_config(meta: GgufMetadata, family: _Family, tensors: dict, layers: int) -> dict[str, Any]:
    """The routing keys the MoE families read; which layers are sparse follows the tensors present
    (llama.cpp itself makes every qwen*moe layer sparse; a dense one lists as mlp_only_layers)."""
    experts = _checked_int(meta, "expert_count", meta.require("expert_count"), "num_experts")
    top_k = _checked_int(meta, "expert_used_count", meta.require("expert_used_count"), "num_experts")
    width = _expert_width(meta, tensors, "ffn_gate_exps")
    stored = meta.arch_get("expert_feed_forward_length")
    if stored is not None and _checked_int(meta, "expert_feed_forward_length", stored, "intermediate_size") != width:
        raise TierlmError(f"{meta.path}: {meta.arch}.expert_feed_forward_length is {stored}, but the expert "
                          f"tensors are {width} wide", hint="the GGUF's metadata is damaged")
    dense = [layer for layer in range(layers) if f"blk.{layer}.ffn_gate_inp.weight" not in tensors]
    if family.model_type == "mixtral":
        if dense:
            raise TierlmError(f"{meta.path}: layer {dense[0]} of this mixture-of-experts llama model has no "
                              "router (ffn_gate_inp); Mixtral routes every layer", hint="the GGUF is incomplete")
        return {"num_local_experts": experts, "num_experts_per_tok": top_k, "router_jitter_noise": 0.0,
                "output_router_logits": False}
    config: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": width,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        # llama.cpp renormalizes the chosen experts' weights for qwen3moe and not for qwen2moe.
        "norm_topk_prob": family.model_type == "qwen3_moe",
        "output_router_logits": False,
    }
    if family.model_type == "qwen2_moe":
        shared = _expert_width(meta, tensors, "ffn_gate_shexp")  # Qwen2-MoE always has a shared expert
        stored = meta.arch_get("expert_shared_feed_forward_length")
        if stored is not None and _checked_int(meta, "expert_shared_feed_forward_length", stored,
                                               "intermediate_size") != shared:
            raise TierlmError(f"{meta.path}: {meta.arch}.expert_shared_feed_forward_length is {stored}, but the "
                              f"shared expert is {shared} wide", hint="the GGUF's metadata is damaged")
        config["shared_expert_intermediate_size"] = shared
    return config


def _head_dim(meta: GgufMetadata, hidden: int, n_head: int) -> int:
    """{arch}.attention.key_length, else hidden / heads, which must then divide evenly."""
    key_length = meta.arch_get("attention.key_length")
    if key_length is not None:
        return _checked_int(meta, "attention.key_length", key_length, "head_dim")
    if hidden % n_head:
        raise TierlmError(
            f"{meta.path}: {meta.arch}.embedding_length {hidden} is not a multiple of attention.head_count {n_head}",
            hint="the GGUF's metadata is damaged",
        )
    return hidden // n_head


def _layer_count(meta: GgufMetadata, tensors: dict) -> int:
    """{arch}.block_count, which must match the blk.N tensors present (0..N-1, each at least once)."""
    count = _checked_int(meta, "block_count", meta.require("block_count"), "num_hidden_layers")
    present = {match[1] for name in tensors if (match := _LAYER_PREFIX.match(name))}
    if present != {str(layer) for layer in range(count)}:
        raise TierlmError(
            f"{meta.path}: {meta.arch}.block_count is {count}, but its blk.N tensors are for "
            f"{len(present)} layer(s), not blk.0 to blk.{count - 1}",
            hint="the GGUF is incomplete, or its metadata is damaged",
        )
    return count


def _rope_scaling(meta: GgufMetadata, tensors: dict, head_dim: int) -> dict[str, Any] | None:
    """HF rope_scaling from {arch}.rope.scaling.* keys, or from a llama3 `rope_freqs` tensor."""
    kind = meta.arch_get("rope.scaling.type")
    # llama.cpp reads a factor of 0 as "not set", as it does a missing key; below 1 is refused, as
    # transformers' RoPE validation does.
    factor_key = next((k for k in ("rope.scaling.factor", "rope.scale_linear") if meta.arch_get(k)), None)
    factor = _checked_float(meta, factor_key, meta.arch_get(factor_key), 1.0) if factor_key else None
    if kind is None and factor is not None and factor != 1.0:
        kind = "linear"  # older files carry only rope.scale_linear
    if kind in (None, "none"):
        freqs = tensors.get("rope_freqs.weight")
        return _llama3_scaling_from_freqs(meta, freqs, head_dim) if freqs is not None else None
    if kind not in ("linear", "yarn"):
        raise TierlmError(f"{meta.path}: RoPE scaling type {kind!r} is not supported (linear, yarn are)")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(factor or 1.0)}
    original = meta.arch_get("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = _checked_int(
            meta, "rope.scaling.original_context_length", original, "max_position_embeddings"
        )
    if kind == "yarn":
        for gguf_key, hf_key in (
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ("rope.scaling.attn_factor", "attention_factor"),
        ):
            value = meta.arch_get(gguf_key)
            if value is not None:
                scaling[hf_key] = _f32(_checked_float(meta, gguf_key, value, 0.0))
    return scaling


def _llama3_scaling_from_freqs(meta: GgufMetadata, freqs_tensor, head_dim: int) -> dict[str, Any] | None:
    """Recover Llama-3.1-style rope_scaling from the per-dimension divisors llama.cpp stores.

    llama.cpp writes the result of HF's llama3 formula as `rope_freqs` instead of its parameters;
    they are found by trying the values Meta's releases use and checking the curve matches exactly.
    """
    stored = np.asarray(freqs_tensor.data, dtype=np.float64).reshape(-1)
    if np.allclose(stored, 1.0):
        return None
    theta = float(meta.arch_get("rope.freq_base", 10000.0))
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor = float(stored.max())
    for original in (2048, 4096, 8192, 16384, 32768, 65536, 131072):
        for low in (0.5, 1.0, 2.0):
            for high in (2.0, 4.0, 8.0, 16.0):
                if high <= low:
                    continue
                smooth = (original / wavelen - low) / (high - low)
                mid = 1.0 / ((1 - smooth) / factor + smooth)
                curve = np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))
                if curve.shape == stored.shape and np.allclose(curve, stored, rtol=1e-4):
                    return {
                        "rope_type": "llama3",
                        "factor": _f32(factor),
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": original,
                    }
    raise TierlmError(f"{meta.path}: its rope_freqs tensor does not match a known RoPE scaling (llama3)")


# ----------------------------------------------------------------------------- weights


def _plan_tensors(meta: GgufMetadata, family: _Family, tensors: dict, config: dict) -> list[PlannedTensor]:
    """Map every GGUF tensor to its HF name; unknown tensors are an error, not silently dropped."""
    plan = []
    n_layers = config["num_hidden_layers"]
    for name, tensor in tensors.items():
        if name == "rope_freqs.weight":
            continue  # folded into config.rope_scaling
        hf_shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
        unpermute = 0
        match = _BLOCK_NAME.fullmatch(name)
        split = _SPLIT_EXPERT_NAME.fullmatch(name) if family.moe_module else None
        if split:
            layer, part, expert = int(split[1]), split[2], int(split[3])
            if layer >= n_layers or expert >= _expert_count(config):
                raise _unknown_tensor(meta, name)
            plan.append(PlannedTensor(tensor, _expert_name(family, layer, expert, part), hf_shape, 0))
            continue
        if match and family.moe_module and match[3] == "weight" and (part := _expert_part(match[2])):
            plan.extend(_expert_slices(meta, family, tensor, int(match[1]), part, config))
            continue
        if match:
            layer, part, kind = int(match[1]), match[2], match[3]
            module = _block_module(family, part)
            if module is None or layer >= n_layers:
                raise _unknown_tensor(meta, name)
            hf_name = f"model.layers.{layer}.{module}.{kind}"
            if family.permute_qk and part in ("attn_q", "attn_k"):
                unpermute = config["num_attention_heads"] if part == "attn_q" else config["num_key_value_heads"]
            if part == "ffn_gate_inp_shexp":
                hf_shape = (1, config["hidden_size"])  # llama.cpp may store the gate's one row as a vector
        else:
            base, _, kind = name.rpartition(".")
            if base not in _GLOBAL_TENSORS or kind != "weight":
                raise _unknown_tensor(meta, name)
            hf_name = f"{_GLOBAL_TENSORS[base]}.weight"
        plan.append(PlannedTensor(tensor, hf_name, hf_shape, unpermute))
    return plan


def _block_module(family: _Family, part: str) -> str | None:
    """The HF module (under model.layers.N) of the per-layer GGUF tensor `part`, if it has one."""
    if part in _BLOCK_TENSORS:
        return _BLOCK_TENSORS[part]
    if family.qk_norm and part in _QK_NORM_TENSORS:
        return _QK_NORM_TENSORS[part]
    if family.moe_module and part == "ffn_gate_inp":
        return f"{family.moe_module}.gate"
    if family.model_type == "qwen2_moe" and part in _SHARED_EXPERT_TENSORS:
        return _SHARED_EXPERT_TENSORS[part]
    return None


def _expert_part(part: str) -> str | None:
    """"gate" for "ffn_gate_exps" (and up, down); None for any other tensor."""
    stem = part.removeprefix("ffn_").removesuffix("_exps")
    return stem if part == f"ffn_{stem}_exps" and stem in _EXPERT_PARTS else None


def _expert_count(config: dict) -> int:
    return config.get("num_experts") or config["num_local_experts"]


def _expert_name(family: _Family, layer: int, expert: int, part: str) -> str:
    projection = family.expert_projections[_EXPERT_PARTS.index(part)]
    return f"model.layers.{layer}.{family.moe_module}.experts.{expert}.{projection}.weight"


def _expert_slices(meta: GgufMetadata, family: _Family, tensor, layer: int, part: str, config: dict) -> list[PlannedTensor]:
    """One planned item per expert of a merged `ffn_{part}_exps` tensor [experts, rows, cols]."""
    experts = _expert_count(config)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if layer >= config["num_hidden_layers"] or len(shape) != 3 or shape[0] != experts:
        raise TierlmError(
            f"{meta.path}: tensor {tensor.name} is {list(shape)}, not [{experts} experts, rows, cols]",
            hint="the GGUF's expert_count does not match its expert tensors; the file is damaged",
        )
    return [
        PlannedTensor(tensor, _expert_name(family, layer, expert, part), shape[1:], 0, expert=expert, slices=experts)
        for expert in range(experts)
    ]


def _unknown_tensor(meta: GgufMetadata, name: str) -> TierlmError:
    return TierlmError(
        f"{meta.path}: tensor {name!r} has no place in a {meta.arch} model",
        hint="this GGUF variant is not supported by tierlm's importer",
    )


def _check_scales(plan: list[PlannedTensor], path: Path, progress: Progress | None) -> None:
    """Every GGUF tensor's scales checked for NaN/Inf (a merged expert tensor once), with progress
    in source bytes; announced before the first tensor, which may be the largest."""
    tensors = list({item.tensor.name: item.tensor for item in plan}.values())
    total, done = sum(int(t.n_bytes) for t in tensors), 0

    def advance(count: int) -> None:
        nonlocal done
        done += count
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    for tensor in tensors:
        check_finite_scales(tensor, path, advance)


# llama.cpp's sampling keys a GGUF may carry, and the generation_config.json fields they become
# (repeat_last_n is tierlm's own: transformers' penalty always covers the whole context).
_SAMPLING_KEYS = MappingProxyType({
    Keys.General.SAMPLING_TEMP: "temperature",
    Keys.General.SAMPLING_TOP_K: "top_k",
    Keys.General.SAMPLING_TOP_P: "top_p",
    Keys.General.SAMPLING_MIN_P: "min_p",
    Keys.General.SAMPLING_PENALTY_REPEAT: "repetition_penalty",
    Keys.General.SAMPLING_PENALTY_LAST_N: "repeat_last_n",
})  # fmt: skip


def _sampling_settings(meta: GgufMetadata, generation: dict[str, Any]) -> dict[str, str]:
    """Put the GGUF's numeric sampling keys into `generation` under transformers' names; returns
    field -> GGUF key. A value out of range is ignored when read (GenerationDefaults)."""
    taken = {}
    for key, field in _SAMPLING_KEYS.items():
        value = meta.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            generation[field] = _f32(value) if isinstance(value, float) else int(value)
            taken[field] = key
    return taken


def _check_tensor_types(path: Path, tensors) -> None:
    """Refuse, before anything is written, a tensor stored in a type outside
    SUPPORTED_TENSOR_TYPES (named, with the list), rather than widen it silently."""
    for tensor in tensors:
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TENSOR_TYPES:
            raise TierlmError(
                f"{path}: tensor {tensor.name} is stored as {kind}, a GGUF type tierlm does not import",
                hint=f"use a file quantized to one of: {', '.join(SUPPORTED_TENSOR_TYPES)}",
            )


def _tensor_types(plan: list[PlannedTensor]) -> dict[str, int]:
    """How many GGUF tensors (a merged expert tensor counts once) each type held: the dequantized
    floats keep that grid."""
    sources = {item.tensor.name: item.tensor.tensor_type.name for item in plan}
    return dict(sorted(Counter(sources.values()).items()))


def _tensor_type_bytes(plan: list[PlannedTensor]) -> dict[str, int]:
    """The GGUF bytes each tensor type holds (what `tierlm show` lists beside the counts)."""
    totals: Counter = Counter()
    for item in plan:
        totals[item.source_type] += item.source_bytes
    return dict(sorted(totals.items()))


# ----------------------------------------------------------------------------- assembling the directory


@dataclass(frozen=True)
class GgufPlan:
    """What a GGUF holds, as an HF model: its metadata, config.json and where each HF tensor lies."""

    meta: GgufMetadata
    config: dict[str, Any]
    plan: list[PlannedTensor]


def read_plan(gguf_path: Path) -> GgufPlan:
    """Parse `gguf_path`'s header (no tensor data is read) into config and tensor plan; every
    check on architecture, metadata, tensor names, types and shapes is made here."""
    reader = open_gguf(gguf_path)
    if reader.byte_order != "I":
        raise TierlmError(f"{gguf_path} is a big-endian GGUF", hint="tierlm reads little-endian GGUF files only")
    meta = GgufMetadata(reader, gguf_path)
    split_count = meta.get("split.count")
    if split_count and int(split_count) > 1:
        raise TierlmError(
            f"{gguf_path} is one part of a split GGUF ({split_count} parts)",
            hint="merge the parts first: llama-gguf-split --merge FIRST-PART OUT.gguf",
        )
    family = _FAMILIES.get(meta.arch)
    if family is not None and family.model_type == "llama" and meta.arch_get("expert_count"):
        family = _MIXTRAL
    if family is None:
        raise TierlmError(
            f"{gguf_path}: GGUF architecture {meta.arch!r} is not supported",
            hint=f"tierlm imports GGUF architectures: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    tensors = {t.name: t for t in reader.tensors}
    _check_tensor_types(gguf_path, tensors.values())
    config = _build_config(meta, family, tensors)
    return GgufPlan(meta, config, _plan_tensors(meta, family, tensors, config))


def _write_model_dir(gguf_path: Path, out: Path, key: str, progress: Progress | None) -> None:
    """Write every file of the imported model into `out` (the temporary directory)."""
    read = read_plan(gguf_path)
    meta, config, plan = read.meta, read.config, read.plan
    # The tokenizer is built before the pass over the weights so its errors come early.
    built = build_tokenizer(meta)
    _check_scales(plan, gguf_path, progress)
    write_json(out / "config.json", config)
    generation: dict[str, Any] = {"_from_model_config": False}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if name in config:
            generation[name] = config[name]
    stops = [_token_id(meta, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    stops = list(dict.fromkeys(s for s in stops if s is not None))
    if len(stops) > 1:  # chat models end turns with eot/eom as well as eos
        generation["eos_token_id"] = stops
    sampling_keys = _sampling_settings(meta, generation)
    write_json(out / "generation_config.json", generation)
    if built is not None:
        tokenizer, tokenizer_config = built
        tokenizer.save(str(out / "tokenizer.json"))
        write_json(out / "tokenizer_config.json", tokenizer_config)
    write_json(
        out / RECORD_NAME,
        {
            "format": IMPORT_FORMAT_VERSION,
            "source_name": gguf_path.name,
            "source_path": str(gguf_path.resolve()),  # an import of other content from here replaces this one
            "source_bytes": gguf_path.stat().st_size,
            "source_key": key,
            "weights": WEIGHTS_IN_GGUF,  # the checkpoint is the GGUF itself (tierlm/weights/gguf_checkpoint.py)
            "parameters": parameter_count(plan),
            "architecture": meta.arch,
            "general_name": meta.get("general.name"),
            "sampling_keys": sampling_keys,  # field -> the GGUF key it came from (`tierlm show` names it)
            "tensor_types": _tensor_types(plan),
            "tensor_type_bytes": _tensor_type_bytes(plan),
            "tensor_type_of": {item.hf_name: item.tensor.tensor_type.name for item in plan},
            "tensor_rows_of": {item.hf_name: item.hf_shape[0] for item in plan},  # a fused weight's runs
        },
    )
