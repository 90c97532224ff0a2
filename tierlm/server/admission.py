"""The one request path both APIs (OpenAI's in app.py, Ollama's in ollama.py) share, from the
body to the job and back: the API key, the body's size and JSON, the prompt's token ids (the
chat template's acceptance; with `serve --context-shift`, a chat's oldest exchanges dropped to
fit: `chat_prompt_ids`), `submit_job` (the prompt against the context, the token budget,
the sampling settings with the model's defaults, the deadline, room in the worker) and a
non-streamed reply's text.

A dialect keeps what truly differs: its request schema (its parser maps its sampling fields onto
schemas.Sampling; its handler its token limits onto `Budget`), the wording of what submit_job
refuses (`Refusals`: its clients read the messages), and its reply bodies and streaming framing."""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from tierlm.config import MODEL_SAMPLING_FIELDS, GenerationDefaults
from tierlm.errors import TierlmError
from tierlm.runtime.context_shift import drop_oldest
from tierlm.runtime.sampling import SamplingParams, resolve_sampling
from tierlm.runtime.speculative import DraftSettings
from tierlm.server.access import entry
from tierlm.server.jobs import ERROR, TEXT, Event, Job
from tierlm.server.schemas import ApiError, Sampling, parse_body
from tierlm.server.worker import SHUTTING_DOWN, Worker

RETRY_AFTER_S = 1
DROPPED_HEADER = "X-Tierlm-Messages-Dropped"  # serve --context-shift: messages dropped for the prompt to fit
CLIENT_GONE = 499  # nginx's "client closed request": for the access log, no client reads it


async def require_key(request: Request) -> None:
    api_key = request.app.state.options.api_key
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "invalid or missing API key (send `Authorization: Bearer <key>`)",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def read_json(request: Request, limit: int):
    """The body as checked JSON (schemas.parse_body), refusing more than `limit` bytes (413)
    before reading them all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes; this server accepts at most {limit}",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body exceeds this server's limit of {limit} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    return parse_body(b"".join(chunks))


async def prompt_ids(tokenizer, *, messages=None, text: str | None = None) -> list[int]:
    """A prompt's token ids, computed off the event loop: chat `messages` through the model's chat
    template, else `text` as it is (with what the tokenizer's post-processor adds: BOS for
    Llama-style models)."""
    if messages is not None:
        return await run_in_threadpool(_encode_chat, tokenizer, messages)
    return await run_in_threadpool(tokenizer.encode, text, add_special_tokens=True)


async def chat_prompt_ids(request: Request, messages, budget: Budget) -> tuple[list[int], int | None]:
    """A chat prompt's ids and how many of its messages were dropped to fit (None: the server does
    not shift). With `serve --context-shift` the oldest exchanges go (runtime/context_shift.py,
    as `chat` drops them) until the prompt leaves room for `budget`; without it, or when even the
    last message alone does not fit, submit_job refuses what does not fit."""
    state = request.app.state
    tokenizer = state.session.tokenizer
    if not state.options.context_shift:
        return await prompt_ids(tokenizer, messages=messages), None
    kept, ids = await run_in_threadpool(drop_oldest, list(messages), lambda m: _encode_chat(tokenizer, m),
                                        lambda prompt: budget.fits(len(prompt), state.context))  # fmt: skip
    return ids, len(messages) - len(kept)


def dropped_header(response: Response, dropped: int | None) -> Response:
    """`response` telling its client how many messages were dropped to fit (a shifting server only)."""
    if dropped is not None:
        response.headers[DROPPED_HEADER] = str(dropped)
    return response


def _encode_chat(tokenizer, messages) -> list[int]:
    try:
        return tokenizer.encode_chat(list(messages), add_generation_prompt=True)
    except TierlmError as err:
        raise ApiError(400, str(err), param="messages", code="invalid_value") from None
    except Exception as err:  # noqa: BLE001 - a template's own checks (e.g. role order) raise anything
        raise ApiError(400, f"the model's chat template refused these messages: {err}", param="messages",
                       code="invalid_value") from None


@dataclass(frozen=True)
class Budget:
    """How many tokens a request may generate, in generic terms (each dialect names them its own way)."""

    max_tokens: int | None = None  # the most it asked for; None: not sent
    default: int | None = None  # what an omitted max_tokens means; None: up to the context
    context: int | None = None  # a smaller context it holds itself to (Ollama's num_ctx); None: the served one

    def fits(self, prompt_tokens: int, served: int) -> bool:
        """Whether a prompt this long leaves the room this budget asks: what submit_job admits."""
        room = (self.context or served) - prompt_tokens
        return room > 0 and (self.max_tokens is None or self.max_tokens <= room)


@dataclass(frozen=True)
class Fit:
    """The numbers a refusal of `submit_job` states."""

    prompt_tokens: int
    max_tokens: int | None  # Budget.max_tokens
    context: int  # the context the request is held to
    served: int  # the context this server serves
    profile: str  # the memory profile that sized it

    @property
    def room(self) -> int:
        return self.context - self.prompt_tokens


class Refusals(Protocol):
    """How a dialect words what `submit_job` refuses (400s; its clients read the messages)."""

    def empty_prompt(self) -> ApiError: ...

    def prompt_too_long(self, fit: Fit) -> ApiError: ...

    def budget_too_large(self, fit: Fit) -> ApiError: ...


def submit_job(request: Request, ids: list[int], sampling: Sampling, budget: Budget, refusals: Refusals, *,
               timeout: float | None = None, variant: str | None = None, dropped: int | None = None) -> Job:
    """Queue a generation of `ids` on the worker and return its Job: the one way in for both APIs.

    The prompt must leave room in the context (as vLLM: refused at once, never cut); the token
    budget is what `budget` asks, else its default, at most that room; fields `sampling` leaves
    out take the model's defaults. `timeout`: the request's own deadline in seconds (None: the
    server's). `variant`: the LoRA variant it is generated with (None: the base). `dropped`: the
    messages chat_prompt_ids dropped, for the access log and the metrics once the job is queued.
    A full queue, a down pipeline or a stopping server refuses it (`_not_queued`)."""
    state = request.app.state
    log = entry(request.scope)
    log.prompt_tokens = len(ids)
    if not ids:
        raise refusals.empty_prompt()
    fit = Fit(len(ids), budget.max_tokens, budget.context or state.context, state.context,
              state.session.profile.name)
    if fit.room <= 0:
        raise refusals.prompt_too_long(fit)
    if budget.max_tokens is None:
        tokens = fit.room if budget.default is None else min(budget.default, fit.room)
    elif budget.max_tokens > fit.room:
        raise refusals.budget_too_large(fit)
    else:
        tokens = budget.max_tokens
    params = sampling_params(sampling, tokens, state.session.generation_defaults)
    draft = draft_settings(sampling, state.options.draft)
    timeout = state.options.default_timeout if timeout is None else timeout
    job = Job(ids, params, deadline=None if timeout is None else time.monotonic() + timeout,
              loop=asyncio.get_running_loop(), on_end=state.metrics.ended, variant=variant, draft=draft)
    log.job = job
    if not state.worker.submit(job):
        raise _not_queued(state.worker)
    if dropped:
        log.dropped_messages = dropped
        state.metrics.shifted(dropped)
    return job


def sampling_params(sampling: Sampling, max_new_tokens: int, defaults: GenerationDefaults) -> SamplingParams:
    """The sampler's settings for a request: the fields it sent, the model's `defaults`
    (runtime/model_defaults.py, or `serve`'s flags) for those it left out, and its token budget.
    What the sampler refuses is a 400."""
    try:
        sent = {name: getattr(sampling, name) for name in MODEL_SAMPLING_FIELDS}
        return resolve_sampling(defaults, **sent, max_new_tokens=max_new_tokens, seed=sampling.seed, stop=sampling.stop)
    except TierlmError as err:
        raise ApiError(400, str(err), code="invalid_value") from None


def draft_settings(sampling: Sampling, served: DraftSettings) -> DraftSettings:
    """A request's speculative decoding: the `draft` and `draft_tokens` it sent, the server's
    (`serve --draft`, `--draft-tokens`) for what it left out."""
    if sampling.draft is not None:
        served = DraftSettings(sampling.draft, served.tokens)  # a request names a kind, never a model
    tokens = served.tokens if sampling.draft_tokens is None else sampling.draft_tokens
    return DraftSettings(served.kind, tokens, served.model)  # the parsers bound both: never refused here


def _not_queued(worker: Worker) -> ApiError:
    """Why a job was not queued: the server is stopping or a pipeline stage is down (503), else
    its queue is full (429)."""
    if worker.stopping:
        return ApiError(503, SHUTTING_DOWN, kind="server_error", code="server_shutting_down")
    down = worker.down_reason()
    if down is not None:  # a pipeline stage failed: refused with the reason until it is back
        return ApiError(503, down, kind="server_error", code="pipeline_unavailable",
                        headers={"Retry-After": str(worker.pipeline.retry_after())})
    return ApiError(429, f"the server is busy ({worker.queue_depth} requests queued); retry shortly",
                    kind="rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


async def whole_reply(request: Request, job: Job, body: Callable[[str], dict]) -> Response:
    """A non-streamed reply: `body(text)` once the job has ended, or a bare 499 (for the access log)
    when the client left first; the job is cancelled then, freeing its slot at once. A job's own
    failure raises its ApiError."""

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()

    watcher = asyncio.ensure_future(watch())
    parts: list[str] = []
    try:
        async for event in job.events():
            if event.kind == TEXT:
                parts.append(event.value)
            elif event.kind == ERROR:
                raise job_error(event)
    finally:
        watcher.cancel()
    if job.finish_reason == "cancelled":
        return Response(status_code=CLIENT_GONE)
    return JSONResponse(body("".join(parts)))


def job_error(event: Event) -> ApiError:
    """The API error a job's ERROR event carries."""
    return ApiError(event.status, event.value, kind="server_error", code=event.code)
