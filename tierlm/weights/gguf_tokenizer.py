"""tokenizer.json and tokenizer_config.json contents from a GGUF's tokenizer metadata.

GGUF describes its tokenizer as metadata (`tokenizer.ggml.*`): a token list with types, merges or
scores, special token ids and a pre-tokenizer name. `build_tokenizer` turns that into a
`tokenizers.Tokenizer` (byte-level BPE or SentencePiece BPE) and the matching tokenizer_config.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from tierlm.errors import TierlmError
from tierlm.weights.gguf_reader import GgufMetadata

SUPPORTED_TOKENIZERS = ("gpt2", "llama")

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 2, 3, 4

# Byte-level pre-tokenizers by `tokenizer.ggml.pre`, following llama.cpp's llama-vocab.cpp.
_GPT2_PRE = ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRE = MappingProxyType(
    {
        **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
        **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _QWEN2_SPLIT),
    }
)
# llama.cpp matches a whole vocabulary word before applying merges for these (HF: ignore_merges).
_IGNORE_MERGES_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3")


def build_tokenizer(meta: GgufMetadata) -> tuple[Any, dict[str, Any]] | None:
    """(tokenizers.Tokenizer, tokenizer_config dict) from the GGUF's tokenizer metadata, or None.

    None when the GGUF has no tokenizer.ggml.model; TierlmError for an unsupported or malformed one.
    """
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        return None
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TierlmError(f"{meta.path}: tokenizer.ggml.tokens is missing; cannot build a tokenizer")
    token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if model == "gpt2":
        tokenizer = _byte_level_bpe(meta, tokens, token_types)
        default_add_bos = False
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(meta, tokens, token_types)
        default_add_bos = True  # llama.cpp and transformers add BOS to SentencePiece vocabularies by default
    else:
        raise TierlmError(
            f"{meta.path}: tokenizer model {model!r} is not supported",
            hint=f"supported tokenizer.ggml.model values: {', '.join(SUPPORTED_TOKENIZERS)}",
        )

    special = {name: _token_id_name(meta, tokens, key) for name, key in
               (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding"))}
    _add_special_tokens(tokenizer, tokens, token_types, [t for t in special.values() if t])
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    _set_post_processor(tokenizer, special["bos_token"] if add_bos else None,
                        special["eos_token"] if add_eos else None, byte_level=model == "gpt2")

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{name: token for name, token in special.items() if token is not None},
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.arch_get("context_length") or 0) or None,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return tokenizer, config


def _token_id_name(meta: GgufMetadata, tokens: list[str], key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return None
    return tokens[int(token_id)]


def _byte_level_bpe(meta: GgufMetadata, tokens: list[str], token_types: list[int]):
    """GPT-2 style byte-level BPE; the pre-tokenizer follows llama.cpp's reading of `tokenizer.ggml.pre`."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in _GPT2_PRE:
        pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _DIGITS_PRE:
        # llama.cpp: "\p{N}" then the GPT-2 regex; the same as HF's Digits(individual) + ByteLevel.
        pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    elif pre in _SPLIT_PRE:
        pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:
        known = sorted({*_GPT2_PRE, *_DIGITS_PRE, *_SPLIT_PRE})
        raise TierlmError(
            f"{meta.path}: byte-level pre-tokenizer {pre!r} is not supported",
            hint=f"supported tokenizer.ggml.pre values: {', '.join(known)}",
        )

    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for index, (token, token_type) in enumerate(zip(tokens, token_types)):
        # Added tokens keep their text; a normal token outside the byte alphabet is respelled into it.
        if token_type not in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNKNOWN) and not set(token) <= spelled:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab[token] = index
    merges = _merges(meta, tokens, vocab, scores=None)
    model = models.BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=False, byte_fallback=False,
                       ignore_merges=pre in _IGNORE_MERGES_PRE)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable bytes map to themselves, the rest
    (controls, space, ...) to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _sentencepiece_bpe(meta: GgufMetadata, tokens: list[str], token_types: list[int]):
    """SentencePiece BPE with byte fallback and Metaspace, as transformers' GGUF converter builds it."""
    vocab = {token: index for index, token in enumerate(tokens)}
    scores = meta.get("tokenizer.ggml.scores")
    merges = _merges(meta, tokens, vocab, scores=scores)
    model = models.BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges(
    meta: GgufMetadata, tokens: list[str], vocab: dict[str, int], scores: list[float] | None
) -> list[tuple[str, str]]:
    """The file's merges, or (SentencePiece files often have none) merges implied by token scores.

    The implied order matches transformers' `generate_merges`: every split of a token into two
    vocabulary pieces, best token score first, then shorter left/right pieces.
    """
    listed = meta.get("tokenizer.ggml.merges")
    if listed:
        merges = []
        for merge in listed:
            parts = merge.split(" ")
            if len(parts) != 2:
                raise TierlmError(f"{meta.path}: malformed tokenizer merge {merge!r}")
            merges.append((parts[0], parts[1]))
        return merges
    if scores is None:
        raise TierlmError(f"{meta.path}: the tokenizer has neither merges nor scores")
    token_scores = dict(zip(tokens, scores))
    candidates = []
    for piece, score in token_scores.items():
        splits = ((piece[:i], piece[i:]) for i in range(1, len(piece)))
        local = [(left, right, score) for left, right in splits if left in vocab and right in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        candidates.extend(local)
    candidates.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _add_special_tokens(tokenizer, tokens: list[str], token_types: list[int], named: list[str]) -> None:
    """Make control tokens (and unk and the named bos/eos/pad) special, user-defined ones plain added.

    Both kinds are matched whole in input text, as llama.cpp does; only special ones are dropped by
    `decode(skip_special_tokens=True)`, so a user-defined `<think>` stays visible (as in transformers).
    """
    vocab = tokenizer.get_vocab()
    special, plain = [], []
    for token, token_type in zip(tokens, token_types):
        if token not in vocab:
            continue
        if token_type in (_TOKEN_CONTROL, _TOKEN_UNKNOWN) or token in named:
            special.append(token)
        elif token_type == _TOKEN_USER_DEFINED:
            plain.append(token)
    for token in named:  # never grow the vocabulary: ids must stay within the embedding
        if token not in special and token in vocab:
            special.append(token)
    if special:
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if plain:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])


def _set_post_processor(tokenizer, bos: str | None, eos: str | None, byte_level: bool) -> None:
    """Add BOS/EOS around encoded text when the GGUF says so (tokenizer.ggml.add_bos/eos_token)."""
    if bos is None and eos is None:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False) if byte_level else None
        return
    prefix, suffix = ([f"{bos}:0"] if bos else []), ([f"{eos}:0"] if eos else [])
    pair_prefix, pair_suffix = ([f"{bos}:1"] if bos else []), ([f"{eos}:1"] if eos else [])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=[*prefix, "$A:0", *suffix],
        pair=[*prefix, "$A:0", *suffix, *pair_prefix, "$B:1", *pair_suffix],
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in dict.fromkeys(filter(None, (bos, eos)))],
    )
