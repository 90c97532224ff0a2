"""The ledger: planned bytes per tier next to measured ones, traffic per token, stalls, hit rates
(hot embedding rows, and for MoE models experts per layer and speculative guesses)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from tierlm.device.backend import DeviceBackend
from tierlm.device.proc import status_bytes


@dataclass
class Ledger:
    """Counters the tiered store updates as it runs; thread-safe for reader threads."""

    planned: dict[str, dict[str, int]] = field(default_factory=dict)
    bytes_read: dict[str, int] = field(default_factory=dict)  # source tier -> bytes moved
    read_s: float = 0.0  # time reader threads spent moving bytes
    stall_s: float = 0.0  # time compute waited for a streamed block
    forwards: int = 0  # counted by the model's forward (WeightStore.note_forward), not by block reads
    tokens: int = 0  # token positions those forwards ran: a prompt's length, a batch step's slots
    hot_hits: int = 0
    hot_misses: int = 0
    expert_lookups: dict[int, tuple[int, int]] = field(default_factory=dict)  # layer -> (hits, misses)
    speculative_guesses: int = 0  # experts hinted from the next layer's router
    speculative_right: int = 0  # of those, the ones that layer then chose
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_read(self, tier: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes_read[tier] = self.bytes_read.get(tier, 0) + nbytes
            self.read_s += seconds

    def record_stall(self, seconds: float) -> None:
        with self._lock:
            self.stall_s += seconds

    def record_forward(self, tokens: int) -> None:
        """One forward over `tokens` token positions."""
        with self._lock:
            self.forwards += 1
            self.tokens += tokens

    def record_rows(self, hits: int, misses: int) -> None:
        with self._lock:
            self.hot_hits += hits
            self.hot_misses += misses

    def record_experts(self, layer: int, hits: int, misses: int) -> None:
        """One MoE layer's lookups: chosen experts found in the expert cache, and those read in."""
        with self._lock:
            before = self.expert_lookups.get(layer, (0, 0))
            self.expert_lookups[layer] = (before[0] + hits, before[1] + misses)

    def record_speculation(self, guessed: int, right: int) -> None:
        """`guessed` experts hinted ahead of a layer, `right` of them then chosen by its router."""
        with self._lock:
            self.speculative_guesses += guessed
            self.speculative_right += right

    @property
    def overlap(self) -> float:
        """Share of streaming time hidden behind compute (1.0 = no stall at all)."""
        return 1.0 - min(self.stall_s / self.read_s, 1.0) if self.read_s else 1.0

    @property
    def hit_rate(self) -> float:
        total = self.hot_hits + self.hot_misses
        return self.hot_hits / total if total else 0.0

    @property
    def expert_hits(self) -> int:
        return self._expert_totals()[0]

    @property
    def expert_misses(self) -> int:
        return self._expert_totals()[1]

    @property
    def expert_hit_rate(self) -> float:
        """Share of chosen experts found in the expert cache, all layers together (0.0 before any)."""
        return _rate(*self._expert_totals())

    @property
    def expert_layer_hit_rates(self) -> dict[int, float]:
        with self._lock:
            return {layer: _rate(*counts) for layer, counts in sorted(self.expert_lookups.items())}

    @property
    def speculative_accuracy(self) -> float:
        """Share of hinted experts the router then chose (0.0 before any guess)."""
        return self.speculative_right / self.speculative_guesses if self.speculative_guesses else 0.0

    def bytes_per_forward(self) -> dict[str, float]:
        return {tier: n / self.forwards for tier, n in self.bytes_read.items()} if self.forwards else {}

    def bytes_per_token(self) -> dict[str, float]:
        return {tier: n / self.tokens for tier, n in self.bytes_read.items()} if self.tokens else {}

    def snapshot(self, device=None) -> dict:
        """Everything /stats, bench and /metrics show, measured now."""
        status = status_bytes()
        measured = {key: status[key] for key in ("RssAnon", "RssFile", "VmRSS", "VmHWM") if key in status}
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            stats = DeviceBackend(device).memory()
            measured["device_allocated"], measured["device_peak"] = stats.allocated, stats.peak
        return {
            "planned": {tier: sum(items.values()) for tier, items in self.planned.items()},
            "measured": measured,
            "forwards": self.forwards,
            "tokens": self.tokens,
            "bytes_read_per_forward": self.bytes_per_forward(),
            "bytes_read_per_token": self.bytes_per_token(),
            "stall_s": self.stall_s,
            "overlap": self.overlap,
            "hot_cache_hit_rate": self.hit_rate,
            "hot_cache_lookups": self.hot_hits + self.hot_misses,
            "at": time.time(),
            **self._expert_snapshot(),
        }

    def _expert_snapshot(self) -> dict:
        """{"experts": ...} once any expert was looked up; nothing for a dense model. Read under
        one lock, so the figures agree with each other while lookups go on."""
        with self._lock:
            lookups = dict(self.expert_lookups)
            guessed, right = self.speculative_guesses, self.speculative_right
        hits, misses = sum(h for h, _ in lookups.values()), sum(m for _, m in lookups.values())
        if not hits + misses:
            return {}
        return {"experts": {
            "hit_rate": _rate(hits, misses),
            "hits": hits,
            "misses": misses,
            "per_layer": {layer: _rate(*counts) for layer, counts in sorted(lookups.items())},
            "speculative_accuracy": right / guessed if guessed else 0.0,
            "speculative_guesses": guessed,
            "speculative_right": right,
        }}

    def _expert_totals(self) -> tuple[int, int]:
        with self._lock:
            return sum(h for h, _ in self.expert_lookups.values()), sum(m for _, m in self.expert_lookups.values())


def _rate(hits: int, misses: int) -> float:
    return hits / (hits + misses) if hits + misses else 0.0
