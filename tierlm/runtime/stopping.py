"""Stop strings over streamed text: hold back only what could still become a stop string."""

from __future__ import annotations


class StopMatcher:
    """Feed text deltas; get back the text that is safe to emit and whether a stop was hit.

    Text that is a prefix of some stop string stays pending until the next delta decides it,
    so a stop string split across tokens is never half-printed.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self.stops:
            return delta, False
        text = self.pending + delta
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            self.pending = ""
            return text[: min(hits)[0]], True
        keep = self._held_back(text)
        self.pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of text that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
