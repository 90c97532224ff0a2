"""OpenAI response bodies (whole and streamed) and the server-sent-events response."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Callable

from starlette.responses import StreamingResponse


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens not prefilled again."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(data: dict | str) -> str:
    """One server-sent event carrying `data` (JSON, or a literal like "[DONE]")."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


class Shape:
    """Builds the bodies of one response: chat.completion(.chunk) or text_completion."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False):
        self.chat = chat
        self.model = model
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def whole(self, text: str, finish_reason: str, usage_: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage_
        return body

    def chunk(self, text: str | None, finish_reason: str | None = None, *, first: bool = False) -> dict:
        """A streamed piece: `text` (None for the closing chunk) and, on the last, the finish reason."""
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if text is not None and not first:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        if self.include_usage:
            body["usage"] = None  # as OpenAI: null in every chunk but the usage chunk
        return body

    def usage_chunk(self, usage_: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = usage_
        return body


class EventStream(StreamingResponse):
    """`text/event-stream` over an async iterator of events; calls `on_disconnect` the moment
    the client goes away (not at the next write), so its job's slot is freed at once."""

    def __init__(self, events: AsyncIterator[str], on_disconnect: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            await self.stream_response(send)
        except OSError:  # the connection broke while writing
            self.on_disconnect()
        finally:
            watcher.cancel()

    async def _watch(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.on_disconnect()
                return
