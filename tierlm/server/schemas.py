"""Request bodies of the OpenAI API, validated by hand into plain dataclasses.

Hand-written rather than pydantic so every refusal is an OpenAI-style 400 that names the
parameter (`{"error": {"message", "type", "param", "code"}}`), never a 422 or a 500. Before
any of that, `parse_body` refuses what is not strict JSON (NaN, Infinity), nests deeper than
JSON_DEPTH_MAX, or holds a lone surrogate ("\\ud800": invalid Unicode) anywhere, keys included.

Parameter policy: what tierlm honours is parsed; parameters that only have a meaning tierlm
lacks (tools, logprobs, penalties, ...) are accepted at their neutral value and refused
otherwise; a few informational ones (`user`, `metadata`, ...) are ignored; anything else is
refused as unrecognized, as OpenAI does. Extensions: `timeout` (seconds, the request's
deadline), `top_k`, `min_p` (as vLLM and llama-server take it), `repetition_penalty`,
`repeat_last_n` (llama-server's: the tokens the penalty looks back over; 0 = off, -1 = all),
`draft` ("off", "ngram" or "auto": speculative decoding for this request, whatever `serve --draft`
says; left out, the server's, which may be a draft model) and `draft_tokens` (the most tokens it
drafts a pass).
Sampling fields a request omits are None here and take the model's defaults (the server's
GenerationDefaults: runtime/model_defaults.py, or `serve`'s flags).

`Sampling` is a request's sampling fields in generic terms: the Ollama parser
(ollama_schemas.py) makes one too, and admission.sampling_params maps either onto the sampler.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from tierlm.lora.spec import NAME_RULE, VARIANT_NAME
from tierlm.runtime.speculative import DRAFT_KINDS, MAX_DRAFT_TOKENS

STOP_STRINGS_MAX = 4  # as OpenAI allows
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
JSON_DEPTH_MAX = 32  # the deepest real body (message > content > part > text) is 5 levels
JSON_DIGITS_MAX = 40  # an integer literal longer than this fits no parameter (seeds have 20 digits)
_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Sampling:
    """The sampling fields a request sent, whichever API it came in by (its parser maps its own
    names and special values onto these, SamplingParams' names); None = not sent: the model's
    default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    repeat_last_n: int | None = None
    seed: int | None = None  # None: a random seed
    stop: tuple[str, ...] = ()
    draft: str | None = None  # speculative decoding: "off", "ngram", "auto" (None: the server's, serve --draft)
    draft_tokens: int | None = None  # most tokens drafted a pass (None: the server's)


@dataclass(frozen=True)
class GenerationRequest:
    """What a chat or completion request asks for, validated; `messages` xor `prompt` is set."""

    messages: tuple[dict, ...] | None
    prompt: str | tuple[int, ...] | None
    model: str | None  # None: not sent (the one model served)
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: not sent
    max_tokens_param: str  # the name it was sent under (errors name it)
    default_max_tokens: int | None  # what an omitted max_tokens means; None: up to the context
    sampling: Sampling
    timeout: float | None


# Accepted only at these neutral values (None = absent).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
_COMPLETION_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logprobs": (None, 0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}
_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                      "prompt_cache_key", "safety_identifier"})
_SAMPLING = frozenset({"model", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p",
                       "seed", "stop", "repetition_penalty", "repeat_last_n", "timeout", "draft", "draft_tokens"})
_CHAT_KEYS = _SAMPLING | {"messages", "max_tokens", "max_completion_tokens"}
_COMPLETION_KEYS = _SAMPLING | {"prompt", "max_tokens"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def parse_body(raw: bytes) -> Any:
    """A request body as JSON, refused (400) unless it is strict JSON of bounded depth whose
    strings are all valid Unicode: nothing past this point has to defend against those."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_int=_integer)
    except RecursionError:
        raise _too_deep() from None
    except _TooManyDigits as err:
        raise ApiError(400, f"the request body holds an integer of {err} digits; at most {JSON_DIGITS_MAX} "
                            "are accepted", code="invalid_value") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
    _check_tree(body)
    return body


class _TooManyDigits(ValueError):
    pass


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > JSON_DIGITS_MAX:  # Python's own limit (4300) speaks of sys settings
        raise _TooManyDigits(len(text.lstrip("-")))
    return int(text)


def _too_deep() -> ApiError:
    return ApiError(400, f"the request body nests JSON deeper than {JSON_DEPTH_MAX} levels", code="invalid_json")


def _check_tree(body: Any) -> None:
    """Depth and lone surrogates (JSON's "\\ud800": no character, and no UTF-8 either), walked
    without recursion so any depth json.loads accepted is safe here."""
    stack = [(body, 0)] if isinstance(body, (str, list, dict)) else []
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise _bad_unicode(body)
            continue
        if depth >= JSON_DEPTH_MAX:
            raise _too_deep()
        if isinstance(node, dict):
            stack.extend((key, depth) for key in node)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((value, depth + 1) for value in children if isinstance(value, (str, list, dict)))


def _bad_unicode(body: Any) -> ApiError:
    where = _surrogate_path(body, "")
    return ApiError(400, f"invalid Unicode in {where or 'the request body'}: a lone surrogate (half of a "
                         f"UTF-16 pair, as JSON's \\ud800 writes it) is not a character", param=where or None,
                    code="invalid_unicode")


def _surrogate_path(node: Any, path: str) -> str | None:
    """Where the first lone surrogate lies (`messages[0].content`); depth is already bounded."""
    if isinstance(node, str):
        return path if _SURROGATE.search(node) else None
    if isinstance(node, list):
        items = ((f"{path}[{i}]", value) for i, value in enumerate(node))
    elif isinstance(node, dict):
        if any(_SURROGATE.search(key) for key in node):
            return path or None
        items = ((f"{path}.{key}" if path else key, value) for key, value in node.items())
    else:
        return None
    return next(filter(None, (_surrogate_path(value, where) for where, value in items)), None)


def parse_chat(body: Any, *, max_messages: int) -> GenerationRequest:
    """Validate a /v1/chat/completions body."""
    body = _object(body)
    _check_keys(body, _CHAT_KEYS, _NEUTRAL)
    messages = _messages(body.get("messages"), max_messages)
    max_tokens = _opt_int(body, "max_tokens", 1)
    max_completion = _opt_int(body, "max_completion_tokens", 1)
    if max_completion is not None:
        max_tokens, param = max_completion, "max_completion_tokens"
    else:
        param = "max_tokens"
    return _generation(body, messages=messages, prompt=None, max_tokens=max_tokens, max_tokens_param=param,
                       default_max_tokens=None)


def parse_completion(body: Any) -> GenerationRequest:
    """Validate a /v1/completions body (one prompt: a string or token ids)."""
    body = _object(body)
    _check_keys(body, _COMPLETION_KEYS, _COMPLETION_NEUTRAL)
    return _generation(body, messages=None, prompt=_prompt(body.get("prompt")),
                       max_tokens=_opt_int(body, "max_tokens", 1), max_tokens_param="max_tokens",
                       default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)


def _generation(body: dict, *, messages, prompt, max_tokens, max_tokens_param, default_max_tokens) -> GenerationRequest:
    stream = _opt_bool(body, "stream") or False
    options = body.get("stream_options")
    if options is not None and not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    include_usage = False
    if options is not None:
        options = _object(options, "stream_options")
        unknown = sorted(set(options) - {"include_usage", "include_obfuscation"})
        if unknown:
            raise ApiError(400, f"unrecognized stream_options key {unknown[0]!r}", param="stream_options")
        include_usage = _opt_bool(options, "include_usage", "stream_options.include_usage") or False
    temperature = _opt_number(body, "temperature", 0.0, 2.0)
    top_p = _opt_number(body, "top_p", 0.0, 1.0)
    if top_p == 0:
        raise ApiError(400, "top_p must be greater than 0 and at most 1", param="top_p", code="invalid_value")
    repetition = _opt_number(body, "repetition_penalty", 0.0, 10.0)
    if repetition == 0:
        raise ApiError(400, "repetition_penalty must be greater than 0", param="repetition_penalty",
                       code="invalid_value")
    timeout = _opt_number(body, "timeout", 0.0, math.inf)
    if timeout == 0:
        raise ApiError(400, "timeout must be a positive number of seconds", param="timeout", code="invalid_value")
    return GenerationRequest(
        messages=messages,
        prompt=prompt,
        model=_model(body),
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        default_max_tokens=default_max_tokens,
        sampling=Sampling(
            temperature=temperature,
            top_p=top_p,
            top_k=_opt_int(body, "top_k", 0),
            min_p=_opt_number(body, "min_p", 0.0, 1.0),
            repetition_penalty=repetition,
            repeat_last_n=_opt_int(body, "repeat_last_n", -1),
            seed=_opt_int(body, "seed", SEED_RANGE[0], SEED_RANGE[1]),
            stop=_stop(body.get("stop")),
            draft=draft_kind(body.get("draft"), "draft"),
            draft_tokens=_opt_int(body, "draft_tokens", 1, MAX_DRAFT_TOKENS),
        ),
        timeout=timeout,
    )


def parse_adapter(body: Any) -> tuple[str, str, float]:
    """Validate a POST /v1/adapters body: {"name", "path", "weight"?} -> (name, path, weight)."""
    body = _object(body)
    unknown = sorted(set(body) - {"name", "path", "weight"})
    if unknown:
        raise ApiError(400, f"unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                       code="unrecognized_parameter")
    for key in ("name", "path"):
        if not isinstance(body.get(key), str) or not body[key]:
            raise ApiError(400, f"{key} is required: a non-empty string", param=key,
                           code="missing_required_parameter" if key not in body else "invalid_type")
    if not VARIANT_NAME.fullmatch(body["name"]):
        raise ApiError(400, f"{body['name']!r} is not a valid name: {NAME_RULE}", param="name", code="invalid_value")
    weight = _opt_number(body, "weight", -1e6, 1e6)
    return body["name"], body["path"], 1.0 if weight is None else weight


def _object(value: Any, name: str | None = None) -> dict:
    if not isinstance(value, dict):
        where = f"{name} must be" if name else "the request body must be"
        raise ApiError(400, f"{where} a JSON object", param=name, code="invalid_type")
    return value


def _check_keys(body: dict, known: frozenset, neutral: Mapping[str, tuple]) -> None:
    for key, value in body.items():
        if key in known or key in _IGNORED:
            continue
        if key in neutral:
            if not any(value == ok and type(value) is type(ok) or value is ok for ok in neutral[key]):
                allowed = ", ".join("null" if ok is None else repr(ok) for ok in neutral[key])
                raise ApiError(400, f"{key} is not supported by tierlm (accepted: {allowed})",
                               param=key, code="unsupported_parameter")
            continue
        raise ApiError(400, f"unrecognized request argument supplied: {key}", param=key,
                       code="unrecognized_parameter")


def _model(body: dict) -> str | None:
    # Whether the name is served (or an alias) is the app's call: it knows the names.
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model", code="invalid_type")
    return model


def _messages(value: Any, max_messages: int) -> tuple[dict, ...]:
    if value is None:
        raise ApiError(400, "messages is required", param="messages", code="missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty array", param="messages", code="invalid_type")
    if len(value) > max_messages:
        raise ApiError(400, f"{len(value)} messages exceed this server's limit of {max_messages}",
                       param="messages", code="too_many_messages")
    return tuple(_message(m, i) for i, m in enumerate(value))


def _message(message: Any, index: int) -> dict:
    where = f"messages[{index}]"
    message = _object(message, where)
    role = message.get("role")
    if not isinstance(role, str):  # a list or an object is not a role (nor hashable)
        raise ApiError(400, f"{where}.role must be a string (system, user or assistant), not "
                            f"{_json_type(role)}", param=f"{where}.role", code="invalid_type")
    if role not in _ROLES:
        raise ApiError(400, f"{where}.role {role!r} is not supported (use system, user or assistant)",
                       param=f"{where}.role", code="invalid_value")
    for key, value in message.items():
        if key not in ("role", "content", "name") and value not in (None, [], ""):
            raise ApiError(400, f"{where}.{key} is not supported by tierlm", param=f"{where}.{key}",
                           code="unsupported_parameter")
    return {"role": _ROLES[role], "content": _content(message.get("content"), where)}


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}.content[{j}]: only text parts are supported",
                               param=f"{where}.content", code="unsupported_content")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where}.content must be a string or an array of text parts",
                   param=f"{where}.content", code="invalid_type")


def _prompt(value: Any) -> str | tuple[int, ...]:
    if value is None:
        raise ApiError(400, "prompt is required", param="prompt", code="missing_required_parameter")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        if not value:
            raise ApiError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        return value
    if not isinstance(value, list) or not value:
        raise ApiError(400, "prompt must be a non-empty string or an array of token ids", param="prompt",
                       code="invalid_type")
    if len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise ApiError(400, "only one prompt per request is supported", param="prompt",
                       code="unsupported_parameter")
    return _token_ids(value)


def _token_ids(value: list) -> tuple[int, ...]:
    """Token ids: integers ≥ 0 (whether each is in the vocabulary is the app's check: it knows it)."""
    for i, token in enumerate(value):
        if not _is_int(token):
            raise ApiError(400, f"prompt[{i}] is {_json_type(token)}, not a token id: an array prompt holds "
                                f"integer token ids", param="prompt", code="invalid_type")
        if token < 0:
            raise ApiError(400, f"prompt[{i}] is {token}: token ids are not negative", param="prompt",
                           code="invalid_value")
    return tuple(value)


def _json_type(value: Any) -> str:
    """How JSON would name `value`'s kind (errors speak the client's language)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    kinds = ((str, "a string"), (int, "an integer"), (float, "a number"), (list, "an array"), (dict, "an object"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop must be a string or an array of strings", param="stop", code="invalid_type")
    if len(stops) > STOP_STRINGS_MAX:
        raise ApiError(400, f"at most {STOP_STRINGS_MAX} stop sequences are allowed", param="stop",
                       code="invalid_value")
    return tuple(s for s in stops if s)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def draft_kind(value: Any, param: str) -> str | None:
    """A request's `draft`: one of DRAFT_KINDS, or None when not sent."""
    if value is None or value in DRAFT_KINDS:
        return value
    raise ApiError(400, f"{param} must be one of {', '.join(map(repr, DRAFT_KINDS))} (ngram: speculative decoding "
                        "with drafts from the conversation's own tokens)", param=param, code="invalid_value")


def _opt_int(body: Mapping, key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise ApiError(400, f"{key} must be an integer", param=key, code="invalid_type")
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"between {low} and {high}"
        raise ApiError(400, f"{key} must be {bound}", param=key, code="invalid_value")
    return value


def _opt_number(body: Mapping, key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"{key} must be a number", param=key, code="invalid_type")
    if not low <= value <= high:
        bound = f"at least {low:g}" if math.isinf(high) else f"between {low:g} and {high:g}"
        raise ApiError(400, f"{key} must be {bound}", param=key, code="invalid_value")
    return float(value)


def _opt_bool(body: Mapping, key: str, name: str | None = None) -> bool | None:
    value = body.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise ApiError(400, f"{name or key} must be true or false", param=name or key, code="invalid_type")
