"""Sampling settings and a sampler: greedy, temperature, top-k, top-p, min-p, repetition penalty
over the last N tokens, seed; and `resolve_sampling`, which fills what the user left unset from
the model's defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tierlm.config import GenerationDefaults
from tierlm.errors import TierlmError

# Temperatures below this sample as greedy: dividing logits by less would overflow fp32 or, at
# best, put all the mass on the top token anyway.
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
# The repetition penalty is applied clamped to this range: beyond it fp32 logits overflow or
# vanish alike (a penalty of 1e-300 would divide a positive logit by zero).
PENALTY_CLAMP = (1e-30, 1e30)
WHOLE_CONTEXT = -1  # repeat_last_n: penalize every token of the prompt and reply (llama.cpp's, Ollama's -1)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. temperature 0 means greedy.

    Any finite temperature ≥ 0 is accepted; below GREEDY_BELOW (1e-5) it samples as greedy.
    Any finite repetition_penalty > 0 is accepted (applied clamped to PENALTY_CLAMP), over the
    last `repeat_last_n` tokens of prompt and reply (0: off, -1: all of them, as in llama.cpp and
    Ollama); a seed must lie in SEED_RANGE, torch's, and is refused outside it rather than wrapped.

    The field defaults are neutral (no filter, logits unscaled); what a run uses where the user
    says nothing is the model's, through `resolve_sampling`.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0  # keep tokens with probability ≥ min_p × the top token's (0 = off)
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64  # tokens the penalty looks back over; 0 = off, -1 = the whole context
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # decode to max_new_tokens regardless (benchmarks: equal-length runs)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise TierlmError("max_new_tokens must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise TierlmError(f"temperature must be a finite number ≥ 0 (0 = greedy), not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise TierlmError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise TierlmError("top_k must be ≥ 0 (0 = off)")
        if not 0 <= self.min_p <= 1:
            raise TierlmError("min_p must be in [0, 1] (0 = off)")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise TierlmError(
                f"repetition_penalty must be a finite number > 0 (1 = off), not {self.repetition_penalty}")
        if isinstance(self.repeat_last_n, bool) or not isinstance(self.repeat_last_n, int) or self.repeat_last_n < -1:
            raise TierlmError(f"repeat_last_n must be an integer ≥ -1 (0 = off, -1 = the whole context), "
                              f"not {str(self.repeat_last_n)[:30]}")
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise TierlmError(f"seed must be an integer in [-2^63, 2^64 - 1], not {str(self.seed)[:30]}",
                              "torch's random generator takes no other seeds")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalty_window(self) -> int | None:
        """How many recent tokens the repetition penalty covers: None when it is off, WHOLE_CONTEXT for all."""
        if self.repetition_penalty == 1.0 or self.repeat_last_n == 0:
            return None
        return self.repeat_last_n


def resolve_sampling(
    defaults: GenerationDefaults,
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    repeat_last_n: int | None = None,
    **fixed,
) -> SamplingParams:
    """SamplingParams from what the user set (None = unset: the model's default) and `fixed`
    fields with no model default (max_new_tokens, seed, stop, ...)."""
    given = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                 repetition_penalty=repetition_penalty, repeat_last_n=repeat_last_n)  # fmt: skip
    chosen = {key: getattr(defaults, key) if value is None else value for key, value in given.items()}
    return SamplingParams(**chosen, **fixed)


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
        """Next token from logits [V] (fp32); `seen` [N] holds the ids the repetition penalty applies
        to (the caller's window: SequenceState keeps the last repeat_last_n)."""
        p = self.params
        if p.repetition_penalty != 1.0 and seen is not None and seen.numel():
            logits = penalize_repetition(logits, seen, p.repetition_penalty)
        if p.greedy and logits.dtype == torch.float32 and logits.is_cpu:
            # numpy's argmax is ~15x torch's here; a finite winner means no NaN (argmax takes the
            # first NaN) and no +inf, so it is the answer of the cleaned logits below.
            values = logits.contiguous().numpy()
            best = int(values.argmax())
            if math.isfinite(values[best]):
                return best
        probs = self._probabilities(logits)
        if probs is None:
            return int(torch.argmax(torch.nan_to_num(logits.float(), nan=float("-inf"))))
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def verify(self, logits: torch.Tensor, draft: int, seen: torch.Tensor | None = None) -> tuple[int, bool]:
        """The token at a drafted position: (draft, True) when the draft stands, else (another
        token, False). The position is sampled exactly as a plain step samples it, with the same
        draws, and the draft stands when the sample is the draft: for a draft chosen without
        sampling (prompt lookup, a greedy draft model) that is the rejection rule (it stands with
        probability p(draft); otherwise the token is p's sample given it is not the draft), so the
        output keeps p's distribution, and a seeded run gives the tokens it gives without drafts
        wherever the verified logits are the step's (greedy: the draft stands when it is the argmax)."""
        token = self(logits, seen)
        return token, token == draft

    def _probabilities(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The distribution sampled from (temperature, top-k, top-p, min-p applied; the penalty is
        the caller's), on the CPU; None where there is nothing to sample among (greedy, or -inf
        everywhere): take the argmax."""
        p = self.params
        # NaN (a broken model) and +inf (an overflow) would make every probability NaN.
        logits = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
        top = logits.max()
        if p.greedy or torch.isinf(top):  # -inf everywhere: nothing to sample among
            return None
        # Shifted to ≤ 0 first, so dividing by a small temperature gives -inf at worst, never NaN;
        # a temperature past fp32's range would become inf, and -inf / inf is NaN.
        logits = (logits - top) / min(p.temperature, torch.finfo(torch.float32).max)
        if p.top_k:
            logits = keep_top_k(logits, p.top_k)
        if p.top_p < 1.0:
            logits = keep_top_p(logits, p.top_p)
        if p.min_p > 0:
            logits = keep_min_p(logits, p.min_p)
        return torch.softmax(logits.float().cpu(), dim=-1)


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty (as transformers applies it): divide positive logits, multiply negative."""
    penalty = min(max(penalty, PENALTY_CLAMP[0]), PENALTY_CLAMP[1])
    picked = logits.gather(0, seen)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return logits.scatter(0, seen, picked)


def keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k >= logits.shape[-1]:
        return logits
    threshold = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def keep_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the most likely token's.

    In log space: p_i ≥ min_p·p_max ⇔ logit_i ≥ logit_max + log(min_p) (softmax's normalizer
    cancels), so no softmax is needed; the top token always survives.
    """
    threshold = logits.max() + math.log(min_p)
    return logits.masked_fill(logits < threshold, float("-inf"))


def keep_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches top_p (at least one)."""
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the mass before it already reaches top_p.
    drop = (probs.cumsum(dim=-1) - probs) >= top_p
    drop[0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter_(0, order, drop), float("-inf"))
