"""Speculative decoding for one sequence: drafts from the sequence's own tokens, verified together.

A draft is a guess at the next few tokens. The target model scores the sequence's pending token
and every drafted one in one forward (one pass over the weight store, streamed blocks included,
for up to k + 1 tokens); each drafted token is then accepted or replaced by the rejection rule
(`Sampler.verify`), so greedy output is the target's and sampled output keeps its distribution.

Drafts come from prompt lookup (`PromptLookup`): the tokens that followed the most recent earlier
occurrence of the sequence's last n tokens — free, and strong where replies quote their prompt
(summaries, extraction, code edits, RAG answers). `DraftPolicy` keeps speculation from costing
more than it gains: it times verification passes against plain steps, shrinks the draft length
when too little is accepted, and pauses drafting (for twice as long each time) when even one
token a pass does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierlm.errors import TierlmError

DRAFT_KINDS = ("off", "ngram")
DEFAULT_DRAFT_TOKENS = 8
MAX_DRAFT_TOKENS = 64  # a verification pass is a prefill chunk: longer drafts are never all accepted
LOOKUP_NGRAMS = (4, 3, 2)  # the last n tokens matched, longest first: one token matches too much


@dataclass(frozen=True)
class DraftSettings:
    """What drafts a sequence: `kind` off or ngram (prompt lookup), at most `tokens` a pass."""

    kind: str = "off"
    tokens: int = DEFAULT_DRAFT_TOKENS

    def __post_init__(self):
        if self.kind not in DRAFT_KINDS:
            raise TierlmError(f"--draft {str(self.kind)[:40]!r} is not a draft source: tierlm drafts from the "
                              "conversation's own tokens (ngram); draft models are not supported yet",
                              "use --draft ngram, or --draft off")  # fmt: skip
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or not 1 <= self.tokens <= MAX_DRAFT_TOKENS:
            raise TierlmError(f"--draft-tokens must be an integer from 1 to {MAX_DRAFT_TOKENS}, "
                              f"not {str(self.tokens)[:30]}",
                              "4-16 suits most text; --draft off turns speculation off")  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.kind != "off"


class PromptLookup:
    """Drafts from the sequence itself: after its last n tokens (n in LOOKUP_NGRAMS), what followed
    their most recent earlier occurrence. An index of where each n-gram's continuation begins keeps
    a lookup O(1) however long the context. Only the sequence's own tokens are added (a draft is
    not, until accepted), so nothing ever needs taking back."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest continuation begins
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            # The grams ending here are indexed as this token arrives, with it as their continuation:
            # the tail's own gram is never its own earlier occurrence.
            end = len(self.tokens)
            for n in LOOKUP_NGRAMS:
                if end >= n:
                    self._next[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def draft(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the tail; [] if none."""
        end = len(self.tokens)
        for n in LOOKUP_NGRAMS:
            start = self._next.get(tuple(self.tokens[end - n : end])) if end >= n else None
            if start is not None:
                return self.tokens[start : start + limit]
        return []


class DraftPolicy:
    """How many tokens to draft next: adapts to the measured worth of verification passes.

    A pass that yields `a + 1` tokens in `t_v` seconds beats plain decoding when
    (a + 1) / t_v > 1 / t_s, t_s being a plain step's time (both smoothed). While it does, the
    draft length grows back to the limit; when it does not, it halves, and below one token
    drafting pauses for a number of steps that doubles at each pause (probing again after it).
    """

    SMOOTHING = 0.3
    PAUSE_STEPS = (8, 512)  # the first pause and the longest

    def __init__(self, limit: int):
        self.limit = limit
        self.length = limit
        self.step_s: float | None = None  # a plain step's smoothed time
        self.worth: float | None = None   # smoothed (tokens a pass) * step_s / pass time
        self.paused = 0
        self.pause_steps = self.PAUSE_STEPS[0]

    def allowed(self) -> int:
        """Tokens the next pass may draft (0: take a plain step). A plain step is measured first."""
        if self.step_s is None or self.paused > 0:
            return 0
        return self.length

    def plain_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else _smooth(self.step_s, seconds, self.SMOOTHING)
        self.paused = max(0, self.paused - 1)

    def verified(self, drafted: int, accepted: int, seconds: float) -> None:
        """A pass of `drafted` tokens of which `accepted` held, in `seconds`."""
        if self.step_s is None or seconds <= 0:
            return
        worth = (accepted + 1) * self.step_s / seconds
        self.worth = worth if self.worth is None else _smooth(self.worth, worth, self.SMOOTHING)
        if accepted == drafted and self.worth >= 1.0:
            self.length = min(self.limit, self.length * 2)
            self.pause_steps = self.PAUSE_STEPS[0]
        elif self.worth < 1.0:
            if self.length > 1:
                self.length = max(1, self.length // 2)
            else:
                self.paused = self.pause_steps
                self.pause_steps = min(self.PAUSE_STEPS[1], self.pause_steps * 2)
                self.length, self.worth = self.limit, None  # the probe after a pause starts afresh


def _smooth(old: float, new: float, weight: float) -> float:
    return (1 - weight) * old + weight * new
