"""Routing counts: how often each layer's router chose each expert, aged, persisted beside the artifact.

The planner fills the expert budget by expected use (uniform before the first run) and the
expert cache promotes and demotes by these counts. Counts age (each recorded pick halves in
weight after `half_life` later picks of its layer), so the hot set follows a change of workload;
plain frequency (LFU without aging) never forgets a past one. Aging is lazy: a new pick is added
with a weight that grows instead of every old count shrinking, so recording costs O(picks).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Iterable, Mapping

COUNTS_NAME = "expert_counts.json"
HALF_LIFE_PICKS = 4096  # per layer: ~512 tokens of top-8 routing, a few requests' worth
_RESCALE_AT = 1e200  # weights grow geometrically; renormalize long before float overflow


class RoutingCounts:
    """Aged pick counts [layer][expert] for `experts` experts in each of `layers` (sparse layer indices)."""

    def __init__(self, layers: Iterable[int], experts: int, *, half_life: float = HALF_LIFE_PICKS):
        self.experts = experts
        self.growth = 2.0 ** (1.0 / half_life)
        self._raw: dict[int, list[float]] = {layer: [0.0] * experts for layer in layers}
        self._weight: dict[int, float] = {layer: 1.0 for layer in self._raw}  # weight of the next pick

    @classmethod
    def load(cls, path: Path, layers: Iterable[int], experts: int, **kwargs) -> "RoutingCounts":
        """Counts saved at `path`, or empty ones (uniform expectations) when the file is absent,
        damaged or was saved for another shape: statistics only ever cost a cold start."""
        counts = cls(layers, experts, **kwargs)
        try:
            saved = json.loads(Path(path).read_text())
            if saved.get("experts") != experts:
                return counts
            for key, values in saved["layers"].items():
                layer = int(key)
                if layer in counts._raw and len(values) == experts:
                    floats = [float(v) for v in values]
                    if all(math.isfinite(v) and v >= 0 for v in floats):
                        counts._raw[layer] = floats
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return cls(layers, experts, **kwargs)
        return counts

    @property
    def layers(self) -> list[int]:
        return list(self._raw)

    def record(self, layer: int, uses: Mapping[int, int]) -> None:
        """Layer `layer`'s router chose expert e for `uses[e]` token rows in one step."""
        raw, weight = self._raw[layer], self._weight[layer]
        for expert, rows in uses.items():
            raw[expert] += rows * weight
        self._weight[layer] = weight * self.growth ** sum(uses.values())
        if self._weight[layer] > _RESCALE_AT:
            scale = self._weight[layer]
            self._raw[layer] = [value / scale for value in raw]
            self._weight[layer] = 1.0

    def count(self, layer: int, expert: int) -> float:
        """The aged count of (layer, expert), in picks as of now (comparable across layers)."""
        return self._raw[layer][expert] / self._weight[layer]

    def share(self, layer: int) -> list[float]:
        """Expected share of layer's picks per expert (sums to 1; uniform with no data yet)."""
        raw = self._raw[layer]
        total = sum(raw)
        if total <= 0:
            return [1.0 / self.experts] * self.experts
        return [value / total for value in raw]

    def ranked(self, layer: int) -> list[int]:
        """Layer's experts, most used first (ties: lower index first)."""
        raw = self._raw[layer]
        return sorted(range(self.experts), key=lambda e: (-raw[e], e))

    def hit_rate(self, layer: int, resident: Iterable[int]) -> float:
        """Expected share of layer's picks that land on the `resident` experts."""
        share = self.share(layer)
        return sum(share[e] for e in set(resident))

    def save(self, path: Path) -> None:
        """Write the counts (normalized to the current weight) atomically; a read-only or full
        cache directory loses only the next run's warm start."""
        path = Path(path)
        data = {
            "version": 1,
            "experts": self.experts,
            "layers": {str(layer): [self.count(layer, e) for e in range(self.experts)] for layer in self._raw},
        }
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
