"""Qwen3, GLM, ChatGLM (original layout) and Mistral with a sliding window: config mapping and
refusals, tokenizers, sizes and plans, INT8 conversion. Their logits, cached and batched decode
against transformers are in tests/test_model_parity.py (the same CASES).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_model_parity import CASES
from tests.tiny import chatglm_config, greedy, make_case, prompt
from tierlm.models import config_from_dict, read_config
from tierlm.errors import TierlmError
from tierlm.runtime.loader import load_model


# -- config.json of each family --------------------------------------------------------------------


def test_glm_rotates_half_of_each_head_unless_told():
    raw = {"model_type": "glm", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16}  # fmt: skip
    assert config_from_dict(raw).rope.partial_rotary_factor == 0.5
    assert config_from_dict({**raw, "partial_rotary_factor": 0.25}).rope.partial_rotary_factor == 0.25


def test_chatglm_keys_map_to_glm_shapes():
    config = config_from_dict(chatglm_config(rope_ratio=50, seq_length=32768))
    assert (config.model_type, config.vocab_size, config.intermediate_size, config.num_hidden_layers) == (
        "chatglm", 320, 96, 2)
    assert (config.num_key_value_heads, config.head_dim, config.max_position_embeddings) == (2, 16, 32768)
    assert config.attention_bias and not config.tie_word_embeddings
    assert config.rope.theta == 500000.0 and config.rope.partial_rotary_factor == 0.5


@pytest.mark.parametrize(
    "override, match",
    [
        ({"apply_residual_connection_post_layernorm": True}, "apply_residual_connection_post_layernorm"),
        ({"rmsnorm": False}, "rmsnorm"),
        ({"multi_query_attention": False}, "multi_query_attention"),
        ({"post_layer_norm": False}, "post_layer_norm"),
        ({"add_bias_linear": True}, "add_bias_linear"),
        ({"position_encoding_2d": True}, "first ChatGLM-6B"),
    ],
)
def test_unsupported_chatglm_variants_are_refused_by_name(override, match):
    with pytest.raises(TierlmError, match=match) as err:
        config_from_dict(chatglm_config(**override))
    assert err.value.hint


def test_chatglm_missing_key_names_chatglms_key():
    raw = chatglm_config()
    del raw["ffn_hidden_size"]
    with pytest.raises(TierlmError, match="ffn_hidden_size"):
        config_from_dict(raw)


def test_qwen_sliding_window_applies_only_when_every_layer_slides():
    raw = {"model_type": "qwen3", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 4, "num_attention_heads": 4, "sliding_window": 8}  # fmt: skip
    assert config_from_dict(raw).sliding_window is None  # use_sliding_window unset
    on = {**raw, "use_sliding_window": True}
    assert config_from_dict({**on, "max_window_layers": 0}).sliding_window == 8
    assert config_from_dict({**on, "max_window_layers": 4}).sliding_window is None
    with pytest.raises(TierlmError, match="2 of 4 layers"):
        config_from_dict({**on, "max_window_layers": 2})


def test_chatglm_tokenizer_that_is_only_python_code_is_refused_naming_tokenizer_json(tmp_path):
    from tierlm.runtime.tokenizer import Tokenizer

    (tmp_path / "tokenization_chatglm.py").write_text("class ChatGLMTokenizer: ...\n")
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLMTokenizer", None]}}))
    with pytest.raises(TierlmError, match="tokenizer.json") as err:
        Tokenizer.from_dir(tmp_path)
    assert "tokenization_chatglm.py" in str(err.value) and err.value.hint
    # Without auto_map, the Python file alone still says the same.
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TierlmError, match="tokenization_chatglm.py"):
        Tokenizer.from_dir(tmp_path)


# -- sizes, planner and INT8 conversion ----------------------------------------------------------

# ChatGLM3-6B's published config.json (THUDM/chatglm3-6b), its own keys.
CHATGLM3_6B = chatglm_config(hidden=4096, layers=28, heads=32, groups=2, kv_channels=128, ffn=13696,
                             vocab=65024, seq_length=8192, torch_dtype="float16")  # fmt: skip


def gpu_bandwidths():
    from tierlm.offload.bandwidths import Bandwidths

    # A consumer GPU on PCIe 4.0 x16 as the cost model sees it (tests/test_planner.py's figures).
    return Bandwidths(device_bytes_per_s=800e9, host_bytes_per_s=40e9, link_bytes_per_s=25e9,
                      disk_bytes_per_s=3e9, device_flops=100e12, host_flops=1e12,
                      per_block_overhead_s=30e-6, device="cuda")  # fmt: skip


def test_chatglm3_6b_sizes_from_its_config_json():
    from tierlm.offload.sizes import sizes_from_config

    config = config_from_dict(CHATGLM3_6B)
    assert (config.q_size, config.kv_size, config.max_position_embeddings) == (4096, 256, 8192)
    sizes = sizes_from_config(config, "int8")
    layer = (4096 + 2 * 256) * 4096 + 4096 * 4096 + 2 * 13696 * 4096 + 13696 * 4096
    assert sizes.params["layers.0"] == layer and sizes.params["embed"] == sizes.params["head"] == 65024 * 4096
    # Plus norms and q/k/v biases (362,496), the 6,243,584,000 parameters ChatGLM3-6B publishes.
    assert sum(sizes.params.values()) + 28 * (2 * 4096 + 4608) + 4096 == 6_243_584_000
    assert sizes.aliases == {}  # output_layer is its own tensor


@pytest.mark.parametrize("quant", ["int8", "fp16"])
def test_chatglm3_6b_fits_a_24gb_card_fully_resident(quant):
    from tierlm.offload.placement import DEVICE
    from tierlm.offload.planner.search import plan
    from tierlm.offload.sizes import sizes_from_config
    from tierlm.profile import load_profile

    config = config_from_dict(CHATGLM3_6B)
    sizes = sizes_from_config(config, quant, accelerator=True)
    placement = plan(config, sizes, load_profile("24gb"), gpu_bandwidths(), accelerator=True,
                     baseline_bytes=400 * 2**20)  # fmt: skip
    assert placement.fully_resident
    # 2 KV groups of 128 channels: 28 layers x K,V x 256 x 4096 tokens x bf16 = 112 MiB.
    assert placement.charges[DEVICE]["kv_cache"] == 28 * 2 * 2 * 128 * 4096 * 2


@pytest.mark.parametrize(
    "case, quant",
    [("qwen3-gqa-head-dim-32", "int8"), ("glm-gqa-half-rotary", "int8-g32"), ("chatglm-mqa-rope-ratio", "int8"),
     ("qwen3-mha-tied-bias", "fp16"), ("qwen3-moe-dense-and-sparse", "int8"), ("qwen2-moe-shared", "int8")],
)  # fmt: skip
def test_sizes_from_config_match_the_converted_artifact(tmp_path, case, quant):
    from tierlm.cache.artifact import PART_ALIGN, Artifact
    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.offload.sizes import sizes_from_artifact, sizes_from_config

    make_case(tmp_path, CASES[case])
    artifact_dir = ensure_artifact(ConversionRequest(tmp_path, (), quant))
    measured = sizes_from_artifact(artifact_dir)
    predicted = sizes_from_config(read_config(tmp_path), quant)
    assert predicted.names == measured.names
    blocks = Artifact.open(artifact_dir).blocks
    for name in measured.names:
        parts = sum(len(t.parts) for t in blocks[name].tensors.values())
        assert abs(predicted.nbytes[name] - measured.nbytes[name]) <= PART_ALIGN * parts, name
    assert predicted.params == measured.params and predicted.aliases == measured.aliases


@pytest.mark.parametrize("case", ["qwen3-gqa-head-dim-32", "chatglm-mqa-rope-ratio"])
def test_int8_artifact_keeps_qk_norms_float_and_tracks_fp32(tmp_path, case):
    """`tierlm convert` (ensure_artifact): INT8 matmul weights, fp32 1-D tensors, logits close to fp32."""
    from tierlm.cache.artifact import Artifact
    from tierlm.cache.convert import ConversionRequest, ensure_artifact

    make_case(tmp_path, CASES[case])
    artifact_dir = ensure_artifact(ConversionRequest(tmp_path, (), "int8"))
    layer = Artifact.open(artifact_dir).blocks["layers.0"].tensors
    assert layer["wqkv"].encoding == "int8" and layer["w13"].encoding == "int8"
    for name in ("q_norm", "k_norm", "bqkv", "attn_norm"):
        if name in layer:
            assert layer[name].encoding == "plain" and layer[name].parts["data"].dtype == "float32", name
    if case.startswith("qwen3"):
        assert "q_norm" in layer and "k_norm" in layer
    full = load_model(tmp_path, device="cpu", dtype=torch.float32)
    int8 = load_model(artifact_dir, device="cpu", dtype=torch.float32)
    ids = prompt(full.config.vocab_size, 24, seed=5)
    expected = full.model.forward(ids, full.new_cache(), logits="all")[0]
    actual = int8.model.forward(ids, int8.new_cache(), logits="all")[0]
    cosine = torch.nn.functional.cosine_similarity(actual, expected, dim=-1)
    assert cosine.min() > 0.99, cosine.min()
    # Greedy decoding from the artifact gives tokens, and mostly fp32's.
    tokens, reference = greedy(int8, ids[:, :8], 8, use_cache=True), greedy(full, ids[:, :8], 8, use_cache=True)
    assert all(0 <= t < full.config.vocab_size for t in tokens)
    assert tokens[:2] == reference[:2]
