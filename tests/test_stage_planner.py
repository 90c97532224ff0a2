"""Planning a pipeline stage (issue 16): a stage's blocks under its own budget, and the split of
a model's layers over several stages (offload/stage_planner.py)."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from tests.test_planner import config_and_sizes
from tierlm.models import read_config
from tierlm.stages import StageSpan, even_split
from tierlm.errors import TierlmError
from tierlm.offload.placement import DEVICE, DISK, placement_to_dict
from tierlm.offload.planner.search import plan
from tierlm.offload.bandwidths import Bandwidths
from tierlm.offload.sizes import kv_cache_bytes, sizes_from_config, workspace_bytes
from tierlm.offload.stage_planner import Link, split_stages
from tierlm.profile import load_profile

MiB, GiB = 2**20, 2**30
BASELINE = 400 * MiB
DATA = Path(__file__).parent / "data"
LLAMA_70B = DATA / "llama-2-70b"
# A consumer GPU (PCIe 4.0 x16) and a desktop CPU as the cost model sees them (tests/test_planner.py's).
GPU = Bandwidths(device_bytes_per_s=800e9, host_bytes_per_s=40e9, link_bytes_per_s=25e9, disk_bytes_per_s=3e9,
                 device_flops=100e12, host_flops=1e12, per_block_overhead_s=30e-6, per_token_overhead_s=2e-3,
                 device="cuda")  # fmt: skip
CPU = Bandwidths(device_bytes_per_s=20e9, host_bytes_per_s=20e9, link_bytes_per_s=10e9, disk_bytes_per_s=2e9,
                 device_flops=500e9, host_flops=500e9, per_block_overhead_s=50e-6, per_token_overhead_s=3e-3)  # fmt: skip
TIED_3B = {"model_type": "qwen2", "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
           "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
           "tie_word_embeddings": True}  # fmt: skip


@pytest.fixture(scope="module")
def llama70b():
    config = read_config(LLAMA_70B)
    return config, sizes_from_config(config, "int8", accelerator=True)


@pytest.fixture(scope="module")
def tied3b(tmp_path_factory):
    return config_and_sizes(tmp_path_factory.mktemp("tied"), TIED_3B)


def stage_plan(config, sizes, span, profile, bandwidths, accelerator):
    tied = sizes.source_block("head") == "embed"
    return plan(config, sizes.only(span.blocks(sizes.names, tied)), profile, bandwidths, accelerator=accelerator,
                baseline_bytes=BASELINE, layers=span.layers)  # fmt: skip


# -- one stage's plan ---------------------------------------------------------------------------


def test_the_whole_range_with_every_block_is_the_whole_model_plan(llama70b):
    config, sizes = llama70b
    for profile, accelerator in (("24gb", True), ("24gb", False), ("8gb", True)):
        bandwidths = GPU if accelerator else CPU
        whole = plan(config, sizes, load_profile(profile), bandwidths, accelerator=accelerator, baseline_bytes=BASELINE)
        ranged = plan(config, sizes.only(sizes.names), load_profile(profile), bandwidths, accelerator=accelerator,
                      baseline_bytes=BASELINE, layers=range(config.num_hidden_layers))  # fmt: skip
        assert placement_to_dict(ranged) == placement_to_dict(whole)


def test_a_stage_is_charged_its_own_layers_kv_cache_and_only_its_blocks(llama70b):
    config, sizes = llama70b
    profile = load_profile("24gb")
    spans = even_split(config.num_hidden_layers, 4)
    placements = [stage_plan(config, sizes, span, profile, GPU, True) for span in spans]
    whole_kv = kv_cache_bytes(config, profile, True)
    for span, placement in zip(spans, placements):
        names = [b.name for b in placement.blocks]
        assert names == list(span.blocks(sizes.names))
        assert ("embed" in names) == span.is_first and ("head" in names) == span.is_last
        assert placement.charges[DEVICE]["kv_cache"] == whole_kv * len(span.layers) // config.num_hidden_layers
        # 20 layers of a 70B in INT8 (~16 GiB) fit a 24gb GPU whole.
        assert all(b.tier == DEVICE for b in placement.blocks)
    # Only the first (sampling) and the last (head) stage hold a step's logits.
    logits = workspace_bytes(config, sizes, profile, True) - workspace_bytes(config, sizes, profile, True, logits=False)
    assert logits > 0
    workspace = [p.charges[DEVICE]["workspace"] for p in placements]
    assert workspace[1] == workspace[2] and workspace[0] - workspace[1] >= logits - 1
    # The per-token overhead is the first stage's alone; the middle stages' steps are equal.
    times = [1 / p.predicted_decode_tokens_per_s for p in placements]
    assert times[1] == pytest.approx(times[2]) and times[0] > times[1] + 1.5e-3


def test_a_middle_stage_may_stream_every_layer_and_a_tied_last_stage_keeps_the_embedding(tied3b):
    config, sizes = tied3b
    tight = replace(load_profile("4gb"), device_memory=GiB, headroom=64 * MiB)
    first, middle, last = even_split(config.num_hidden_layers, 3)
    planned = stage_plan(config, sizes, middle, replace(tight, device_memory=850 * MiB), CPU, False)
    assert [b.tier for b in planned.blocks] == [DISK] * len(middle.layers)
    assert planned.binding_limit == "disk"
    # The tied last stage holds the embedding the head reads, resident with the norm and head.
    with pytest.raises(TierlmError, match=r"layers 24-35 of 36, int8.*short by"):
        stage_plan(config, sizes, last, tight, CPU, False)
    kept = stage_plan(config, sizes, last, replace(tight, device_memory=2 * GiB), CPU, False)
    assert {b.name: b.tier for b in kept.blocks}["embed"] == DEVICE
    assert {b.name: b.tier for b in kept.blocks}["head"] == DEVICE


def test_stage_sizes_and_layers_must_agree(llama70b):
    config, sizes = llama70b
    span = even_split(config.num_hidden_layers, 4)[1]
    with pytest.raises(ValueError, match="sizes hold layers"):
        plan(config, sizes.only(span.blocks(sizes.names)), load_profile("24gb"), GPU, accelerator=True,
             baseline_bytes=BASELINE, layers=range(0, 20))  # fmt: skip
    with pytest.raises(ValueError, match="not among"):
        sizes.only(["layers.80"])
    tied = sizes_from_config(replace(config, tie_word_embeddings=True), "int8")
    with pytest.raises(ValueError, match="keep both"):
        tied.only(["head", "norm"])


# -- the split over stages ------------------------------------------------------------------------

LINK = Link(bytes_per_s=1.25e9, latency_s=50e-6, source="test: 10 Gbit/s Ethernet")
# Equal layers and no per-token cost: the only uneven things are the embedding and the head.
UNIFORM = replace(GPU, per_token_overhead_s=0.0)
# Llama-2-70B's layers, 12 of them (0.8 GiB each in INT8): small enough to try every split.
SMALL = {**json.loads((LLAMA_70B / "config.json").read_text()), "num_hidden_layers": 12}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return config_and_sizes(tmp_path_factory.mktemp("small"), SMALL, accelerator=True)


def split(config, sizes, profiles, bandwidths=GPU, accelerator=True):
    profiles = [load_profile(p) if isinstance(p, str) else p for p in profiles]
    return split_stages(config, sizes, profiles, bandwidths, LINK, accelerator=accelerator, baseline_bytes=BASELINE)


def counts(stage_plan) -> list[int]:
    return [len(span.layers) for span in stage_plan.spans]


def brute_force_bottleneck(config, sizes, profiles, bandwidths) -> float:
    """The least slowest-stage time over every split, each stage planned on its own."""
    layers, world = config.num_hidden_layers, len(profiles)
    best = float("inf")
    for cuts in itertools.combinations(range(1, layers), world - 1):
        bounds = [0, *cuts, layers]
        worst = 0.0
        for rank in range(world):
            span = StageSpan(rank, world, bounds[rank], bounds[rank + 1])
            try:
                placement = stage_plan(config, sizes, span, profiles[rank], bandwidths, True)
            except TierlmError:
                worst = float("inf")
                break
            worst = max(worst, profiles[rank].batch_size / placement.predicted_decode_tokens_per_s)
        best = min(best, worst)
    return best


@pytest.mark.slow
def test_llama_2_70b_int8_plans_over_four_24gb_stages(llama70b):
    config, sizes = llama70b
    planned = split(config, sizes, ["24gb"] * 4)
    # ~20 layers (~16 GiB) each, every stage resident; rank 0's per-token cost may cost it a layer.
    assert all(abs(count - 20) <= 1 for count in counts(planned))
    covered = [b.name for stage in planned.stages for b in stage.placement.blocks]
    assert covered == list(sizes.names)  # every block once, in order
    for stage in planned.stages:
        assert all(b.tier == DEVICE for b in stage.placement.blocks)
        for tier, budget in stage.placement.budgets.items():
            assert budget is None or stage.placement.total(tier) <= budget
    # Batch 1: the stages and transfers add up: three hand-overs of 8192 bf16 values, the logits back.
    assert planned.handover_bytes() == 8192 * 2 and planned.return_bytes() == 32000 * 4
    handover, back = planned.transfer_seconds()
    assert handover == pytest.approx(50e-6 + 16384 / 1.25e9) and back == pytest.approx(50e-6 + 128000 / 1.25e9)
    total = sum(s.step_seconds for s in planned.stages) + 3 * handover + back
    assert planned.tokens_per_s() == pytest.approx(1 / total)
    # One 24gb card streams most of the model from host RAM and disk: the pipeline is >10x faster.
    alone = plan(config, sizes, load_profile("24gb"), GPU, accelerator=True, baseline_bytes=BASELINE)
    assert planned.tokens_per_s() > 10 * alone.predicted_decode_tokens_per_s


@pytest.mark.slow
def test_a_model_one_card_cannot_hold_is_refused_with_the_stages_that_would(llama70b):
    config, sizes = llama70b
    in_memory = replace(load_profile("24gb"), disk_offload=False)  # weights in GPU + host memory only
    with pytest.raises(TierlmError) as refused:
        split(config, sizes, [in_memory])
    assert "rank 0 (24gb) cannot hold layers 0-79" in refused.value.message
    assert "short by" in refused.value.message or "more than" in refused.value.message
    assert "--stages 2" in refused.value.hint
    assert counts(split(config, sizes, [in_memory] * 2)) == [40, 40]
    # Four 8 GB cards hold 4 x ~15 GiB of 64 GiB: the last stage is left short, by a named amount.
    with pytest.raises(TierlmError, match=r"rank 3 \(8gb\) cannot hold layers \d+-79.*need [\d.]+ GiB more") as short:
        split(config, sizes, [replace(load_profile("8gb"), disk_offload=False)] * 4)
    assert re.search(r"--stages \d+", short.value.hint)


def test_a_uniform_model_splits_evenly_and_the_bottleneck_is_the_least(small, llama70b):
    config, sizes = small
    for world in (2, 3, 4):
        planned = split(config, sizes, ["24gb"] * world, UNIFORM)
        assert max(counts(planned)) - min(counts(planned)) <= 1
        assert planned.bottleneck.step_seconds == pytest.approx(
            brute_force_bottleneck(config, sizes, [load_profile("24gb")] * world, UNIFORM), rel=1e-9)
    config, sizes = llama70b
    assert counts(split(config, sizes, ["24gb"] * 5, UNIFORM)) == [16] * 5


@pytest.mark.slow
def test_uneven_profiles_get_uneven_splits(small, llama70b):
    config, sizes = small
    # A 4 GB card holds 3 of these layers resident beside its KV cache; a fourth would stream.
    profiles = [load_profile("24gb"), load_profile("4gb"), load_profile("24gb")]
    planned = split(config, sizes, profiles, UNIFORM)
    assert counts(planned)[1] < min(counts(planned)[0], counts(planned)[2])
    assert all(b.tier == DEVICE for b in planned.stages[1].placement.blocks)
    assert planned.bottleneck.step_seconds == pytest.approx(
        brute_force_bottleneck(config, sizes, profiles, UNIFORM), rel=1e-9)
    config, sizes = llama70b
    planned = split(config, sizes, ["24gb", "24gb", "16gb", "8gb"])
    assert counts(planned)[3] < counts(planned)[2] < min(counts(planned)[:2])
    even = [stage_plan(config, sizes, span, load_profile(p), GPU, True)
            for span, p in zip(even_split(80, 4), ["24gb", "24gb", "16gb", "8gb"])]  # fmt: skip
    assert planned.bottleneck.step_seconds < max(1 / p.predicted_decode_tokens_per_s for p in even)


def test_each_stage_is_the_plan_its_rank_would_load(llama70b, tied3b):
    for (config, sizes), profiles, accelerator in ((llama70b, ["24gb", "16gb", "24gb"], True),
                                                   (tied3b, ["4gb", "4gb"], False)):  # fmt: skip
        bandwidths = GPU if accelerator else CPU
        planned = split(config, sizes, profiles, bandwidths, accelerator)
        for stage, profile in zip(planned.stages, profiles):
            alone = stage_plan(config, sizes, stage.span, load_profile(profile), bandwidths, accelerator)
            assert placement_to_dict(stage.placement) == placement_to_dict(alone)


@pytest.mark.slow
def test_a_batch_in_micro_batches_is_priced_round_the_ring(llama70b):
    config, sizes = llama70b
    planned = split(config, sizes, [replace(load_profile("24gb"), batch_size=4)] * 4)
    assert planned.batch == 4
    one, four = planned.stage_seconds(1), planned.stage_seconds(4)
    assert all(b >= a for a, b in zip(one, four))  # weight-bound decode: rows come (nearly) free
    (h1, r1), (h4, r4) = planned.transfer_seconds(1), planned.transfer_seconds(4)
    assert h4 > h1 and r4 > r1
    # One group of 4 goes round once; 4 groups of 1 each go round, no stage on two at once.
    assert planned.decode_seconds(4, 1) == pytest.approx(sum(four) + 3 * h4 + r4)
    assert planned.decode_seconds(4, 4) == pytest.approx(max(sum(one) + 3 * h1 + r1, 4 * max(*one, h1, r1)))
    assert planned.tokens_per_s(4, 4) == pytest.approx(4 / planned.decode_seconds(4, 4))
    # Batch 1 is the sum of every stage and transfer, however many groups are asked for.
    assert planned.decode_seconds(1, 4) == pytest.approx(sum(one) + 3 * h1 + r1)


# -- the link probe and `tierlm plan --stages` ----------------------------------------------------


def test_a_given_link_is_taken_as_given_and_a_cached_one_is_read_back(tmp_path):
    """The link's figures without measuring (the test below measures two gloo processes): given
    by hand, and a record written and read back; a record of another version is not read."""
    from tierlm.probe.link import LINK_VERSION, gbps_link, link_record, read_link, save_link

    given = gbps_link(10, 0.2)
    assert given.bytes_per_s == 1.25e9 and given.latency_s == pytest.approx(2e-4) and given.probed_at is None
    with pytest.raises(TierlmError, match="--link-gbps"):
        gbps_link(0, 0.1)
    record = link_record(2.5e9, 3e-5)
    path = save_link(record, tmp_path / "probe" / "link.json")
    cached = read_link(path)
    assert (cached.bytes_per_s, cached.latency_s, cached.probed_at) == (2.5e9, 3e-5, record["probed_at"])
    path.write_text(json.dumps({**record, "version": LINK_VERSION + 1}))
    assert read_link(path) is None and read_link(tmp_path / "missing.json") is None


@pytest.mark.e2e
def test_the_link_probe_measures_two_gloo_processes_caches_and_reprobes(monkeypatch, tmp_path):
    from tierlm.probe.link import gbps_link, link_path, load_link

    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path))
    measured = load_link()
    assert link_path().is_file()
    # Local gloo over loopback: well above 10 MB/s, a round trip well under 50 ms.
    assert 1e7 < measured.bytes_per_s < 1e12 and 0 < measured.latency_s < 0.05
    assert load_link() == measured  # read back, not measured again
    again = load_link(refresh=True)
    assert again.probed_at > measured.probed_at
    given = gbps_link(10, 0.2)
    assert given.bytes_per_s == 1.25e9 and given.latency_s == pytest.approx(2e-4) and given.probed_at is None
    with pytest.raises(TierlmError, match="--link-gbps"):
        gbps_link(0, 0.1)


def tierlm(*args: str):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "tierlm", *args], capture_output=True, text=True, timeout=300,
                          env=os.environ.copy())  # fmt: skip


@pytest.mark.e2e
def test_plan_stages_cli_shows_each_stage_as_its_rank_would_plan_it(tmp_path):
    import subprocess
    import sys

    from tierlm.probe.record import save_bandwidths

    # Pin the bandwidths the CLI finds in its cache (the path depends on the child's thread count).
    where = subprocess.run(
        [sys.executable, "-c", "from tierlm.probe.record import bandwidths_path; print(bandwidths_path('cpu'))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    save_bandwidths(CPU, "cpu")
    assert Path(where.stdout.strip()).is_file()
    args = ("plan", str(LLAMA_70B), "--device", "cpu", "--link-gbps", "10", "--link-latency-ms", "0.1")
    shown = json.loads(tierlm(*args, "--stages", "4", "--json").stdout)
    assert [(s["first"], s["end"]) for s in shown["stages"]] == [(0, 20), (20, 40), (40, 60), (60, 80)]
    assert shown["link"]["bytes_per_s"] == 1.25e9 and shown["handover_bytes"] == 8192 * 4  # fp32 on CPUs
    config = read_config(LLAMA_70B)
    sizes = sizes_from_config(config, "int8")
    for stage, span in zip(shown["stages"], even_split(80, 4)):
        baseline = stage["placement"]["charges"]["device"]["baseline"]  # the child's RSS, as a load charges it
        alone = plan(config, sizes.only(span.blocks(sizes.names)), load_profile("24gb"), CPU, accelerator=False,
                     baseline_bytes=baseline, layers=span.layers)  # fmt: skip
        assert stage["placement"] == json.loads(json.dumps(placement_to_dict(alone)))
    text = tierlm(*args, "--stages", "3", "--profile", "24gb,24gb,8gb")
    assert text.returncode == 0, text.stderr
    assert re.search(r"^2 +\d+-79 +8gb ", text.stdout, re.M) and "hand-over" in text.stdout
    assert re.search(r"decode +[\d.]+ tokens/s \(predicted, batch 1\)", text.stdout)
    # One 24 GB card without disk streaming cannot hold it: the refusal says how many stages would.
    no_disk = tmp_path / "24gb-in-memory.toml"
    no_disk.write_text((Path(__file__).parents[1] / "tierlm/profiles/24gb.toml").read_text()
                       .replace("disk_offload = true", "disk_offload = false"))  # fmt: skip
    refused = tierlm("plan", str(LLAMA_70B), "--device", "cpu", "--profile", str(no_disk))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert re.search(r"--stages \d+", refused.stderr) and "disk_offload is false" in refused.stderr
    wrong = tierlm(*args, "--stages", "3", "--profile", "24gb,8gb")
    assert wrong.returncode == 1 and "lists 2 profiles for 3 stages" in wrong.stderr


@pytest.mark.slow
def test_a_mixture_of_experts_stage_places_its_own_layers_experts():
    from tierlm.blocks import expert_of

    config = read_config(DATA / "qwen3-30b-a3b")
    sizes = sizes_from_config(config, "int8")
    planned = split(config, sizes, ["16gb", "8gb"], CPU, accelerator=False)
    placed = [b.name for stage in planned.stages for b in stage.placement.blocks]
    assert sorted(placed) == sorted(sizes.names)  # every block, expert or not, in exactly one stage
    for stage in planned.stages:
        layers = {x.layer for x in stage.placement.expert_layers}
        assert layers == set(stage.span.layers) & set(config.moe.sparse_layers)
        experts = [b for b in stage.placement.blocks if expert_of(b.name) is not None]
        assert all(expert_of(b.name)[0] in stage.span.layers for b in experts)
        assert 0 < stage.placement.expert_slots < len(experts)  # some resident, the rest cold
