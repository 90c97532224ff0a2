"""Issue 14, placement per expert: Qwen3-30B-A3B's real config.json planned under 24gb, 16gb and 8gb.

The dense parts are placed as for any model; the routed experts fill what the device has left,
hottest first (routing counts; uniform without), the rest host RAM or disk. Bandwidths and the
baseline are fixed (tests/test_planner.py's desktop CPU and consumer GPU), so every number here
is reproducible. Expected hit rates and bytes are recomputed from the routing shares by hand.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from tests.cli_runner import run_tierlm
from tests.tiers import quick
from tierlm.blocks import expert_block, expert_of, is_expert
from tierlm.config import ModelConfig
from tierlm.models import config_from_dict, read_config
from tierlm.errors import TierlmError
from tierlm.offload.placement import DEVICE, DISK, HOST, placement_to_dict
from tierlm.offload.planner.cost import decode_terms, step_seconds
from tierlm.offload.planner.experts import host_computes_expert
from tierlm.offload.planner.search import plan
from tierlm.offload.bandwidths import Bandwidths
from tierlm.offload.routing_counts import COUNTS_NAME, RoutingCounts
from tierlm.offload.sizes import BlockSizes, expected_routing, sizes_from_config
from tierlm.profile import load_profile

MiB, GiB = 2**20, 2**30
BASELINE = 400 * MiB
QWEN3_30B = Path(__file__).parent / "data" / "qwen3-30b-a3b"
CPU = Bandwidths(device_bytes_per_s=20e9, host_bytes_per_s=20e9, link_bytes_per_s=10e9, disk_bytes_per_s=2e9,
                 device_flops=500e9, host_flops=500e9, per_block_overhead_s=50e-6)  # fmt: skip
GPU = Bandwidths(device_bytes_per_s=800e9, host_bytes_per_s=40e9, link_bytes_per_s=25e9, disk_bytes_per_s=3e9,
                 device_flops=100e12, host_flops=1e12, per_block_overhead_s=30e-6, device="cuda")  # fmt: skip
PROFILES = ("8gb", "16gb", "24gb")  # smallest first
MODES = [pytest.param(False, id="cpu-only"), pytest.param(True, id="accelerator")]


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return read_config(QWEN3_30B)


def make_plan(config, profile, accelerator, routing=None, bandwidths=None):
    profile = load_profile(profile) if isinstance(profile, str) else profile
    sizes = sizes_from_config(config, "int8", accelerator=accelerator)
    bandwidths = bandwidths or (GPU if accelerator else CPU)
    return plan(config, sizes, profile, bandwidths, accelerator=accelerator, baseline_bytes=BASELINE, routing=routing)


def skewed_counts(config, seed: int = 14) -> RoutingCounts:
    """Zipf-like routing (exponent 0.8: the hottest expert takes ~11% of a layer's picks, under the
    1/top_k a top-k router allows), the ranking shuffled independently in every layer."""
    moe = config.moe
    counts = RoutingCounts(moe.sparse_layers, moe.experts)
    rng = random.Random(seed)
    for layer in moe.sparse_layers:
        order = list(range(moe.experts))
        rng.shuffle(order)
        counts.record(layer, {e: int(10000 / (rank + 1) ** 0.8) for rank, e in enumerate(order)})
    assert max(max(counts.share(layer)) for layer in moe.sparse_layers) <= 1 / moe.top_k
    return counts


def expert_tiers(placement) -> dict[tuple[int, int], str]:
    return {expert_of(b.name): b.tier for b in placement.blocks if is_expert(b.name)}


# -- the three profiles --------------------------------------------------------------------------


@pytest.mark.parametrize("accelerator", quick([False, True], fast=[False], ids=["cpu-only", "accelerator"]))
def test_qwen3_30b_a3b_plans_under_24_16_and_8_gb_within_every_budget(config, accelerator):
    moe = config.moe
    sizes = sizes_from_config(config, "int8", accelerator=accelerator)
    expert_bytes = sizes.nbytes[expert_block(0, 0)]
    assert moe.experts == 128 and moe.top_k == 8 and len(moe.sparse_layers) == 48
    assert 4 * MiB < expert_bytes < 5 * MiB  # ew13 [1536, 2048] + ew2 [2048, 768] int8 with fp32 scales
    before = None
    for name in PROFILES:
        placement = make_plan(config, name, accelerator)
        for tier, budget in placement.budgets.items():
            if budget is not None:
                assert placement.total(tier) <= budget, (name, tier, placement.charges[tier])
        device = placement.charges[DEVICE]
        tiers = expert_tiers(placement)
        resident = sum(1 for t in tiers.values() if t == DEVICE)
        assert len(tiers) == 128 * 48
        # The slots hold what is resident; the stream slots are top_k per layer, twice with prefetch.
        assert placement.expert_slots == resident and placement.expert_slot_bytes == expert_bytes
        assert device["experts"] == resident * expert_bytes
        assert placement.expert_stream_slots == 2 * moe.top_k
        assert device["expert_stream"] == 2 * moe.top_k * expert_bytes
        # Every weight byte is charged once: dense resident as weights, resident experts in slots.
        cold_weights = sum(placement.charges[t].get("weights", 0) for t in (HOST, DISK) if t in placement.charges)
        assert device["weights"] + resident * expert_bytes + cold_weights == sizes.total
        # Dense blocks all resident: 30B-A3B's dense part (attention, routers, embeddings) is ~1.4 GiB.
        assert all(b.tier == DEVICE for b in placement.blocks if not is_expert(b.name))
        # No counts: resident experts spread evenly, hit rate = resident / E in every layer.
        per_layer = [x.resident for x in placement.expert_layers]
        assert max(per_layer) - min(per_layer) <= 1 and sum(per_layer) == resident
        for x in placement.expert_layers:
            assert x.hit_rate == pytest.approx(x.resident / 128)
            assert sum(x.bytes_per_token.values()) == pytest.approx(moe.top_k * expert_bytes)
            assert x.bytes_per_token[DEVICE] == pytest.approx(moe.top_k * x.hit_rate * expert_bytes)
        # More budget: more resident experts, a higher prediction.
        if before is not None:
            assert resident > before[0] and placement.predicted_decode_tokens_per_s > before[1], name
        before = (resident, placement.predicted_decode_tokens_per_s)
        if not accelerator:
            assert HOST not in placement.budgets and set(tiers.values()) <= {DEVICE, DISK}
    assert before[0] < 128 * 48  # 28.5 GiB of INT8 weights: even 24gb streams some experts


@pytest.mark.slow
def test_cpu_prediction_is_the_disk_reading_the_missed_experts(config):
    """On the CPU box with everything dense resident, a token reads top_k x (1 - hit) x expert
    bytes per layer from disk, which binds: tok/s = disk bandwidth / those bytes."""
    sizes = sizes_from_config(config, "int8")
    expert_bytes = sizes.nbytes[expert_block(0, 0)]
    for name in PROFILES:
        placement = make_plan(config, name, False)
        missed = sum(config.moe.top_k * (1 - x.hit_rate) * expert_bytes for x in placement.expert_layers)
        assert placement.binding_limit == "disk"
        assert placement.predicted_decode_tokens_per_s == pytest.approx(CPU.disk_bytes_per_s / missed)


# -- routing counts --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("accelerator", MODES)
def test_skewed_counts_make_the_hottest_experts_resident_and_raise_hit_rate_and_speed(config, accelerator):
    counts = skewed_counts(config)
    for name in PROFILES:
        uniform = make_plan(config, name, accelerator)
        skewed = make_plan(config, name, accelerator, routing=counts)
        tiers = expert_tiers(skewed)
        assert skewed.expert_slots == uniform.expert_slots  # the same room, better used
        # Resident experts are the top-counted ones, across all layers.
        hot = [counts.count(layer, e) for (layer, e), t in tiers.items() if t == DEVICE]
        cold = [counts.count(layer, e) for (layer, e), t in tiers.items() if t != DEVICE]
        assert min(hot) >= max(cold)
        # The expected hit rate is the resident experts' share of the picks.
        for x in skewed.expert_layers:
            resident = [e for (layer, e), t in tiers.items() if layer == x.layer and t == DEVICE]
            assert x.resident == len(resident)
            assert x.hit_rate == pytest.approx(sum(counts.share(x.layer)[e] for e in resident))
            assert x.hit_rate == pytest.approx(counts.hit_rate(x.layer, resident))
        hit = sum(x.hit_rate for x in skewed.expert_layers) / 48
        uniform_hit = sum(x.hit_rate for x in uniform.expert_layers) / 48
        assert hit > uniform_hit + 0.1, name
        assert skewed.predicted_decode_tokens_per_s > 1.2 * uniform.predicted_decode_tokens_per_s, name
        for tier, budget in skewed.budgets.items():
            if budget is not None:
                assert skewed.total(tier) <= budget


@pytest.mark.slow
def test_decode_terms_reproduce_the_planned_step_without_the_counts(config):
    """A measured run is compared with decode_terms of the placement; without the counts it uses
    each layer's planned hit rate, and gives the plan's own prediction."""
    counts = skewed_counts(config)
    sizes = sizes_from_config(config, "int8")
    profile = load_profile("16gb")
    placement = make_plan(config, profile, False, routing=counts)
    for routing in (None, counts):
        terms = decode_terms(config, sizes, profile, CPU, placement, accelerator=False, routing=routing)
        seconds, _ = step_seconds(terms, profile.prefetch_depth)
        assert 1 / seconds == pytest.approx(placement.predicted_decode_tokens_per_s, rel=1e-6)


def test_counts_are_read_beside_the_artifact(tmp_path, config):
    counts = skewed_counts(config)
    counts.save(tmp_path / COUNTS_NAME)
    predicted = sizes_from_config(config, "int8")
    from_artifact = replace(predicted, source=str(tmp_path))
    read = expected_routing(config, from_artifact)
    assert read.ranked(5) == counts.ranked(5) and read.share(5) == pytest.approx(counts.share(5))
    assert expected_routing(config, predicted).share(5) == [1 / 128] * 128  # config.json alone: uniform
    dense = replace(config, moe=None)
    assert expected_routing(dense, predicted) is None


# -- host compute beside an accelerator -------------------------------------------------------------


@pytest.mark.slow
def test_cold_host_experts_compute_on_the_cpu_when_a_host_matmul_beats_the_link(config):
    sizes = sizes_from_config(config, "int8", accelerator=True)
    block = expert_block(0, 0)
    nbytes, params = sizes.nbytes[block], sizes.params[block]
    slow_cpu = replace(GPU, host_bytes_per_s=5e9)  # slower than the 25 GB/s link
    assert host_computes_expert(GPU, nbytes, params) and not host_computes_expert(slow_cpu, nbytes, params)
    for bandwidths, where in ((GPU, HOST), (slow_cpu, DEVICE)):
        placement = make_plan(config, "16gb", True, bandwidths=bandwidths)
        host = [b for b in placement.blocks if is_expert(b.name) and b.tier == HOST]
        assert host and {b.compute for b in host} == {where}
        assert all(b.streamed == (where == DEVICE) for b in host)
        computed = sum(x.host_computed for x in placement.expert_layers)
        assert computed == (len(host) if where == HOST else 0)
        # The CPU computing experts needs its workspace in the host tier.
        assert (placement.charges[HOST]["workspace"] > 0) == (where == HOST)
        assert placement.total(HOST) <= placement.budgets[HOST]
    # Computing them where they lie beats copying them: the cost model says so for this placement.
    profile = load_profile("16gb")
    chosen = make_plan(config, profile, True)
    copied = replace(chosen, blocks=tuple(replace(b, compute=DEVICE) if is_expert(b.name) and b.tier == HOST else b
                                          for b in chosen.blocks))  # fmt: skip
    seconds = {}
    for name, placement in (("chosen", chosen), ("copied", copied)):
        terms = decode_terms(config, sizes, profile, GPU, placement, accelerator=True)
        seconds[name] = step_seconds(terms, profile.prefetch_depth)[0]
    assert seconds["chosen"] < seconds["copied"]
    assert 1 / seconds["chosen"] == pytest.approx(chosen.predicted_decode_tokens_per_s, rel=1e-6)


def test_emulated_host_tier_copies_host_experts_into_the_device_tier(config):
    profile = replace(load_profile("16gb"), device_memory=8 * GiB, host_memory=6 * GiB, emulate_host_tier=True)
    placement = make_plan(config, profile, False)
    tiers = set(expert_tiers(placement).values())
    assert tiers == {DEVICE, HOST, DISK}
    host = [b for b in placement.blocks if is_expert(b.name) and b.tier == HOST]
    assert all(b.compute == DEVICE and b.streamed for b in host)  # one processor: never host-computed
    assert placement.total(DEVICE) <= 8 * GiB and placement.total(HOST) <= 6 * GiB
    assert placement.charges[HOST]["expert_stream"] == 0  # CPU disk reads land in the stream slots


# -- budgets, refusals, dense models ---------------------------------------------------------------


@pytest.mark.slow
def test_without_disk_offload_the_experts_must_fit_or_the_plan_is_refused(config):
    fits = replace(load_profile("24gb"), device_memory=40 * GiB, disk_offload=False)
    placement = make_plan(config, fits, False)
    assert placement.expert_slots == 128 * 48 and placement.expert_stream_slots == 0
    assert placement.charges[DEVICE]["expert_stream"] == 0 and placement.fully_resident
    with pytest.raises(TierlmError, match="disk_offload is false") as refused:
        make_plan(config, replace(load_profile("24gb"), disk_offload=False), False)
    assert "28.56 GiB" in str(refused.value)  # the weights, experts included (fp32 routers)


def test_all_experts_resident_needs_no_stream_slots_and_a_tiny_budget_keeps_none():
    """A small MoE-shaped BlockSizes: everything resident when it fits; with room for the dense
    part only, every expert streams and the device still holds its stream slots."""
    config = read_config(QWEN3_30B)
    config = replace(config, num_hidden_layers=2, vocab_size=1024, moe=replace(config.moe, sparse_layers=(0, 1)))
    sizes = sizes_from_config(config, "int8")
    assert sum(1 for n in sizes.names if is_expert(n)) == 256
    roomy = replace(load_profile("8gb"), device_memory=4 * GiB)
    placement = plan(config, sizes, roomy, CPU, accelerator=False, baseline_bytes=BASELINE)
    assert placement.expert_slots == 256 and placement.expert_stream_slots == 0
    assert all(x.hit_rate == pytest.approx(1.0) for x in placement.expert_layers)
    fixed = placement.total(DEVICE) - placement.charges[DEVICE]["experts"]
    tight = replace(roomy, device_memory=fixed + 16 * sizes.nbytes[expert_block(0, 0)] + 2 * MiB)
    placement = plan(config, sizes, tight, CPU, accelerator=False, baseline_bytes=BASELINE)
    assert placement.expert_slots == 0 and placement.charges[DEVICE]["expert_stream"] > 0
    assert placement.total(DEVICE) <= tight.device_memory


def test_dense_models_have_no_expert_charges(tmp_path):
    raw = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
           "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1000, "rms_norm_eps": 1e-5}  # fmt: skip
    config = config_from_dict(raw)
    sizes = sizes_from_config(config, "int8")
    placement = plan(config, sizes, load_profile("4gb"), CPU, accelerator=False, baseline_bytes=BASELINE)
    assert config.moe is None and placement.expert_layers == () and placement.expert_slots == 0
    assert "experts" not in placement.charges[DEVICE] and "expert_stream" not in placement.charges[DEVICE]
    assert isinstance(sizes, BlockSizes) and not any(is_expert(n) for n in sizes.names)


# -- `tierlm plan` ----------------------------------------------------------------------------------


def test_plan_cli_shows_experts_per_layer_range(config):
    from tierlm.probe.record import save_bandwidths

    save_bandwidths(CPU, "cpu")
    run = run_tierlm("plan", "--model", str(QWEN3_30B), "--profile", "16gb", "--device", "cpu", "--json")
    assert run.returncode == 0, run.stderr
    shown = json.loads(run.stdout)
    expected = plan(config, sizes_from_config(config, "int8"), load_profile("16gb"), CPU, accelerator=False,
                    baseline_bytes=shown["charges"]["device"]["baseline"])  # fmt: skip
    assert shown == json.loads(json.dumps(placement_to_dict(expected)))
    assert len(shown["expert_layers"]) == 48 and shown["expert_slots"] > 0

    from tierlm.cli.plan_view import describe, expert_rows

    rows = expert_rows(expected)
    # Equal layers grouped: uniform counts leave at most two resident counts, in two ranges.
    spans = [tuple(int(i) for i in r["layers"].split("-")) for r in rows]
    assert 1 <= len(rows) <= 2 and [layer for span in spans for layer in range(span[0], span[-1] + 1)] == list(range(48))
    assert rows[0]["resident"] == rows[-1]["resident"] + (len(rows) - 1)
    text = describe(expected)
    assert f"{rows[0]['resident']}/128" in text and f"{rows[0]['hit_rate'] * 100:.1f}%" in text
    assert "experts.0.0" not in text and "expert_stream" in text and "stream slots" in text
