"""Mixed 4/8-bit precision: which concrete mode each weight tensor gets under `mixed:SIZE`.

Each 2-D weight may be stored in any mode of `OPTIONS`, from the smallest (int4-g128) to int8;
each option costs bytes and does damage. The damage of an option on a weight W [out, in] is the
output error it causes on calibration activations x, to first order

    sum_k E[x_k^2] * sum_n (W - W~)_nk^2          (W~ the weight as that option stores it)

i.e. the quantization error weighted by each input column's mean square activation (the
diagonal of the layer's Hessian: the measure GPTQ, AWQ and HAWQ start from). Without
activation statistics (a prediction from config.json, a model too large to run in RAM) every
column weighs the same and the error is estimated from `GAUSSIAN_ERROR`.

`allocate` starts every weight at its smallest option and upgrades, greedily, the weight whose
next option buys the most damage reduction per added byte (on each weight's lower convex hull
of (bytes, damage), so the greedy is the optimal fractional choice), while the total fits the
target. The result is deterministic: ties go to the earlier tensor.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tierlm.errors import TierlmError

# Smallest first. int4 groups are the packed chunks' multiples; per-channel int8 is the cheap 8-bit
# option (the fastest int8 kernel, its error ~100x below int4's), q8_0 (GGUF's Q8_0, 8.5 bits)
# nearly halves its error and carries a Q8_0 source exactly, int8-g32-asym the exact one for
# Q5 sources.
OPTIONS = ("int4-g128", "int4-g64", "int4-g32", "int4-g32-asym", "int8", "q8_0", "int8-g32-asym")
# Bump when the same weights and size would be given other modes (artifact keys include it).
ALLOCATOR_VERSION = 3  # 2: int8-g32-asym among the options; 3: q8_0 too
# Mean squared error relative to the weight's mean square, measured on N(0, 1) weights [1024 x 4096]
# with this package's quantizers: the damage estimate when no weights are at hand.
GAUSSIAN_ERROR = {"int4-g128": 1.07e-2, "int4-g64": 8.98e-3, "int4-g32": 7.23e-3, "int4-g32-asym": 5.88e-3,
                  "int8": 7.55e-5, "q8_0": 2.87e-5, "int8-g32-asym": 2.07e-5}  # fmt: skip


@dataclass(frozen=True)
class Candidate:
    """One weight's options: `sizes[mode]` stored bytes and `damage[mode]` (any common unit)."""

    key: str  # "block/tensor"
    sizes: Mapping[str, int]
    damage: Mapping[str, float]


def estimated_candidate(key: str, shape: tuple[int, int], size_of) -> Candidate:
    """A weight's options with damage estimated from `GAUSSIAN_ERROR` (no weights at hand):
    elements x relative error; `size_of(shape, mode)` gives stored bytes."""
    elements = shape[0] * shape[1]
    return Candidate(key, {m: size_of(shape, m) for m in OPTIONS}, {m: elements * GAUSSIAN_ERROR[m] for m in OPTIONS})


def allocate(candidates: Sequence[Candidate], budget: int) -> dict[str, str]:
    """key -> mode, the weights' total stored bytes within `budget`, least total damage first.

    TierlmError when even the smallest option of every weight exceeds `budget`.
    """
    chosen = {c.key: _hull(c)[0] for c in candidates}
    total = sum(c.sizes[chosen[c.key]] for c in candidates)
    if total > budget:  # callers refuse a size below the model's floor first (cache/mixed_estimate.py)
        need = -(-total // 2**20)
        raise TierlmError(
            f"the weights need at least {need} MiB even with every tensor at {OPTIONS[0]}, "
            f"more than the {max(budget, 0) // 2**20} MiB left for them",
            f"ask for mixed:{need}MiB or more",
        )
    hulls = {c.key: _hull(c) for c in candidates}
    by_key = {c.key: c for c in candidates}
    order = {c.key: i for i, c in enumerate(candidates)}
    heap = []

    def push(key: str) -> None:
        hull, now = hulls[key], chosen[key]
        step = hull.index(now) + 1
        if step < len(hull):
            c, nxt = by_key[key], hull[step]
            added = c.sizes[nxt] - c.sizes[now]
            gain = c.damage[now] - c.damage[nxt]
            heapq.heappush(heap, (-gain / max(added, 1), order[key], key, nxt, added))

    for key in chosen:
        push(key)
    while heap:
        _, _, key, nxt, added = heapq.heappop(heap)
        if total + added > budget:
            continue  # this upgrade does not fit; smaller ones of other weights may
        total += added
        chosen[key] = nxt
        push(key)
    return chosen


def _hull(c: Candidate) -> list[str]:
    """The options on the lower convex hull of (bytes, damage), smallest first: an option that
    costs more bytes without doing less damage, or lies above the chord of its neighbours, is
    never worth taking."""
    points = sorted(((c.sizes[m], c.damage[m], i, m) for i, m in enumerate(OPTIONS) if m in c.sizes))
    hull: list[tuple[int, float, int, str]] = []
    for point in points:
        if hull and point[1] >= hull[-1][1]:
            continue  # more bytes, no less damage
        while len(hull) >= 2 and _above_chord(hull[-2], hull[-1], point):
            hull.pop()
        hull.append(point)
    return [p[3] for p in hull]


def _above_chord(a, b, c) -> bool:
    """Whether b lies on or above the segment a-c (so a straight a->c upgrade beats a->b->c)."""
    return (b[1] - a[1]) * (c[0] - a[0]) >= (c[1] - a[1]) * (b[0] - a[0])


def mode_counts(choices: Mapping[str, str]) -> tuple[tuple[str, int], ...]:
    """(mode, weights in it) for a per-weight choice, most first, then by name."""
    counts: dict[str, int] = {}
    for mode in choices.values():
        counts[mode] = counts.get(mode, 0) + 1
    return tuple(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def mode_bytes(choices: Mapping[str, str], stored: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """(mode, bytes its weights store) for a per-weight choice, in `mode_counts`' order."""
    totals: dict[str, int] = {}
    for key, mode in choices.items():
        totals[mode] = totals.get(mode, 0) + stored.get(key, 0)
    return tuple((mode, totals[mode]) for mode, _ in mode_counts(choices))


def summary(choices: Mapping[str, str]) -> str:
    """"int4-g128 x 150, int8 x 61": how many weights each mode holds, most first."""
    return ", ".join(f"{mode} x {n}" for mode, n in mode_counts(choices))
