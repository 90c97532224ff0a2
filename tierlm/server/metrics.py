"""Prometheus metrics for one server: its own registry, nothing global.

Counters and histograms are updated as requests end and steps run; gauges that describe the
present (queue, memory, the tiered store's ledger) are read when /metrics is scraped.
"""

from __future__ import annotations

import re
from typing import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tierlm.device.proc import resident_bytes
from tierlm.server.batch import StepReport
from tierlm.server.jobs import Job

OUTCOMES = ("stop", "length", "timeout", "cancelled", "error", "rejected", "invalid")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class Metrics:
    """The server's metrics; `live()` supplies the scrape-time readings."""

    def __init__(self, live: Callable[[], dict[str, float]]):
        """`live` returns {metric name: value} for the gauges read at scrape time."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("tierlm_requests", "Requests by outcome (finish reason, or why refused)",
                                ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.ttft = Histogram("tierlm_time_to_first_token_seconds", "From request received to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("tierlm_request_duration_seconds", "From request received to its end",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tierlm_prompt_tokens", "Prompt tokens of ended requests", registry=r)
        self.cached_prompt_tokens = Counter("tierlm_prompt_tokens_cached",
                                            "Prompt tokens of ended requests reused from a slot, not prefilled",
                                            registry=r)  # fmt: skip
        self.generated_tokens = Counter("tierlm_generated_tokens", "Tokens generated", registry=r)
        self.shifted_requests = Counter("tierlm_context_shifted_requests",
                                        "Chat requests that dropped old messages to fit (serve --context-shift)",
                                        registry=r)  # fmt: skip
        self.dropped_messages = Counter("tierlm_context_shift_dropped_messages",
                                        "Messages dropped for chat prompts to fit (serve --context-shift)", registry=r)
        self.decode_rate = Gauge("tierlm_decode_tokens_per_second",
                                 "Tokens/s of the latest decode step, all sequences together", registry=r)
        self.prefill_rate = Gauge("tierlm_prefill_tokens_per_second", "Tokens/s of the latest prefill chunk",
                                  registry=r)
        self.batch_size = Histogram("tierlm_batch_size", "Sequences per decode step", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.restarts = Counter("tierlm_worker_restarts", "Worker restarts by the watchdog", registry=r)
        self.drafted_tokens = Counter("tierlm_draft_tokens", "Tokens drafted and verified (speculative decoding)",
                                      registry=r)  # fmt: skip
        self.accepted_tokens = Counter("tierlm_draft_accepted_tokens", "Drafted tokens that verification kept",
                                       registry=r)  # fmt: skip
        r.register(_LiveCollector(live))

    def ended(self, job: Job) -> None:
        """A job ended (any thread)."""
        self.requests.labels(job.finish_reason or "error").inc()
        self.prompt_tokens.inc(len(job.prompt_ids))
        self.cached_prompt_tokens.inc(job.cached_tokens)
        if job.first_token_at is not None:
            self.ttft.observe(job.first_token_at - job.received)
        if job.ended_at is not None:
            self.latency.observe(job.ended_at - job.received)

    def shifted(self, dropped: int) -> None:
        """A chat request was queued with its `dropped` oldest messages dropped to fit."""
        self.shifted_requests.inc()
        self.dropped_messages.inc(dropped)

    def refused(self, outcome: str) -> None:
        """A request refused before it became a job: "rejected" (queue full) or "invalid"."""
        self.requests.labels(outcome).inc()

    def step(self, report: StepReport) -> None:
        self.generated_tokens.inc(report.sampled)
        self.drafted_tokens.inc(report.drafted)
        self.accepted_tokens.inc(report.accepted)
        if report.batch:
            self.batch_size.observe(report.batch)
            if report.decode_s > 0:
                self.decode_rate.set(report.batch / report.decode_s)
        if report.prefill_tokens and report.prefill_s > 0:
            self.prefill_rate.set(report.prefill_tokens / report.prefill_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _LiveCollector:
    """Gauges computed at scrape time from `live()`; a name with {k="v"} carries labels, and one
    ending in _total is a counter (a running count the store keeps, not a reading of the present)."""

    def __init__(self, live: Callable[[], dict[str, float]]):
        self.live = live

    def describe(self) -> list:
        return []  # values appear and disappear with the store's figures

    def collect(self) -> Iterator:
        families: dict = {}
        for key, value in self.live().items():
            name, labels = _split_labels(key)
            if name not in families:
                kind = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
                families[name] = kind(name, _HELP.get(name, name.replace("_", " ")), labels=list(labels))
            families[name].add_metric(list(labels.values()), float(value))
        yield from families.values()


_HELP = {
    "tierlm_queue_depth": "Requests waiting for a slot",
    "tierlm_active_sequences": "Sequences holding a KV slot",
    "tierlm_batch_slots": "KV slots (the most sequences decoded together)",
    "tierlm_worker_healthy": "1 while the worker beats and runs, 0 otherwise",
    "tierlm_process_resident_bytes": "Resident memory of the server process (VmRSS)",
    "tierlm_process_peak_resident_bytes": "Peak resident memory of the server process (VmHWM)",
    "tierlm_weight_bytes_held": "Model weight bytes the weight store holds in memory",
    "tierlm_planned_bytes": "Bytes the planner charged to each memory tier",
    "tierlm_weight_bytes_read": "Weight bytes streamed so far, by the tier read from (a counter)",
    "tierlm_weight_bytes_read_per_forward": "Weight bytes streamed per forward pass, by source tier",
    "tierlm_prefetch_stall_seconds": "Time compute waited for streamed blocks so far (a counter)",
    "tierlm_prefetch_overlap_ratio": "Share of streaming time hidden behind compute",
    "tierlm_hot_cache_hit_rate": "Embedding rows served from the hot-row cache",
    "tierlm_kv_cache_bytes": "KV cache bytes: reserved for all slots, used by the live sequences",
    "tierlm_slot_tokens_held": "Tokens whose keys and values a KV slot holds (a running sequence's, or kept for reuse)",
    "tierlm_kv_pages": "KV pool pages: used (of those, shared by several sequences, or kept only for idle conversations) and free",
    "tierlm_kv_preempted_total": "Running sequences whose KV pages were taken for older ones (computed again later)",
    "tierlm_kv_reclaimed_total": "Idle conversations whose KV pages were taken for running sequences",
    "tierlm_kv_spill_bytes": "Bytes of idle conversations' keys and values kept in host RAM after their slot was taken",
    "tierlm_kv_spilled_total": "Conversations whose rows were copied out of a slot another request took",
    "tierlm_kv_restored_total": "Conversations whose rows were copied back into a slot when they returned",
    "tierlm_expert_hits_total": "MoE experts the router chose that were in the expert cache",
    "tierlm_expert_misses_total": "MoE experts the router chose that had to be read in (or host-computed)",
    "tierlm_expert_hit_rate": "Share of chosen MoE experts found in the expert cache, all layers",
    "tierlm_expert_layer_hit_rate": "Share of chosen MoE experts found in the expert cache, per layer",
    "tierlm_speculative_guesses_total": "MoE experts prefetched on a guess from the next layer's router",
    "tierlm_speculative_right_total": "Prefetched MoE experts that the layer's router then chose",
    "tierlm_speculative_accuracy": "Share of speculatively prefetched MoE experts that were then chosen",
}
_LABELED = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}$")


def _split_labels(key: str) -> tuple[str, dict[str, str]]:
    match = _LABELED.match(key)
    if not match:
        return key, {}
    labels = dict(pair.split("=", 1) for pair in match.group(2).split(","))
    return match.group(1), {k: v.strip('"') for k, v in labels.items()}


def process_memory() -> dict[str, float]:
    """VmRSS and VmHWM of this process in bytes (the peak is left out where /proc is absent)."""
    rss, peak = resident_bytes()
    peak_field = {} if peak is None else {"tierlm_process_peak_resident_bytes": peak}
    return {"tierlm_process_resident_bytes": rss, **peak_field}


def store_metrics(store) -> dict[str, float]:
    """Weight bytes the store holds in memory and, for a tiered store, its ledger: planned bytes
    per tier, forwards and the token positions they ran, weight bytes read (total, per forward
    and per token) per source tier, prefetch stall and overlap, hot-row cache hit rate, and for
    an MoE model the expert cache's hits and misses (overall and per layer) and speculation."""
    out: dict[str, float] = {}
    try:
        out["tierlm_weight_bytes_held"] = store.nbytes()
    except (AttributeError, NotImplementedError):
        pass
    ledger = store.stats()
    if not ledger.planned:  # a resident store streams nothing: no figures to report
        return out
    try:
        snapshot = ledger.snapshot()
        read_total = dict(ledger.bytes_read)
    except RuntimeError:  # a reader thread added a tier mid-read: skip this scrape's figures
        return out
    for tier, nbytes in snapshot["planned"].items():
        out[f'tierlm_planned_bytes{{tier="{tier}"}}'] = nbytes
    for tier, nbytes in read_total.items():
        out[f'tierlm_weight_bytes_read{{tier="{tier}"}}'] = nbytes
    for tier, nbytes in snapshot["bytes_read_per_forward"].items():
        out[f'tierlm_weight_bytes_read_per_forward{{tier="{tier}"}}'] = nbytes
    for tier, nbytes in snapshot["bytes_read_per_token"].items():
        out[f'tierlm_weight_bytes_read_per_token{{tier="{tier}"}}'] = nbytes
    out["tierlm_forwards"], out["tierlm_forward_tokens"] = snapshot["forwards"], snapshot["tokens"]
    out["tierlm_prefetch_stall_seconds"] = snapshot["stall_s"]
    out["tierlm_prefetch_overlap_ratio"] = snapshot["overlap"]
    out["tierlm_hot_cache_hit_rate"] = snapshot["hot_cache_hit_rate"]
    experts = snapshot.get("experts")
    if experts:
        out["tierlm_expert_hits_total"], out["tierlm_expert_misses_total"] = experts["hits"], experts["misses"]
        out["tierlm_expert_hit_rate"] = experts["hit_rate"]
        for layer, rate in experts["per_layer"].items():
            out[f'tierlm_expert_layer_hit_rate{{layer="{layer}"}}'] = rate
        out["tierlm_speculative_guesses_total"] = experts["speculative_guesses"]
        out["tierlm_speculative_right_total"] = experts["speculative_right"]
        out["tierlm_speculative_accuracy"] = experts["speculative_accuracy"]
    return out
