"""mixed:source carries every GGUF quantized type exactly at its own size: each type's codes and
scales read from its blocks into the form that holds it (tierlm/weights/gguf_carry.py), so the
artifact dequantizes bit for bit to what the `gguf` package gives, and a model's logits are those
of transformers' GGUF loader.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.activation_rounding import activation_model
from tests.test_gguf_import import assert_logits_are_gguf_loaders, byte_level_vocab, gguf_name, gguf_writer
from tests.tiny import DECODE_ATOL
from tierlm.errors import TierlmError
from tierlm.quant.low_bit_k import NATIVE_KINDS
from tierlm.quant.modes import CARRIED_SOURCE_TYPES, source_grid_mode
from tierlm.weights.gguf_carry import carry_weight
from tierlm.weights.gguf_tensors import SCALE_FIELDS

KINDS = sorted(CARRIED_SOURCE_TYPES)
OWN_LAYOUTS = ["Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K"]
LOW_BIT_K = ("Q2_K", "Q3_K")  # weights that describe themselves to the kernels (`native_words`)


def read_own_layout(kind: str, raw: np.ndarray):
    """GGUF blocks of `kind` in the form tierlm carries them in (gguf_carry.carry_weight)."""
    return carry_weight(kind, raw)


def random_blocks(kind: str, rows: int, cols: int, rng, *, spread: float | None = None) -> np.ndarray:
    """Random blocks of GGUF type `kind`, uint8 [rows, row bytes]: every byte random but the fp16
    scale fields, which are finite; `spread`: their d and dmin scaled so the values' standard
    deviation is about that."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = getattr(GGMLQuantizationType, kind)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    fields = SCALE_FIELDS[kind]
    for offset in fields:
        blocks[:, offset : offset + 2] = rng.uniform(-2, 2, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    if spread is not None:
        factor = spread / float(dequantize(raw, qtype).std())
        for offset in fields:
            scaled = blocks[:, offset : offset + 2].copy().view(np.float16).astype(np.float32) * factor
            blocks[:, offset : offset + 2] = scaled.astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("kind", KINDS)
def test_each_type_is_carried_bit_for_bit_at_its_own_size(kind):
    """Random blocks, plus edge blocks: zero scales, the largest fp16 scales with the largest
    sub-scales and codes (products at the edge of fp32's exact range), all-equal bytes. The form
    takes the file's bytes (the super-block layouts keep 6-bit sub-scales a byte each: <= 3 % more)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = getattr(GGMLQuantizationType, kind)
    rng = np.random.default_rng(3)
    cols = 512
    raw = random_blocks(kind, 8, cols, rng)
    size = GGML_QUANT_SIZES[qtype][1]
    edge = raw[:4].reshape(-1, size)
    for offset in SCALE_FIELDS[kind]:
        edge[0::3, offset : offset + 2] = np.zeros(1, dtype=np.float16).view(np.uint8)  # zero scales
        edge[1::3, offset : offset + 2] = np.array([65504.0], dtype=np.float16).view(np.uint8)  # largest
        edge[2::3, offset : offset + 2] = np.array([-6.1e-5], dtype=np.float16).view(np.uint8)  # tiny, negative
    fields = {o + i for o in SCALE_FIELDS[kind] for i in (0, 1)}
    codes = [i for i in range(size) if i not in fields]
    edge[1::3][:, codes] = 0xFF  # every sub-scale and code at its largest
    edge[2::3][:, codes] = 0x00
    with np.errstate(over="ignore", invalid="ignore"):
        expected = dequantize(raw, qtype).reshape(8, cols)
    carried = carry_weight(kind, raw)
    assert raw.nbytes <= carried.nbytes <= 1.03 * raw.nbytes
    got = carried.dequantize().numpy()
    finite = np.isfinite(expected)
    assert finite[4:].all()
    np.testing.assert_array_equal(got[finite], expected[finite])
    assert not np.isfinite(got[~finite]).any()  # 65504 x the largest sub-scale overflows alike


def llama_writer(path, config, name: str):
    """A GGUFWriter for a llama-architecture file of `config` with the byte-level tokenizer."""
    tokens, types, merges = byte_level_vocab()
    writer = gguf_writer(path, "llama", config, name)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return writer


def write_quantized_gguf(path, kinds_of, rng):
    """A Llama-shaped GGUF (hidden 256, so K-quants' 256-value blocks fit every row) whose 2-D
    tensors are random blocks of the type `kinds_of(gguf name)`; norms F32."""
    import transformers
    from gguf import GGMLQuantizationType

    config = transformers.LlamaConfig(vocab_size=len(byte_level_vocab()[0]), hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)  # fmt: skip
    writer = llama_writer(path, config, "tiny quantized")
    model = transformers.LlamaForCausalLM(config)
    for name, tensor in model.state_dict().items():
        if tensor.dim() == 1:
            writer.add_tensor(gguf_name(name), (1.0 + 0.1 * rng.standard_normal(tensor.shape)).astype(np.float32))
            continue
        kind = kinds_of(gguf_name(name))
        rows, cols = tensor.shape
        raw = random_blocks(kind, rows, cols, rng, spread=0.05)
        writer.add_tensor(gguf_name(name), raw, raw_dtype=getattr(GGMLQuantizationType, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def q4_k_m_like(name: str) -> str:
    """llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for the head, attn_v and ffn_down."""
    return "Q6_K" if name.startswith("output") or "ffn_down" in name or "attn_v" in name else "Q4_K"


def q3_k_m_like(name: str) -> str:
    """What llama.cpp's Q3_K_M falls back to where rows are no whole 256-value blocks (the
    embedded model's files): Q4_0, with Q8_0 for attn_v and the head, Q4_1 for ffn_up."""
    return "Q8_0" if name.startswith("output") or "attn_v" in name else "Q4_1" if "ffn_up" in name else "Q4_0"


MIXES = {"Q4_K_M-like": q4_k_m_like, "Q3_K_M-like": q3_k_m_like}


@pytest.mark.parametrize("mix", [*MIXES, *KINDS])
def test_quantized_gguf_logits_are_transformers_gguf_loaders(tmp_path, monkeypatch, mix):
    """Under `auto` every weight is carried in its type's exact form (the mixes as llama.cpp makes
    them: a weight fused from rows of two types as a row stack of each one's own form) at the
    file's size, and the logits equal those of transformers' GGUF loader, which dequantizes with
    the `gguf` package."""
    from tierlm.cache.artifact import Artifact
    from tierlm.cache.encodings import record_mode
    from tierlm.runtime.loader import load_model
    from tierlm.weights.gguf_import import import_gguf

    kinds_of = MIXES.get(mix, lambda name: mix)

    path = tmp_path / "tiny.gguf"
    write_quantized_gguf(path, kinds_of, np.random.default_rng(5))
    out = import_gguf(path, tmp_path / "out")
    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    loaded = load_model(out, device="cpu", dtype=torch.float32, quant="auto")
    artifact = Artifact.open(loaded.artifact_dir)
    assert artifact.manifest["quant"] == "mixed-source"
    modes = {f"{b}/{t}": record_mode(r) for b, block in artifact.blocks.items() for t, r in block.tensors.items()
             if r.encoding != "plain"}  # fmt: skip
    if mix == "Q4_K_M-like":
        assert modes["layers.0/w13"] == modes["layers.0/wo"] == "q4_k"
        assert modes["layers.0/w2"] == modes["head/head"] == "q6_k"
        assert modes["layers.0/wqkv"] == "q4_k*384+q6_k*128"  # Q4_K q, k fused with a Q6_K v, each as stored
    elif mix == "Q3_K_M-like":
        assert modes["layers.0/wqkv"] == "int4-g32*384+q8_0*128" and modes["head/head"] == "q8_0"
        assert modes["layers.0/w13"] == "int4-g32-asym"  # Q4_0 with Q4_1: one int4 form holds both, no stack
    else:
        expected = "int4-g32" if mix == "Q4_0" else "int4-g32-asym" if mix == "Q4_1" else source_grid_mode([mix])
        assert set(modes.values()) == {expected}
    import gguf

    # Every mix at its own size (Q4_K_M-like's wqkv a row stack): within 3 % of the file's bytes.
    quantized = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.tensor_type.name != "F32")
    stored = sum(int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize for block in artifact.blocks.values()
                 for r in block.tensors.values() if r.encoding != "plain" for p in r.parts.values())  # fmt: skip
    assert quantized <= stored <= 1.03 * quantized, (stored, quantized)
    artifact.close()
    # The planner predicts each block's bytes from the import's recorded types, before converting.
    from tierlm.models import read_config
    from tierlm.offload.sizes import sizes_from_artifact, sizes_from_config

    predicted = sizes_from_config(read_config(out), "mixed-source", model_dir=out)
    assert dict(predicted.nbytes) == dict(sizes_from_artifact(loaded.artifact_dir).nbytes)

    assert_logits_are_gguf_loaders(loaded, path)
    loaded.close()


@pytest.mark.parametrize("kind", [*OWN_LAYOUTS, *MIXES])
def test_own_layouts_decode_in_the_fused_step_as_eagerly(tmp_path, monkeypatch, kind):
    """A decode step over weights in each own layout (and over the mixes' row stacks) runs
    natively (the fused step reads the blocks as stored, a stack's runs each by its own kernel)
    and gives the eager path's logits."""
    from tierlm.models import fused_decode
    from tierlm.quant import native
    from tierlm.runtime.loader import load_model
    from tierlm.weights.gguf_import import import_gguf

    path = tmp_path / "tiny.gguf"
    write_quantized_gguf(path, MIXES.get(kind, lambda name: kind), np.random.default_rng(6))
    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    kinds = []
    words = native.describe_weight
    monkeypatch.setattr(fused_decode, "describe_weight", lambda *a: kinds.append((w := words(*a)) and w[7]) or w)
    steps = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("TIERLM_FUSED", fused)
        loaded = load_model(import_gguf(path, tmp_path / "out"), device="cpu", dtype=torch.float32, quant="auto")
        cache = loaded.new_cache()
        loaded.model.forward(torch.tensor([[1, 70, 80, 90]]), cache)
        steps[fused] = loaded.model.forward(torch.tensor([[259]]), cache)
        loaded.close()
    want = {"Q4_K": native.KIND_INT4K, "Q6_K": native.KIND_INT6K, "Q5_K": native.KIND_INT5K,
            "IQ4_NL": native.KIND_IQ4, "IQ4_XS": native.KIND_IQ4X, **NATIVE_KINDS,
            **dict.fromkeys(MIXES, native.KIND_STACK)}
    assert want.get(kind, native.KIND_INT5) in kinds
    torch.testing.assert_close(steps["1"], steps["0"], rtol=0, atol=DECODE_ATOL)


@pytest.mark.parametrize("kind", OWN_LAYOUTS)
@pytest.mark.parametrize("rows", [1, 7, 37])
def test_super_block_kernels_on_each_isa_path(native_build, kind, rows):
    """The own layouts' kernels built for AVX2 and for portable vectors (the default build, AVX-512 where
    the CPU has it, runs everywhere else): dequantization exactly gguf's, products within fp32
    summation error of it, for 1-5 activation rows and row counts that leave partial tiles."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    cols = 768
    raw = random_blocks(kind, rows, cols, np.random.default_rng(rows))
    expected = dequantize(raw, getattr(GGMLQuantizationType, kind)).reshape(rows, cols)
    weight = read_own_layout(kind, raw)
    np.testing.assert_array_equal(weight.dequantize().numpy(), expected)
    if kind in LOW_BIT_K:
        return check_words_kernels(native_build, weight, expected)
    parts = weight.tensors()
    if kind.startswith("Q5"):  # these entry points take every part, absent ones as None
        parts = {name: weight.tensors().get(name) for name in ("codes", "scales", "offsets", "superblocks")}
    if kind.startswith("IQ4"):
        parts = {name: weight.tensors().get(name) for name in ("packed", "scales", "superblocks")}
    native = native_build
    dequantize_into, matmul = {"Q4_K": (native.dequantize4k_into, native.matmul4k),
                               "Q6_K": (native.dequantize6k_into, native.matmul6k),
                               "IQ4_NL": (native.dequantize_iq4_into, native.matmul_iq4),
                               "IQ4_XS": (native.dequantize_iq4_into, native.matmul_iq4)}.get(
        kind, (native.dequantize5_into, native.matmul5))  # fmt: skip
    out = torch.empty(rows, cols)
    np.testing.assert_array_equal(dequantize_into(*parts.values(), out).numpy(), expected)
    reference = torch.from_numpy(expected).double()
    _, rounding = activation_model(kind)  # up to 4 rows run the integer rows, which round x
    for m in range(1, 6):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        bias = torch.randn(rows)
        got = matmul(x, *parts.values(), bias)
        want = x.double() @ reference.T + bias.double()
        scale = (x.double().abs() @ reference.abs().T).max()
        assert bool(((got.double() - want).abs() <= rounding(x, reference) + 1e-5 * float(scale)).all())
    with pytest.raises(ValueError, match="multiple of"):
        matmul(torch.randn(1, 16), *(part[:, :8].contiguous() if part is not None else None for part in parts.values()))


def check_words_kernels(native, weight, expected):
    """A weight read through its `native_words`: dequantized exactly as gguf, products within fp32
    summation error, for 1-5 activation rows; parts the kernels cannot read refused by name."""
    rows, cols = expected.shape
    out = torch.empty(rows, cols)
    np.testing.assert_array_equal(native.dequantize_words_into(weight, out).numpy(), expected)
    reference = torch.from_numpy(expected).double()
    for m in range(1, 6):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        bias = torch.randn(rows)
        got = native.matmul_words(x, weight, bias)
        want = x.double() @ reference.T + bias.double()
        scale = (x.double().abs() @ reference.abs().T).max()
        assert float((got.double() - want).abs().max()) <= 1e-5 * float(scale)
    elsewhere = type(weight)(**{name: part.to("meta") for name, part in weight.tensors().items()})
    with pytest.raises(ValueError, match="must be CPU tensors"):
        native.matmul_words(torch.randn(1, cols), elsewhere)


@pytest.mark.parametrize("kind", LOW_BIT_K)
def test_low_bit_k_quantizer_rounds_to_its_grid(kind):
    """What a LoRA variant of a Q2_K / Q3_K base stores for the weights it changes: every value
    within half a step of its group's grid (Q3_K: one step, where a value of the sign opposite to
    the group's largest one meets the clamp at +3), so a wrong packing of scales or codes lands
    far off; the layout's bytes exactly GGUF's per 256 columns."""
    from tierlm.quant.gguf_layouts import low_bit_k_group_values
    from tierlm.quant.low_bit_k import BLOCK_BYTES, quantize_low_bit_k

    weight = torch.randn(24, 512, generator=torch.Generator().manual_seed(2)) * 0.02
    weight[3] = 0.0  # an all-zero row: zero scales, values exactly 0
    carried = quantize_low_bit_k(weight, kind)
    assert carried.nbytes == 24 * 2 * BLOCK_BYTES[kind]
    scales, _ = low_bit_k_group_values(carried.superblocks, kind == "Q3_K")
    error = (carried.dequantize() - weight).abs().view(24, -1, 16).amax(-1)
    steps = 1.0 if kind == "Q3_K" else 0.5
    assert bool((error <= scales.abs() * steps * 1.001 + 1e-7).all())
    assert torch.equal(carried.dequantize()[3], torch.zeros(512))
    relative = float((carried.dequantize() - weight).abs().mean() / weight.abs().mean())
    assert relative < (0.4 if kind == "Q2_K" else 0.2), relative  # 4 and 8 levels a group


@pytest.mark.parametrize("kind", OWN_LAYOUTS)
def test_own_layouts_without_native_kernels(kind):
    """Where no native kernel loads (the torch and dequantize+BLAS kernels) and on accelerators (the
    exact Int8Weight form they are moved in), the products and values are the reference's."""
    from tierlm.quant.dispatch import KernelChoice
    from tierlm.quant.torch_kernels import BlasKernel, TorchKernel

    weight = read_own_layout(kind, random_blocks(kind, 9, 512, np.random.default_rng(9)))
    reference = weight.dequantize()
    assert torch.equal(weight.as_int8().dequantize(), reference)
    x, bias = torch.randn(3, 512), torch.randn(9)
    for kernel in (BlasKernel(block_bytes=4 * 512 * 4), TorchKernel()):  # blocks of 4 rows: several GEMMs
        choice = KernelChoice(gemv=kernel, gemm=kernel, crossover=0, fp32_only=False)
        torch.testing.assert_close(choice.linear(x, weight, bias), x @ reference.T + bias, rtol=1e-5, atol=1e-4)
    ids = torch.tensor([[3, 0], [8, 3]])
    assert torch.equal(weight.rows(ids), reference[ids])


def test_lora_on_a_gguf_base_changes_only_the_touched_weights_format(tmp_path, monkeypatch):
    """A LoRA adapter over a Q4_K_M-like import: the weights it leaves alone are carried as stored;
    the ones it changes are re-quantized into the format their sources are carried in (q4_k, q6_k,
    a row stack of both), the same in a full `--lora` conversion and in a variant over the base, whose
    blocks read byte for byte as the full conversion's. The logits stay within the re-quantization
    error of the merged weights computed in float."""
    import transformers

    from tests.test_artifact import make_adapter
    from tierlm.cache.artifact import Artifact
    from tierlm.cache.convert import ConversionRequest, ensure_artifact, ensure_variant_artifact
    from tierlm.cache.encodings import record_mode
    from tierlm.runtime.loader import load_model
    from tierlm.weights.gguf_import import import_gguf

    path = tmp_path / "tiny.gguf"
    write_quantized_gguf(path, q4_k_m_like, np.random.default_rng(8))
    out = import_gguf(path, tmp_path / "out")
    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(out)).save_pretrained(tmp_path / "shapes")
    adapter = make_adapter(tmp_path / "shapes", tmp_path / "adapter", target_modules=("q_proj", "down_proj"))
    pairs = ((adapter, 1.0),)
    full = Artifact.open(ensure_artifact(ConversionRequest(out, pairs, "mixed-source")))
    variant = Artifact.open(ensure_variant_artifact(ConversionRequest(out, (), "mixed-source"), pairs))
    modes = {f"{b}/{t}": record_mode(r) for b, block in full.blocks.items() for t, r in block.tensors.items()
             if r.encoding != "plain" and b == "layers.0"}  # fmt: skip
    assert modes == {"layers.0/wqkv": "q4_k*384+q6_k*128", "layers.0/wo": "q4_k", "layers.0/w13": "q4_k",
                     "layers.0/w2": "q6_k"}  # fmt: skip
    for name in variant.blocks:
        assert bytes(variant.read_bytes(name).numpy()) == bytes(full.read_bytes(name).numpy()), name
    assert set(variant.own_blocks) == {"layers.0", "layers.1"}
    full.close()
    variant.close()

    ids = torch.tensor([[1, 70, 80, 90, 259, 260, 5, 44]])
    ours = load_model(out, device="cpu", dtype=torch.float32, quant="auto", adapters=pairs)
    got = ours.model.forward(ids, ours.new_cache(), logits="all")
    ours.close()
    exact = load_model(out, device="cpu", dtype=torch.float32, quant="fp32", adapters=pairs)  # merged in float
    want = exact.model.forward(ids, exact.new_cache(), logits="all")
    exact.close()
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())  # measured 1.5 %


def test_own_layouts_are_no_quant_flag():
    """`--quant q4_k` (and the other carried-only layouts) is refused in one line that says how
    to get them: they hold a GGUF's tensors as stored, never quantize floats."""
    from tests.cli_runner import run_tierlm
    from tierlm.quant.modes import CARRIED_ONLY, check_mode_name

    for mode, kind in CARRIED_ONLY.items():
        with pytest.raises(TierlmError, match=rf"{mode} holds a GGUF's {kind} tensors as they are"):
            check_mode_name(mode)
    done = run_tierlm("plan", "--quant", "q4_k", "--device", "cpu")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode != 0 and len(errors) == 1 and "q4_k" in errors[0] and "Traceback" not in done.stderr


KILLED_TRANSCODE = """
import sys, time
from tierlm.cache.convert import ConversionRequest, ensure_artifact

def slow(done, total):
    if done == 0:
        return  # the first block is still being transcoded
    print("block", done, flush=True)
    time.sleep(60)

ensure_artifact(ConversionRequest(sys.argv[1], (), "mixed-source"), lambda label, unit="": slow)
"""


@pytest.mark.e2e
def test_killed_transcode_leaves_no_listed_entry(tmp_path, monkeypatch):
    """kill -9 while a K-quant GGUF is transcoded into its artifact: nothing is listed (no
    artifact in `tierlm list`, no directory but the temporary one), and the next conversion
    writes the whole artifact, whose logits are transformers' GGUF loader's."""
    import os
    import subprocess
    import sys

    from tests.test_gguf_import import killed_after_first_line
    from tierlm.cache.catalog import catalog
    from tierlm.cache.manifest import artifacts_root
    from tierlm.runtime.loader import load_model
    from tierlm.weights.gguf_import import import_gguf

    path = tmp_path / "tiny.gguf"
    write_quantized_gguf(path, lambda name: "Q6_K" if "ffn_down" in name or name.startswith("output") else "Q4_K",
                         np.random.default_rng(9))  # fmt: skip
    out = import_gguf(path, tmp_path / "out")
    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    child = subprocess.Popen([sys.executable, "-c", KILLED_TRANSCODE, str(out)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "TIERLM_CACHE": str(tmp_path / "cache")})  # fmt: skip
    assert killed_after_first_line(child).startswith("block")  # a block was written, the rest pending
    root = artifacts_root()
    assert any(p.name.startswith(".") for p in root.iterdir()), "the conversion should have been writing a temp dir"
    assert [p for p in root.iterdir() if not p.name.startswith(".")] == []
    assert [e for e in catalog() if e.kind == "artifact"] == []

    loaded = load_model(out, device="cpu", dtype=torch.float32, quant="auto")
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == [loaded.artifact_dir.name]
    assert [e.path.name for e in catalog() if e.kind == "artifact"] == [loaded.artifact_dir.name]
    assert_logits_are_gguf_loaders(loaded, path)
    loaded.close()
