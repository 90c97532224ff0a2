"""Sampling settings and a sampler: greedy, temperature, top-k, top-p, repetition penalty, seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierlm.errors import TierlmError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. temperature 0 means greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # decode to max_new_tokens regardless (benchmarks: equal-length runs)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise TierlmError("max_new_tokens must be at least 1")
        if self.temperature < 0:
            raise TierlmError("temperature must be ≥ 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise TierlmError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise TierlmError("top_k must be ≥ 0 (0 = off)")
        if self.repetition_penalty <= 0:
            raise TierlmError("repetition_penalty must be > 0 (1 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Picks token ids from logits; owns the random generator so a seed reproduces a run."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> int:
        """Next token from logits [V] (fp32); `seen` [N] holds ids the repetition penalty applies to."""
        p = self.params
        if p.repetition_penalty != 1.0 and seen is not None and seen.numel():
            logits = penalize_repetition(logits, seen, p.repetition_penalty)
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k:
            logits = keep_top_k(logits, p.top_k)
        if p.top_p < 1.0:
            logits = keep_top_p(logits, p.top_p)
        probs = torch.softmax(logits.float().cpu(), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty (as transformers applies it): divide positive logits, multiply negative."""
    picked = logits.gather(0, seen)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return logits.scatter(0, seen, picked)


def keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k >= logits.shape[-1]:
        return logits
    threshold = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def keep_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches top_p (at least one)."""
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the mass before it already reaches top_p.
    drop = (probs.cumsum(dim=-1) - probs) >= top_p
    drop[0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter_(0, order, drop), float("-inf"))
