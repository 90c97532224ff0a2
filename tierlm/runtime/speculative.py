"""Speculative decoding for one sequence: drafts from the sequence's own tokens, verified together.

A draft is a guess at the next few tokens. The target model scores the sequence's pending token
and every drafted one in one forward (one pass over the weight store, streamed blocks included,
for up to k + 1 tokens); each drafted token is then accepted or replaced by the rejection rule
(`Sampler.verify`), so greedy output is the target's and sampled output keeps its distribution.

Drafts come from prompt lookup (`PromptLookup`): the tokens that followed the most recent earlier
occurrence of the sequence's last n tokens — free, and strong where replies quote their prompt
(summaries, extraction, code edits, RAG answers). `DraftPolicy` keeps speculation from costing
more than it gains: it times passes of each length against plain steps, drafts the length that
promises the most tokens a second at the acceptance seen, and pauses drafting (for twice as long
each time) when no length beats plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierlm.errors import TierlmError

# What drafts: nothing, prompt lookup, or the best source that costs no memory (today prompt
# lookup); any other --draft names a draft model (runtime/draft_model.py).
DRAFT_KINDS = ("off", "ngram", "auto")
MODEL = "model"
DEFAULT_DRAFT_TOKENS = 8
MAX_DRAFT_TOKENS = 64  # a verification pass is a prefill chunk: longer drafts are never all accepted
LOOKUP_NGRAMS = (4, 3, 2)  # the last n tokens matched, longest first: one token matches too much


@dataclass(frozen=True)
class DraftSettings:
    """What drafts a sequence: `kind` off, ngram (prompt lookup), auto (ngram today) or model (the
    draft model `model` names), at most `tokens` a pass."""

    kind: str = "off"
    tokens: int = DEFAULT_DRAFT_TOKENS
    model: str | None = None  # the draft model as the user named it (kind "model")

    @classmethod
    def parse(cls, source: str | None, tokens: int | None) -> "DraftSettings":
        """--draft SOURCE (a kind, else a draft model's name or path) and --draft-tokens K."""
        tokens = DEFAULT_DRAFT_TOKENS if tokens is None else tokens
        if source is None or source in DRAFT_KINDS:
            return cls(source or "off", tokens)
        return cls(MODEL, tokens, str(source))

    def __post_init__(self):
        if self.kind not in DRAFT_KINDS and not (self.kind == MODEL and self.model):
            raise TierlmError(f"--draft {str(self.kind)[:40]!r} is not a draft source",
                              f"use {', '.join(DRAFT_KINDS)}, or a draft model's name or path")  # fmt: skip
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or not 1 <= self.tokens <= MAX_DRAFT_TOKENS:
            raise TierlmError(f"--draft-tokens must be an integer from 1 to {MAX_DRAFT_TOKENS}, "
                              f"not {str(self.tokens)[:30]}",
                              "4-16 suits most text; --draft off turns speculation off")  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.kind != "off"

    @property
    def uses_model(self) -> bool:
        return self.kind == MODEL


def draft_limit(allowed: int, context_room: int, tokens_left: int) -> int:
    """Tokens the next pass may draft: what the policy `allowed`, within the positions the cache has
    left after the pending token and the tokens the sequence may still produce besides the pass's own."""
    return max(0, min(allowed, context_room - 1, tokens_left - 1))


class Verification:
    """One verification pass in progress: its logits rows, the drafts they check, and how far the
    sequence has come through them. Row i scores the token after the pending one and drafts[:i].
    `base`: the cache positions before the pass (its pending token is at `base`)."""

    def __init__(self, rows, drafts: list[int], base: int):
        self.rows, self.drafts, self.base = rows, drafts, base
        self.row = -1  # the row the last token came from
        self.standing = False  # whether that token was the row's draft, accepted

    def next_token(self, state) -> int:
        """The token of the next row, from `state` (runtime/sequence.py SequenceState): its draft if
        it stands, a replacement, or (after the last draft) the pass's own token."""
        self.row += 1
        if self.row < len(self.drafts):
            token, self.standing = state.verify(self.rows[self.row], self.drafts[self.row])
        else:
            token, self.standing = state.sample(self.rows[self.row]), False
        return token

    @property
    def accepted(self) -> int:
        return self.row + (1 if self.standing else 0)

    @property
    def kept(self) -> int:
        """Cache positions the sequence keeps: the pending token and the accepted drafts before the
        last token (which, as after any step, is not in the cache yet)."""
        return self.base + self.row + 1


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

    def take_overhead(self) -> float:
        """Seconds spent catching up since last asked, which a pass's cost leaves out: none here."""
        return 0.0

    def draft(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the tail; [] if none."""
        end = len(self.tokens)
        for n in LOOKUP_NGRAMS:
            start = self._next.get(tuple(self.tokens[end - n : end])) if end >= n else None
            if start is not None:
                return self.tokens[start : start + limit]
        return []


class DraftPolicy:
    """How many tokens to draft next, from what passes have cost and yielded.

    A pass of k drafts yields E(k) = 1 + a + ... + a^k tokens on average, a being the share of
    drafted positions that stood (smoothed over recent passes), and costs c(k) seconds: measured
    per length and smoothed, interpolated between the lengths measured and taken as flat past the
    longest (c(0) is a plain step). On a CPU a pass of up to four tokens costs about a step and
    one of nine about three; read from disk, every length costs one pass over the weights. The
    next pass drafts the k maximizing E(k) / c(k). When no k beats a plain step by MARGIN,
    drafting pauses for a number of steps that doubles at each pause, then probes again; for the
    longest pause at once when no k would even were every draft to stand. A pass's cost leaves out
    what its drafter spent catching up on the tokens of a pause (`overhead_s`), paid once.
    """

    SMOOTHING = 0.3  # weight of the newest time of a length
    DECAY = 0.8  # weight of older passes in the acceptance counts
    MARGIN = 1.05  # speculation must promise this much more than plain decoding
    PAUSE_STEPS = (8, 512)  # the first pause and the longest
    PRIOR = (1.0, 2.0)  # stood, verified: the acceptance before any pass (a = 0.5)

    def __init__(self, limit: int, costs: dict[int, float] | None = None):
        """`costs`: drafts in a pass -> its smoothed seconds (0: a plain step), shared by the
        sequences of one model (a property of the machine, where acceptance is the text's)."""
        self.limit = limit
        self.costs = {} if costs is None else costs
        self.stood, self.verified_positions = self.PRIOR
        self.paused = 0
        self.pause_steps = self.PAUSE_STEPS[0]
        if 0 in self.costs and len(self.costs) > 1 and self.ceiling() * self.costs[0] < self.MARGIN:
            self.paused = self.PAUSE_STEPS[1]  # the drafter is known not to pay here: no probe at once

    @property
    def acceptance(self) -> float:
        return self.stood / self.verified_positions

    def allowed(self) -> int:
        """Tokens the next pass may draft (0: take a plain step). A plain step is timed first."""
        if 0 not in self.costs or self.paused > 0:
            return 0
        return self.best()[0]

    def best(self) -> tuple[int, float]:
        """(k, expected tokens per second) of the best draft length."""
        return max(((k, self.expected(k) / self.cost(k)) for k in range(1, self.limit + 1)), key=lambda kv: kv[1])

    def ceiling(self) -> float:
        """Tokens a second the best length would give if every draft stood."""
        return max((k + 1) / self.cost(k) for k in range(1, self.limit + 1))

    def expected(self, k: int) -> float:
        a = min(self.acceptance, 1.0)
        return k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def cost(self, k: int) -> float:
        if k in self.costs:
            return self.costs[k]
        below = max(length for length in self.costs if length < k)
        above = [length for length in self.costs if length > k]
        if not above:
            return self.costs[below]
        up = min(above)
        share = (k - below) / (up - below)
        return self.costs[below] + share * (self.costs[up] - self.costs[below])

    def plain_step(self, seconds: float) -> None:
        self._time(0, seconds)
        self.paused = max(0, self.paused - 1)

    def verified(self, drafted: int, accepted: int, seconds: float) -> None:
        """A pass of `drafted` tokens of which `accepted` stood took `seconds`, its tokens' sampling
        included."""
        if drafted < 1 or 0 not in self.costs:
            return
        self._time(drafted, seconds)
        checked = accepted + (1 if accepted < drafted else 0)  # the positions verification decided
        self.stood = self.DECAY * self.stood + accepted
        self.verified_positions = self.DECAY * self.verified_positions + checked
        if self.best()[1] * self.costs[0] < self.MARGIN:
            # Drafts that would not pay even were every one to stand (a draft model as slow as the
            # target) pause for the longest; others for twice as long as the last time.
            hopeless = self.ceiling() * self.costs[0] < self.MARGIN
            self.paused = self.PAUSE_STEPS[1] if hopeless else self.pause_steps
            self.pause_steps = min(self.PAUSE_STEPS[1], self.pause_steps * 2)
        else:
            self.pause_steps = self.PAUSE_STEPS[0]

    def _time(self, drafted: int, seconds: float) -> None:
        if seconds > 0:
            old = self.costs.get(drafted)
            self.costs[drafted] = seconds if old is None else _smooth(old, seconds, self.SMOOTHING)


def _smooth(old: float, new: float, weight: float) -> float:
    return (1 - weight) * old + weight * new
