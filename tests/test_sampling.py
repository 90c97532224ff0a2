"""Sampling filters against transformers' logits processors; seeds reproduce; stop strings."""

from __future__ import annotations

import pytest
import torch

from tierlm.errors import TierlmError
from tierlm.runtime.sampling import (
    Sampler,
    SamplingParams,
    keep_top_k,
    keep_top_p,
    penalize_repetition,
)
from tierlm.runtime.stopping import StopMatcher


def logits(seed: int, size: int = 200) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("k", [1, 5, 50, 199])
def test_top_k_matches_transformers(k):
    from transformers.generation.logits_process import TopKLogitsWarper

    x = logits(k)
    expected = TopKLogitsWarper(top_k=k)(None, x[None].clone())[0]
    assert torch.equal(keep_top_k(x, k), expected)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9, 0.99])
def test_top_p_matches_transformers(p):
    from transformers.generation.logits_process import TopPLogitsWarper

    x = logits(int(p * 100))
    expected = TopPLogitsWarper(top_p=p)(None, x[None].clone())[0]
    assert torch.equal(torch.isinf(keep_top_p(x, p)), torch.isinf(expected))


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    x = logits(7)
    seen = torch.tensor([3, 10, 10, 150, 42])
    expected = RepetitionPenaltyLogitsProcessor(penalty=1.3)(seen[None], x[None].clone())[0]
    torch.testing.assert_close(penalize_repetition(x, seen, 1.3), expected)


def test_greedy_takes_argmax_and_seed_reproduces_sampling():
    x = logits(3)
    assert Sampler(SamplingParams(temperature=0))(x) == int(x.argmax())
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    first = [Sampler(params)(logits(i)) for i in range(20)]
    again = [Sampler(params)(logits(i)) for i in range(20)]
    assert first == again
    other = [Sampler(SamplingParams(temperature=1.0, top_p=0.95, seed=99))(logits(i)) for i in range(20)]
    assert other != first



@pytest.mark.parametrize("case", ["nan-first", "nan-at-max", "posinf", "two-posinf", "all-neginf", "all-nan", "ties"])
def test_greedy_on_non_finite_logits_picks_what_the_cleaned_logits_pick(case):
    """Greedy's fast argmax answers only when its winner is finite; NaN (a broken model) counts
    as -inf and +inf as fp32's largest value, as the sampling path treats them."""
    x = logits(5)
    if case == "nan-first":
        x[0] = float("nan")
    elif case == "nan-at-max":
        x[int(x.argmax())] = float("nan")
    elif case == "posinf":
        x[17] = float("inf")
    elif case == "two-posinf":
        x[9], x[4], x[2] = float("inf"), float("inf"), torch.finfo(torch.float32).max
    elif case == "all-neginf":
        x[:] = float("-inf")
    elif case == "all-nan":
        x[:] = float("nan")
    else:
        x[[3, 11]] = x.max() + 1
    cleaned = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    assert Sampler(SamplingParams(temperature=0))(x) == int(torch.argmax(cleaned))

def test_top_k_one_is_greedy_even_at_high_temperature():
    sampler = Sampler(SamplingParams(temperature=5.0, top_k=1, seed=0))
    assert all(sampler(logits(i)) == int(logits(i).argmax()) for i in range(10))


@pytest.mark.parametrize(
    "bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_new_tokens=0)]
)
def test_invalid_params_are_refused(bad):
    with pytest.raises(TierlmError):
        SamplingParams(**bad)


def test_stop_string_split_across_deltas_is_never_emitted():
    matcher = StopMatcher(("</end>",))
    out, stopped = [], False
    for delta in ["Hello </", "en", "d> more"]:
        text, stopped = matcher.feed(delta)
        out.append(text)
        if stopped:
            break
    assert stopped and "".join(out) == "Hello "


def test_stop_prefix_that_does_not_complete_is_released():
    matcher = StopMatcher(("STOP",))
    texts = [matcher.feed(d)[0] for d in ["a ST", "ART b"]]
    assert texts == ["a ", "START b"]
    assert matcher.feed("ST") == ("", False)
    assert matcher.flush() == "ST"


def test_earliest_of_several_stops_wins():
    matcher = StopMatcher(("xyz", "b"))
    assert matcher.feed("a b xyz") == ("a ", True)
