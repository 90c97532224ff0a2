"""The planner across pipeline stages: which contiguous layers each rank runs (issue 16).

A pure function, like the planner (offload/planner/search.py `plan`), which it calls once per
candidate stage: stage r of a split, layers [first, end), is planned as the rank that runs it
would plan its own load (`plan(sizes.only(span.blocks), layers=span.layers)` under that rank's
profile and bandwidths), so a stage may keep host or disk tiers of its own. A stage's time is
its plan's predicted decode step at its profile's batch size; a stage that does not fit costs
infinity.

The split minimizes the slowest stage's time (the pipeline's bottleneck once micro-batches keep
every stage busy). Stage time only grows with its layers, so for a bound T the stages reachable
under T are found greedily, and T is bisected over the times splits really have: each feasible
greedy split lowers the upper bound to its own bottleneck, each infeasible bound raises the
lower one, until they meet (~15 rounds of at most world x log2(layers) plans, each cached per
(profile group, first, end)). Among splits with that bottleneck, each stage takes as near an
even share of the layers left as the bound allows (`_Search.split`), so a uniform model on equal ranks
splits evenly and an uneven set of profiles gets an uneven split.

What a token costs besides the stages (`Link`: measured by probe/link.py):
    hand-over   per boundary, hidden_size x rows x c bytes (c: compute dtype, 4 on CPUs, 2 on
                accelerators): latency + bytes / bandwidth
    return      the last stage's logits to rank 0, which samples: vocab x rows x 4 bytes (fp32)
Pipeline speed for a batch of B sequences in m micro-batches of b = ceil(B / m) rows
(`StagePlan.decode_seconds`): each group goes once round the ring per token, and no stage (nor a
boundary's link) works on two groups at once:
    step(m) = max(sum_i t_i(b) + (N - 1) x hand-over(b) + return(b),  m x max(max_i t_i(b), hand-over(b), return(b)))
    tok/s   = B / step(m)
m = 1 (batch 1 always) is the sum of every stage and transfer: a pipeline makes one sequence no
faster, it only holds a model no single stage could. With m = min(B, N) groups every stage is
busy, but each group re-reads the stage's weights: where a step's time is set by weight bytes
(decode at small batches) that costs up to m x the reads and m groups can be slower than one;
they pay where a step's time grows with its rows (large batches, CPU compute, prefill).
`StagePlan.micro_batches` picks the faster of the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from tierlm.config import ModelConfig
from tierlm.stages import StageSpan, even_split
from tierlm.errors import TierlmError
from tierlm.offload.bandwidths import Bandwidths
from tierlm.offload.placement import Placement, placement_to_dict
from tierlm.offload.planner.cost import decode_terms, step_seconds
from tierlm.offload.planner.search import plan
from tierlm.offload.sizes import BlockSizes, compute_bytes
from tierlm.profile import Profile

LOGIT_BYTES = 4  # logits cross back to rank 0 in fp32
_TOLERANCE = 1e-3  # bisection stops when the bounds are within this share of each other


@dataclass(frozen=True)
class Link:
    """The connection between two ranks as the stage planner sees it: a message of n bytes takes
    latency_s + n / bytes_per_s."""

    bytes_per_s: float
    latency_s: float
    source: str = "measured"  # "measured ..." (probe/link.py), or "--link-gbps"
    probed_at: float | None = None  # when it was measured (time.time()); None: given by hand

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / max(self.bytes_per_s, 1e-9)


@dataclass(frozen=True)
class PlannedStage:
    """One rank's stage: its span, the profile it runs under, its own plan and predicted step."""

    span: StageSpan
    profile: Profile
    sizes: BlockSizes  # the stage's blocks (BlockSizes.only)
    placement: Placement
    bandwidths: Bandwidths

    @property
    def step_seconds(self) -> float:
        """Predicted decode step of the profile's batch size."""
        return self.profile.batch_size / self.placement.predicted_decode_tokens_per_s


@dataclass(frozen=True)
class StagePlan:
    """A split of the model over ranks, each stage planned, with the transfers between them."""

    config: ModelConfig
    stages: tuple[PlannedStage, ...]
    link: Link
    accelerator: bool

    @property
    def spans(self) -> list[StageSpan]:
        return [stage.span for stage in self.stages]

    @property
    def batch(self) -> int:
        """Sequences the pipeline holds: every stage reserves KV cache for its profile's batch."""
        return min(stage.profile.batch_size for stage in self.stages)

    @property
    def bottleneck(self) -> PlannedStage:
        return max(self.stages, key=lambda stage: stage.step_seconds)

    def handover_bytes(self, rows: int = 1) -> int:
        """Hidden states one boundary passes per decode step of `rows` sequences."""
        return self.config.hidden_size * rows * compute_bytes(self.accelerator)

    def return_bytes(self, rows: int = 1) -> int:
        """The logits the last stage sends back to rank 0 per decode step of `rows` sequences."""
        return self.config.vocab_size * rows * LOGIT_BYTES

    def transfer_seconds(self, rows: int = 1) -> tuple[float, float]:
        """(one boundary's hand-over, the logits' return) per decode step of `rows` sequences;
        nothing for a single stage."""
        if len(self.stages) == 1:
            return 0.0, 0.0
        return self.link.seconds(self.handover_bytes(rows)), self.link.seconds(self.return_bytes(rows))

    def stage_seconds(self, rows: int) -> list[float]:
        """Each stage's predicted decode step of `rows` sequences (its plan's cost model)."""
        return [step_seconds(decode_terms(self.config, s.sizes, s.profile, s.bandwidths, s.placement,
                                          accelerator=self.accelerator, batch=rows, layers=s.span.layers),
                             s.profile.prefetch_depth)[0]
                for s in self.stages]  # fmt: skip

    def decode_seconds(self, batch: int = 1, groups: int = 1) -> float:
        """Predicted seconds for a decode step of `batch` sequences in `groups` micro-batches
        (the module docstring's step(m))."""
        groups = max(1, min(groups, batch))
        rows = -(-batch // groups)
        times = self.stage_seconds(rows)
        handover, back = self.transfer_seconds(rows)
        round_trip = sum(times) + (len(times) - 1) * handover + back
        return max(round_trip, groups * max(*times, handover, back))

    def tokens_per_s(self, batch: int = 1, groups: int = 1) -> float:
        return batch / self.decode_seconds(batch, groups)

    def micro_batches(self, batch: int) -> int:
        """The faster way to run `batch` sequences: as one group, or min(batch, stages) groups."""
        split = min(batch, len(self.stages))
        return split if self.decode_seconds(batch, split) < self.decode_seconds(batch, 1) else 1

    def to_dict(self) -> dict:
        handover, back = self.transfer_seconds()
        batch, world = self.batch, len(self.stages)
        return {
            "stages": [
                {"rank": s.span.rank, "first": s.span.first, "end": s.span.end, "profile": s.profile.name,
                 "step_s": s.step_seconds, "bytes": {tier: s.placement.total(tier) for tier in s.placement.charges},
                 "placement": placement_to_dict(s.placement)}
                for s in self.stages
            ],
            "link": {"bytes_per_s": self.link.bytes_per_s, "latency_s": self.link.latency_s, "source": self.link.source,
                     "probed_at": self.link.probed_at},
            "handover_bytes": self.handover_bytes(), "handover_s": handover,
            "return_bytes": self.return_bytes(), "return_s": back,
            "bottleneck_rank": self.bottleneck.span.rank,
            "tokens_per_s": self.tokens_per_s(),
            "batch": batch,
            "batch_tokens_per_s": self.tokens_per_s(batch),
            "micro_batches": self.micro_batches(batch),
            "micro_batched_tokens_per_s": self.tokens_per_s(batch, min(batch, world)),
        }  # fmt: skip


def split_stages(
    config: ModelConfig,
    sizes: BlockSizes,
    profiles: Sequence[Profile],
    bandwidths: Bandwidths | Sequence[Bandwidths],
    link: Link,
    *,
    accelerator: bool,
    baseline_bytes: int,
    limits=None,
) -> StagePlan:
    """The split of `sizes`' model over len(`profiles`) ranks (rank r under profiles[r] and
    bandwidths[r], or one Bandwidths for all) whose slowest stage is fastest, every stage within
    its own budgets. `limits`: the process limits each rank's budgets are capped at (one
    MemoryLimits for all; None: the profiles as written). Raises TierlmError when no split fits,
    naming the stage that falls short and by how much."""
    world = len(profiles)
    if world < 1:
        raise TierlmError("a pipeline needs at least one stage")
    even_split(config.num_hidden_layers, world)  # refuses more stages than layers
    if isinstance(bandwidths, Bandwidths):
        bandwidths = [bandwidths] * world
    if len(bandwidths) != world:
        raise TierlmError(f"{len(bandwidths)} bandwidth records for {world} stages", "give one per stage, or one for all")
    search = _Search(config, sizes, list(profiles), list(bandwidths), accelerator, baseline_bytes, limits)
    return search.best(link)


def least_stages(
    config: ModelConfig,
    sizes: BlockSizes,
    profiles: Sequence[Profile],
    bandwidths: Bandwidths | Sequence[Bandwidths],
    *,
    accelerator: bool,
    baseline_bytes: int,
    limits=None,
    most: int = 64,
) -> int | None:
    """The fewest stages, more than len(`profiles`), over which the model fits: `profiles` then
    the last of them repeated (likewise `bandwidths`); None when even `most` stages do not."""
    profiles = list(profiles)
    bandwidths = [bandwidths] * len(profiles) if isinstance(bandwidths, Bandwidths) else list(bandwidths)
    for world in range(len(profiles) + 1, min(most, config.num_hidden_layers) + 1):
        extra = world - len(profiles)
        search = _Search(config, sizes, profiles + [profiles[-1]] * extra, bandwidths + [bandwidths[-1]] * extra,
                         accelerator, baseline_bytes, limits)  # fmt: skip
        if search.least_starts(math.inf) is not None:
            return world
    return None


class _Search:
    """Stage costs, cached per (group of ranks alike, first, end), and the bisection over them."""

    def __init__(self, config, sizes, profiles, bandwidths, accelerator, baseline_bytes, limits):
        self.config, self.sizes, self.profiles, self.bandwidths = config, sizes, profiles, bandwidths
        self.accelerator, self.baseline, self.limits = accelerator, baseline_bytes, limits
        self.world, self.layers = len(profiles), config.num_hidden_layers
        keys = [(p, b) for p, b in zip(profiles, bandwidths)]
        self.group = [keys.index(key) for key in keys]  # ranks alike share their plans
        self.planned: dict[tuple[int, int, int], Placement | TierlmError] = {}

    # -- one stage ---------------------------------------------------------------------------

    def span(self, rank: int, first: int, end: int) -> StageSpan:
        return StageSpan(rank, self.world, first, end)

    def stage_sizes(self, span: StageSpan) -> BlockSizes:
        return self.sizes.only(span.blocks(self.sizes.names, tied=self.config.tie_word_embeddings))

    def placement(self, rank: int, first: int, end: int) -> Placement | TierlmError:
        """Rank `rank`'s plan for layers [first, end), or the refusal its planner gives."""
        key = (self.group[rank], first, end)
        if key not in self.planned:
            span = self.span(rank, first, end)
            try:
                self.planned[key] = plan(self.config, self.stage_sizes(span), self.profiles[rank], self.bandwidths[rank],
                                         accelerator=self.accelerator, baseline_bytes=self.baseline,
                                         limits=self.limits, layers=span.layers)  # fmt: skip
            except TierlmError as refusal:
                self.planned[key] = refusal
        return self.planned[key]

    def seconds(self, rank: int, first: int, end: int) -> float:
        found = self.placement(rank, first, end)
        if isinstance(found, TierlmError):
            return math.inf
        return self.profiles[rank].batch_size / found.predicted_decode_tokens_per_s

    def within(self, rank: int, first: int, end: int, bound: float) -> bool:
        """Whether the stage fits its budgets and takes at most `bound`."""
        seconds = self.seconds(rank, first, end)
        return seconds <= bound and math.isfinite(seconds)

    # -- the split ---------------------------------------------------------------------------

    def reach(self, rank: int, first: int, bound: float) -> int | None:
        """The farthest end rank `rank` starting at `first` may run to within `bound`, leaving
        a layer for each later rank (the last must end at the last layer); None: not even one."""
        last = self.layers - (self.world - 1 - rank)
        if rank == self.world - 1:
            return last if self.within(rank, first, last, bound) else None
        if first + 1 > last or not self.within(rank, first, first + 1, bound):
            return None
        low, high = first + 1, last  # low fits
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if self.within(rank, first, middle, bound) else (low, middle - 1)
        return low

    def least_starts(self, bound: float) -> list[int] | None:
        """starts[r]: the earliest layer rank r can start at with ranks r.. covering the rest
        within `bound` (a later start leaves rank r fewer layers, never slower); None: no split."""
        starts = [0] * (self.world + 1)
        starts[self.world] = self.layers
        for rank in range(self.world - 1, -1, -1):
            end = starts[rank + 1]
            if rank == 0:  # the first stage starts at layer 0 (it embeds)
                return starts if self.within(0, 0, end, bound) else None
            if end - 1 < rank or not self.within(rank, end - 1, end, bound):
                return None
            low, high = rank, end - 1  # high fits
            while low < high:
                middle = (low + high) // 2
                low, high = (low, middle) if self.within(rank, middle, end, bound) else (middle + 1, high)
            starts[rank] = low
        raise AssertionError("unreachable: rank 0 returns")

    def split(self, bound: float) -> list[int] | None:
        """Boundaries [0, b1, ..., layers] of a split whose every stage is within `bound`, each
        stage as near an even share of the layers left as the bound allows; None when none is."""
        starts = self.least_starts(bound)
        if starts is None:
            return None
        bounds = [0]
        for rank in range(self.world - 1):
            first = bounds[-1]
            farthest = self.reach(rank, first, bound)
            nearest = max(starts[rank + 1], first + 1)
            even = first + -(-(self.layers - first) // (self.world - rank))  # an even share of what is left
            # starts[] guarantees the rest fits from `nearest` on, and `farthest` >= nearest.
            bounds.append(min(max(even, nearest), farthest))
        bounds.append(self.layers)
        return bounds

    def bottleneck(self, bounds: list[int]) -> float:
        return max(self.seconds(rank, bounds[rank], bounds[rank + 1]) for rank in range(self.world))

    def best(self, link: Link) -> StagePlan:
        bounds = self.split(math.inf)
        if bounds is None:
            raise self.refusal()
        high = self.bottleneck(bounds)
        even = [span.first for span in even_split(self.layers, self.world)] + [self.layers]
        if self.bottleneck(even) <= high:
            bounds, high = even, self.bottleneck(even)
        low = 0.0
        while high - low > _TOLERANCE * high:
            middle = (low + high) / 2
            found = self.split(middle)
            if found is None:
                low = middle
            else:
                bounds, high = found, self.bottleneck(found)
        stages = []
        for rank in range(self.world):
            span = self.span(rank, bounds[rank], bounds[rank + 1])
            stages.append(PlannedStage(span, self.profiles[rank], self.stage_sizes(span),
                                       self.placement(rank, span.first, span.end), self.bandwidths[rank]))  # fmt: skip
        return StagePlan(self.config, tuple(stages), link, self.accelerator)

    def refusal(self) -> TierlmError:
        """No split fits: the earlier ranks each take all the layers they can hold, and the
        stage left short says by how much (its own planner's refusal)."""
        first, held = 0, []
        for rank in range(self.world):
            end = self.reach(rank, first, math.inf)
            if end is None:
                stop = self.layers if rank == self.world - 1 else first + 1
                reason = self.placement(rank, first, stop)
                what = f"layers {first}-{stop - 1}" if stop - first > 1 else f"layer {first}"
                taken = ", ".join(f"rank {r} layers {a}-{b - 1}" for r, (a, b) in enumerate(held))
                before = f" with {taken} (all they can hold)" if taken else ""
                more = least_stages(self.config, self.sizes, self.profiles, self.bandwidths,
                                    accelerator=self.accelerator, baseline_bytes=self.baseline, limits=self.limits)  # fmt: skip
                stages = f"--stages {more}" if more else "more stages"
                hint = f"use {stages} (the added ones under {self.profiles[-1].name}), larger profiles or a smaller --quant"
                return TierlmError(f"no split of {self.layers} layers over {_stages(self.world)} fits{before}: "
                                   f"rank {rank} ({self.profiles[rank].name}) cannot hold {what}: {reason.message}",
                                   hint)  # fmt: skip
            held.append((first, end))
            first = end
        raise AssertionError("refusal() called for a split that fits")


def _stages(count: int) -> str:
    return f"{count} stage{'s' if count != 1 else ''}"
