"""Request bodies of the Ollama API (/api/chat, /api/generate, /api/show), validated by hand.

Every refusal is an ApiError (the Ollama routes write it as `{"error": "..."}`) naming the
field, so a client never gets a 422 or a 500 for its input. Policy, as for the OpenAI routes:
what tierlm honours is parsed; a field or option that would change the output in a way tierlm
cannot follow is accepted only at its neutral value and refused otherwise; options that only
steer Ollama's own runner (threads, GPU layers, mmap, batch size: tierlm's profile decides
those) are accepted and have no effect here, as they have none on the text.

Options and what they become (omitted ones take the model's defaults, generation_config.json,
as on the OpenAI routes; not Ollama's built-in defaults):
  temperature, top_p, top_k, min_p, seed  the sampler's own; seed -1 means "random", as in Ollama
  num_predict   the reply's token budget; -1 and -2 (Ollama's "no limit", "fill the context"):
                up to the context
  num_ctx       the context for this request, prompt and reply together: at most the served
                context; smaller caps the budget
  stop          stop strings (at most STOP_STRINGS_MAX)
  repeat_penalty, repeat_last_n  the sampler's repetition penalty, over the last repeat_last_n
                tokens of prompt and reply (0: off, -1: all of them, as in Ollama)
  draft, draft_tokens  tierlm's: speculative decoding for this request ("off", "ngram" or "auto";
                the most tokens drafted a pass), whatever `serve --draft` says
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from tierlm.runtime.speculative import MAX_DRAFT_TOKENS
from tierlm.server.schemas import SEED_RANGE, ApiError, Sampling, draft_kind

STOP_STRINGS_MAX = 16  # Ollama sets no limit; a model's own stops rarely number more than a few
RANDOM_SEED = -1  # Ollama's default seed: a new random seed per request
UNLIMITED_PREDICT = (-1, -2)  # num_predict: "no limit", "fill the context"
# Go's time.ParseDuration syntax ("5m", "1h30m", "-1s"), which Ollama's keep_alive takes, or a number of seconds.
_DURATION = re.compile(r"^-?(\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)((\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h))*$")

# Options that change what is generated in ways tierlm's sampler does not have: accepted at these values only.
_NEUTRAL_OPTIONS: dict[str, tuple[Any, ...]] = {
    "typical_p": (1, 1.0),
    "tfs_z": (1, 1.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "mirostat": (0,),
    "vocab_only": (False,),
    "logits_all": (False,),
    "embedding_only": (False,),
}
# Options with no effect on the text here: how Ollama's runner uses the hardware (tierlm's profile
# and planner decide that), mirostat's parameters while mirostat is off (checked), penalize_newline
# (Ollama itself ignores it since its new engine), num_keep (what a context shift keeps: tierlm
# refuses a prompt that does not fit, or with `serve --context-shift` drops whole exchanges, keeping
# the system messages).
_NO_EFFECT_OPTIONS = frozenset({"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "use_mmap",
                                "use_mlock", "num_thread", "num_keep", "mirostat_tau", "mirostat_eta",
                                "penalize_newline"})
_SAMPLING_OPTIONS = frozenset({"temperature", "top_p", "top_k", "min_p", "seed", "num_predict", "num_ctx", "stop",
                               "repeat_penalty", "repeat_last_n", "draft", "draft_tokens"})

# Top-level fields accepted only at these values (None = absent).
_NEUTRAL_FIELDS: dict[str, tuple[Any, ...]] = {
    "format": (None, ""),
    "tools": (None, []),
    "think": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "images": (None, []),
    "suffix": (None, ""),
    "template": (None, ""),
    "context": (None, []),
    "width": (None,),
    "height": (None,),
    "steps": (None,),
}
_WHY_NOT = {
    "format": "tierlm has no constrained decoding (JSON mode or a schema); ask for JSON in the prompt instead",
    "tools": "tierlm does not run tool calls",
    "think": "tierlm does not separate a model's thinking from its reply",
    "logprobs": "tierlm does not return log-probabilities",
    "top_logprobs": "tierlm does not return log-probabilities",
    "images": "tierlm serves text-only models",
    "suffix": "tierlm does not fill in the middle",
    "template": "tierlm renders prompts with the model's own chat template; send `raw: true` with a prompt "
                "you formatted yourself instead",
    "context": "send the conversation as messages to /api/chat instead",
    "width": "tierlm does not generate images",
    "height": "tierlm does not generate images",
    "steps": "tierlm does not generate images",
}
_COMMON_FIELDS = frozenset({"model", "stream", "options", "keep_alive"})
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "format", "tools", "think", "logprobs", "top_logprobs"}
_GENERATE_FIELDS = _COMMON_FIELDS | {"prompt", "system", "raw"} | set(_NEUTRAL_FIELDS)
_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class OllamaOptions:
    """The `options` a request sets, validated; None = not set (the model's default)."""

    sampling: Sampling = Sampling()  # temperature, top_p, top_k, min_p, repeat_penalty, repeat_last_n, seed, stop
    num_predict: int | None = None  # None: up to the context (also for -1 and -2)
    num_ctx: int | None = None


@dataclass(frozen=True)
class OllamaRequest:
    """A /api/chat or /api/generate request: `messages` for a chat (or a templated generate),
    `prompt` for a raw generate; neither when the request only asks for the model to be loaded."""

    model: str
    messages: tuple[dict, ...] | None
    prompt: str | None
    stream: bool
    options: OllamaOptions
    keep_alive: str | float | None


def parse_chat(body: Any, *, max_messages: int) -> OllamaRequest:
    """Validate a /api/chat body; an empty `messages` asks only that the model be loaded."""
    body = _object(body)
    _check_fields(body, _CHAT_FIELDS)
    messages = body.get("messages")
    if messages is None:
        messages = []
    if not isinstance(messages, list):
        raise ApiError(400, "messages must be an array of {role, content} objects", param="messages")
    if len(messages) > max_messages:
        raise ApiError(400, f"{len(messages)} messages exceed this server's limit of {max_messages}",
                       param="messages")
    parsed = tuple(_message(m, i) for i, m in enumerate(messages))
    return _request(body, messages=parsed or None, prompt=None)


def parse_generate(body: Any) -> OllamaRequest:
    """Validate a /api/generate body. Not raw: `system` and `prompt` become a system and a user
    message rendered with the model's chat template (as Ollama renders its template). Raw: the
    prompt is tokenized as it is. An empty prompt asks only that the model be loaded."""
    body = _object(body)
    _check_fields(body, _GENERATE_FIELDS)
    prompt = _optional_str(body, "prompt") or ""
    system = _optional_str(body, "system") or ""
    raw = body.get("raw")
    if raw is not None and not isinstance(raw, bool):
        raise ApiError(400, "raw must be true or false", param="raw")
    if raw and system:
        raise ApiError(400, "system cannot be combined with raw: a raw prompt is used exactly as sent; write the "
                            "system text into the prompt yourself, or drop raw", param="system")
    if not prompt:
        return _request(body, messages=None, prompt=None)
    if raw:
        return _request(body, messages=None, prompt=prompt)
    messages = ({"role": "system", "content": system},) if system else ()
    return _request(body, messages=(*messages, {"role": "user", "content": prompt}), prompt=None)


def parse_model_name(body: Any) -> str:
    """The model a /api/show body names (`model`, or the older `name`)."""
    body = _object(body)
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model is required: the name of a model /api/tags lists", param="model")
    return name


def _request(body: dict, *, messages, prompt) -> OllamaRequest:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    return OllamaRequest(model=_model(body), messages=messages, prompt=prompt,
                         stream=True if stream is None else stream,  # Ollama streams unless told not to
                         options=_options(body.get("options")), keep_alive=_keep_alive(body.get("keep_alive")))


def _object(value: Any) -> dict:
    if not isinstance(value, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return value


def _check_fields(body: dict, known: frozenset) -> None:
    for key, value in body.items():
        if key not in known:
            raise ApiError(400, f"unknown field {key!r}: tierlm's Ollama API does not take it", param=key)
        if key in _NEUTRAL_FIELDS and not _is_one_of(value, _NEUTRAL_FIELDS[key]):
            raise ApiError(400, f"{key} is not supported: {_WHY_NOT[key]}", param=key)


def _is_one_of(value: Any, allowed: tuple) -> bool:
    return any(value is ok or (type(value) is type(ok) and value == ok) or
               (isinstance(ok, float) and _is_number(value) and value == ok) for ok in allowed)


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: the name of a model /api/tags lists", param="model")
    return model


def _optional_str(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"{key} must be a string", param=key)
    return value


def _message(message: Any, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ApiError(400, f"{where} must be an object with role and content", param=where)
    role = message.get("role")
    if role not in _ROLES:
        shown = role if isinstance(role, str) else type(role).__name__
        raise ApiError(400, f"{where}.role {shown!r} is not supported (use system, user or assistant; tierlm "
                            "does not run tools)", param=f"{where}.role")
    content = message.get("content")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ApiError(400, f"{where}.content must be a string", param=f"{where}.content")
    for key, value in message.items():
        if key in ("role", "content"):
            continue
        if key in ("images", "tool_calls", "thinking", "tool_name"):
            if value not in (None, [], ""):
                why = "tierlm serves text-only models" if key == "images" else "tierlm does not run tools or " \
                      "separate thinking"
                raise ApiError(400, f"{where}.{key} is not supported: {why}", param=f"{where}.{key}")
            continue
        raise ApiError(400, f"unknown field {where}.{key!r}", param=f"{where}.{key}")
    return {"role": role, "content": content}


def _keep_alive(value: Any) -> str | float | None:
    """Checked for form only: the model stays loaded for as long as `tierlm serve` runs."""
    if value is None or (_is_number(value) and math.isfinite(value)):
        return value
    if isinstance(value, str) and (_DURATION.match(value) or _is_number_text(value)):
        return value
    raise ApiError(400, f"keep_alive {str(value)[:40]!r} is not a duration: use a number of seconds or a "
                        "duration such as \"5m\" or \"1h\"", param="keep_alive")


def _is_number_text(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _options(options: Any) -> OllamaOptions:
    if options is None:
        return OllamaOptions()
    if not isinstance(options, dict):
        raise ApiError(400, "options must be an object such as {\"temperature\": 0}", param="options")
    for key, value in options.items():
        if value is None or key in _SAMPLING_OPTIONS or key in _NO_EFFECT_OPTIONS:
            continue
        if key in _NEUTRAL_OPTIONS:
            if not _is_one_of(value, _NEUTRAL_OPTIONS[key]):
                neutral = _NEUTRAL_OPTIONS[key][0]
                raise ApiError(400, f"option {key} is not supported by tierlm's sampler (accepted only as "
                                    f"{str(neutral).lower()}, which leaves it off)", param=f"options.{key}")
            continue
        raise ApiError(400, f"unknown option {key!r}", param=f"options.{key}")
    for key in ("mirostat_tau", "mirostat_eta"):
        _number(options, key, 0.0, math.inf)
    penalty = _number(options, "repeat_penalty", 0.0, math.inf)
    if penalty == 0:
        raise ApiError(400, "option repeat_penalty must be greater than 0 (1 = off)", param="options.repeat_penalty")
    window = _integer(options, "repeat_last_n", -1)
    top_p = _number(options, "top_p", 0.0, 1.0)
    if top_p == 0:
        raise ApiError(400, "option top_p must be greater than 0 and at most 1 (for greedy decoding send "
                            "temperature 0)", param="options.top_p")
    predict = _integer(options, "num_predict", -2)
    if predict == 0:
        raise ApiError(400, "option num_predict must be at least 1 (or -1: up to the context)",
                       param="options.num_predict")
    seed = _integer(options, "seed", SEED_RANGE[0], SEED_RANGE[1])
    temperature = _number(options, "temperature", 0.0, math.inf)
    top_k = _integer(options, "top_k", 0)
    min_p = _number(options, "min_p", 0.0, 1.0)
    num_ctx = _integer(options, "num_ctx", 1)
    sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=penalty,
                        repeat_last_n=window, seed=None if seed == RANDOM_SEED else seed,
                        stop=_stop(options.get("stop")), draft=draft_kind(options.get("draft"), "options.draft"),
                        draft_tokens=_integer(options, "draft_tokens", 1, MAX_DRAFT_TOKENS))
    return OllamaOptions(sampling, num_predict=None if predict in UNLIMITED_PREDICT else predict, num_ctx=num_ctx)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(options: dict, key: str, low: float, high: float) -> float | None:
    value = options.get(key)
    if value is None:
        return None
    if not _is_number(value) or not math.isfinite(value):
        raise ApiError(400, f"option {key} must be a number", param=f"options.{key}")
    if not low <= value <= high:
        bound = f"at least {low:g}" if math.isinf(high) else f"between {low:g} and {high:g}"
        raise ApiError(400, f"option {key} must be {bound}", param=f"options.{key}")
    return float(value)


def _integer(options: dict, key: str, low: int, high: int | None = None) -> int | None:
    value = options.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_number(value) or not isinstance(value, int):
        raise ApiError(400, f"option {key} must be an integer", param=f"options.{key}")
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"between {low} and {high}"
        raise ApiError(400, f"option {key} must be {bound}", param=f"options.{key}")
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "option stop must be a string or an array of strings", param="options.stop")
    if len(stops) > STOP_STRINGS_MAX:
        raise ApiError(400, f"at most {STOP_STRINGS_MAX} stop strings are allowed", param="options.stop")
    return tuple(s for s in stops if s)
