"""Fitting a conversation into the context by dropping its oldest exchanges: the one policy of
`chat` (runtime/chat.py) and `serve --context-shift` (server/admission.py), so both drop alike.

The leading system messages are always kept. Then, oldest first, a user message goes together
with the assistant reply after it, until the rendered prompt fits or one message is left (the
caller refuses that one if it still does not fit)."""

from __future__ import annotations

from typing import Callable

Messages = list[dict[str, str]]


def drop_oldest(messages: Messages, render: Callable[[Messages], list[int]],
                fits: Callable[[list[int]], bool]) -> tuple[Messages, list[int]]:
    """(the messages kept, their prompt ids): `render` gives a conversation's prompt ids, `fits`
    says whether they leave the room the reply needs."""
    head = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    system, rest = list(messages[:head]), list(messages[head:])
    while True:
        ids = render(system + rest)
        if fits(ids) or len(rest) <= 1:
            return system + rest, ids
        # Drop the oldest exchange: a user message and the assistant reply after it.
        drop = 2 if len(rest) > 2 and rest[1]["role"] == "assistant" else 1
        rest = rest[drop:]
