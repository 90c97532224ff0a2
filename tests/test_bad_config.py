"""A corpus of bad model settings: config.json values, GGUF metadata and sampling values.

Each case is refused with one TierlmError line naming the key (and the value and what is
expected) before anything is sized or allocated from it; a few go through the real CLI
(exit status 1, `error: ...`, no traceback).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tierlm.config import LIMITS
from tierlm.models import config_from_dict, read_config
from tierlm.errors import TierlmError
from tierlm.runtime.sampling import Sampler, SamplingParams

LLAMA = {
    "model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512, "rope_theta": 10000.0, "eos_token_id": 2, "tie_word_embeddings": False,
}  # fmt: skip
CHATGLM = {
    "model_type": "chatglm", "num_layers": 2, "padded_vocab_size": 320, "hidden_size": 64,
    "ffn_hidden_size": 96, "kv_channels": 16, "num_attention_heads": 4, "multi_query_attention": True,
    "multi_query_group_num": 2, "add_qkv_bias": True, "layernorm_epsilon": 1e-5, "rope_ratio": 1.0,
    "seq_length": 512,
}  # fmt: skip
NAN, INF = float("nan"), float("inf")

# (name, config.json overrides, text the error must contain). "key" cases name the key itself.
BAD_CONFIGS = [
    ("hidden-str", {"hidden_size": "576x"}, "hidden_size = '576x'"),
    ("hidden-null", {"hidden_size": None}, "hidden_size = None"),
    ("hidden-list", {"hidden_size": [576]}, "hidden_size = [576]"),
    ("hidden-bool", {"hidden_size": True}, "hidden_size = True"),
    ("hidden-zero", {"hidden_size": 0}, "hidden_size = 0"),
    ("hidden-fraction", {"hidden_size": 64.5}, "hidden_size = 64.5"),
    ("hidden-nan", {"hidden_size": NAN}, "hidden_size = nan"),
    ("hidden-huge", {"hidden_size": 2**40}, f"integer in [1, {LIMITS['hidden_size']}]"),
    ("hidden-bigint", {"hidden_size": 10**400}, "hidden_size = <an integer of"),
    ("layers-negative", {"num_hidden_layers": -1}, "num_hidden_layers = -1"),
    ("layers-billion", {"num_hidden_layers": 10**9}, "integer in [1, 1024]"),
    ("layers-str", {"num_hidden_layers": "2"}, "num_hidden_layers = '2'"),
    ("layers-missing", {"num_hidden_layers": ...}, "lacks the required key 'num_hidden_layers'"),
    ("heads-zero", {"num_attention_heads": 0}, "num_attention_heads = 0"),
    ("kv-zero", {"num_key_value_heads": 0}, "num_key_value_heads = 0"),
    ("kv-not-divisor", {"num_key_value_heads": 3}, "multiple of num_key_value_heads (3)"),
    ("heads-not-divisor", {"num_attention_heads": 3, "num_key_value_heads": 3},
     "hidden_size 64 is not a multiple of num_attention_heads 3"),
    ("head-dim-odd", {"head_dim": 15}, "rotate 15 of each head's 15 channels"),
    ("head-dim-huge", {"head_dim": 2**20}, "head_dim = 1048576"),
    ("vocab-huge", {"vocab_size": 2**25}, f"integer in [1, {LIMITS['vocab_size']}]"),
    ("intermediate-huge", {"intermediate_size": 2**21}, "intermediate_size"),
    ("positions-zero", {"max_position_embeddings": 0}, "max_position_embeddings = 0"),
    ("positions-huge", {"max_position_embeddings": 2**30}, "max_position_embeddings"),
    ("eps-str", {"rms_norm_eps": "tiny"}, "rms_norm_eps = 'tiny'"),
    ("eps-nan", {"rms_norm_eps": NAN}, "rms_norm_eps = nan"),
    ("eps-inf", {"rms_norm_eps": INF}, "rms_norm_eps = inf"),
    ("eps-zero", {"rms_norm_eps": 0}, "finite number in (0, 1]"),
    ("eps-negative", {"rms_norm_eps": -1e-6}, "rms_norm_eps = -1e-06"),
    ("eos-str", {"eos_token_id": "two"}, "eos_token_id = 'two'"),
    ("eos-list-str", {"eos_token_id": [2, "x"]}, "eos_token_id = [2, 'x']"),
    ("eos-negative", {"eos_token_id": -1}, "token id in [0,"),
    ("eos-bool", {"eos_token_id": True}, "eos_token_id = True"),
    ("bos-str", {"bos_token_id": "1"}, "bos_token_id = '1'"),
    ("rope-scaling-str", {"rope_scaling": "yes"}, "rope_scaling = 'yes'"),
    ("rope-scaling-list", {"rope_scaling": [1]}, "rope_scaling = [1]"),
    ("rope-parameters-str", {"rope_parameters": "x"}, "rope_parameters = 'x'"),
    ("rope-factor-zero", {"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling.factor = 0"),
    ("rope-factor-nan", {"rope_scaling": {"rope_type": "linear", "factor": NAN}}, "rope_scaling.factor = nan"),
    ("rope-type-list", {"rope_scaling": {"rope_type": ["linear"]}}, "rope_scaling.rope_type = ['linear']"),
    ("rope-llama3-inverted", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                               "high_freq_factor": 1.0}}, "high_freq_factor (1) > low_freq_factor (4)"),
    ("rope-original-zero", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                             "original_max_position_embeddings": 0}},
     "rope_scaling.original_max_position_embeddings = 0"),
    ("theta-negative", {"rope_theta": -1}, "rope_theta = -1"),
    ("theta-zero", {"rope_theta": 0}, "rope_theta = 0"),
    ("theta-tiny", {"rope_theta": 1e-300}, "rope_theta = 1e-300"),
    ("theta-nan", {"rope_theta": NAN}, "rope_theta = nan"),
    ("theta-inf", {"rope_theta": INF}, "rope_theta = inf"),
    ("theta-str", {"rope_theta": "1e4"}, "rope_theta = '1e4'"),
    ("theta-nested-negative", {"rope_parameters": {"rope_theta": -5.0, "rope_type": "default"}},
     "rope_parameters.rope_theta = -5.0"),
    ("tie-str", {"tie_word_embeddings": "false"}, "tie_word_embeddings = 'false'"),
    ("tie-int", {"tie_word_embeddings": 1}, "true or false"),
    ("bias-list", {"attention_bias": []}, "attention_bias = []"),
    ("model-type-list", {"model_type": ["llama"]}, "unsupported model_type ['llama']"),
    ("model-type-null", {"model_type": None}, "unsupported model_type None"),
    ("dtype-int", {"torch_dtype": 5}, "torch_dtype = 5"),
    ("mistral-window-negative", {"model_type": "mistral", "sliding_window": -1}, "sliding_window = -1"),
    ("mistral-window-str", {"model_type": "mistral", "sliding_window": "4096"}, "sliding_window = '4096'"),
    ("qwen-window-flag-str", {"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": "yes"},
     "use_sliding_window = 'yes'"),
    ("window-layer-types", {"model_type": "mistral", "sliding_window": 8, "layer_types": ["sliding_attention"]},
     "a list of 2 strings"),
    ("glm-partial-zero", {"model_type": "glm", "head_dim": 16, "partial_rotary_factor": 0}, "partial_rotary_factor"),
    ("glm-partial-odd", {"model_type": "glm", "head_dim": 6, "partial_rotary_factor": 0.5},
     "rotate 3 of each head's 6"),
]
BAD_CHATGLM = [
    ("layers-negative", {"num_layers": -1}, "num_layers = -1"),
    ("vocab-str", {"padded_vocab_size": "x"}, "padded_vocab_size = 'x'"),
    ("kv-channels-zero", {"kv_channels": 0}, "kv_channels = 0"),
    ("heads-zero", {"num_attention_heads": 0, "kv_channels": None}, "num_attention_heads = 0"),
    ("rope-ratio-zero", {"rope_ratio": 0}, "rope_ratio = 0"),
    ("rope-ratio-str", {"rope_ratio": "50"}, "rope_ratio = '50'"),
    ("mqa-str", {"multi_query_attention": "yes"}, "multi_query_attention = 'yes'"),
    ("groups-huge", {"multi_query_group_num": 10**6}, "multi_query_group_num"),
]


def with_overrides(base: dict, overrides: dict) -> dict:
    """`base` updated by `overrides`, where a value of ... deletes the key."""
    merged = {**base, **overrides}
    return {key: value for key, value in merged.items() if value is not ...}


def assert_one_line(err: pytest.ExceptionInfo, *needles: str) -> None:
    text = str(err.value)
    assert "\n" not in text and len(text) < 400, text
    for needle in needles:
        assert needle in text, text


# ----------------------------------------------------------------------------- config.json values


@pytest.mark.parametrize("overrides, needle", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_value_is_one_clear_error(overrides, needle):
    with pytest.raises(TierlmError) as err:
        config_from_dict(with_overrides(LLAMA, overrides), "config.json")
    assert_one_line(err, needle)


@pytest.mark.parametrize("overrides, needle", [c[1:] for c in BAD_CHATGLM], ids=[c[0] for c in BAD_CHATGLM])
def test_bad_chatglm_value_names_chatglms_key(overrides, needle):
    with pytest.raises(TierlmError) as err:
        config_from_dict(with_overrides(CHATGLM, overrides))
    assert_one_line(err, needle)


def test_baselines_and_tolerated_forms_are_accepted():
    assert config_from_dict(LLAMA).head_dim == 16
    assert config_from_dict(CHATGLM).head_dim == 16
    # null means "not given"; integral floats are integers; the ceilings themselves are allowed.
    loose = {**LLAMA, "num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048.0,
             "num_hidden_layers": LIMITS["num_hidden_layers"], "eos_token_id": [2, 3], "rope_scaling": None}
    config = config_from_dict(loose)
    assert (config.num_key_value_heads, config.head_dim, config.max_position_embeddings) == (4, 16, 2048)
    assert config.num_hidden_layers == 1024 and config.eos_token_ids == (2, 3)
    llama31 = {**LLAMA, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192}}
    assert config_from_dict(llama31).rope.theta == 500000.0


def test_plan_sizes_the_largest_accepted_config_quickly():
    """The ceilings are finite in memory as well as in value: sizing them allocates nothing big."""
    from tierlm.offload.sizes import sizes_from_config

    largest = {**LLAMA, **{k: LIMITS[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                  "num_hidden_layers", "max_position_embeddings")},
               "num_attention_heads": 1024, "num_key_value_heads": 1024}
    sizes = sizes_from_config(config_from_dict(largest), "int8")
    assert len(sizes.names) == LIMITS["num_hidden_layers"] + 3 and sizes.total > 0


# ----------------------------------------------------------------------------- config.json files


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[1, 2]", "must hold a JSON object, not a list"),
        ('"llama"', "must hold a JSON object, not a string"),
        ("{\"model_type\": \"llama\",", "is not valid JSON"),
        (json.dumps(LLAMA).replace("1e-06", "NaN"), "rms_norm_eps = nan"),
        (json.dumps(LLAMA).replace("10000.0", "-Infinity"), "rope_theta = -inf"),
        (json.dumps(LLAMA).replace("512", "9" * 5000), "is not valid JSON"),  # past Python's digit limit
        ("[" * 100_000 + "]" * 100_000, "is not valid JSON"),  # past the recursion limit
        (b"\xff\xfe\x00garbage", "is not valid JSON"),
    ],
    ids=["list", "string", "truncated", "nan", "infinity", "5000-digits", "deep-nesting", "binary"],
)
def test_bad_config_file_is_one_clear_error(tmp_path, text, needle):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(TierlmError) as err:
        read_config(tmp_path)
    assert_one_line(err, needle)
    assert str(path) in str(err.value)  # the error names the file


def test_oversized_config_file_is_not_read(tmp_path, monkeypatch):
    import tierlm.config

    monkeypatch.setattr(tierlm.config, "MAX_CONFIG_BYTES", 1024)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "padding": "x" * 2048}))
    with pytest.raises(TierlmError) as err:
        read_config(tmp_path)
    assert_one_line(err, "a config.json is a few KiB")


# ----------------------------------------------------------------------------- through the CLI


def _config_only(directory: Path, overrides: dict) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(with_overrides(LLAMA, overrides)))
    return directory


def test_cli_plan_refuses_a_billion_layers_in_one_line(tmp_path):
    from tests.test_cli_errors import assert_clean_failure, tierlm

    model = _config_only(tmp_path / "m", {"num_hidden_layers": 10**9})
    assert_clean_failure(tierlm("plan", "--model", str(model)), "num_hidden_layers = 1000000000", "[1, 1024]")


def test_cli_convert_refuses_negative_layers_before_writing_an_artifact(tmp_path, tierlm_cache):
    from tests.test_cli_errors import assert_clean_failure, tierlm

    model = _config_only(tmp_path / "m", {"num_hidden_layers": -1})
    before = set(Path(tierlm_cache).rglob("*"))
    assert_clean_failure(tierlm("convert", "--model", str(model), "--quant", "int8"), "num_hidden_layers = -1")
    # Only bookkeeping (a lock, usage records) may appear: no weights, no manifest.
    new = [p for p in set(Path(tierlm_cache).rglob("*")) - before if p.is_file()]
    assert all(p.stat().st_size < 4096 and p.name not in ("weights.bin", "manifest.json") for p in new), new


# ----------------------------------------------------------------------------- GGUF metadata

GGUF_DEFAULTS = {
    "block_count": ("uint32", 2), "context_length": ("uint32", 256), "embedding_length": ("uint32", 64),
    "feed_forward_length": ("uint32", 96), "attention.head_count": ("uint32", 4),
    "attention.head_count_kv": ("uint32", 2), "attention.layer_norm_rms_epsilon": ("float32", 1e-6),
    "rope.freq_base": ("float32", 10000.0),
}  # fmt: skip

# (name, {arch key or tokenizer key: (type, value) or ... to drop}, layers with tensors, error text)
BAD_GGUFS = [
    ("heads-zero", {"attention.head_count": ("uint32", 0)}, 2, "llama.attention.head_count = 0"),
    ("heads-str", {"attention.head_count": ("string", "four")}, 2, "llama.attention.head_count = 'four'"),
    ("heads-differ", {"attention.head_count": ("array", [4, 8])}, 2, "differs between layers"),
    ("heads-empty-list", {"attention.head_count": ("array", [])}, 2, "llama.attention.head_count"),
    ("kv-zero", {"attention.head_count_kv": ("uint32", 0)}, 2, "llama.attention.head_count_kv = 0"),
    ("kv-not-divisor", {"attention.head_count_kv": ("uint32", 3)}, 2, "multiple of num_key_value_heads (3)"),
    ("hidden-not-divisible", {"embedding_length": ("uint32", 66)}, 2, "embedding_length 66 is not a multiple"),
    ("hidden-huge", {"embedding_length": ("uint64", 2**40)}, 2, "llama.embedding_length = 1099511627776"),
    ("blocks-billion", {"block_count": ("uint32", 10**9)}, 2, "llama.block_count = 1000000000"),
    ("blocks-negative", {"block_count": ("int32", -1)}, 2, "llama.block_count = -1"),
    ("blocks-beyond-tensors", {"block_count": ("uint32", 3)}, 2, "block_count is 3, but its blk.N tensors are for 2"),
    ("blocks-short-of-tensors", {"block_count": ("uint32", 1)}, 2, "block_count is 1, but its blk.N tensors are for 2"),
    ("context-zero", {"context_length": ("uint32", 0)}, 2, "llama.context_length = 0"),
    ("ffn-bool", {"feed_forward_length": ("bool", True)}, 2, "llama.feed_forward_length = True"),
    ("eps-nan", {"attention.layer_norm_rms_epsilon": ("float32", NAN)}, 2, "layer_norm_rms_epsilon = nan"),
    ("eps-str", {"attention.layer_norm_rms_epsilon": ("string", "tiny")}, 2, "layer_norm_rms_epsilon = 'tiny'"),
    ("eps-zero", {"attention.layer_norm_rms_epsilon": ("float32", 0.0)}, 2, "layer_norm_rms_epsilon = 0.0"),
    ("theta-negative", {"rope.freq_base": ("float32", -1.0)}, 2, "llama.rope.freq_base = -1.0"),
    ("theta-inf", {"rope.freq_base": ("float32", INF)}, 2, "llama.rope.freq_base = inf"),
    ("key-length-odd", {"attention.key_length": ("uint32", 15)}, 2, "rotate 15 of each head's 15"),
    ("rope-factor-below-one", {"rope.scaling.type": ("string", "linear"), "rope.scaling.factor": ("float32", 0.5)},
     2, "llama.rope.scaling.factor = 0.5"),
    ("rope-factor-str", {"rope.scaling.type": ("string", "linear"), "rope.scaling.factor": ("string", "2")}, 2,
     "llama.rope.scaling.factor = '2'"),
    ("eos-str", {"tokenizer.ggml.eos_token_id": ("string", "two")}, 2, "tokenizer.ggml.eos_token_id = 'two'"),
    ("eos-negative", {"tokenizer.ggml.eos_token_id": ("int32", -2)}, 2, "tokenizer.ggml.eos_token_id = -2"),
    ("eos-list", {"tokenizer.ggml.eos_token_id": ("array", [2, 3])}, 2, "tokenizer.ggml.eos_token_id = [2, 3]"),
    ("no-layers", {}, 0, "block_count is 2, but its blk.N tensors are for 0"),
]


def write_gguf(path: Path, overrides: dict, layers: int) -> Path:
    """A small llama GGUF: metadata from GGUF_DEFAULTS with `overrides`, an embedding and one norm
    per layer (enough for the config to be built; the importer stops at the metadata)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    types = {"uint32": gguf.GGUFValueType.UINT32, "uint64": gguf.GGUFValueType.UINT64,
             "int32": gguf.GGUFValueType.INT32, "float32": gguf.GGUFValueType.FLOAT32,
             "string": gguf.GGUFValueType.STRING, "bool": gguf.GGUFValueType.BOOL}
    for key, spec in {**GGUF_DEFAULTS, **overrides}.items():
        if spec is ...:
            continue
        kind, value = spec
        name = key if key.startswith("tokenizer.") else f"llama.{key}"
        if kind == "array":
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, types[kind])
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    for layer in range(layers):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_corpus_baseline_builds_a_config(tmp_path):
    """The corpus's base file is valid, so each case below fails for its own reason."""
    from tierlm.weights.gguf_import import _FAMILIES, _build_config
    from tierlm.weights.gguf_reader import GgufMetadata, open_gguf

    path = write_gguf(tmp_path / "ok.gguf", {}, 2)
    reader = open_gguf(path)
    config = _build_config(GgufMetadata(reader, path), _FAMILIES["llama"], {t.name: t for t in reader.tensors})
    assert (config["num_hidden_layers"], config["head_dim"], config["vocab_size"]) == (2, 16, 32)


@pytest.mark.parametrize("overrides, layers, needle", [c[1:] for c in BAD_GGUFS], ids=[c[0] for c in BAD_GGUFS])
def test_bad_gguf_metadata_is_one_clear_error(tmp_path, overrides, layers, needle):
    from tierlm.weights.gguf_import import import_gguf

    path = write_gguf(tmp_path / "bad.gguf", overrides, layers)
    with pytest.raises(TierlmError) as err:
        import_gguf(path, tmp_path / "out")
    assert_one_line(err, needle)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- sampling values


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("seed", 10**23, "seed must be an integer in [-2^63, 2^64 - 1]"),
        ("seed", -(2**63) - 1, "seed must be"),
        ("temperature", NAN, "temperature must be a finite number"),
        ("temperature", INF, "temperature must be a finite number"),
        ("repetition_penalty", NAN, "repetition_penalty must be a finite number"),
        ("repetition_penalty", INF, "repetition_penalty must be a finite number"),
        ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
    ],
)
def test_bad_sampling_values_are_refused(field, value, needle):
    with pytest.raises(TierlmError) as err:
        SamplingParams(**{field: value})
    assert_one_line(err, needle)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6, 1e-5, 1e-3, 1.0, 1e6, 1e300])
@pytest.mark.parametrize("penalty", [1e-300, 1e-6, 1.0, 1e6, 1e300])
def test_sampler_gives_a_valid_token_for_extreme_values(temperature, penalty):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=gen) * 30
    logits[3], logits[7], logits[11] = 0.0, 3e38, -3e38  # a zero logit, and ones near fp32's limits
    seen = torch.tensor([0, 3, 7, 11, 20])
    sampler = Sampler(SamplingParams(temperature=temperature, repetition_penalty=penalty, top_p=0.9, top_k=20,
                                     seed=2**64 - 1))
    token = sampler(logits, seen)
    assert 0 <= token < 50
    if temperature < 1e-5:  # below GREEDY_BELOW: greedy, whatever the penalty did
        assert SamplingParams(temperature=temperature).greedy


def test_sampler_survives_non_finite_logits():
    sampler = Sampler(SamplingParams(temperature=0.7, seed=0))
    logits = torch.tensor([float("nan"), float("inf"), 1.0, float("-inf")])
    assert sampler(logits) == 1  # +inf is the clear favourite; NaN is never picked
    assert 0 <= sampler(torch.full((4,), float("nan"))) < 4
    assert 0 <= sampler(torch.full((4,), float("-inf"))) < 4
