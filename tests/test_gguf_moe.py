"""GGUF import of mixture-of-experts models: llama.cpp's merged expert tensors, per family.

Tiny random transformers models (tests/tiny.MOE_CASES) are written as llama.cpp's
convert_hf_to_gguf.py writes them: the experts of a layer stacked into one [experts, rows, cols]
tensor per projection (`ffn_{gate,up,down}_exps`), the router as `ffn_gate_inp`, Qwen2-MoE's shared
expert as `ffn_*_shexp` and its gate `ffn_gate_inp_shexp`, Mixtral as arch "llama" with permuted
Q/K rows. The import must give back the source model: the same tensors and the same logits.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.test_gguf_import import byte_level_vocab, gguf_writer, hf_copy_of_import, llama_cpp_permute, load_imported
from tests.tiers import quick
from tests.tiny import MOE_CASES, make_model
from tierlm.errors import TierlmError
from tierlm.weights.gguf_import import RECORD_NAME, import_gguf

VOCAB = len(byte_level_vocab()[0])
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
HF_CLASS = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# The per-expert names transformers saves, and llama.cpp's merged tensor for each projection.
EXPERT_PROJECTIONS = {
    "mixtral": ("block_sparse_moe", {"w1": "gate", "w3": "up", "w2": "down"}),
    "qwen2_moe": ("mlp", {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}),
    "qwen3_moe": ("mlp", {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}),
}
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def source_model(tmp_path: Path, case: str, **overrides):
    """A tiny MoE model saved by transformers (per-expert tensor names); (model, saved tensors)."""
    args = {**MOE_CASES[case], **overrides}
    family = args.pop("family")
    model = make_model(tmp_path / "hf", family, vocab=VOCAB, with_tokenizer=False, **args)
    return model, {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def gguf_tensors(family: str, config, saved: dict[str, np.ndarray], split_experts: bool = False):
    """llama.cpp's tensors for the HF `saved` tensors: GGUF name -> array (numpy row-major)."""
    module, projections = EXPERT_PROJECTIONS[family]
    out: dict[str, np.ndarray] = {
        "token_embd.weight": saved["model.embed_tokens.weight"],
        "output_norm.weight": saved["model.norm.weight"],
    }
    if "lm_head.weight" in saved:
        out["output.weight"] = saved["lm_head.weight"]
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for hf, gguf in LAYER_TENSORS.items():
            if prefix + hf in saved:
                array = saved[prefix + hf]
                if family == "mixtral" and hf == "self_attn.q_proj.weight":
                    array = llama_cpp_permute(array, config.num_attention_heads)
                elif family == "mixtral" and hf == "self_attn.k_proj.weight":
                    array = llama_cpp_permute(array, config.num_key_value_heads)
                elif hf == "mlp.shared_expert_gate.weight":
                    array = array.reshape(-1)  # llama.cpp's loader wants the gate's one row as a vector
                out[f"blk.{layer}.{gguf}"] = array
        experts = f"{prefix}{module}.experts."
        count = len({k for k in saved if k.startswith(experts) and k.endswith(".weight")}) // 3
        for projection, part in projections.items():
            rows = [saved[f"{experts}{e}.{projection}.weight"] for e in range(count)]
            if not rows:
                continue
            if split_experts:  # the pre-2024 Mixtral layout: one tensor per expert
                out.update({f"blk.{layer}.ffn_{part}.{e}.weight": r for e, r in enumerate(rows)})
            else:
                out[f"blk.{layer}.ffn_{part}_exps.weight"] = np.stack(rows)
    return out


def write_moe_gguf(path: Path, family: str, config, saved: dict, *, quant: str | None = None,
                   split_experts: bool = False, metadata_overrides: dict | None = None) -> dict[str, np.ndarray]:
    """Write the GGUF; `quant` "Q8_0" stores every expert tensor as Q8_0. Returns the GGUF tensors."""
    import gguf

    arch = GGUF_ARCH[family]
    writer = gguf_writer(path, arch, config, "tiny moe")
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if family != "mixtral":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if family == "qwen3_moe":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if family == "mixtral":
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    for key, value in (metadata_overrides or {}).items():
        writer.add_uint32(f"{arch}.{key}", value)
    tokens, types, merges = byte_level_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(2)
    tensors = gguf_tensors(family, config, saved, split_experts)
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        if quant == "Q8_0" and "_exps." in name:
            writer.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif quant == "F16" and array.ndim >= 2:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


# ----------------------------------------------------------------------------- 1. exact round trip


@pytest.mark.parametrize("case", quick(["mixtral", "qwen2-moe-shared", "qwen3-moe-dense-and-sparse"],
                                      fast=["qwen3-moe-dense-and-sparse"]))
def test_moe_gguf_imports_to_the_source_model(tmp_path, case):
    """fp32 GGUF: per-expert tensors equal the source bit for bit (Mixtral's Q/K un-permuted),
    config.json loads in transformers as the source's class, and the logits equal the source's."""
    import transformers

    model, saved = source_model(tmp_path, case)
    family = model.config.model_type
    write_moe_gguf(tmp_path / "moe.gguf", family, model.config, saved)
    seen = []
    out = import_gguf(tmp_path / "moe.gguf", tmp_path / "out", progress=lambda done, total: seen.append((done, total)))

    imported = load_imported(out)
    assert set(imported) == set(saved)
    for name, original in saved.items():
        np.testing.assert_array_equal(imported[name], original, err_msg=name)
    assert seen[-1][0] == seen[-1][1]

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [HF_CLASS[family]] and config["model_type"] == family
    reloaded = getattr(transformers, HF_CLASS[family]).from_pretrained(hf_copy_of_import(out, tmp_path / "hf-copy"),
                                                                       dtype=torch.float32).eval()  # fmt: skip
    ref, got = model.config, reloaded.config
    assert got.num_experts_per_tok == ref.num_experts_per_tok
    assert getattr(got, "num_local_experts", None) or got.num_experts == (
        getattr(ref, "num_local_experts", None) or ref.num_experts)
    if family != "mixtral":
        assert (got.moe_intermediate_size, got.norm_topk_prob) == (ref.moe_intermediate_size, ref.norm_topk_prob)
    if family == "qwen3_moe":  # layers 0, 2, 3, 4 dense: listed as mlp_only_layers, every other layer sparse
        assert config["mlp_only_layers"] == [0, 2, 3, 4] and config["decoder_sparse_step"] == 1
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids), rtol=0, atol=1e-5)

    # tierlm's own loader reads the same directory as the same MoE model.
    from tierlm.models import read_config
    from tierlm.runtime.loader import load_model

    moe = read_config(out).moe
    assert moe.experts == (getattr(ref, "num_local_experts", None) or ref.num_experts)
    assert moe.sparse_layers == read_config(tmp_path / "hf").moe.sparse_layers
    loaded = load_model(out, device="cpu", dtype=torch.float32)
    ours = loaded.model.forward(ids[:1], loaded.new_cache(), logits="all")
    torch.testing.assert_close(ours.reshape(-1, VOCAB), logits(model, ids[:1])[0], rtol=0, atol=1e-4)
    record = json.loads((out / RECORD_NAME).read_text())
    assert record["architecture"] == GGUF_ARCH[family]


@pytest.mark.parametrize("case", ["qwen2-moe-shared", "qwen3-moe-dense-and-sparse"])
def test_written_gguf_is_what_transformers_gguf_reader_expects(tmp_path, case):
    """The GGUFs these tests write follow llama.cpp's layout as transformers' own GGUF reader
    knows it: read by transformers, they are the source model (logits equal). Its config map
    lacks expert_feed_forward_length, so the widths are passed; it reads llama-arch Mixtral as
    a dense Llama, so Mixtral has no such second reader."""
    from transformers import AutoModelForCausalLM

    overrides = dict(layers=2, decoder_sparse_step=1, mlp_only_layers=[]) if "qwen3" in case else {}
    model, saved = source_model(tmp_path, case, **overrides)
    write_moe_gguf(tmp_path / "moe.gguf", model.config.model_type, model.config, saved)
    widths = {k: getattr(model.config, k) for k in ("moe_intermediate_size", "shared_expert_intermediate_size",
                                                     "norm_topk_prob") if hasattr(model.config, k)}
    reader = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="moe.gguf", dtype=torch.float32, **widths)
    out = import_gguf(tmp_path / "moe.gguf", tmp_path / "out")
    imported = AutoModelForCausalLM.from_pretrained(hf_copy_of_import(out, tmp_path / "hf-copy"), dtype=torch.float32)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(reader.eval(), ids), logits(model, ids), rtol=0, atol=1e-6)
    torch.testing.assert_close(logits(imported.eval(), ids), logits(reader, ids), rtol=0, atol=1e-5)


def test_split_expert_mixtral_gguf(tmp_path):
    """Mixtral GGUFs from before llama.cpp merged the experts hold `blk.N.ffn_gate.E.weight`."""
    model, saved = source_model(tmp_path, "mixtral")
    write_moe_gguf(tmp_path / "old.gguf", "mixtral", model.config, saved, split_experts=True)
    imported = load_imported(import_gguf(tmp_path / "old.gguf", tmp_path / "out"))
    assert set(imported) == set(saved)
    for name, original in saved.items():
        np.testing.assert_array_equal(imported[name], original, err_msg=name)


# ----------------------------------------------------------------------------- 2. quantized experts


@pytest.mark.parametrize("case,quant", [("qwen3-moe-dense-and-sparse", "Q8_0"), ("mixtral", "F16")])
def test_quantized_expert_tensors(tmp_path, case, quant):
    """Q8_0 / F16 experts dequantize per expert to exactly gguf's dequantization of the whole
    merged tensor; the logits stay within the grid's error of the source's."""
    import gguf
    import transformers

    model, saved = source_model(tmp_path, case)
    family = model.config.model_type
    written = write_moe_gguf(tmp_path / "q.gguf", family, model.config, saved, quant=quant)
    out = import_gguf(tmp_path / "q.gguf", tmp_path / "out")
    imported = load_imported(out)
    reader = gguf.GGUFReader(tmp_path / "q.gguf")
    module, projections = EXPERT_PROJECTIONS[family]
    checked = 0
    for tensor in reader.tensors:
        if "_exps." not in tensor.name:
            continue
        whole = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # [experts, rows, cols]
        layer, part = tensor.name.split(".")[1], tensor.name.split(".")[2].split("_")[1]
        projection = next(p for p, q in projections.items() if q == part)
        for e in range(whole.shape[0]):
            name = f"model.layers.{layer}.{module}.experts.{e}.{projection}.weight"
            np.testing.assert_array_equal(imported[name], whole[e], err_msg=name)
            checked += 1
        if quant == "Q8_0":
            assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
            assert not np.array_equal(whole, written[tensor.name])  # it really was rounded
    assert checked == sum(1 for k in saved if ".experts." in k)
    counted = json.loads((out / RECORD_NAME).read_text())["tensor_types"]
    assert counted.get(quant) == sum(1 for t in reader.tensors if t.tensor_type.name == quant)
    reloaded = getattr(transformers, HF_CLASS[family]).from_pretrained(hf_copy_of_import(out, tmp_path / "hf-copy"),
                                                                       dtype=torch.float32).eval()  # fmt: skip
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    got, want = logits(reloaded, ids), logits(model, ids)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


# ----------------------------------------------------------------------------- 3. bounded memory


@pytest.mark.slow
def test_experts_are_read_one_at_a_time_and_no_float_copy_is_written(tmp_path):
    """The import writes no weights (kilobytes beside a 64 MiB GGUF), and reading its checkpoint
    tensor by tensor, as a conversion does, holds one expert's fp32 slice at a time: peak
    Python-heap memory far below one merged tensor."""
    from tierlm.weights.checkpoint import open_checkpoint

    # 64 experts of [256, 512]: each merged tensor is 32 MiB as fp32, one expert 0.5 MiB.
    model, saved = source_model(tmp_path, "qwen3-moe-dense-and-sparse", hidden=256, layers=2, heads=4,
                                kv_heads=2, num_experts=64, moe_intermediate_size=512, decoder_sparse_step=1,
                                mlp_only_layers=[], intermediate=64, head_dim=64)
    write_moe_gguf(tmp_path / "big.gguf", "qwen3_moe", model.config, saved, quant="F16")
    del saved
    merged = 64 * 256 * 512 * 4
    out = import_gguf(tmp_path / "big.gguf", tmp_path / "out")
    written = sum(p.stat().st_size for p in out.iterdir())
    assert not list(out.glob("*.safetensors")) and written < 2**20 < (tmp_path / "big.gguf").stat().st_size / 32
    checkpoint = open_checkpoint(out)
    names = [n for n in checkpoint.names() if ".experts." in n]
    assert len(names) == 2 * 3 * 64
    tracemalloc.start()
    try:
        for name in names:
            assert tuple(checkpoint.get(name).shape) in ((512, 256), (256, 512))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # One expert in flight (0.5 MiB as fp32, its F16 bytes, gguf's temporaries); a merged tensor is 32 MiB.
    assert peak < merged / 8, f"peak {peak / 2**20:.1f} MiB against a {merged / 2**20:.0f} MiB merged tensor"


# ----------------------------------------------------------------------------- 4. errors


def test_wrong_expert_count_is_a_clear_error(tmp_path):
    model, saved = source_model(tmp_path, "mixtral")
    write_moe_gguf(tmp_path / "bad.gguf", "mixtral", model.config, saved, metadata_overrides={"expert_count": 5})
    with pytest.raises(TierlmError, match=r"ffn_\w+_exps\.weight is \[4, .*not \[5 experts"):
        import_gguf(tmp_path / "bad.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_mixtral_layer_without_router_is_refused(tmp_path):
    import gguf

    model, saved = source_model(tmp_path, "mixtral")
    write_moe_gguf(tmp_path / "moe.gguf", "mixtral", model.config, saved)
    reader = gguf.GGUFReader(tmp_path / "moe.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "norouter.gguf"), "llama")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name != "blk.1.ffn_gate_inp.weight":
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(TierlmError, match="layer 1 .* has no router"):
        import_gguf(tmp_path / "norouter.gguf", tmp_path / "out")
