"""Generation: prefill + decode over a KV cache, streamed as text deltas.

The engine remembers which token ids its cache holds, so a chat turn that extends the
previous conversation only prefills the new tokens. With drafts on (runtime/speculative.py) a
decode step may verify several drafted tokens in one forward; the cache then keeps only the
positions the sequence accepted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from tierlm.errors import TierlmError
from tierlm.runtime.sampling import SamplingParams
from tierlm.runtime.sequence import PREFILL_CHUNK, SequenceState, reusable_prefix
from tierlm.runtime.speculative import DraftPolicy, DraftSettings, PromptLookup, Verification, draft_limit


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose keys/values were already cached
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    finish_reason: str = ""  # "stop" (EOS or stop string), "length" (token limit or full context)
    drafted: int = 0  # tokens drafted for verification (speculative decoding)
    accepted: int = 0  # of those, tokens the target model's verification kept
    verify_passes: int = 0  # forwards that verified drafts (each also yields one token of its own)

    @property
    def prefill_tokens_per_s(self) -> float:
        computed = self.prompt_tokens - self.reused_tokens
        return computed / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes out of prefill; decode steps produce the rest.
        steps = max(self.new_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s and steps else 0.0


@dataclass
class Generation:
    """An in-progress generation: iterate for text deltas; `stats`/`token_ids` fill as it runs."""

    deltas: Iterator[str]
    stats: GenerationStats = field(default_factory=GenerationStats)
    token_ids: list[int] = field(default_factory=list)

    def __iter__(self) -> Iterator[str]:
        return self.deltas

    def text(self) -> str:
        return "".join(self)


class Engine:
    """Owns a model's KV cache and runs one sequence at a time through it."""

    def __init__(self, loaded, tokenizer, cache=None, draft: DraftSettings | None = None, draft_model=None):
        """`draft`: how sequences draft tokens unless `generate` says otherwise (default: off);
        `draft_model`: the loaded DraftModel (runtime/draft_model.py) drafts of kind "model" use."""
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = tokenizer
        self.cache = cache if cache is not None else loaded.new_cache()
        self.cached_ids: list[int] = []
        self.draft = draft or DraftSettings()
        self.draft_model = draft_model
        # What verification passes cost here, per drafter (DraftPolicy): a draft model's include its steps.
        self.pass_costs: dict[str, dict[int, float]] = {}
        # Per drafter: [passes, drafted positions that stood, positions verification decided, steps
        # whose drafter found nothing to draft] (the session records them: runtime/acceptance.py).
        self.drafting_counts: dict[str, list[int]] = {}

    @property
    def context_length(self) -> int:
        return self.cache.max_len

    def reset(self) -> None:
        self.cache.reset()
        self.cached_ids = []

    def generate(self, prompt_ids: list[int], params: SamplingParams, draft: DraftSettings | None = None) -> Generation:
        """Start generating after `prompt_ids`; nothing runs until the result is iterated. `draft`:
        this sequence's drafts (default: the engine's)."""
        if not prompt_ids:
            raise TierlmError("the prompt is empty")
        if len(prompt_ids) >= self.context_length:
            raise TierlmError(
                f"the prompt is {len(prompt_ids)} tokens but the context holds "
                f"{self.context_length}",
                "shorten the prompt, or raise --context (up to the model's maximum)",
            )
        draft = draft or self.draft
        if draft.uses_model and self.draft_model is None:
            raise TierlmError(f"the draft model {draft.model} is not loaded beside this model",
                              "open the model with --draft MODEL, or draft with ngram")  # fmt: skip
        state = SequenceState(prompt_ids, params, self.tokenizer, self.context_length)
        generation = Generation(iter(()), token_ids=state.token_ids)
        generation.deltas = self._run(list(prompt_ids), state, generation.stats, draft)
        return generation

    def _run(self, prompt: list[int], state: SequenceState, stats: GenerationStats,
             draft: DraftSettings) -> Iterator[str]:
        stats.prompt_tokens = len(prompt)
        started = time.perf_counter()
        logits = self._prefill(prompt, stats)
        stats.prefill_s = time.perf_counter() - started
        token = state.sample(logits)
        stats.ttft_s = time.perf_counter() - started
        decode_started = time.perf_counter()
        drafter = self._drafter(prompt, draft)
        drafter_name = draft.model if draft.uses_model else "lookup"
        costs = self.pass_costs.setdefault(drafter_name, {})
        policy = DraftPolicy(draft.tokens, costs) if draft.enabled else None
        verifying: Verification | None = None  # the pass whose rows the next tokens come from
        # When the step or pass that produced the current token(s) began: the policy is told what
        # each one cost, sampling and the caller's own time between tokens included.
        round_started: float | None = None
        while True:
            text, reason = state.accept(token)
            stats.new_tokens = len(state.token_ids)
            if reason is not None:
                if verifying is not None:
                    self._close(verifying, stats, drafter_name)
                stats.finish_reason = reason
                stats.decode_s = time.perf_counter() - decode_started
                if text:
                    yield text
                return
            if text:
                yield text
            if drafter is not None:
                drafter.extend([token])
            if verifying is not None and verifying.standing:  # the next row scores the next draft
                token = verifying.next_token(state)
                continue
            now = time.perf_counter()
            if verifying is not None:
                self._close(verifying, stats, drafter_name)
                spent = now - round_started - drafter.take_overhead()  # a catch-up is paid once, not by the pass
                policy.verified(len(verifying.drafts), verifying.accepted, spent)
                verifying = None
            elif policy is not None and round_started is not None:
                policy.plain_step(now - round_started)
            round_started = now
            drafts = self._drafts(drafter, policy, state, drafter_name) if drafter is not None else []
            if not drafts:
                token = state.sample(self._step([token]))
                continue
            base = len(self.cached_ids)
            verifying = Verification(self._verify([token, *drafts]), drafts, base)
            stats.drafted += len(drafts)
            stats.verify_passes += 1
            token = verifying.next_token(state)

    def _close(self, verification: Verification, stats: GenerationStats, drafter: str) -> None:
        """A pass's tokens are all taken: keep its positions, count what stood."""
        self._keep(verification.kept)
        stats.accepted += verification.accepted
        counts = self.drafting_counts.setdefault(drafter, [0, 0, 0, 0])
        accepted, drafted = verification.accepted, len(verification.drafts)
        counts[0] += 1
        counts[1] += accepted
        counts[2] += accepted + (1 if accepted < drafted else 0)

    def _prefill(self, prompt: list[int], stats: GenerationStats) -> torch.Tensor:
        """Reuse the cached common prefix, run the rest in chunks; logits [V] of the last token."""
        common = reusable_prefix(self.cached_ids, prompt)
        self.cache.trim(common)
        self.cached_ids = prompt[:common]
        stats.reused_tokens = common
        logits = None
        for start in range(common, len(prompt), PREFILL_CHUNK):
            logits = self._step(prompt[start : start + PREFILL_CHUNK])
        return logits

    def _step(self, ids: list[int]) -> torch.Tensor:
        batch = torch.tensor([ids], dtype=torch.long, device=self.loaded.device)
        logits = self.model.forward(batch, self.cache, logits="last")
        self.cached_ids.extend(ids)
        return logits[0, -1]

    def _verify(self, ids: list[int]) -> torch.Tensor:
        """Logits [T, V] of every one of `ids` (a pending token and its drafts), in one forward."""
        batch = torch.tensor([ids], dtype=torch.long, device=self.loaded.device)
        logits = self.model.forward(batch, self.cache, logits="all", as_steps=True)
        self.cached_ids.extend(ids)
        return logits[0]

    def _keep(self, length: int) -> None:
        """Roll the cache back to its first `length` positions (a rejected draft's are not the
        sequence's); the positions past it are rewritten by the next forward."""
        if length < len(self.cached_ids):
            self.cache.trim(length)
            del self.cached_ids[length:]

    def _drafter(self, prompt: list[int], draft: DraftSettings):
        """What drafts for this sequence (None: nothing): the draft model, or prompt lookup."""
        if not draft.enabled:
            return None
        return self.draft_model.drafts_for(prompt) if draft.uses_model else PromptLookup(prompt)

    def _drafts(self, drafter, policy: DraftPolicy, state: SequenceState, name: str) -> list[int]:
        """Tokens to verify after the pending one: as many as the policy allows, the cache has room
        for, and the sequence may still produce (the pass's own token included)."""
        limit = draft_limit(policy.allowed(), self.context_length - len(self.cached_ids),
                            state.params.max_new_tokens - len(state.token_ids))
        if limit <= 0:
            return []
        drafts = drafter.draft(limit)
        if not drafts:  # nothing found where drafting was asked for: a step the drafter cannot speed
            self.drafting_counts.setdefault(name, [0, 0, 0, 0])[3] += 1
        return drafts

