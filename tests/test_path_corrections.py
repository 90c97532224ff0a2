"""Honest predictions (issue 24 item 4): a measured run corrects the figures of the path it ran.

A run that streamed from disk says how fast streaming was, not how fast resident weights are read:
its correction blames the tier it streamed from and applies to streamed plans only, so the
resident prediction stays what it was (the bug: a tight-profile bench slowed the resident
prediction from 17.1 to 10.7 tok/s, and the next resident run measured 1.26x that). `plan` names
the measurement behind each figure it predicts with.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tests.cli_runner import run_tierlm
from tests.test_planner import CPU, MODELS
from tierlm.models import read_config
from tierlm.offload.bandwidths import Correction, decode_path
from tierlm.offload.planner.cost import decode_terms, placement_path, step_seconds
from tierlm.offload.planner.search import plan
from tierlm.offload.sizes import sizes_from_config
from tierlm.probe.measured import assess
from tierlm.probe.record import ProbeRecord, bandwidths_path, read_probe, record_measured_run, save_bandwidths
from tierlm.profile import load_profile, profile_from_dict

MiB = 2**20
BASELINE = 300 * MiB
# SmolLM2-135M's public config (the embedded model's shape).
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}  # fmt: skip
# The artifact's pages are cached by the OS: reading "from disk" is predicted faster than computing,
# so the streamed plan is predicted compute-bound, as the tight-profile bench of the issue was.
CACHED_DISK = replace(CPU, disk_bytes_per_s=40e9)


def tight(baseline: int = BASELINE):
    """A CPU-only profile that holds the embedding and about half of smollm2's layers."""
    return profile_from_dict("tight", dict(description="d", device_memory=baseline + 160 * MiB, host_memory="1GiB",
                                           disk_offload=True, headroom="8MiB", quant="int8", kv_cache="auto",
                                           context_length=1024, batch_size=1, prefetch_depth=1))  # fmt: skip


@pytest.fixture()
def smollm2(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    config = read_config(tmp_path)
    return config, sizes_from_config(config, "int8")


def placed(smollm2, profile, bandwidths):
    config, sizes = smollm2
    placement = plan(config, sizes, profile, bandwidths, accelerator=False, baseline_bytes=BASELINE)
    loaded = SimpleNamespace(config=config, sizes=sizes, placement=placement, device=SimpleNamespace(type="cpu"))
    return placement, loaded


def test_a_slow_streamed_run_corrects_the_disk_figure_for_streamed_plans_only(smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    resident, _ = placed(smollm2, load_profile("24gb"), CACHED_DISK)
    streamed, loaded = placed(smollm2, tight(), CACHED_DISK)
    assert placement_path(resident) == "resident" and placement_path(streamed) == "streamed"
    assert streamed.binding_limit == "device bandwidth", "predicted compute-bound, as the issue's bench was"

    # The tight bench measures half the predicted speed; it is recorded in the probe's cache.
    save_bandwidths(CACHED_DISK, "cpu", probed_at=1000.0)
    measured = streamed.predicted_decode_tokens_per_s / 2
    record = record_measured_run("cpu", lambda figures: assess(loaded, tight(), figures, measured, "bench tight"))
    assert record.last_run["path"] == "streamed" and record.last_run["corrected"]
    corrected = read_probe(bandwidths_path("cpu")).bandwidths
    assert corrected == record.bandwidths, "the correction survives the cache file"
    fix = corrected.correction("streamed")
    assert [name for name, _ in fix.factors] == ["disk_bytes_per_s"], "the tier it streamed from is blamed"
    assert fix.source == "bench tight" and corrected.correction("resident") is None

    # The resident plan predicts what it did; the streamed plan predicts what was measured.
    assert placed(smollm2, load_profile("24gb"), corrected)[0] == resident
    again, _ = placed(smollm2, tight(), corrected)
    assert again.predicted_decode_tokens_per_s == pytest.approx(measured, rel=1e-9)
    assert again.binding_limit == "disk" and again.blocks == streamed.blocks
    disk = next(f for f in again.decode_sources if f.name == "disk_bytes_per_s")
    assert (disk.source, disk.path, disk.value) == ("bench tight", "streamed", pytest.approx(corrected.for_path("streamed").disk_bytes_per_s))
    ram = next(f for f in again.decode_sources if f.label == "RAM")
    assert ram.source is None and ram.value == CACHED_DISK.device_bytes_per_s, "RAM stays the probe's"


def test_a_resident_run_corrects_resident_plans_and_leaves_streamed_ones(smollm2, tmp_path, monkeypatch):
    resident, loaded = placed(smollm2, load_profile("24gb"), CACHED_DISK)
    streamed, _ = placed(smollm2, tight(), CACHED_DISK)
    run, corrected = assess(loaded, load_profile("24gb"), CACHED_DISK, resident.predicted_decode_tokens_per_s * 2, "bench r")
    assert run["path"] == "resident" and corrected.correction("resident") is not None
    assert corrected.for_path("streamed") == CACHED_DISK == corrected.for_path("moe")
    assert placed(smollm2, tight(), corrected)[0] == streamed
    faster = placed(smollm2, load_profile("24gb"), corrected)[0]
    assert faster.predicted_decode_tokens_per_s == pytest.approx(2 * resident.predicted_decode_tokens_per_s, rel=1e-9)
    assert {f.source for f in faster.decode_sources} == {"bench r"}, "every figure it rests on was corrected"


def test_a_correction_round_trips_and_a_record_without_any_still_reads(tmp_path):
    fix = Correction("moe", (("disk_bytes_per_s", 0.5),), "bench q", 12.0)
    figures = CPU.corrected("moe", replace(CPU, disk_bytes_per_s=1e9), "bench q", 12.0)
    assert figures.path_corrections == (fix,) and figures.for_path("moe").disk_bytes_per_s == 1e9
    assert CPU.from_dict(json.loads(json.dumps(figures.to_dict()))) == figures
    old = {k: v for k, v in CPU.to_dict().items() if k != "path_corrections"}
    record = ProbeRecord.from_dict({**old, "probed_at": 5.0, "corrections": [{"source": "an old run"}]})
    assert record.bandwidths == CPU and record.corrections == ({"source": "an old run"},)
    assert decode_path(["device", "disk"], False) == "streamed" and decode_path(["device"], True) == "moe"


def test_plan_names_the_measurement_behind_each_figure(tmp_path, monkeypatch):
    """Through the real `tierlm plan`: a recorded streamed-run correction shows on the streamed
    plan's disk figure with its run and date; the resident plan's RAM figure is the probe's."""
    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(MODELS["llama-2-7b"]))
    at = time.mktime((2026, 12, 1, 14, 2, 0, 0, 0, -1))
    figures = CPU.corrected("streamed", replace(CPU, disk_bytes_per_s=1e9), "bench m, profile 8gb", at)
    path = bandwidths_path("cpu", threads=1)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(ProbeRecord(figures, probed_at=time.time()).to_dict()))

    def shown(profile: str) -> list[str]:
        done = run_tierlm("plan", "--model", str(tmp_path / "m"), "--profile", profile, "--device", "cpu", "--threads", "1")
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("decode "))
        return [line[9:] for line in lines[start + 1:] if line.startswith(("from ", "         "))]

    streamed = shown("8gb")
    assert streamed[0] == "disk 1.00 GB/s measured by bench m, profile 8gb on 2026-12-01 14:02 (streamed)", streamed
    assert "RAM 20.00 GB/s probed (streamed)" in streamed
    assert shown("24gb")[0] == "RAM 20.00 GB/s probed (resident)"


def test_a_run_deep_in_a_long_context_is_compared_at_its_position_and_corrects_nothing(smollm2):
    """At 6,000 positions attention over the KV cache (compute the probe does not measure) is a
    large share of a step: the run is recorded against the prediction there, and the figures are
    not bent to explain it (the bug: an 8k-context bench taught the resident path 10x too slow)."""
    profile = replace(load_profile("24gb"), context_length=8192)
    resident, loaded = placed(smollm2, profile, CACHED_DISK)
    slow = resident.predicted_decode_tokens_per_s / 10
    run, corrected = assess(loaded, profile, CACHED_DISK, slow, "bench deep", position=6000)
    assert corrected is None and run["position"] == 6000
    # The KV read is predicted: slower than at the start, faster than at the context's end (8,192).
    assert resident.predicted_decode_full_context_tokens_per_s < run["predicted_tok_s"] < resident.predicted_decode_tokens_per_s
    # Near the start of the conversation the same measurement does correct the resident figures.
    assert assess(loaded, profile, CACHED_DISK, slow, "bench short", position=100)[1] is not None
