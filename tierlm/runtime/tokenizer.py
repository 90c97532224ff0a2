"""Tokenizer: a `tokenizers.Tokenizer` plus what a checkpoint says around it.

A model directory carries the tokenizer proper (tokenizer.json), its special tokens and
chat template (tokenizer_config.json, chat_template.jinja) and the ids that end a turn
(generation_config.json, config.json). `Tokenizer.from_dir` reads all of them;
`StreamDecoder` turns generated ids into text one token at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from tierlm.errors import TierlmError
from tierlm.runtime.chat_template import ChatTemplate

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Text <-> token ids, chat-template rendering and streaming decode for one model."""

    def __init__(
        self,
        backend: Any,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        no_template_reason: str | None = None,
    ):
        """`backend`: a `tokenizers.Tokenizer`. `special_tokens`: {"bos_token": "<s>", ...} as
        strings. `extra_eos_token_ids`: ids from generation_config/config that also end a turn.
        `no_template_reason`: why `chat_template` is None, for the error message."""
        self.backend = backend
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_template = chat_template
        self._no_template_reason = no_template_reason
        # One ChatTemplate per tokenizer: it compiles the Jinja source once, on first render.
        self._chat = ChatTemplate(chat_template, self.special_tokens) if chat_template is not None else None
        eos = set(int(i) for i in extra_eos_token_ids)
        eos_id = self.token_to_id(self.special_tokens.get("eos_token"))
        if eos_id is not None:
            eos.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.bos_token_id: int | None = self.token_to_id(self.special_tokens.get("bos_token"))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory.

        Reads tokenizer.json (required), tokenizer_config.json, chat_template.jinja (which
        wins over tokenizer_config's `chat_template`, as in transformers 5),
        generation_config.json and config.json (for `eos_token_id`).
        """
        root = Path(path)
        if not root.is_dir():
            raise TierlmError(f"tokenizer directory {root} does not exist")
        tok_file = root / "tokenizer.json"
        config = _read_json(root / "tokenizer_config.json")
        if not tok_file.is_file():
            raise _missing_tokenizer_json(root, config)
        try:
            backend = Backend.from_file(str(tok_file))
        except Exception as err:  # noqa: BLE001 - the Rust loader raises a bare Exception
            raise TierlmError(f"cannot read {tok_file}: {err}",
                              hint="the file may be from a newer `tokenizers`; try upgrading it") from err

        legacy_map = _read_json(root / "special_tokens_map.json")
        special = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = _token_content(config.get(name, legacy_map.get(name)))
            if value is not None:
                special[name] = value

        template, reason = select_chat_template(root, config)
        eos_ids = _eos_ids(_read_json(root / "generation_config.json")) | _eos_ids(_read_json(root / "config.json"))
        return cls(backend, special_tokens=special, chat_template=template, extra_eos_token_ids=eos_ids,
                   no_template_reason=reason)

    @property
    def vocab_size(self) -> int:
        """Number of ids this tokenizer can produce (highest id + 1, added tokens included).

        The model's embedding may be larger (padded to a multiple of 64/128).
        """
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max(vocab.values()) + 1 if vocab else 0

    def token_to_id(self, token: str | None) -> int | None:
        """The id of one token string (e.g. "<|im_end|>"), or None if it is not in the vocabulary."""
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings inside it (e.g. "<|im_start|>") become
        their ids. No BOS is added unless `add_special_tokens` applies tokenizer.json's
        post-processor (what transformers does for a raw prompt)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; incomplete UTF-8 at the end decodes to U+FFFD (use StreamDecoder to stream)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return self._chat is not None

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages`, identical to transformers'
        `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`."""
        if self._chat is None:
            reason = self._no_template_reason or "this model's tokenizer has no chat template"
            raise TierlmError(reason, hint="use `tierlm generate` to run a raw prompt without a template")
        return self._chat.render(messages, add_generation_prompt, tools=tools, **template_kwargs)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of `render_chat(...)`, tokenized like transformers does it (no added BOS;
        the template writes its own)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools=tools, **template_kwargs))

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh incremental decoder for one generated sequence."""
        return StreamDecoder(self.backend, skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns only text that is final.

    Decoding token by token is wrong for byte-level BPE and byte-fallback tokens (one
    character can span tokens) and for SentencePiece's `▁` (a leading space is stripped
    from the first token of any decode). So, as text-generation-inference and vLLM do,
    it decodes a short window of ids twice: `prefix` = ids[prefix:read] (already emitted,
    kept only as context) and the window up to the newest id; the difference is new text.
    An incomplete character decodes to a trailing U+FFFD, so output is held until it is
    complete. Invariant: "".join(pushes) + flush() == decode(all ids).
    """

    def __init__(self, backend: Any, skip_special_tokens: bool = True):
        self._backend = backend
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # ids from the window start; older ids are dropped
        self._read = 0  # ids[:read] are emitted; ids[read:] are pending
        self._prefix_len = 0  # len(decode(ids[:read])), decoded with the same window start

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ("" while a character is partial)."""
        self._ids.append(int(token_id))
        text = self._backend.decode(self._ids, skip_special_tokens=self._skip)
        # Not longer: the id added nothing (a skipped special token). Trailing U+FFFD: a
        # character is still incomplete; wait for its remaining bytes.
        if len(text) <= self._prefix_len or text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Return whatever is pending at the end of the sequence (an incomplete character
        becomes U+FFFD, as a full decode would render it)."""
        if self._read == len(self._ids):
            return ""
        text = self._backend.decode(self._ids, skip_special_tokens=self._skip)
        return self._emit(text)

    def _emit(self, text: str) -> str:
        out = text[self._prefix_len:]
        # The newly emitted ids become the context for the next step; the old context goes.
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._prefix_len = len(self._backend.decode(self._ids, skip_special_tokens=self._skip))
        return out


def _read_json(path: Path) -> dict:
    """A JSON object from `path`, or {} if the file does not exist."""
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise TierlmError(f"cannot read {path}: {err}") from err
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token given as "<s>" or as an AddedToken dict {"content": "<s>", ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def select_chat_template(root: Path, config: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(template source, None) or (None, why there is none)."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), None
    template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"], None
        return None, (f"the tokenizer in {root} has chat templates named {sorted(map(str, named))} "
                      "but none named 'default'")
    if isinstance(template, str):
        return template, None
    return None, (f"the tokenizer in {root} has no chat template "
                  "(no chat_template.jinja, no chat_template in tokenizer_config.json)")


def _eos_ids(config: Mapping[str, Any]) -> set[int]:
    """`eos_token_id` (an int or a list) from a generation_config/config dict, also under text_config."""
    ids: set[int] = set()
    for source in (config, config.get("text_config") or {}):
        value = source.get("eos_token_id") if isinstance(source, Mapping) else None
        if isinstance(value, int) and not isinstance(value, bool):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ids


def _missing_tokenizer_json(root: Path, config: Mapping[str, Any]) -> TierlmError:
    """The error for a directory without tokenizer.json, naming what is there instead."""
    message = f"no tokenizer.json in {root}: tierlm needs a tokenizer.json (Hugging Face `tokenizers` format)"
    convert = ("convert it once with transformers: "
               "AutoTokenizer.from_pretrained(dir).save_pretrained(dir) writes tokenizer.json")
    auto_map = config.get("auto_map")
    remote = (isinstance(auto_map, Mapping) and "AutoTokenizer" in auto_map) or isinstance(auto_map, list)
    # ChatGLM2/3 and other remote-code checkpoints ship their tokenizer as tokenization_*.py.
    code = sorted(p.name for p in root.glob("tokenization_*.py"))
    if remote or code:
        where = ", ".join(code) if code else "auto_map in tokenizer_config.json"
        return TierlmError(message + f"; this model's tokenizer is custom code ({where}), "
                           "which tierlm never runs",
                           hint="use a checkpoint that ships a tokenizer.json: a transformers-native "
                                "release of the model, like GLM-4's -hf repositories")
    if (root / "tokenizer.model").is_file():
        return TierlmError(message + "; only a SentencePiece tokenizer.model was found", hint=convert)
    if (root / "vocab.json").is_file():
        return TierlmError(message + "; only vocab.json/merges.txt were found", hint=convert)
    return TierlmError(message, hint="copy tokenizer.json from the original model repository")
