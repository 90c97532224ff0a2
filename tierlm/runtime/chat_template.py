"""Render a model's Jinja chat template exactly as transformers' `apply_chat_template` does.

The template comes from the checkpoint (tokenizer_config.json or chat_template.jinja) and is
untrusted code, so it runs in jinja2's immutable sandbox. The environment matches
transformers' one: trim_blocks + lstrip_blocks, the loopcontrols extension, a `tojson`
that does not HTML-escape, `raise_exception`, `strftime_now`, a safe `dict` and
`namespace`. The variables it sees are the messages, `add_generation_prompt`, `tools`,
`documents`, the named special tokens (bos_token, eos_token, ...) and any extra keyword
arguments (e.g. `enable_thinking`).

Unlike transformers, a render is bounded (tierlm.runtime.template_budget): by default 2 s and
4 Mi characters per value and prompt (more when the conversation itself is larger), so a
template that loops for minutes or builds gigabyte strings is stopped with a TierlmError.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.utils import Namespace

from tierlm.errors import TierlmError
from tierlm.runtime.template_budget import DEFAULT_MAX_CHARS, DEFAULT_SECONDS, RenderBudget, bounded_environment, text_size

# Names a message's reasoning may arrive under; templates read the first one
# (gpt-oss templates read "thinking"), so both are filled, as transformers does.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplate:
    """One compiled chat template plus the special-token variables it is rendered with.

    Compilation happens once, on first use, and is kept on this object (the owning
    tokenizer holds one `ChatTemplate`), so no module-level cache is needed.
    """

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str] | None = None,
        *,
        time_limit_s: float = DEFAULT_SECONDS,
        max_chars: int = DEFAULT_MAX_CHARS,
    ):
        """`source`: the Jinja text. `special_tokens`: e.g. {"bos_token": "<s>", "eos_token": "</s>"}.

        A render may take `time_limit_s` and build values and a prompt of `max_chars`
        characters, or twice the conversation's own text where that is more.
        """
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.time_limit_s = time_limit_s
        self.max_chars = max_chars
        self._compiled = None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` (a list of {"role", "content", ...} dicts) to the prompt text.

        Extra keyword arguments become template variables and override special tokens of
        the same name, as in transformers.
        """
        if not messages:
            raise TierlmError("cannot render a chat template for an empty conversation",
                              hint="pass at least one message")
        if tools is not None:
            for tool in tools:
                if not isinstance(tool, Mapping):
                    raise TierlmError(f"a tool must be a JSON-schema dict, got {type(tool).__name__}")
        if documents is not None:
            for document in documents:
                if not isinstance(document, Mapping):
                    raise TierlmError("documents must be dicts with 'title' and 'text' keys")
        inputs = dict(
            messages=_alias_reasoning_fields(_normalize_messages(messages)),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain({**self.special_tokens, **template_kwargs}),
        )
        template = self._template()
        # A conversation larger than the default bound still renders: its own text is allowed twice.
        budget = RenderBudget(self.time_limit_s, max(self.max_chars, 2 * text_size(inputs)))
        try:
            with template.environment.spending(budget):
                return budget.collect(template.generate(**inputs))
        except TierlmError:
            raise
        except RecursionError as err:  # macros or recursive loops calling themselves without end
            raise TierlmError("the chat template recursed too deeply (RecursionError) and was stopped",
                              hint="the model's chat template is broken; fix chat_template") from err
        except Exception as err:  # noqa: BLE001 - any failure inside template code is the template's
            raise TierlmError(f"the chat template failed to render the conversation: {_describe(err)}",
                              hint="check the message roles and order the model's template accepts") from err

    def _template(self):
        """The compiled jinja2 Template, built on first use."""
        if self._compiled is None:
            self._compiled = compile_template(self.source)
        return self._compiled


def compile_template(source: str):
    """Compile `source` in a sandboxed environment configured like transformers', bounded as
    tierlm.runtime.template_budget says (render it through ChatTemplate.render, which sets the budget).

    Raises TierlmError (with the line number) on a syntax error.
    """
    # Templates are untrusted code; jinja2 before 3.1.6 has known sandbox escapes.
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        raise TierlmError(f"chat templates need jinja2>=3.1.6 (found {jinja2.__version__})",
                          hint="pip install -U jinja2")
    env = bounded_environment(
        filters={"tojson": _tojson},
        globals={
            "raise_exception": _raise_exception,
            "strftime_now": _strftime_now,
            "dict": _TemplateDict(),
            "namespace": _TemplateNamespace,
        },
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[loopcontrols, _GenerationTag],
    )
    hint = "fix chat_template in tokenizer_config.json or chat_template.jinja"
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise TierlmError(f"the chat template has a syntax error at line {err.lineno}: {err.message}",
                          hint=hint) from err
    except Exception as err:  # noqa: BLE001 - e.g. a 5000-digit literal, or nesting past the recursion limit
        raise TierlmError(f"the chat template cannot be compiled: {_describe(err)}", hint=hint) from err


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes <, >, & and ', which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself to the sandbox."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name):
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})")


class _TemplateNamespace(Namespace):
    """A jinja2 Namespace that refuses underscore names, closing a route to CPython internals."""

    def __init__(*args, **kwargs):  # noqa: N805 - Namespace's signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_namespace_name(name)
        Namespace.__setitem__(self, name, value)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; for
    inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Plain-dict copies of the messages with None-valued keys dropped.

    APIs like OpenAI's send `content=None` / `tool_calls=None`; templates handle a missing
    key but would render a literal "None".
    """
    out = []
    for message in messages:
        message = _plain(message)
        if not isinstance(message, dict):
            raise TierlmError(f"a chat message must be a dict with 'role' and 'content', got {message!r}")
        out.append({key: value for key, value in message.items() if value is not None})
    return out


def _alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    aliased = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _plain(value: Any) -> Any:
    """Rebuild `value` from plain JSON-like types, so the sandbox only ever sees those.

    Rich objects (arrays, images, enums) carry methods the sandbox does not know are
    unsafe; anything that is not plain data becomes a "<TypeName>" placeholder.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if callable(getattr(value, "item", None)) and getattr(value, "shape", None) == ():
        return _plain(value.item())  # numpy / torch scalars
    return f"<{type(value).__name__}>"


def _describe(err: Exception) -> str:
    """One line for a template failure: the template's own message where it raised one."""
    text = str(err) or type(err).__name__
    return text if type(err).__name__ == "TemplateError" else f"{type(err).__name__}: {text}"
