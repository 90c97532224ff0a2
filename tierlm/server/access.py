"""The access log: one line per request on stderr, written when the response has ended.

    127.0.0.1 "POST /v1/chat/completions" 200 prompt=12 completion=20 0.84s

A streamed response is logged when its stream ends, so its token counts are final. Routes
that generate nothing (and requests refused before tokenizing) show `prompt=- completion=-`.
A chat request whose oldest messages `serve --context-shift` dropped to fit adds `dropped=N`.
uvicorn's own access log stays off (run.py), so each request has exactly one line.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from typing import Callable

SCOPE_KEY = "tierlm.access"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass
class Entry:
    """What a handler tells the log about its request: the prompt's length and the job."""

    prompt_tokens: int | None = None
    job: object | None = None  # jobs.Job: its counts are read when the line is written
    dropped_messages: int = 0  # messages dropped for the prompt to fit (serve --context-shift)

    def counts(self) -> tuple[int | None, int | None]:
        if self.job is None:
            return self.prompt_tokens, None
        return len(self.job.prompt_ids), self.job.completion_tokens


def entry(scope: dict) -> Entry:
    """The log entry of the request in `scope` (a detached one when the log is off)."""
    return scope.get(SCOPE_KEY) or Entry()


def line(client: str, method: str, path: str, status: int, prompt: int | None, completion: int | None,
         seconds: float, dropped: int = 0) -> str:
    shown = ["-" if n is None else str(n) for n in (prompt, completion)]
    path = _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", path)  # a decoded %0A must not start a forged line
    shift = f" dropped={dropped}" if dropped else ""
    return f'{client} "{method} {path}" {status} prompt={shown[0]} completion={shown[1]}{shift} {seconds:.2f}s'


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)  # sys.stderr looked up per line: it may be replaced


class AccessLog:
    """ASGI middleware writing `line(...)` for every HTTP request once its response is done."""

    def __init__(self, app, write: Callable[[str], None] = _stderr):
        self.app = app
        self.write = write

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        note = scope[SCOPE_KEY] = Entry()
        status = 500  # unless a response starts: an exception escaped the app

        async def send_noting_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            client = scope.get("client")
            self.write(line(client[0] if client else "-", scope["method"], scope["path"], status,
                            *note.counts(), time.monotonic() - started, note.dropped_messages))
