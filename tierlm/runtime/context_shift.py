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
    says whether they leave the room the reply needs.

    The first cut that fits is found by bisection (a conversation never renders longer for
    losing messages): a server's 512-message request renders ~10 times, not 256 (a minute of
    tokenizing for a 1 MiB body)."""
    head = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    system, rest = list(messages[:head]), list(messages[head:])
    cuts = _cuts(rest)
    rendered: dict[int, list[int]] = {}

    def ids(index: int) -> list[int]:
        if index not in rendered:
            rendered[index] = render(system + rest[cuts[index]:])
        return rendered[index]

    if fits(ids(0)):  # the usual case: nothing to drop, one rendering
        return system + rest, ids(0)
    low, high = min(1, len(cuts) - 1), len(cuts) - 1  # the last cut is taken even if it does not fit
    while low < high:
        middle = (low + high) // 2
        if fits(ids(middle)):
            high = middle
        else:
            low = middle + 1
    return system + rest[cuts[low]:], ids(low)


def _cuts(rest: Messages) -> list[int]:
    """Where the kept messages may begin, oldest exchange dropped first: a user message and the
    assistant reply after it go together; one message is always left."""
    cuts, start = [0], 0
    while len(rest) - start > 1:
        after = rest[start + 1 :]
        start += 2 if len(after) > 1 and after[0]["role"] == "assistant" else 1
        cuts.append(start)
    return cuts
