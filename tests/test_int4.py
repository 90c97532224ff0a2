"""INT4 (W4A16) weights: packing, the quantizer against its error bounds, exact carry of GGUF
Q4_0/Q4_1 grids (checked against the `gguf` package's own quantize/dequantize), the kernels'
dispatch against the dequantize-then-matmul reference, the codec, and whole models: an int4
artifact of a checkpoint on a Q4 grid computes what transformers computes on that checkpoint,
and a LoRA merged into int4 equals peft's merge followed by the same quantization."""

from __future__ import annotations

import pytest
import torch

from tests.activation_rounding import rounding_bound
from tests.tiers import quick
from tierlm.quant.int4 import (
    Int4Weight,
    dequantize4,
    int4_on_source_grid,
    pack_nibbles,
    quantize_int4,
    unpack_nibbles,
)


def test_packing_puts_columns_j_and_j_plus_16_of_each_chunk_in_one_byte():
    u = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64).repeat(3, 1)
    u[1] = torch.randint(0, 16, (64,), generator=torch.Generator().manual_seed(1))
    packed = pack_nibbles(u)
    assert packed.shape == (3, 32) and packed.dtype == torch.uint8
    for chunk in range(2):
        for j in range(16):
            byte = int(packed[1, 16 * chunk + j])
            assert byte & 15 == u[1, 32 * chunk + j] and byte >> 4 == u[1, 32 * chunk + 16 + j]
    assert torch.equal(unpack_nibbles(packed), u)


def _plain_rule(block: torch.Tensor, asymmetric: bool) -> torch.Tensor:
    """The textbook int4 of block [rows, g] with fp16 scales (and offsets): symmetric q in
    [-7, 7] times max|w| / 7, or asymmetric 16 levels from the min in steps of (max - min) / 15."""
    if asymmetric:
        low = block.amin(1, keepdim=True).half().float()
        step = ((block.amax(1, keepdim=True) - block.amin(1, keepdim=True)) / 15).half().float()
        safe = torch.where(step > 0, step, torch.ones_like(step))
        return ((block - low) / safe).round().clamp(0, 15) * step + low
    step = (block.abs().amax(1, keepdim=True) / 7).half().float()
    safe = torch.where(step > 0, step, torch.ones_like(step))
    return (block / safe).round().clamp(-7, 7) * step


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("asymmetric", [False, True])
def test_quantizer_does_no_worse_than_the_plain_rule_per_group(group, asymmetric):
    """Per group (a ragged last one included: 576 = 4 x 128 + 64), the squared error is at most
    the plain rule's and no value is off by more than its step."""
    gen = torch.Generator().manual_seed(group)
    weight = torch.randn(40, 576, generator=gen) * torch.rand(40, 1, generator=gen)
    q = quantize_int4(weight, group, asymmetric=asymmetric)
    restored = q.dequantize()
    assert q.scales.dtype == torch.float16 and (q.offsets is not None) == asymmetric
    for start in range(0, 576, group):
        block = weight[:, start:start + group]
        ours = (restored[:, start:start + group] - block).square().sum(1)
        plain = (_plain_rule(block, asymmetric) - block).square().sum(1)
        assert (ours <= plain * (1 + 1e-5) + 1e-12).all(), (group, start)
        span = (block.amax(1) - block.amin(1)) / 15 if asymmetric else block.abs().amax(1) / 7
        assert ((restored[:, start:start + group] - block).abs().amax(1) <= span * 1.01).all()
    assert (restored - weight).square().mean() < 0.02 * weight.square().mean()


def test_constant_and_zero_groups_are_exact():
    weight = torch.zeros(4, 64)
    weight[1] = 0.25
    weight[2, :32] = -3.0
    for asymmetric in (False, True):
        assert torch.equal(quantize_int4(weight, 32, asymmetric=asymmetric).dequantize(), weight)


@pytest.mark.parametrize("kind, modes", [("Q4_0", (False, True)), ("Q4_1", (True,))])
def test_gguf_q4_tensors_are_carried_bit_for_bit(kind, modes):
    np = pytest.importorskip("numpy")
    quants = pytest.importorskip("gguf.quants")
    qtype = getattr(pytest.importorskip("gguf").GGMLQuantizationType, kind)
    rng = np.random.default_rng(3)
    sources = {"normal": rng.standard_normal((96, 512)), "heavy tails": rng.standard_t(3, (96, 512)),
               "sparse": rng.standard_normal((96, 512)) * (rng.random((96, 512)) < 0.1)}  # fmt: skip
    for name, values in sources.items():
        stored = quants.dequantize(quants.quantize((values * 0.02).astype(np.float32), qtype), qtype)
        weight = torch.from_numpy(np.ascontiguousarray(stored.astype(np.float32))).reshape(96, 512)
        for asymmetric in modes:
            assert torch.equal(quantize_int4(weight, 32, asymmetric=asymmetric).dequantize(), weight), (kind, name)
            carried = int4_on_source_grid(weight, asymmetric=asymmetric)
            assert carried is not None and torch.equal(carried.dequantize(), weight), (kind, name)


def test_only_grids_of_16_levels_count_as_a_source_grid():
    np = pytest.importorskip("numpy")
    quants = pytest.importorskip("gguf.quants")
    gguf = pytest.importorskip("gguf")
    values = (np.random.default_rng(0).standard_normal((64, 256)) * 0.02).astype(np.float32)
    q8 = quants.dequantize(quants.quantize(values, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
    for weight in (torch.from_numpy(values), torch.from_numpy(np.ascontiguousarray(q8.astype(np.float32)))):
        assert int4_on_source_grid(weight, asymmetric=True) is None
    assert int4_on_source_grid(torch.randn(8, 48), asymmetric=True) is None  # 48 columns: no int4 layout


@pytest.mark.parametrize("rows", [1, 3, 8, 100])
@pytest.mark.parametrize("asymmetric", [False, True])
def test_linear_matches_the_dequantized_matmul(rows, asymmetric):
    """The chosen CPU kernels (native GEMV for few rows, the integer GEMM for many: csrc/gemm_a16.h)
    against x @ dequantize().T, with a bias and a ragged last group (576 = 4 x 128 + 64). Many rows
    are within the int16 activations' rounding of the fp32 product: its bound over the codes' share
    (the offsets' share is summed from x unquantized)."""
    gen = torch.Generator().manual_seed(rows)
    weight, x, bias = torch.randn(200, 576, generator=gen), torch.randn(rows, 576, generator=gen), torch.randn(200)
    q = quantize_int4(weight, 128, asymmetric=asymmetric)
    reference = x @ q.dequantize().T + bias
    codes = q.dequantize() - (q.offsets.float().repeat_interleave(128, 1)[:, :576] if asymmetric else 0)
    atol = 1e-4 if rows <= 8 else float(rounding_bound(x, codes).max()) + 1e-4
    torch.testing.assert_close(q.linear(x, bias), reference, rtol=1e-5, atol=atol)
    torch.testing.assert_close(q.linear(x.view(rows, 1, 576)).view(rows, 200), reference - bias, rtol=1e-5, atol=atol)


def test_rows_serialization_and_moves_keep_the_weight():
    q = quantize_int4(torch.randn(50, 64, generator=torch.Generator().manual_seed(2)), 32, asymmetric=True)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(q.rows(ids), q.dequantize()[ids])
    assert q.rows(ids, torch.bfloat16).dtype == torch.bfloat16
    again = Int4Weight.from_tensors(q.tensors(), 32)
    assert torch.equal(again.dequantize(), q.dequantize()) and again.nbytes == 50 * 32 + 2 * 50 * 2 * 2
    assert torch.equal(q.to("cpu", torch.float16).dequantize(), q.dequantize())
    with pytest.raises(ValueError, match="float16"):
        Int4Weight(q.packed, q.scales.float(), 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(4, 64), 48)


def test_torch_kernels_run_the_int4_weight_on_any_device_path():
    """The accelerators' path (dequantize to the activation dtype, F.linear) and the no-compiler
    BLAS path give the reference too."""
    from tierlm.quant.torch_kernels import BlasKernel, TorchKernel

    gen = torch.Generator().manual_seed(4)
    q = quantize_int4(torch.randn(70, 96, generator=gen), 32)
    x = torch.randn(5, 96, generator=gen)
    reference = x @ q.dequantize().T
    for kernel in (TorchKernel(), BlasKernel(block_bytes=4096)):
        torch.testing.assert_close(kernel.matmul4(x, q.packed, q.scales, q.offsets, 32), reference, rtol=1e-5, atol=1e-4)
    half = TorchKernel().matmul4(x.bfloat16(), q.packed, q.scales, q.offsets, 32)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), reference, rtol=2e-2, atol=5e-2)


# -- codec and modes ---------------------------------------------------------------------------------


def test_modes_parse_and_refuse_with_the_accepted_names():
    from tierlm.errors import TierlmError
    from tierlm.quant.modes import check_mode_name, parse_quant_mode

    g128 = parse_quant_mode("INT4-G128-asym")
    assert (g128.name, g128.weight_dtype, g128.group_size, g128.asymmetric, g128.quantized) == (
        "int4-g128-asym", "int4", 128, True, True)  # fmt: skip
    assert check_mode_name("mixed:1GiB") == "mixed-1073741824" == parse_quant_mode("mixed-1073741824").name
    assert parse_quant_mode("mixed:source").name == "mixed-source" and parse_quant_mode("mixed:source").mixed
    for bad, hint in (("int4-g48", "multiple of 32"), ("int4", "int4-g32"), ("mixed:lots", "mixed:5.2GiB")):
        with pytest.raises(TierlmError, match=hint):
            parse_quant_mode(bad)


def test_codec_round_trip_checks_and_falls_back_where_int4_cannot_pack():
    from tierlm.cache import codec
    from tierlm.cache.artifact import PartRecord, TensorRecord
    from tierlm.quant.modes import parse_quant_mode

    weight = torch.randn(24, 64)
    encoding, parts, meta = codec.encode(weight, parse_quant_mode("int4-g32-asym"), "wo")
    assert encoding == "int4" and meta == {"group_size": 32} and set(parts) == {"packed", "scales", "offsets"}
    assert [p.nbytes for p in parts.values()] == codec.part_bytes((24, 64), parse_quant_mode("int4-g32-asym"))
    record = TensorRecord(encoding, {name: PartRecord(0, t.nbytes, str(t.dtype).removeprefix("torch."), tuple(t.shape))
                                     for name, t in parts.items()}, meta)  # fmt: skip
    assert codec.check_record(record, (24, 64)) is None and codec.logical_shape(record) == (24, 64)
    assert torch.equal(codec.decode(record, parts).dequantize(), quantize_int4(weight, 32, asymmetric=True).dequantize())
    assert "expected float16" in codec.check_record(TensorRecord("int4", {**record.parts, "scales": PartRecord(
        0, 24 * 2 * 4, "float32", (24, 2))}, meta))  # fmt: skip
    assert "multiple of 32" in codec.check_record(TensorRecord("int4", record.parts, {"group_size": 16}))
    assert "config.json implies" in codec.check_record(record, (24, 128))
    # 48 input columns cannot be packed: that weight is stored as int8 of the same group.
    encoding, parts, meta = codec.encode(torch.randn(8, 48), parse_quant_mode("int4-g32-asym"), "wo")
    assert encoding == "int8" and meta == {"group_size": 32} and "offsets" in parts


def test_mixed_source_keeps_each_tensor_on_the_smallest_exact_grid():
    np = pytest.importorskip("numpy")
    quants = pytest.importorskip("gguf.quants")
    gguf = pytest.importorskip("gguf")
    from tierlm.cache import codec
    from tierlm.quant.modes import parse_quant_mode

    values = (np.random.default_rng(5).standard_normal((32, 128)) * 0.02).astype(np.float32)
    source = parse_quant_mode("mixed:source")
    # Q8_0 is carried as q8_0 (int8 with fp16 scales, no offsets); Q5_1 on int8-g32-asym's grid.
    expected = {"Q4_0": ("int4", False), "Q4_1": ("int4", True), "Q8_0": ("int8", False), "Q5_1": ("int8", True)}
    for kind, (encoding, with_offsets) in expected.items():
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        stored = quants.dequantize(quants.quantize(values, qtype), qtype).astype(np.float32)
        weight = torch.from_numpy(np.ascontiguousarray(stored))
        got, parts, meta = codec.encode(weight, source, "wo")
        assert (got, "offsets" in parts, meta["group_size"]) == (encoding, with_offsets, 32), kind
        assert parts["scales"].dtype == (torch.float32 if got == "int8" and with_offsets else torch.float16), kind
        from tierlm.quant.int8 import Int8Weight

        restored = (Int4Weight.from_tensors(parts, 32) if got == "int4" else Int8Weight.from_tensors(parts, 32)).dequantize()
        assert torch.equal(restored, weight), kind


# -- whole models ---------------------------------------------------------------------------------


def _on_q4_grid(model_dir, kind: str = "Q4_1"):
    """Rewrite a saved checkpoint's 2-D weights as GGUF `kind` would store them (values on its grid)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    qtype = getattr(GGMLQuantizationType, kind)
    for name, tensor in tensors.items():
        if tensor.dim() == 2:
            stored = quants.dequantize(quants.quantize(tensor.float().numpy(), qtype), qtype)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(stored.astype(np.float32)))
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("family, kind, quant", quick([("llama", "Q4_1", "int4-g32-asym"), ("qwen2", "Q4_0", "int4-g32"),
                                                       ("qwen3", "Q4_1", "mixed:source")],
                                                      fast=[("llama", "Q4_1", "int4-g32-asym")]))  # fmt: skip
def test_an_int4_artifact_of_a_q4_checkpoint_computes_what_transformers_computes(tmp_path, family, kind, quant):
    import transformers

    from tests.tiny import greedy, make_model
    from tierlm.cache.artifact import Artifact
    from tierlm.runtime.loader import load_model

    make_model(tmp_path, family, tied=family == "qwen2")
    _on_q4_grid(tmp_path, kind)
    loaded = load_model(tmp_path, device="cpu", dtype=torch.float32, quant=quant)
    records = [t for b in Artifact.open(loaded.artifact_dir).blocks.values() for t in b.tensors.values()]
    assert {r.encoding for r in records} == {"int4", "plain"}
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 8]])
    with torch.no_grad():
        expected = reference(ids).logits
    got = loaded.model.forward(ids, loaded.new_cache(), logits="all")
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    fp32 = load_model(tmp_path, device="cpu", dtype=torch.float32, quant="fp32")
    assert greedy(loaded, ids, 12, use_cache=True) == greedy(fp32, ids, 12, use_cache=True) == greedy(loaded, ids, 12, use_cache=False)
    assert loaded.store.nbytes() < fp32.store.nbytes() / 5


def test_lora_merged_into_int4_equals_peft_merge_then_the_same_quantization(tmp_path):
    from peft import LoraConfig

    from tests.test_lora_merge import peft_merged, save_adapter
    from tests.tiny import make_model
    from tierlm.cache.artifact import Artifact
    from tierlm.cache.convert import ConversionRequest, ensure_artifact

    make_model(tmp_path / "base", "llama", with_tokenizer=False)
    adapter = save_adapter(tmp_path / "base", tmp_path / "adapter",
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], use_rslora=True), seed=2)  # fmt: skip
    artifact = Artifact.open(ensure_artifact(ConversionRequest(tmp_path / "base", ((adapter, 1.0),), "int4-g64-asym")))
    merged = peft_merged(tmp_path / "base", adapter)
    for layer in range(2):
        read = artifact.read_block(f"layers.{layer}")
        prefix = f"model.layers.{layer}."
        expect = {"w2": merged[prefix + "mlp.down_proj.weight"],
                  "wqkv": torch.cat([merged[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"])}  # fmt: skip
        for name, weight in expect.items():
            oracle = quantize_int4(weight, 64, asymmetric=True)
            _, parts = read[name]
            for part, tensor in oracle.tensors().items():
                assert torch.equal(parts[part], tensor), (layer, name, part)


def test_sizes_from_config_predict_a_mixed_source_import(tmp_path):
    """mixed:source planned before converting: from the import's per-tensor types, the bytes the
    conversion then writes."""
    import json

    from tests.tiny import make_model
    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.models import read_config
    from tierlm.offload.sizes import sizes_from_artifact, sizes_from_config

    make_model(tmp_path, "llama", with_tokenizer=False)
    _on_q4_grid(tmp_path, "Q4_1")
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        types = {name: ("Q4_1" if f.get_slice(name).get_shape().__len__() == 2 else "F32") for name in f.keys()}
    (tmp_path / "tierlm-import.json").write_text(json.dumps({"tensor_types": {"Q4_1": 1}, "tensor_type_of": types}))
    predicted = sizes_from_config(read_config(tmp_path), "mixed-source", model_dir=tmp_path)
    measured = sizes_from_artifact(ensure_artifact(ConversionRequest(tmp_path, (), "mixed-source")))
    assert predicted.quant == measured.quant == "mixed-source"
    for name in measured.names:
        assert abs(predicted.nbytes[name] - measured.nbytes[name]) <= 64 * 8, name
