"""MoE figures in the ledger, and where they show: chat's /stats, bench, /metrics."""

from __future__ import annotations

import collections
import sys
import threading

import pytest

from tierlm.weights.ledger import Ledger


def test_expert_lookups_add_up_per_layer_and_overall():
    ledger = Ledger()
    ledger.record_experts(0, hits=3, misses=1)
    ledger.record_experts(2, hits=0, misses=4)
    ledger.record_experts(0, hits=2, misses=2)
    assert (ledger.expert_hits, ledger.expert_misses) == (5, 7)
    assert ledger.expert_hit_rate == 5 / 12
    assert ledger.expert_layer_hit_rates == {0: 5 / 8, 2: 0.0}
    ledger.record_speculation(guessed=8, right=6)
    ledger.record_speculation(guessed=8, right=2)
    assert ledger.speculative_accuracy == 0.5
    experts = ledger.snapshot()["experts"]
    assert experts == {"hit_rate": 5 / 12, "hits": 5, "misses": 7, "per_layer": {0: 5 / 8, 2: 0.0},
                       "speculative_accuracy": 0.5, "speculative_guesses": 16, "speculative_right": 8}


def test_dense_snapshot_has_no_expert_section():
    ledger = Ledger()
    ledger.record_rows(3, 1)
    ledger.record_speculation(guessed=4, right=4)  # guesses alone are no lookups
    ledger.record_experts(1, hits=0, misses=0)  # nor is a layer that chose nothing
    assert "experts" not in ledger.snapshot()
    assert (ledger.expert_hit_rate, Ledger().speculative_accuracy) == (0.0, 0.0)


def test_expert_counts_are_thread_safe():
    ledger = Ledger()
    barrier = threading.Barrier(4)

    def lookups(layer: int) -> None:
        barrier.wait()
        for _ in range(2000):
            ledger.record_experts(layer % 2, 1, 1)
            ledger.record_speculation(2, 1)

    threads = [threading.Thread(target=lookups, args=(n,)) for n in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so an unlocked read-modify-write would lose counts
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert ledger.expert_lookups == {0: (4000, 4000), 1: (4000, 4000)}
    assert (ledger.speculative_guesses, ledger.speculative_right) == (16000, 8000)


class _LedgerStore:
    """A store reduced to what /metrics reads: its held bytes and its ledger."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger

    def nbytes(self) -> int:
        return 1 << 20

    def stats(self) -> Ledger:
        return self.ledger


def _scrape(ledger: Ledger) -> str:
    from tierlm.server.metrics import Metrics, store_metrics

    body, _ = Metrics(lambda: store_metrics(_LedgerStore(ledger))).render()
    return body.decode()


def _value(text: str, sample: str) -> float:
    import re

    return float(re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M).group(1))


def test_metrics_show_expert_counters_rates_and_speculation():
    ledger = Ledger(planned={"device": {"weights": 100}, "disk": {"weights": 300}})
    ledger.record_experts(1, hits=6, misses=2)
    ledger.record_experts(3, hits=1, misses=3)
    ledger.record_speculation(guessed=10, right=7)
    ledger.record_stall(0.25)
    text = _scrape(ledger)
    assert "# TYPE tierlm_expert_hits_total counter" in text
    assert "# TYPE tierlm_speculative_guesses_total counter" in text
    assert (_value(text, "tierlm_expert_hits_total"), _value(text, "tierlm_expert_misses_total")) == (7, 5)
    assert _value(text, "tierlm_expert_hit_rate") == 7 / 12
    assert _value(text, 'tierlm_expert_layer_hit_rate{layer="1"}') == 0.75
    assert _value(text, 'tierlm_expert_layer_hit_rate{layer="3"}') == 0.25
    assert (_value(text, "tierlm_speculative_guesses_total"), _value(text, "tierlm_speculative_right_total")) == (10, 7)
    assert _value(text, "tierlm_speculative_accuracy") == 0.7
    assert _value(text, "tierlm_prefetch_stall_seconds") == 0.25


def test_metrics_of_a_dense_model_name_no_experts():
    ledger = Ledger(planned={"device": {"weights": 100}, "disk": {"weights": 300}})
    ledger.record_rows(2, 2)
    text = _scrape(ledger)
    assert "tierlm_hot_cache_hit_rate" in text
    assert "tierlm_expert" not in text and "tierlm_speculative" not in text


def test_bench_prints_expert_hit_rates_and_speculation():
    from tierlm.cli.bench import format_bench

    ledger = Ledger(planned={"disk": {"weights": 300}})
    ledger.record_forward(4)
    ledger.record_read("disk", 4096, 0.01)
    for layer in range(40):
        ledger.record_experts(layer, hits=layer % 4, misses=1)
    ledger.record_speculation(guessed=50, right=45)
    result = {"model": "m", "device": "cpu", "profile": "16gb", "quant": "int8", "threads": 2, "runs": 1,
              "prompt_tokens": 4, "new_tokens": 4, "prefill_tokens_per_s": 10.0, "ttft_s": 0.1,
              "decode_tokens_per_s": 5.0, "peak_rss_bytes": 1 << 30, "budget_bytes": 16 << 30, "load_s": 1.0,
              "ledger": ledger.snapshot(), "predicted_expert_hit_rate": 0.5}  # fmt: skip
    lines = format_bench(result).splitlines()
    assert any(line.startswith("streaming disk 4.0 KiB read per forward (disk 1.0 KiB per token), ") for line in lines)
    first = next(n for n, line in enumerate(lines) if line.startswith("experts "))
    assert lines[first] == ("experts   hit rate 60% of 100 chosen (planned 50%), "
                            "speculative prefetch 90% right of 50 guesses")
    per_layer = " ".join(lines[first + 1:]).split()
    assert per_layer[:3] == ["per", "layer", "0:0%"] and per_layer[-1] == "39:75%" and len(per_layer) == 42
    assert all(len(line) <= 100 for line in lines[first:])



def test_planned_hit_rate_weighs_every_sparse_layer_alike():
    from tierlm.cli.bench import expected_expert_hit_rate
    from tierlm.offload.placement import ExpertLayer, Placement

    layers = tuple(ExpertLayer(layer, 8, resident, resident / 8, {}) for layer, resident in enumerate((2, 4, 6)))
    assert expected_expert_hit_rate(Placement((), {}, {}, expert_layers=layers)) == 0.5


RESIDENT = (0, 3)  # of each sparse layer's 6 experts; the rest stream from disk


@pytest.fixture(scope="module")
def moe_session(tmp_path_factory):
    """A tiny Qwen3-MoE chat model over a TieredStore that keeps two experts per layer resident
    (built by hand: no planner, no machine probe, so the test stays quick)."""
    import torch

    from tests.tiny import make_model, write_profile
    from tierlm.blocks import expert_of
    from tierlm.cache.artifact import Artifact
    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.models import family_class, read_config
    from tierlm.offload.placement import DEVICE, DISK, BlockPlacement, Placement
    from tierlm.store.tiered import TieredStore
    from tierlm.profile import load_profile
    from tierlm.runtime.loader import LoadedModel
    from tierlm.runtime.session import Session
    from tierlm.runtime.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("moe-stats")
    model_dir = root / "tiny-moe"
    make_model(model_dir, "qwen3_moe", layers=3, heads=4, kv_heads=2, num_experts=6, num_experts_per_tok=2,
               moe_intermediate_size=32)  # fmt: skip
    art = Artifact.open(ensure_artifact(ConversionRequest(model_dir, (), "fp16")))  # no native INT8 kernel to build
    blocks = tuple(BlockPlacement(name, DISK if (expert_of(name) or (0, 0))[1] not in RESIDENT else DEVICE,
                                  record.nbytes) for name, record in art.blocks.items())  # fmt: skip
    charges = {tier: {"weights": sum(b.nbytes for b in blocks if b.tier == tier)} for tier in (DEVICE, DISK)}
    experts = [b.nbytes for b in blocks if expert_of(b.name)]
    place = Placement(blocks, {}, charges, ring_slots=2, expert_slots=3 * len(RESIDENT), expert_stream_slots=2,
                      expert_slot_bytes=max(experts))  # fmt: skip
    config, store = read_config(model_dir), TieredStore(art, place)
    model = family_class(config)(config, store, 128, torch.device("cpu"), torch.float32)
    loaded = LoadedModel(config, model, store, 128, torch.device("cpu"), torch.float32, place, None, "fp16")
    profile = load_profile(str(write_profile(root / "serve.toml", context_length=128, batch_size=2)))
    with Session(loaded, Tokenizer.from_dir(model_dir), profile, model_dir, load_s=0.0) as session:
        yield session


def test_served_moe_model_shows_its_expert_figures(moe_session, monkeypatch):
    """/metrics over a real tiered MoE run: every expert lookup the model made is counted as a hit or a miss,
    per layer; chat's /stats and bench print the same figures."""
    import httpx

    from tierlm.cli.repl import format_stats
    from tierlm.server.options import ServerOptions
    from tierlm.server.run import BackgroundServer

    monkeypatch.setenv("TIERLM_FUSED", "0")  # MoE layers run eagerly anyway: building the native step only costs time
    store = moe_session.loaded.store
    asked = collections.Counter()
    experts = store.experts

    def counted(layer, uses):
        asked[layer] += len(uses)
        return experts(layer, uses)

    store.experts = counted  # the model's calls, counted apart from the store's own bookkeeping
    with BackgroundServer(moe_session, ServerOptions(aliases=("tiny",))) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            reply = client.post("/v1/completions", json={"model": "tiny", "prompt": "the quick brown fox",
                                                         "max_tokens": 6, "temperature": 0})  # fmt: skip
            assert reply.status_code == 200
            text = client.get("/metrics").text
    assert sorted(asked) == [0, 1, 2]
    hits, misses = _value(text, "tierlm_expert_hits_total"), _value(text, "tierlm_expert_misses_total")
    assert hits + misses == sum(asked.values()) and misses > 0  # four of six experts start on disk
    rates = {layer: _value(text, f'tierlm_expert_layer_hit_rate{{layer="{layer}"}}') for layer in asked}
    assert all(0.0 <= rate <= 1.0 for rate in rates.values())
    assert _value(text, "tierlm_expert_hit_rate") == pytest.approx(hits / (hits + misses))
    assert _value(text, 'tierlm_weight_bytes_read_per_token{tier="disk"}') > 0
    guessed, right = _value(text, "tierlm_speculative_guesses_total"), _value(text, "tierlm_speculative_right_total")
    assert 0 <= right <= guessed and guessed > 0  # dense blocks resident: each next router can guess
    assert _value(text, "tierlm_speculative_accuracy") == pytest.approx(right / guessed)
    assert _value(text, "tierlm_prefetch_stall_seconds") >= 0
    shown = format_stats(moe_session, None)
    assert f"experts   hit rate {hits / (hits + misses):.0%} of {int(hits + misses)} chosen" in shown
    assert "per layer 0:" in shown
