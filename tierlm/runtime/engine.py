"""Generation: prefill + decode over a KV cache, streamed as text deltas.

The engine remembers which token ids its cache holds, so a chat turn that extends the
previous conversation only prefills the new tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from tierlm.errors import TierlmError
from tierlm.runtime.sampling import SamplingParams
from tierlm.runtime.sequence import PREFILL_CHUNK, SequenceState


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose keys/values were already cached
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    finish_reason: str = ""  # "stop" (EOS or stop string), "length" (token limit or full context)

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

    def __init__(self, loaded, tokenizer, cache=None):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = tokenizer
        self.cache = cache if cache is not None else loaded.new_cache()
        self.cached_ids: list[int] = []

    @property
    def context_length(self) -> int:
        return self.cache.max_len

    def reset(self) -> None:
        self.cache.reset()
        self.cached_ids = []

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Start generating after `prompt_ids`; nothing runs until the result is iterated."""
        if not prompt_ids:
            raise TierlmError("the prompt is empty")
        if len(prompt_ids) >= self.context_length:
            raise TierlmError(
                f"the prompt is {len(prompt_ids)} tokens but the context holds "
                f"{self.context_length}",
                "shorten the prompt, or raise --context (up to the model's maximum)",
            )
        state = SequenceState(prompt_ids, params, self.tokenizer, self.context_length)
        generation = Generation(iter(()), token_ids=state.token_ids)
        generation.deltas = self._run(list(prompt_ids), state, generation.stats)
        return generation

    def _run(self, prompt: list[int], state: SequenceState, stats: GenerationStats) -> Iterator[str]:
        stats.prompt_tokens = len(prompt)
        started = time.perf_counter()
        logits = self._prefill(prompt, stats)
        stats.prefill_s = time.perf_counter() - started
        decode_started = time.perf_counter()
        while True:
            token = state.sample(logits)
            if not state.token_ids:
                stats.ttft_s = time.perf_counter() - started
                decode_started = time.perf_counter()
            text, reason = state.accept(token)
            stats.new_tokens = len(state.token_ids)
            if reason is not None:
                stats.finish_reason = reason
                stats.decode_s = time.perf_counter() - decode_started
                if text:
                    yield text
                return
            if text:
                yield text
            logits = self._step([token])

    def _prefill(self, prompt: list[int], stats: GenerationStats) -> torch.Tensor:
        """Reuse the cached common prefix, run the rest in chunks; logits [V] of the last token."""
        common = 0
        for cached, new in zip(self.cached_ids, prompt):
            if cached != new:
                break
            common += 1
        common = min(common, len(prompt) - 1)  # the last prompt token must run to give logits
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
