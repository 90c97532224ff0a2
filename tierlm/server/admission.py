"""What both APIs (OpenAI's in app.py, Ollama's in ollama.py) check before a job is queued: the
API key, the body's size and JSON, the chat template's acceptance, and room in the worker."""

from __future__ import annotations

import asyncio
import hmac

from fastapi import Request

from tierlm.errors import TierlmError
from tierlm.server.jobs import ERROR, TEXT, Event, Job
from tierlm.server.schemas import ApiError, parse_body
from tierlm.server.worker import SHUTTING_DOWN, Worker

RETRY_AFTER_S = 1
CLIENT_GONE = 499  # nginx's "client closed request": for the access log, no client reads it


async def require_key(request: Request) -> None:
    api_key = request.app.state.options.api_key
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "invalid or missing API key (send `Authorization: Bearer <key>`)",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def refusal(worker: Worker) -> ApiError:
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


def encode_chat(tokenizer, messages) -> list[int]:
    try:
        return tokenizer.encode_chat(list(messages), add_generation_prompt=True)
    except TierlmError as err:
        raise ApiError(400, str(err), param="messages", code="invalid_value") from None
    except Exception as err:  # noqa: BLE001 - a template's own checks (e.g. role order) raise anything
        raise ApiError(400, f"the model's chat template refused these messages: {err}", param="messages",
                       code="invalid_value") from None


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


async def collect_text(request: Request, job: Job) -> str | None:
    """A non-streamed job's whole text; None when the client left first (the job is cancelled then,
    freeing its slot at once). A job's own failure raises its ApiError."""

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
    return None if job.finish_reason == "cancelled" else "".join(parts)


def job_error(event: Event) -> ApiError:
    """The API error a job's ERROR event carries."""
    return ApiError(event.status, event.value, kind="server_error", code=event.code)
