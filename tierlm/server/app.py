"""The HTTP side: routes that validate, enqueue and stream; `create_app` builds one server's app.

Routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /metrics,
GET/POST /v1/adapters, DELETE /v1/adapters/{name}, GET /stats (speed, memory against the budget and
placement, as JSON: stats.py), GET / (the chat page, static/chat.html: never behind the API key, the
calls it makes are), GET /health (never behind the API key), and
POST /debug/worker when test hooks are enabled. The Ollama API (/api/chat, /api/generate, /api/tags,
/api/show, /api/ps, /api/version, with Ollama's bodies and errors) is ollama.py's, on the same worker.
Both take one request path (admission.py: submit_job); this module keeps OpenAI's own: its schema
(schemas.py), the wording of its refusals, its response bodies and server-sent events.
Errors are OpenAI-style bodies: 400 invalid or unsupported input (any JSON shape, depth or
invalid Unicode included), 401 API key, 404 unknown route, 413 body too large, 429 queue full
(with Retry-After), 500 this request's generation failed (the batch it shared goes on), 503 the
worker failed, a pipeline stage is down (`pipeline_unavailable`, with Retry-After, until the
watchdog has restarted it) or the server is shutting down. A streamed response that has begun ends with an
error event instead. A client that leaves before its reply began is logged as 499, without a
traceback.

Shutdown (SIGTERM, SIGINT): requests in flight are answered at once with a 503
`server_shutting_down` (streams with that error event), then the process exits (run.py).

Finish reasons are OpenAI's "stop" and "length", plus "timeout": the request's deadline
(its `timeout` field, else the server's default) passed, and the text is what was generated
until then.

Context limits, as vLLM: a prompt that leaves no room in the context, or a `max_tokens`
(`max_completion_tokens`) larger than the room the prompt leaves, is refused at once with a
400 `context_length_exceeded` that states the numbers (param `messages`/`prompt`, or the
max-tokens parameter). With `serve --context-shift` a chat request drops its oldest exchanges
instead (the system messages kept; `X-Tierlm-Messages-Dropped: N` says how many) until it fits;
its last message alone not fitting, or a /v1/completions prompt, is still refused. An omitted
`max_tokens` means "up to the context" for chat and OpenAI's 16 (or the room left, if less) for
completions; a reply that reaches it ends "length".

Models: the server serves one base model under one name (`--model-name`, else the catalogue
name), and its LoRA variants (`serve --lora NAME=PATH`, or added by POST /v1/adapters) under
theirs; /v1/models lists them all, each variant with its base as "parent". A request picks one
by `model`: the base's name, one of its aliases (`--alias`) or no model at all is the base; any
other name but a ready variant's gets OpenAI's 404 `model_not_found`. Responses carry the served
name, also when the request used an alias. Requests for different variants share decode steps.

Adapters: POST /v1/adapters {"name", "path", "weight"?} loads only an adapter under --adapter-dir
or one the cache knows by name (adapter_sources.py; 403 otherwise), checks it against the base at
once (another base's shape: 400, nothing written), answers 202 and converts it off the serving
thread; GET /v1/adapters shows each one's status and progress; DELETE /v1/adapters/{name} stops
new requests for it at once and drops it when those in flight have ended (adapters.py).

Every request gets one access-log line on stderr when its response ends (access.py), unless
the server runs with `access_log` off (`serve --quiet`).
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from tierlm.distributed.supervisor import RestartPolicy, supervise
from tierlm.server.access import AccessLog
from tierlm.server.admission import (CLIENT_GONE, Budget, Fit, chat_prompt_ids, dropped_header, job_error,
                                     prompt_ids, read_json, require_key, submit_job, whole_reply)
from tierlm.server.adapter_sources import AdapterSources
from tierlm.server.adapters import Variants
from tierlm.server.jobs import DONE, ERROR, TEXT, Job
from tierlm.server.metrics import Metrics, process_memory, store_metrics
from tierlm.server.ollama import router as ollama_routes
from tierlm.server.options import ServerOptions
from tierlm.server.responses import EventStream, Shape, sse, usage
from tierlm.server.schemas import ApiError, GenerationRequest, parse_adapter, parse_chat, parse_completion
from tierlm.server.stats import server_stats
from tierlm.server.worker import DEBUG_ACTIONS, Worker, WorkerSettings

# The chat page loads nothing from elsewhere: it must work offline, and model output never runs as code.
CHAT_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


def create_app(session, options: ServerOptions) -> FastAPI:
    """A FastAPI app serving `session` (runtime.session.Session); its worker starts with the app.

    The routes below are module-level and read what they serve from `request.app.state`."""
    app = FastAPI(title="tierlm", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    state = app.state
    state.session = session
    state.options = options
    state.model_id = options.served_name(session.model_dir)
    state.created = int(time.time())
    state.slots = options.batch_size or session.profile.batch_size
    state.context = session.loaded.max_len
    state.metrics = metrics = Metrics(lambda: _live(state))
    state.worker = Worker(
        session.loaded,
        session.tokenizer,
        WorkerSettings(state.slots, options.max_queue, options.stall_timeout, options.restart_backoff,
                       spill_disk_bytes=options.kv_spill_disk, parallel=options.parallel),
        on_step=metrics.step,
        on_restart=lambda _problem: metrics.restarts.inc(),
        pipeline=_pipeline_supervisor(session, options),
        draft_model=session.draft_model,
    )
    state.drain = state.worker.drain  # run.py: the moment shutdown begins
    state.variants = Variants(session, state.model_id, options.aliases, state.worker, AdapterSources.of(options.adapter_dir))
    _install_error_handlers(app, metrics)
    if options.access_log:
        app.add_middleware(AccessLog)
    app.include_router(_public)
    app.include_router(_api)

    app.include_router(ollama_routes)
    if options.debug_hooks:
        app.include_router(_debug)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    worker = app.state.worker
    worker.start()
    try:
        yield
    finally:
        await run_in_threadpool(worker.stop)


def _pipeline_supervisor(session, options: ServerOptions):
    """The restarter of a pipeline of stages (None for one process), backing off from the
    server's --restart-backoff."""
    return supervise(session.loaded, RestartPolicy(backoff_s=options.restart_backoff))


def _live(state) -> dict[str, float]:
    """The gauges /metrics reads at scrape time."""
    worker = state.worker
    readings = {
        "tierlm_queue_depth": worker.queue_depth,
        "tierlm_active_sequences": worker.active,
        "tierlm_batch_slots": state.slots,
        "tierlm_worker_healthy": 1.0 if worker.health()["status"] == "ok" else 0.0,
        **process_memory(),
        **store_metrics(state.session.loaded.store),
        **_pipeline_readings(worker.pipeline),
    }
    kv = worker.kv_bytes()
    if kv is not None:
        readings['tierlm_kv_cache_bytes{state="reserved"}'], readings['tierlm_kv_cache_bytes{state="used"}'] = kv
    for slot, held in enumerate(worker.slots_held() or []):
        readings[f'tierlm_slot_tokens_held{{slot="{slot}"}}'] = held["tokens"]
    pages = worker.page_stats()
    if pages is not None:
        for state_name in ("used", "free", "shared", "idle"):
            readings[f'tierlm_kv_pages{{state="{state_name}"}}'] = pages[state_name]
        readings["tierlm_kv_preempted_total"] = pages["preempted"]
        readings["tierlm_kv_reclaimed_total"] = pages["reclaimed"]
    spill = worker.spill_stats()
    if spill is not None:
        readings["tierlm_kv_spill_bytes"] = spill["bytes"]
        readings["tierlm_kv_spilled_total"] = spill["spilled"]
        readings["tierlm_kv_restored_total"] = spill["restored"]
    return readings


def _pipeline_readings(pipeline) -> dict[str, float]:
    if pipeline is None:
        return {}
    return {"tierlm_pipeline_up": 0.0 if pipeline.down_reason() else 1.0,
            "tierlm_pipeline_restarts_total": pipeline.restarts}  # fmt: skip


_public = APIRouter()  # /health and the chat page: never behind the API key
_api = APIRouter(dependencies=[Depends(require_key)])
_debug = APIRouter(dependencies=[Depends(require_key)])  # included only when test hooks are on


@_public.get("/health")
async def health(request: Request):
    state = request.app.state
    profile = state.session.profile
    report = state.worker.health()
    report["model"] = state.model_id
    report["profile"] = {"name": profile.name, "context_length": state.context, "batch_size": state.slots,
                         "kv_cache": profile.kv_cache,
                         "quant": profile.quant_resolved or profile.quant, "summary": profile.summary()}
    return JSONResponse(report, status_code=200 if report["status"] == "ok" else 503)


@_public.api_route("/", methods=["GET", "HEAD"])  # HEAD: the liveness check Ollama's own CLI makes
async def chat_page():
    page = resources.files("tierlm.server").joinpath("static").joinpath("chat.html").read_bytes()
    return Response(page, media_type="text/html; charset=utf-8", headers=CHAT_PAGE_HEADERS)


@_api.get("/stats")
async def stats(request: Request):
    return await run_in_threadpool(server_stats, request.app.state)  # reads /proc and the store's ledger


@_api.get("/v1/models")
async def list_models(request: Request):
    state = request.app.state
    variants = [_model_card(v.name, v.created, state.model_id) for v in state.variants.ready()]
    return {"object": "list", "data": [_model_card(state.model_id, state.created), *variants]}


@_api.get("/v1/models/{name:path}")
async def get_model(name: str, request: Request):
    state = request.app.state
    variant = state.variants.resolve(name)
    if variant is None:
        return _model_card(state.model_id, state.created)
    created = next((v.created for v in state.variants.all() if v.name == variant), state.created)
    return _model_card(variant, created, state.model_id)


@_api.get("/v1/adapters")
async def list_adapters(request: Request):
    state = request.app.state
    return {"object": "list", "data": [v.card(state.model_id) for v in state.variants.all()]}


@_api.post("/v1/adapters")
async def add_adapter(request: Request):
    state = request.app.state
    name, path, weight = parse_adapter(await read_json(request, 64 * 1024))
    variant = await run_in_threadpool(state.variants.add, name, path, weight)
    return JSONResponse(variant.card(state.model_id), status_code=202)


@_api.delete("/v1/adapters/{name}")
async def delete_adapter(name: str, request: Request):
    state = request.app.state
    variant = state.variants.remove(name)
    return {"id": variant.name, "object": "adapter", "deleted": True, "status": variant.status}


@_api.get("/metrics")
async def prometheus(request: Request):
    body, content_type = request.app.state.metrics.render()
    return Response(body, media_type=content_type)


@_api.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = request.app.state
    options = state.options
    req = parse_chat(await read_json(request, options.max_body_bytes), max_messages=options.max_messages)
    variant = state.variants.resolve(req.model)
    ids, dropped = await chat_prompt_ids(request, req.messages, _budget(req))
    return dropped_header(await _generate(request, req, ids, chat=True, variant=variant, dropped=dropped), dropped)


@_api.post("/v1/completions")
async def completions(request: Request):
    state = request.app.state
    req = parse_completion(await read_json(request, state.options.max_body_bytes))
    variant = state.variants.resolve(req.model)
    if isinstance(req.prompt, str):
        ids = await prompt_ids(state.session.tokenizer, text=req.prompt)
    else:
        ids = _in_vocabulary(req.prompt, state.session.loaded.config.vocab_size)
    return await _generate(request, req, ids, chat=False, variant=variant)


@_debug.post("/debug/worker")
async def debug_worker(request: Request):
    body = await read_json(request, 4096)
    action = body.get("action") if isinstance(body, dict) else None
    seconds = body.get("seconds", 0) if isinstance(body, dict) else None
    if action not in DEBUG_ACTIONS or not _is_seconds(seconds):  # a bad sleep would kill the worker
        raise ApiError(400, f"action must be one of {', '.join(DEBUG_ACTIONS)}; seconds a number ≥ 0")
    request.app.state.worker.debug(action, float(seconds))
    return {"ok": True}


async def _generate(request: Request, req: GenerationRequest, ids: list[int], *, chat: bool,
                    variant: str | None = None, dropped: int | None = None):
    job = submit_job(request, ids, req.sampling, _budget(req), _Refusals(req.max_tokens_param, chat),
                     timeout=req.timeout, variant=variant, dropped=dropped)
    shape = Shape(chat, variant or request.app.state.model_id, req.include_usage)
    if req.stream:
        return EventStream(_stream(job, shape), on_disconnect=job.cancel)
    return await whole_reply(request, job, lambda text: shape.whole(text, job.finish_reason, _usage(job)))


def _budget(req: GenerationRequest) -> Budget:
    return Budget(req.max_tokens, default=req.default_max_tokens)


@dataclass(frozen=True)
class _Refusals:
    """How the OpenAI routes word what submit_job refuses: as vLLM, `context_length_exceeded` with
    the numbers, naming the parameter the client sent."""

    max_tokens_param: str  # max_tokens or max_completion_tokens
    chat: bool

    def empty_prompt(self) -> ApiError:
        return ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")

    def prompt_too_long(self, fit: Fit) -> ApiError:
        return ApiError(400, f"the prompt is {fit.prompt_tokens} tokens but the context holds {fit.context} "
                             f"(profile {fit.profile!r}); shorten it", param="messages" if self.chat else "prompt",
                        code="context_length_exceeded")

    def budget_too_large(self, fit: Fit) -> ApiError:
        name = self.max_tokens_param
        return ApiError(400, f"{name} is too large: {fit.max_tokens}. The context holds {fit.context} tokens and "
                             f"the prompt takes {fit.prompt_tokens}, so at most {fit.room} can be generated; "
                             f"lower {name} or omit it", param=name, code="context_length_exceeded")


def _model_card(model_id: str, created: int, parent: str | None = None) -> dict:
    card = {"id": model_id, "object": "model", "created": created, "owned_by": "tierlm"}
    if parent is not None:  # a LoRA variant of the base `parent` (as vLLM lists adapters)
        card["parent"] = parent
    return card


def _is_seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e6


def _in_vocabulary(ids: tuple[int, ...], vocab: int) -> list[int]:
    """Token ids (schemas checked they are integers ≥ 0) that the model has embeddings for."""
    bad = next((i for i, token in enumerate(ids) if token >= vocab), None)
    if bad is not None:
        raise ApiError(400, f"prompt[{bad}] is token id {ids[bad]}, outside the vocabulary ({vocab} ids: "
                            f"0 to {vocab - 1})", param="prompt", code="invalid_value")
    return list(ids)


async def _stream(job: Job, shape: Shape):
    if shape.chat:
        yield sse(shape.chunk(None, first=True))
    async for event in job.events():
        if event.kind == TEXT:
            yield sse(shape.chunk(event.value))
        elif event.kind == DONE:
            if event.value == "cancelled":
                return  # the client is gone
            yield sse(shape.chunk(None, event.value))
            if shape.include_usage:
                yield sse(shape.usage_chunk(_usage(job)))
            yield sse("[DONE]")
        elif event.kind == ERROR:
            yield sse(job_error(event).body())


def _usage(job: Job) -> dict:
    return usage(len(job.prompt_ids), job.completion_tokens, job.cached_tokens)


def _install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    def reply(err: ApiError) -> JSONResponse:
        if err.status < 500:  # a job's own failure is counted when it ends (metrics.ended)
            metrics.refused("rejected" if err.status == 429 else "invalid")
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(ApiError)
    async def api_error(_request, err: ApiError):
        return reply(err)

    @app.exception_handler(HTTPException)
    async def http_error(_request, err: HTTPException):
        message = "no such route" if err.status_code == 404 else str(err.detail)
        return reply(ApiError(err.status_code, message, code="not_found" if err.status_code == 404 else None))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_request, _err: ClientDisconnect):
        # The client left while sending its body: the access log's 499 line says so; no traceback.
        return Response(status_code=CLIENT_GONE)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, err: RequestValidationError):
        return reply(ApiError(400, f"invalid request: {err.errors()}"))

    @app.exception_handler(Exception)
    async def internal_error(_request, err: Exception):
        body = ApiError(500, f"internal error: {type(err).__name__}: {err}", kind="server_error").body()
        return JSONResponse(body, status_code=500)
