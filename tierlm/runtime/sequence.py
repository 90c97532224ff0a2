"""One sequence's generation state: the single place that decides sampling, stops and limits.

The CLI engine and the server's batch runner both feed model logits through a
`SequenceState`, so a sequence ends for the same reason, with the same text, on either path
(nano-vllm's `Scheduler.postprocess`). What the callers keep is only what differs between
them: how logits are computed (one cache or a slot in a batch) and where text goes.
"""

from __future__ import annotations

from collections import deque

import torch

# Tokens per prefill step, re-exported: one home in offload/sizes.py, whose workspace charge depends on it.
from tierlm.offload.sizes import PREFILL_CHUNK
from tierlm.runtime.sampling import WHOLE_CONTEXT, Sampler, SamplingParams
from tierlm.runtime.stopping import StopMatcher


class SequenceState:
    """Sampler, stop matcher, stream decoder, repetition-penalty ids and limits of one sequence.

    `sample(logits)` picks the next token; `accept(token)` records it and returns
    (text to emit, finish_reason or None). A finish by EOS or a limit includes the text still
    held back; a stop string drops what follows it. `flush()` releases held-back text for a
    sequence ended from outside (a deadline).
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams, tokenizer, context_length: int,
                 *, sampler: Sampler | None = None, stops: StopMatcher | None = None):
        """`context_length`: tokens the sequence's KV cache holds. `sampler`/`stops`: built from
        `params` unless given (the server builds its own, so a test can inject faults)."""
        self.params = params
        self.sampler = sampler if sampler is not None else Sampler(params)
        self.stops = stops if stops is not None else StopMatcher(params.stop)
        self.decoder = tokenizer.stream_decoder()
        self.eos = frozenset() if params.ignore_eos else tokenizer.eos_token_ids
        self.prompt_tokens = len(prompt_ids)
        self.context_length = context_length
        self.token_ids: list[int] = []
        # The ids the repetition penalty looks back over: the last repeat_last_n of prompt and reply
        # (llama.cpp's and Ollama's window), all of them for -1; None when the penalty is off.
        window = params.penalty_window
        self.recent: deque[int] | None = None
        if window is not None:
            # A window past the context is the whole context (and a huge one no deque size).
            whole = window == WHOLE_CONTEXT or window >= context_length
            self.recent = deque(prompt_ids, maxlen=None if whole else window)

    def sample(self, logits: torch.Tensor) -> int:
        """The next token from logits [V]."""
        seen = torch.tensor(list(self.recent), dtype=torch.long) if self.recent else None
        return self.sampler(logits, seen)

    def verify(self, logits: torch.Tensor, draft: int) -> tuple[int, bool]:
        """The token at a drafted position from its logits [V]: (draft, True) if it stands, else
        (its replacement, False); by the rejection rule (Sampler.verify)."""
        seen = torch.tensor(list(self.recent), dtype=torch.long) if self.recent else None
        return self.sampler.verify(logits, draft, seen)

    def accept(self, token: int) -> tuple[str, str | None]:
        """Record `token`; (text safe to emit, "stop" / "length" / None while it goes on)."""
        self.token_ids.append(token)
        if token in self.eos:
            return self.flush(), "stop"
        text, stopped = self.stops.feed(self.decoder.push(token))
        if stopped:
            return text, "stop"
        # The cache holds the prompt and every token but this one; feeding it needs one more slot.
        cached = self.prompt_tokens + len(self.token_ids) - 1
        if len(self.token_ids) >= self.params.max_new_tokens or cached >= self.context_length:
            return text + self.flush(), "length"
        if self.recent is not None:
            self.recent.append(token)
        return text, None

    def flush(self) -> str:
        """Text still held back: an incomplete character, a possible stop-string prefix (a stop
        string completed by it cuts it there)."""
        tail, _ = self.stops.feed(self.decoder.flush())
        return tail + self.stops.flush()


def reusable_prefix(cached: list[int], tokens: list[int]) -> int:
    """How many of `tokens` a cache holding `cached` keeps: their common prefix, short of the last
    token (which must run again to give logits)."""
    common = 0
    for held, token in zip(cached, tokens):
        if held != token:
            break
        common += 1
    return min(common, len(tokens) - 1)
