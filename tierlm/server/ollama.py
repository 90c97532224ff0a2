"""The Ollama dialect beside the OpenAI one: POST /api/chat, /api/generate, /api/show and GET
/api/tags, /api/ps, /api/version, for Ollama's own clients (its CLI with OLLAMA_HOST, its Python
and JS libraries, Open WebUI, Enchanted, Continue, ...).

Requests take the OpenAI routes' path (admission.py: one submit_job, one sampling mapping) to the
same worker (one batched engine), under the same API key (`Authorization: Bearer KEY`), body,
queue and context limits, metrics and access log; Ollama's own are the schema (ollama_schemas.py),
the wording of refusals, and the replies: NDJSON streams (one JSON object a line, the last with
`done: true`, the finish reason and the counts and durations in nanoseconds) unless `stream` is
false, and errors as `{"error": "..."}`, also as a stream's last line when a reply that has begun
fails. `done_reason` is Ollama's "stop" or "length", or "timeout" when the server's deadline
(`serve --timeout`) ended the reply (its text so far is kept).

Models: the base under its served name and each ready LoRA variant under its own, each as
NAME:latest unless the name has a tag already; a request may name them with or without the tag
(or by an alias). What request fields and options do is in ollama_schemas.py. `keep_alive` is
accepted and has no effect: `tierlm serve` loads its model once and keeps it (and its variants)
until it stops, so /api/ps reports them loaded with no expiry (a far-future `expires_at`, as
Ollama reports a negative keep_alive); a request that only asks to unload the model is refused.
/api/ps adds to each model, under `tierlm`, the device it computes on and its weight bytes per
tier (`{"device": "cuda:0", "weights": {"device": ..., "host": ..., "disk": ...}}`: `tierlm ps`
draws them); Ollama's clients ignore fields they do not know.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from tierlm import __version__
from tierlm.cache.artifact import Artifact
from tierlm.cache.fingerprint import checkpoint_digest
from tierlm.offload.placement import DEVICE
from tierlm.server.admission import (Budget, Fit, chat_prompt_ids, dropped_header, prompt_ids, read_json, require_key,
                                     submit_job, whole_reply)
from tierlm.server.jobs import DONE, ERROR, TEXT, Job
from tierlm.server.ollama_schemas import OllamaOptions, OllamaRequest, parse_chat, parse_generate, parse_model_name
from tierlm.server.responses import EventStream
from tierlm.server.schemas import ApiError

# The Ollama release whose API (docs/api.md) these routes follow: clients compare it to gate features.
OLLAMA_API_VERSION = "0.6.0"
NEVER_EXPIRES = "2318-01-01T00:00:00Z"  # where Ollama's own "kept forever" (keep_alive < 0) lands
LATEST = ":latest"
SHOW_BODY_LIMIT = 64 * 1024


class _OllamaRoute(APIRoute):
    """A route whose refusals (the API key's included) are Ollama's `{"error": "..."}` bodies."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def ollama_errors(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as err:
                if err.status < 500:  # a job's own failure is counted when it ends (metrics.ended)
                    request.app.state.metrics.refused("rejected" if err.status == 429 else "invalid")
                return JSONResponse({"error": err.message}, status_code=err.status, headers=err.headers)

        return ollama_errors


router = APIRouter(route_class=_OllamaRoute, dependencies=[Depends(require_key)])


@router.get("/api/version")
async def version():
    return {"version": OLLAMA_API_VERSION, "tierlm": __version__}


@router.get("/api/tags")
async def tags(request: Request):
    state = request.app.state
    base = await _base_card(state)
    return {"models": [base, *(_variant_card(base, v) for v in state.variants.ready())]}


@router.get("/api/ps")
async def running(request: Request):
    state = request.app.state
    base = await _base_card(state)
    size, vram = _resident_bytes(state)
    device = state.session.loaded.device
    loaded = {**base, "size": size, "size_vram": vram, "expires_at": NEVER_EXPIRES, "context_length": state.context,
              "tierlm": {"device": str(device), "weights": _weights_by_tier(state.session.loaded)}}  # fmt: skip
    variants = []
    for variant in state.variants.ready():
        card = _variant_card(base, variant)
        held = getattr(variant.overlay, "nbytes", 0)
        tier = getattr(variant.overlay, "tier", DEVICE)
        variants.append({**card, "size": held, "size_vram": held if device.type != "cpu" else 0,
                         "expires_at": NEVER_EXPIRES, "context_length": state.context,
                         "tierlm": {"device": str(device), "weights": {tier: held}}})  # fmt: skip
    return {"models": [loaded, *variants]}


@router.post("/api/show")
async def show(request: Request):
    state = request.app.state
    name = parse_model_name(await read_json(request, SHOW_BODY_LIMIT))
    variant = _resolve(state, name)
    base = await _base_card(state)
    card = base
    if variant is not None:
        ready = next((v for v in state.variants.ready() if v.name == variant), None)
        if ready is None:  # removed since
            raise ApiError(404, f"model '{name}' not found", param="model")
        card = _variant_card(base, ready)
    loaded, session = state.session.loaded, state.session
    config = loaded.config
    arch = config.model_type
    defaults = session.generation_defaults
    parameters = {"temperature": defaults.temperature, "top_p": defaults.top_p, "top_k": defaults.top_k,
                  "min_p": defaults.min_p, "repeat_penalty": defaults.repetition_penalty,
                  "repeat_last_n": defaults.repeat_last_n, "num_ctx": state.context}
    return {
        "modelfile": f"# served by tierlm {__version__}\nFROM {card['name']}\n"
                     + "".join(f"PARAMETER {k} {v}\n" for k, v in parameters.items()),
        "parameters": "\n".join(f"{k:<30} {v}" for k, v in parameters.items()),
        "template": session.tokenizer.chat_template or "",  # Jinja, as the model ships it (Ollama's are Go templates)
        "license": "",
        "details": card["details"],
        "model_info": {
            "general.architecture": arch,
            "general.parameter_count": _parameter_count(loaded),
            f"{arch}.context_length": state.context,  # what this server serves, not the model's maximum
            f"{arch}.embedding_length": config.hidden_size,
            f"{arch}.feed_forward_length": config.intermediate_size,
            f"{arch}.block_count": config.num_hidden_layers,
            f"{arch}.attention.head_count": config.num_attention_heads,
            f"{arch}.attention.head_count_kv": config.num_key_value_heads,
            f"{arch}.vocab_size": config.vocab_size,
        },
        "capabilities": ["completion"],
        "modified_at": card["modified_at"],
    }


@router.post("/api/chat")
async def chat(request: Request):
    options = request.app.state.options
    req = parse_chat(await read_json(request, options.max_body_bytes), max_messages=options.max_messages)
    return await _generate(request, req, chat=True)


@router.post("/api/generate")
async def generate(request: Request):
    req = parse_generate(await read_json(request, request.app.state.options.max_body_bytes))
    return await _generate(request, req, chat=False)


_ROUTES = {"/api/chat": "POST", "/api/generate": "POST", "/api/show": "POST", "/api/tags": "GET",
           "/api/ps": "GET", "/api/version": "GET"}
_ABSENT = {  # what Ollama clients call that tierlm does not do, and what to do instead
    "pull": "tierlm does not download models: start `tierlm serve MODEL` with the model you want",
    "embed": "tierlm serves text generation only; it computes no embeddings",
    "embeddings": "tierlm serves text generation only; it computes no embeddings",
}


@router.api_route("/api/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
async def elsewhere(rest: str, request: Request):
    """Anything else under /api/: an Ollama-style error that says what is served (declared last)."""
    path = f"/api/{rest}"
    if path in _ROUTES:
        raise ApiError(405, f"{request.method} {path} is not served: send {_ROUTES[path]} {path}")
    served = ", ".join(f"{method} {route}" for route, method in _ROUTES.items())
    why = _ABSENT.get(rest, f"tierlm's Ollama API has no {path}")
    raise ApiError(404, f"{why} (it serves {served}, and the OpenAI API under /v1)")


# -- generation ------------------------------------------------------------------------------


class _Reply:
    """Builds the objects of one reply: chat's `message` or generate's `response`."""

    def __init__(self, model: str, chat: bool):
        self.model = model
        self.chat = chat

    def part(self, text: str, *, done: bool = False) -> dict:
        body = {"model": self.model, "created_at": _now()}
        body.update({"message": {"role": "assistant", "content": text}} if self.chat else {"response": text})
        body["done"] = done
        return body

    def last(self, job: Job, text: str = "") -> dict:
        """The closing object: the finish reason, token counts and durations (ns) of `job`."""
        received, first, ended = job.received, job.first_token_at, job.ended_at or time.monotonic()
        first = ended if first is None else first
        return {**self.part(text, done=True), "done_reason": job.finish_reason,
                "total_duration": _ns(ended - received),
                "load_duration": 0,  # the model was loaded when the server started
                "prompt_eval_count": len(job.prompt_ids),
                "prompt_eval_duration": _ns(first - received),  # queueing and prefill, until the first token
                "eval_count": job.completion_tokens,
                "eval_duration": _ns(ended - first)}


class _NdjsonStream(EventStream):
    """EventStream's disconnect handling, as newline-delimited JSON (Ollama's streaming)."""

    def __init__(self, lines, on_disconnect):
        super().__init__(lines, on_disconnect)
        self.headers["content-type"] = "application/x-ndjson"


async def _generate(request: Request, req: OllamaRequest, *, chat: bool):
    state = request.app.state
    variant = _resolve(state, req.model)
    reply = _Reply(req.model, chat)
    if req.messages is None and req.prompt is None:
        return _load_only(req, reply)
    options = req.options
    _check_num_ctx(options, state.context, state.session.profile.name)
    budget = Budget(options.num_predict, context=options.num_ctx)
    dropped = None
    if chat:  # serve --context-shift may drop the oldest exchanges to fit
        ids, dropped = await chat_prompt_ids(request, req.messages, budget)
    else:  # a raw prompt is tokenized as /v1/completions tokenizes one; else system and prompt take the template
        ids = await prompt_ids(state.session.tokenizer, messages=req.messages, text=req.prompt)
    job = submit_job(request, ids, options.sampling, budget, _Refusals(options.num_ctx), variant=variant,
                     dropped=dropped)  # the deadline: the server's (`serve --timeout`)
    if req.stream:
        return dropped_header(_NdjsonStream(_stream(job, reply), on_disconnect=job.cancel), dropped)
    return dropped_header(await whole_reply(request, job, lambda text: reply.last(job, text)), dropped)


def _load_only(req: OllamaRequest, reply: _Reply) -> JSONResponse:
    """Ollama's answer to a request with nothing to generate: the model is loaded (it always is here)."""
    if _is_zero_duration(req.keep_alive):
        raise ApiError(400, "tierlm keeps its model loaded for as long as `tierlm serve` runs; stop the server to "
                            "free its memory", param="keep_alive")
    return JSONResponse({**reply.part(""), "done": True, "done_reason": "load"})


def _check_num_ctx(options: OllamaOptions, served: int, profile: str) -> None:
    """num_ctx may lower the context a request is held to, never raise it past the served one."""
    if options.num_ctx is not None and options.num_ctx > served:
        raise ApiError(400, f"num_ctx {options.num_ctx} exceeds the context this server serves, {served} tokens "
                            f"(profile {profile!r}); send num_ctx {served} or less, or start `tierlm serve` with a "
                            "longer --context", param="options.num_ctx")


@dataclass(frozen=True)
class _Refusals:
    """How the Ollama routes word what submit_job refuses, in Ollama's terms (num_ctx, num_predict)."""

    num_ctx: int | None  # the request's own context, if it set one

    def empty_prompt(self) -> ApiError:
        return ApiError(400, "the prompt is empty once tokenized", param="prompt")

    def prompt_too_long(self, fit: Fit) -> ApiError:
        more = "" if fit.context == fit.served else f" or raise num_ctx (up to {fit.served})"
        return ApiError(400, f"the prompt is {fit.prompt_tokens} tokens, which leaves no room in {self._where(fit)}; "
                             f"shorten it{more}", param="messages")

    def budget_too_large(self, fit: Fit) -> ApiError:
        return ApiError(400, f"num_predict {fit.max_tokens} does not fit: the prompt takes {fit.prompt_tokens} of "
                             f"{self._where(fit)}, so at most {fit.room} tokens can be generated; lower num_predict "
                             "(-1: up to the context) or shorten the prompt", param="options.num_predict")

    def _where(self, fit: Fit) -> str:
        return f"num_ctx {fit.context}" if self.num_ctx else f"the context of {fit.context} tokens"


async def _stream(job: Job, reply: _Reply):
    async for event in job.events():
        if event.kind == TEXT:
            yield _line(reply.part(event.value))
        elif event.kind == DONE:
            if event.value != "cancelled":  # else the client is gone
                yield _line(reply.last(job))
        elif event.kind == ERROR:
            yield _line({"error": event.value})


def _line(body: dict) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n"


# -- models ----------------------------------------------------------------------------------


def _resolve(state, name: str) -> str | None:
    """The variant `name` means (None: the base), with or without the `:latest` tag; else a 404."""
    for candidate in dict.fromkeys((name, name.removesuffix(LATEST))):
        try:
            return state.variants.resolve(candidate)
        except ApiError:
            continue
    served = ", ".join(repr(_tagged(n)) for n in [state.model_id, *(v.name for v in state.variants.ready())])
    raise ApiError(404, f"model '{name}' not found; this server serves {served}", param="model")


def _tagged(name: str) -> str:
    """The name as Ollama writes it: with a tag (`:latest` unless it has one)."""
    return name if ":" in name else name + LATEST


async def _base_card(state) -> dict:
    """How /api/tags lists the base; its digest is computed once (it may hash the checkpoint)."""
    if getattr(state, "ollama_base_card", None) is None:
        state.ollama_base_card = await run_in_threadpool(_describe_base, state)
    return state.ollama_base_card


def _describe_base(state) -> dict:
    loaded = state.session.loaded
    source = Path(loaded.artifact_dir or state.session.model_dir)
    name = _tagged(state.model_id)
    return {
        "name": name,
        "model": name,
        "modified_at": _iso(source.stat().st_mtime if source.exists() else state.created),
        "size": _stored_bytes(loaded),
        "digest": _digest(loaded, state.session.model_dir),
        "details": {
            "parent_model": "",
            "format": "tierlm",
            "family": loaded.config.model_type,
            "families": [loaded.config.model_type],
            "parameter_size": _parameter_size(_parameter_count(loaded)),
            "quantization_level": (loaded.weight_format or "unknown").upper(),
        },
    }


def _variant_card(base: dict, variant) -> dict:
    """A LoRA variant: the base's details with the base as parent; the digest names base and adapters."""
    name = _tagged(variant.name)
    adapters = [[str(path), weight] for path, weight in variant.adapters]
    digest = hashlib.sha256(json.dumps({"base": base["digest"], "adapters": adapters}).encode()).hexdigest()
    return {**base, "name": name, "model": name, "modified_at": _iso(variant.created), "digest": digest,
            "size": getattr(variant.overlay, "nbytes", 0), "details": {**base["details"], "parent_model": base["name"]}}


def _digest(loaded, model_dir: Path) -> str:
    """The artifact's content key (sha256 of weights, adapters and quant), else the checkpoint's digest."""
    if loaded.artifact_dir is not None:
        artifact = Artifact.open(Path(loaded.artifact_dir))
        try:
            key = artifact.manifest.get("key")
        finally:
            artifact.close()
        if isinstance(key, str):
            return key
    return checkpoint_digest(Path(model_dir))


def _stored_bytes(loaded) -> int:
    sizes = loaded.sizes
    return int(sum(sizes.nbytes.values())) if sizes is not None else 0


def _parameter_count(loaded) -> int:
    """Elements of the model's matrices (embedding and head included; a tied head counted once)."""
    sizes = loaded.sizes
    if sizes is None:
        return 0
    return int(sum(count for block, count in sizes.params.items() if block not in sizes.aliases))


def _parameter_size(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def _weights_by_tier(loaded) -> dict[str, int]:
    """Weight bytes on each tier (device, host, disk) as the load placed its blocks; a load
    without a plan holds them all where it computes."""
    if loaded.placement is None:
        return {DEVICE: _stored_bytes(loaded)}
    return loaded.placement.block_bytes_by_tier()


def _resident_bytes(state) -> tuple[int, int]:
    """(bytes the base holds in memory: weights and KV cache, of which on the accelerator)."""
    loaded = state.session.loaded
    try:
        held = int(loaded.store.nbytes())
    except (AttributeError, NotImplementedError):
        held = _stored_bytes(loaded)
    kv = state.worker.kv_bytes()
    size = held + (kv[0] if kv else 0)
    if loaded.device.type == "cpu":
        return size, 0
    planned = loaded.store.stats().planned  # tier -> {item: bytes}; empty for a resident store
    return size, int(sum(planned["device"].values())) if "device" in planned else size


def _is_zero_duration(keep_alive) -> bool:
    if keep_alive is None:
        return False
    if not isinstance(keep_alive, str):
        return keep_alive == 0
    return all(float(n) == 0 for n in re.findall(r"\d+\.?\d*|\.\d+", keep_alive))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(int(seconds * 1e9), 0)
