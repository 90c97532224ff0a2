"""Finding the grid a group of weights already sits on (a GGUF 4/5/8-bit source's d*j + m).

Shared by the INT8 and INT4 quantizers: both reproduce such a group exactly where their levels
can hold its grid.
"""

from __future__ import annotations

import numpy as np
import torch


def gcd_steps(flat, span, rounds=12):
    """Step counts of the groups flat [n, group] whose smallest gap spans several steps of their
    grid, e.g. Q4_0 levels -8, 0, 3 (gaps 8d, 3d): span / d, d the greatest common divisor of
    their gaps; 0 where there is none (no grid) or the count is off.

    Euclid's algorithm on floats: fmod is exact in IEEE arithmetic, so on gaps that are whole
    multiples of d (< 2^24 d) each remainder is too, and the last nonzero one is d itself. A
    pair's gcd takes at most 11 rounds for multiples below 256 (Fibonacci); `rounds` bounds it
    for gaps that are no multiples of anything (floats), whose result is then discarded.
    """
    gaps = sorted_rows(flat).diff(dim=-1)
    while gaps.shape[1] > 1:  # gcd of pairs of columns, halving them
        if gaps.shape[1] % 2:
            gaps = torch.cat([gaps, torch.zeros_like(gaps[:, :1])], dim=1)  # gcd(x, 0) = x
        a, b = gaps[:, 0::2], gaps[:, 1::2]
        for _ in range(rounds):
            more = b > 0
            if not more.any():
                break
            a, b = torch.where(more, b, a), torch.where(more, torch.fmod(a, b), b)
        gaps = torch.where(b > 0, torch.nan, a)  # unfinished: no step
    steps = torch.round(span / gaps[:, 0])
    return torch.where(steps.isfinite(), steps, torch.zeros_like(steps))


def sorted_rows(flat):
    """flat [n, group] sorted along its rows: numpy's SIMD sort on the CPU (~10x torch's for
    rows of 32), torch's elsewhere."""
    if flat.device.type == "cpu" and flat.dtype == torch.float32:
        return torch.from_numpy(np.sort(flat.detach().numpy(), axis=-1))
    return flat.sort(dim=-1).values
