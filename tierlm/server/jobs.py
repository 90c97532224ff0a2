"""A job: one request on its way through the worker, and the bridge back to its HTTP handler.

The worker thread calls `emit_text` / `finish` / `fail`; they post events onto the handler's
asyncio loop. The first `finish`/`fail` wins and closes the job, so a worker that was
declared dead (or a handler that gave up at the deadline) can no longer write to it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

# After its deadline the handler waits this long for the worker's own "timeout" ending before
# ending the request itself (a stalled worker must not hang the client).
DEADLINE_GRACE_S = 2.0

TEXT, DONE, ERROR = "text", "done", "error"


@dataclass
class Event:
    kind: str  # TEXT, DONE or ERROR
    value: str  # the text delta, the finish reason, or the error message
    status: int = 503  # ERROR only: the HTTP status and error code the client gets
    code: str | None = "worker_failed"


class Job:
    """Prompt ids + sampling settings in; text deltas and one ending out.

    Endings (`finish_reason`): "stop", "length", "timeout" (deadline passed; the text so far is
    kept), "cancelled" (the client went away), or an error (`error` holds the message).
    """

    _ids = itertools.count(1)

    def __init__(
        self,
        prompt_ids: list[int],
        params,
        *,
        deadline: float | None,
        loop: asyncio.AbstractEventLoop,
        on_end: Callable[["Job"], None] | None = None,
        variant: str | None = None,
        draft=None,
    ):
        """`params`: SamplingParams. `deadline`: time.monotonic() value, or None for none.
        `on_end` runs once, in whichever thread ends the job (metrics). `variant`: the LoRA
        variant it is generated with (None: the base). `draft`: its DraftSettings (None: off)."""
        self.number = next(self._ids)
        self.variant = variant
        self.draft = draft
        self.prompt_ids = prompt_ids
        self.params = params
        self.deadline = deadline
        self.received = time.monotonic()
        self.first_token_at: float | None = None
        self.ended_at: float | None = None
        self.completion_tokens = 0  # tokens generated so far (the worker counts them live)
        self.cached_tokens = 0  # prompt tokens whose keys and values a slot still held (not prefilled)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._on_end = on_end
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self.wake: Callable[[], None] | None = None  # set by the worker: a cancel wakes it at once

    # -- worker side ---------------------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def closed(self) -> bool:
        return self.ended_at is not None

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def emit_text(self, text: str) -> None:
        if text and not self.closed:
            self._post(Event(TEXT, text))

    def finish(self, reason: str, completion_tokens: int | None = None) -> bool:
        """End with a finish reason; False if the job had already ended."""
        return self._end(Event(DONE, reason), reason, None, completion_tokens)

    def fail(self, message: str, *, status: int = 503, code: str | None = "worker_failed") -> bool:
        """End with an error the client sees (`status`: 503 when the server, not the request, failed);
        False if the job had already ended."""
        return self._end(Event(ERROR, message, status, code), "error", message, None)

    def _end(self, event: Event, reason: str, error: str | None, tokens: int | None) -> bool:
        with self._lock:
            if self.ended_at is not None:
                return False
            self.ended_at = time.monotonic()
            self.finish_reason, self.error = reason, error
            if tokens is not None:
                self.completion_tokens = tokens
        self._post(event)
        if self._on_end is not None:
            self._on_end(self)
        return True

    def _post(self, event: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is listening
            pass

    # -- handler side --------------------------------------------------------------------

    def cancel(self) -> None:
        """The client is gone: the worker drops the job (and frees its slot) at its next step."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        self.finish("cancelled")
        if self.wake is not None:
            self.wake()

    async def events(self) -> AsyncIterator[Event]:
        """Text events, then exactly one DONE or ERROR event.

        Past the deadline (plus a grace period for the worker's own ending) the job is ended
        here with "timeout", so a stalled worker never hangs the client.
        """
        while True:
            wait = None
            if self.deadline is not None:
                wait = max(self.deadline - time.monotonic(), 0.0) + DEADLINE_GRACE_S
            try:
                event = await asyncio.wait_for(self._queue.get(), wait)
            except asyncio.TimeoutError:
                self._cancelled.set()
                self.finish("timeout")
                event = await self._queue.get()  # whichever ending won
            yield event
            if event.kind != TEXT:
                return
