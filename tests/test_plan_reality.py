"""Plan = what happens: `tierlm plan` places the blocks the real load places under tight
profiles, measured runs correct a probe that mispredicts, and the plan says how old its probe is.

The CLI tests run `tierlm plan` and `tierlm bench` in fresh child processes (as users do), on the
embedded model, with a fixed probe written into the cache so no child probes the machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from tierlm.models import read_config
from tierlm.offload.planner.cost import decode_terms, implied_bandwidths, step_seconds
from tierlm.offload.planner.search import plan
from tierlm.offload.bandwidths import Bandwidths
from tierlm.probe.record import ProbeRecord, bandwidths_path, read_probe, record_measured_run, save_bandwidths
from tierlm.offload.sizes import sizes_from_config
from tierlm.profile import load_profile

MiB, GiB, DAY = 2**20, 2**30, 86400
FIXED = Bandwidths(device_bytes_per_s=10e9, host_bytes_per_s=10e9, link_bytes_per_s=8e9, disk_bytes_per_s=1.5e9,
                   device_flops=2e11, host_flops=2e11, per_block_overhead_s=1e-4)  # fmt: skip
# A probe taken on a machine too busy to measure anything: ~1000x slower than any real CPU.
POISONED = Bandwidths(device_bytes_per_s=1e7, host_bytes_per_s=1e7, link_bytes_per_s=8e6, disk_bytes_per_s=1.5e6,
                      device_flops=2e8, host_flops=2e8, per_block_overhead_s=0.1)  # fmt: skip
GPU = Bandwidths(device_bytes_per_s=800e9, host_bytes_per_s=40e9, link_bytes_per_s=25e9, disk_bytes_per_s=3e9,
                 device_flops=100e12, host_flops=1e12, per_block_overhead_s=30e-6, device="cuda")  # fmt: skip
LLAMA_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}  # fmt: skip


def tierlm(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "tierlm", *args], capture_output=True, text=True, timeout=600,
                          env=os.environ.copy())  # fmt: skip
    assert done.returncode == 0, f"tierlm {' '.join(args)} failed:\n{done.stderr[-3000:]}"
    return done


def write_profile(path: Path, device_memory: int) -> Path:
    path.write_text("\n".join([
        'description = "plan-reality test"', f"device_memory = {device_memory}", f"host_memory = {device_memory}",
        "disk_offload = true", 'headroom = "8MiB"', 'quant = "int8"', 'kv_cache = "auto"',
        "context_length = 256", "batch_size = 1", "prefetch_depth = 1",
    ]) + "\n")  # fmt: skip
    return path


def bench(profile: Path, tokens: int = 3) -> dict:
    return json.loads(tierlm("bench", "--profile", str(profile), "--device", "cpu", "--prompt-tokens", "4",
                             "--tokens", str(tokens), "--runs", "1", "--json").stdout)  # fmt: skip


def tiers(blocks: list[dict]) -> list[tuple[str, str, str]]:
    return [(b["name"], b["tier"], b["compute"]) for b in blocks]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tierlm.runtime.session import resolve_model_dir

    return resolve_model_dir(None)  # the embedded model, imported once into the test cache


@pytest.fixture(scope="module")
def child_probe_path() -> Path:
    """Where a child with the default thread count looks for its probe."""
    where = subprocess.run([sys.executable, "-c", "from tierlm.probe.record import bandwidths_path; "
                            "print(bandwidths_path('cpu'))"], capture_output=True, text=True, check=True)  # fmt: skip
    return Path(where.stdout.strip())


@pytest.fixture()
def fixed_probe(child_probe_path) -> Path:
    """The session cache's probe pinned to FIXED, where the children read it."""
    path = save_bandwidths(FIXED, "cpu")
    assert path == child_probe_path, "children must read the probe this test writes"
    return path


# -- plan == load ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.e2e
def test_plan_places_the_blocks_the_load_places(model_dir, fixed_probe, tmp_path):
    """For budgets exactly at, one byte below, and between split points, the plan's placement and
    charges equal the real load's, each in a fresh process."""
    from tierlm.offload.sizes import cached_artifact, sizes_from_artifact

    roomy = bench(write_profile(tmp_path / "roomy.toml", 2 * GiB))  # also builds the int8 artifact
    assert {t for _, t, _ in tiers(roomy["placement"])} == {"device"}
    baseline = roomy["charges"]["device"]["baseline"]
    config = read_config(model_dir)
    sizes = sizes_from_artifact(cached_artifact(model_dir, "int8"))
    layer = sizes.nbytes["layers.0"]

    def least_budget(resident_layers: int) -> int:
        """The smallest device_memory whose plan keeps `resident_layers` layers resident."""
        low, high = baseline, baseline + 2 * sizes.total
        while high - low > 1:
            mid = (low + high) // 2
            try:
                placed = plan(config, sizes, load_profile(str(write_profile(tmp_path / "search.toml", mid))),
                              FIXED, accelerator=False, baseline_bytes=baseline)  # fmt: skip
                kept = sum(1 for b in placed.blocks if b.name.startswith("layers.") and b.tier == "device")
            except Exception:  # noqa: BLE001 - refused: too small
                kept = -1
            low, high = (low, mid) if kept >= resident_layers else (mid, high)
        return high

    layers = config.num_hidden_layers
    budgets = {"edge": least_budget(layers // 3), "below-edge": least_budget(layers // 2) - 1,
               "between": least_budget(3 * layers // 4) + layer // 2}  # fmt: skip
    splits = set()
    for name, budget in budgets.items():
        profile = write_profile(tmp_path / f"{name}.toml", budget)
        planned = json.loads(tierlm("plan", "--profile", str(profile), "--device", "cpu", "--json").stdout)
        loaded = bench(profile)
        assert tiers(planned["blocks"]) == tiers(loaded["placement"]), f"{name}: plan and load disagree"
        assert planned["charges"] == loaded["charges"], f"{name}: plan and load charge differently"
        streamed = [b for _, b, _ in tiers(planned["blocks"])].count("disk")
        assert 0 < streamed < layers, f"{name}: the budget must split the model"
        splits.add(streamed)
    assert len(splits) == 3, "each budget splits the model at a different layer"


def test_the_baseline_charge_is_steady_across_processes(tmp_path):
    from tierlm.probe.baseline import GRAIN, KEEP_BELOW, TOLERANCE, steady_charge

    record = tmp_path / "baseline.json"
    measured = 250 * MiB + 12345
    charged = steady_charge(measured, record)
    assert charged >= measured + TOLERANCE and charged % GRAIN == 0
    # Other processes a little above or well below: the same charge, never below what they measured.
    assert steady_charge(charged, record) == charged
    assert steady_charge(measured - TOLERANCE, record) == charged
    assert steady_charge(charged - KEEP_BELOW, record) == charged
    # A lower process first, then a higher one beyond its slack: the higher charge stands for both.
    low = tmp_path / "low-first.json"
    steady_charge(measured - 2 * TOLERANCE, low)
    high = steady_charge(measured, low)
    assert high >= measured + TOLERANCE and steady_charge(measured - 2 * TOLERANCE, low) == high
    # A real change is measured afresh, up (the charge covers it) or far down (it comes back down).
    grown = charged + 1
    assert steady_charge(grown, record) >= grown + TOLERANCE
    assert steady_charge(grown + 1, record) == steady_charge(grown, record)
    shrunk = measured - 8 * KEEP_BELOW
    assert steady_charge(shrunk, record) < charged - KEEP_BELOW


# -- measured runs correct the probe -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.e2e
def test_a_measured_run_corrects_a_poisoned_probe(model_dir, fixed_probe, tmp_path):
    """A probe ~1000x too slow predicts a fraction of a token per second; one bench run corrects
    it, `plan` then predicts what was measured, and says how old the probe is."""
    path = save_bandwidths(POISONED, "cpu", probed_at=time.time() - 3 * DAY - 60)
    profile = write_profile(tmp_path / "roomy.toml", 2 * GiB)
    before = tierlm("plan", "--profile", str(profile), "--device", "cpu", "--quant", "int8-g128").stdout
    assert "probe    3 days old" in before and "last measured run" not in before
    assert re.search(r"^quant +int8-g128 \(--quant.*the profile's is int8\)$", before, re.M), "--quant shows"

    measured = bench(profile, tokens=10)
    check = measured["probe_check"]
    assert check["corrected"] and check["measured_tok_s"] == measured["decode_tokens_per_s"]
    record = read_probe(path)
    corrected = record.bandwidths.for_path("resident")
    assert corrected.device_bytes_per_s > 10 * POISONED.device_bytes_per_s
    assert corrected.disk_bytes_per_s == POISONED.disk_bytes_per_s, "only the binding figures change"
    assert record.bandwidths.for_path("streamed") == POISONED, "a resident run corrects resident plans only"
    assert record.corrections[-1]["before"] == POISONED.to_dict() and "bench" in record.corrections[-1]["source"]
    assert record.probed_at < time.time() - 3 * DAY, "a correction is not a new probe"

    after = tierlm("plan", "--profile", str(profile), "--device", "cpu").stdout
    predicted = float(re.search(r"decode\s+([\d.]+) tokens/s", after).group(1))
    # The corrected figures predict this placement at exactly the measured speed.
    assert predicted == pytest.approx(check["measured_tok_s"], rel=0.02, abs=0.006)
    assert float(re.search(r"decode\s+([\d.]+) tokens/s", before).group(1)) < predicted / 10
    assert "corrected" in after and "last measured run: " in after and "x the prediction" in after


@pytest.mark.slow
@pytest.mark.e2e
def test_chat_stats_corrects_a_poisoned_probe(model_dir, fixed_probe, tmp_path):
    """Chat's /stats is a measured run too: after a reply, it corrects a probe far off."""
    path = save_bandwidths(POISONED, "cpu", probed_at=time.time() - DAY)
    profile = write_profile(tmp_path / "roomy.toml", 2 * GiB)
    # Plain decoding: a reply with verified drafts is not the speed the probe predicts.
    done = subprocess.run([sys.executable, "-m", "tierlm", "chat", "--profile", str(profile), "--device", "cpu",
                           "-t", "0", "-n", "24", "--draft", "off"], input="Count from one to twenty.\n/stats\n",
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "corrected from this run's" in done.stderr
    record = read_probe(path)
    # Raised, not by how much: a busy machine measures slowly too, only never as slowly as the poison.
    assert record.bandwidths.for_path("resident").device_bytes_per_s > POISONED.device_bytes_per_s
    assert "chat" in record.corrections[-1]["source"]


@pytest.mark.slow
@pytest.mark.e2e
def test_doctor_probe_measures_afresh(fixed_probe):
    path = save_bandwidths(POISONED, "cpu", probed_at=1.0)
    shown = tierlm("doctor").stdout
    assert re.search(r"probe\s+cpu-\S+: int8 0\.01 GB/s", shown), "doctor shows the cached probe"
    report = json.loads(tierlm("doctor", "--probe", "--json").stdout)["probe"]
    record = read_probe(path)
    assert report["refreshed"] and report["probed_at"] == record.probed_at > time.time() - 3600
    assert record.bandwidths != POISONED and record.bandwidths.device_bytes_per_s > 0


def test_implied_bandwidths_reproduce_the_measured_step(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_7B))
    config = read_config(tmp_path)
    sizes = sizes_from_config(config, "int8")
    for name, accelerator, bandwidths in [("24gb", False, FIXED), ("8gb", False, FIXED), ("8gb", True, GPU)]:
        profile = load_profile(name)
        placed = plan(config, sizes, profile, bandwidths, accelerator=accelerator, baseline_bytes=300 * MiB)
        terms = decode_terms(config, sizes, profile, bandwidths, placed, accelerator=accelerator)
        predicted, limit = step_seconds(terms, profile.prefetch_depth)
        for factor in (0.1, 3.0):
            measured = predicted * factor
            fixed = implied_bandwidths(bandwidths, terms, measured, accelerator=accelerator,
                                       prefetch_depth=profile.prefetch_depth)  # fmt: skip
            again = decode_terms(config, sizes, profile, fixed, placed, accelerator=accelerator)
            assert step_seconds(again, profile.prefetch_depth)[0] == pytest.approx(measured, rel=1e-6), (name, limit)
            changed = {k for k, v in fixed.to_dict().items() if v != bandwidths.to_dict()[k]}
            cpu_compute = {"device_bytes_per_s", "host_bytes_per_s", "device_flops", "host_flops", "per_block_overhead_s"}
            if factor < 1:  # faster than every channel predicted slower than that: all of those were off
                assert ("disk_bytes_per_s" in changed) == (limit == "disk") and changed, (name, limit)
            elif limit == "disk":  # slower: only the binding channel is known to be off
                assert changed == {"disk_bytes_per_s"}
            elif not accelerator:  # one processor: every compute figure moves together
                assert changed == cpu_compute
            else:  # the binding processor alone: a run bound by the CPU says nothing of the GPU
                assert limit == "host bandwidth" and changed == {"host_bytes_per_s", "host_flops"}


def test_a_run_within_noise_is_recorded_but_corrects_nothing(tmp_path, monkeypatch):
    from tierlm.probe.measured import CORRECTION_RATIO, assess

    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_7B))
    config = read_config(tmp_path)
    sizes = sizes_from_config(config, "int8")
    profile = load_profile("24gb")
    placed = plan(config, sizes, profile, FIXED, accelerator=False, baseline_bytes=300 * MiB)
    loaded = SimpleNamespace(config=config, sizes=sizes, placement=placed, device=SimpleNamespace(type="cpu"))
    predicted = placed.predicted_decode_tokens_per_s  # batch 1 under 24gb

    run, corrected = assess(loaded, profile, FIXED, predicted * 0.9 * CORRECTION_RATIO, "test")
    assert corrected is None and run["predicted_tok_s"] == pytest.approx(predicted)
    run, corrected = assess(loaded, profile, FIXED, predicted * 1.1 * CORRECTION_RATIO, "test")
    assert corrected is not None and corrected.for_path("resident").device_bytes_per_s > FIXED.device_bytes_per_s
    assert run["path"] == "resident" and corrected.device_bytes_per_s == FIXED.device_bytes_per_s, "the probe's own stays"
    run, corrected = assess(loaded, profile, FIXED, predicted / (1.1 * CORRECTION_RATIO), "test")
    assert corrected is not None and corrected.for_path("resident").device_bytes_per_s < FIXED.device_bytes_per_s

    save_bandwidths(FIXED, "cpu", probed_at=1000.0)
    noted = record_measured_run("cpu", lambda figures: ({"source": "a", "measured_tok_s": 2.0,
                                                         "predicted_tok_s": 2.1, "limit": "x"}, None))  # fmt: skip
    assert noted.last_run["source"] == "a" and not noted.last_run["corrected"] and noted.corrections == ()
    faster = replace(FIXED, device_bytes_per_s=2 * FIXED.device_bytes_per_s)
    noted = record_measured_run("cpu", lambda figures: ({"source": "b", "measured_tok_s": 4.0,
                                                         "predicted_tok_s": 2.0, "limit": "x"}, faster))  # fmt: skip
    assert read_probe(bandwidths_path("cpu")) == noted and noted.bandwidths == faster and noted.probed_at == 1000.0
    assert [c["source"] for c in noted.corrections] == ["b"] and noted.corrections[0]["before"] == FIXED.to_dict()


def test_plan_header_lines_say_how_old_the_probe_is_and_how_far_runs_were():
    from tierlm.cli.plan_view import format_age, probe_lines

    now = 10 * DAY
    run = {"at": now - 2 * 3600 - 5, "source": "bench m, profile 4gb", "measured_tok_s": 54.0,
           "predicted_tok_s": 52.9, "corrected": False}  # fmt: skip
    record = ProbeRecord(FIXED, probed_at=now - 3 * DAY - 10, last_run=run)
    assert probe_lines(record, "cpu-2t-v2", now) == [
        "probe    3 days old (cpu-2t-v2)",
        "last measured run: 54 tok/s, 1.02x the prediction, 2 h ago (bench m, profile 4gb)",
    ]
    assert [format_age(s) for s in (5, 60, 7200, DAY)] == ["5 s", "1 min", "2 h", "1 day"]


def test_stats_names_the_weight_format_and_the_compute_dtype(tmp_path):
    import torch

    from tests.tiny import make_model
    from tierlm.runtime.loader import load_model

    make_model(tmp_path)
    assert load_model(tmp_path, device="cpu", dtype=torch.float32, quant="int8").formats == "int8 weights, fp32 compute"
    assert load_model(tmp_path, device="cpu", dtype=torch.float32).formats == "fp32 weights, fp32 compute"
