"""mixed:SIZE: the allocation of int8/int4 per weight (against brute force), the measured choice
while converting (within the size, activations weighed, better than all-int4 at the same
bytes), and its prediction from config.json for `plan`."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest
import torch

from tierlm.errors import TierlmError
from tierlm.quant.mixed import OPTIONS, Candidate, allocate


def _random_candidates(seed: int, count: int = 4) -> list[Candidate]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        elements = rng.choice([4096, 16384, 65536])
        scale = rng.uniform(0.1, 10)
        sizes = {"int4-g128": elements // 2 + elements // 64, "int4-g64": elements // 2 + elements // 32,
                 "int4-g32": elements // 2 + elements // 16, "int4-g32-asym": elements // 2 + elements // 8,
                 "int8": elements + 4 * 64, "q8_0": elements + elements // 16,
                 "int8-g32-asym": elements + elements // 4}  # fmt: skip
        base = {"int4-g128": 1.0, "int4-g64": 0.85, "int4-g32": 0.7, "int4-g32-asym": 0.55, "int8": 0.01,
                "q8_0": 0.004, "int8-g32-asym": 0.003}  # fmt: skip
        damage = {m: elements * scale * base[m] * rng.uniform(0.9, 1.1) for m in OPTIONS}
        out.append(Candidate(f"t{i}", sizes, damage))
    return out


def _total(candidates, chosen, what):
    return sum(getattr(c, what)[chosen[c.key]] for c in candidates)


@pytest.mark.parametrize("seed", range(6))
def test_allocation_fits_and_comes_close_to_the_best_choice(seed):
    candidates = _random_candidates(seed)
    smallest = sum(min(c.sizes.values()) for c in candidates)
    largest = sum(max(c.sizes.values()) for c in candidates)
    previous = None
    for share in (0.0, 0.2, 0.5, 0.8, 1.0):
        budget = int(smallest + share * (largest - smallest))
        chosen = allocate(candidates, budget)
        assert _total(candidates, chosen, "sizes") <= budget
        damage = _total(candidates, chosen, "damage")
        best = min(sum(c.damage[m] for c, m in zip(candidates, combo))
                   for combo in itertools.product(OPTIONS, repeat=len(candidates))
                   if sum(c.sizes[m] for c, m in zip(candidates, combo)) <= budget)  # fmt: skip
        # Greedy on each weight's convex hull: optimal at hull points, within one weight's step between.
        step = max(max(c.damage.values()) - min(c.damage.values()) for c in candidates)
        assert best <= damage <= best + step
        assert previous is None or damage <= previous  # more bytes never do more damage
        previous = damage
    assert set(allocate(candidates, largest).values()) == {"int8-g32-asym"}
    assert set(allocate(candidates, smallest).values()) == {"int4-g128"}


def test_the_weight_that_hurts_most_per_byte_gets_8_bits_first():
    quiet, loud = _random_candidates(1, 2)
    loud = Candidate("loud", loud.sizes, {m: 1000 * d for m, d in loud.damage.items()})
    room = min(quiet.sizes.values()) + loud.sizes["int8"]
    assert allocate([quiet, loud], room) == {"t0": "int4-g128", "loud": "int8"}
    assert allocate([quiet, loud], room + loud.sizes["int8-g32-asym"])["loud"] == "int8-g32-asym"


def test_a_size_below_the_smallest_is_refused_with_what_would_do():
    candidates = _random_candidates(2)
    smallest = sum(min(c.sizes.values()) for c in candidates)
    with pytest.raises(TierlmError, match=r"ask for mixed:\d+MiB or more") as refused:
        allocate(candidates, smallest - 1)
    assert "GiB" not in refused.value.message
    with pytest.raises(TierlmError, match=r"more than the 0 MiB left for them"):  # never a negative size
        allocate(candidates, -4096)


# -- converting ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny import make_model

    path = tmp_path_factory.mktemp("mixed-base")
    make_model(path, "llama", hidden=128, intermediate=256, layers=3, vocab=320)
    return path


def _weights_bytes(artifact_dir) -> int:
    return (artifact_dir / "weights.bin").stat().st_size


def test_mixed_conversion_fits_its_size_and_beats_all_int4_at_the_same_bytes(tiny):
    from tierlm.cache.artifact import Artifact
    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.store.calibration import activation_stats
    from tierlm.models import read_config
    from tierlm.offload.sizes import sizes_from_config
    from tierlm.runtime.loader import load_model

    int4 = ensure_artifact(ConversionRequest(tiny, (), "int4-g128"))
    int8 = ensure_artifact(ConversionRequest(tiny, (), "int8"))
    target = (_weights_bytes(int4) + _weights_bytes(int8)) // 2
    mixed = ensure_artifact(ConversionRequest(tiny, (), f"mixed:{target}"), calibrate=activation_stats)
    assert _weights_bytes(mixed) <= target
    manifest = Artifact.open(mixed).manifest
    assert manifest["quant"] == f"mixed-{target}" and manifest["mixed"]["sensitivity"].startswith("activations")
    encodings = {t.encoding for b in Artifact.open(mixed).blocks.values() for t in b.tensors.values()}
    assert {"int4", "int8"} <= encodings
    predicted = sizes_from_config(read_config(tiny), f"mixed:{target}")
    assert predicted.total <= target

    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 8, 77, 120, 6]])

    def logits(quant):
        loaded = load_model(tiny, device="cpu", dtype=torch.float32, quant=quant)
        return loaded.model.forward(ids, loaded.new_cache(), logits="all")

    reference = logits("fp32")
    mixed_error = (logits(f"mixed:{target}") - reference).square().mean()
    int4_error = (logits("int4-g128") - reference).square().mean()
    assert mixed_error < int4_error
    assert ensure_artifact(ConversionRequest(tiny, (), f"mixed-{target}"), calibrate=activation_stats) == mixed


def test_a_mixed_size_too_small_is_refused_before_anything_is_cached(tiny):
    from tierlm.cache.convert import ConversionRequest, artifacts_root, ensure_artifact
    from tierlm.store.calibration import activation_stats

    before = set(artifacts_root().glob("*")) if artifacts_root().exists() else set()
    with pytest.raises(TierlmError, match="mixed:"):
        ensure_artifact(ConversionRequest(tiny, (), "mixed:100KiB"), calibrate=activation_stats)
    after = {p for p in artifacts_root().glob("*") if not p.name.startswith(".")}
    assert after <= before | {p for p in after if p.name.endswith(".lock")}


def test_a_size_below_the_floor_is_refused_at_once_in_mib_and_the_floor_itself_converts(tiny, monkeypatch):
    """A mixed:SIZE below the smallest the model can be stored in (every weight at int4) is one
    error line, in MiB with the size that would do, from every command and before any weight is
    read or calibrated; exactly the floor converts, within it."""
    from tests.cli_runner import run_tierlm
    from tierlm.cache.catalog import model_name
    from tierlm.cache.manifest import artifacts_root
    from tierlm.cache.mixed_estimate import mixed_floor
    from tierlm.models import read_config
    from tierlm.store import calibration

    floor = mixed_floor(read_config(tiny))
    need, name = -(-floor // 2**20), model_name(tiny)
    calibrated = []
    real = calibration.activation_stats
    monkeypatch.setattr(calibration, "activation_stats", lambda *args: calibrated.append(args[1]) or real(*args))
    commands = [("convert",), ("generate", "hello", "-n", "1"), ("plan", "--device", "cpu")]
    for size in (f"mixed:{floor - 1}", "mixed:1KiB"):
        for command in commands:
            result = run_tierlm(*command, "--model", str(tiny), "--quant", size)
            assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
            assert f"is below {name}'s floor of {need} MiB" in result.stderr, result.stderr
            assert f"ask for at least mixed:{need}MiB" in result.stderr and "GiB" not in result.stderr
        assert not list(artifacts_root().glob(f"*-{_mode_name(size)}-*"))
    assert calibrated == []
    at_floor = run_tierlm("convert", "--model", str(tiny), "--quant", f"mixed:{floor}")
    assert at_floor.returncode == 0, at_floor.stderr
    assert calibrated == [tiny] and _weights_bytes(Path(at_floor.stdout.strip())) <= floor


def _mode_name(size: str) -> str:
    from tierlm.quant.modes import parse_quant_mode

    return parse_quant_mode(size).name


def test_plan_shows_the_mixed_choice_and_suggests_a_size_that_fits(tmp_path):
    """`tierlm plan` for a config.json alone: a mixed size plans within it, and a profile the
    int8 weights overflow is answered with a mixed size that fits. Each plan is its own process, as
    a user's is: in this one the budget would charge the test process's memory as the baseline (1 GiB
    more held here leaves no mixed size that fits)."""
    import subprocess
    import sys

    config = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))

    def plan(*args):
        return subprocess.run([sys.executable, "-m", "tierlm", "plan", "--model", str(tmp_path), "--device", "cpu", *args],
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    done = plan("--quant", "mixed:4.5GiB", "--profile", "8gb", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["weights_bytes"] <= 4.5 * 2**30
    modes = report["weight_modes"]
    assert sum(modes.values()) == 32 * 4 + 2 and any(m.startswith("int4") for m in modes) and "int8" in modes
    stored = report["weight_mode_bytes"]  # the 2-D weights: all of the model's bytes but its norms
    assert set(stored) == set(modes) and 0.99 * report["weights_bytes"] < sum(stored.values()) <= report["weights_bytes"]
    # int8 streams part of the model from disk under 8gb: the plan names the mixed size that would not.
    text = plan("--quant", "int8", "--profile", "8gb")
    assert text.returncode == 0, text.stderr
    size = re.search(r"every block on the device with --quant (mixed:[0-9.]+GiB)", text.stdout).group(1)
    resident = json.loads(plan("--quant", size, "--profile", "8gb", "--json").stdout)
    assert {b["tier"] for b in resident["blocks"]} == {"device"}
    assert resident["resident_mixed_bytes"] == 0  # already resident: nothing to suggest


def test_chatglm3_6b_plans_within_5_2_gib_of_mixed_weights():
    """The seed's headline: ChatGLM3-6B (its real config.json) at mixed:5.2GiB plans at most 5.2 GiB
    of weights, int8 where the estimate says it matters most and int4 elsewhere."""
    from pathlib import Path

    from tierlm.models import read_config
    from tierlm.offload.sizes import sizes_from_config

    config = read_config(Path(__file__).parent / "data" / "chatglm3-6b")
    sizes = sizes_from_config(config, "mixed:5.2GiB")
    assert sizes.total <= 5.2 * 2**30
    modes = set(sizes.tensor_modes.values())
    assert "int8" in modes and any(m.startswith("int4") for m in modes)
    assert sizes.total > sizes_from_config(config, "int4-g128").total


def test_a_synthetic_mixed_artifact_fits_its_size_and_runs(tmp_path):
    """Benchmarks write big random models straight into the cache; mixed:SIZE works there too."""
    from tierlm.cache.artifact import Artifact
    from tierlm.cache.synthetic import write_synthetic_artifact
    from tierlm.runtime.loader import load_model

    config = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 128,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False}  # fmt: skip
    int8 = write_synthetic_artifact(config, tmp_path / "int8", quant="int8")
    target = _weights_bytes(int8) * 3 // 4
    mixed = write_synthetic_artifact(config, tmp_path / "mixed", quant=f"mixed:{target}")
    assert _weights_bytes(mixed) <= target
    encodings = {t.encoding for b in Artifact.open(mixed).blocks.values() for t in b.tensors.values()}
    assert {"int4", "int8", "plain"} == encodings
    loaded = load_model(mixed, device="cpu", dtype=torch.float32)
    logits = loaded.model.forward(torch.tensor([[1, 2, 3, 4]]), loaded.new_cache())
    assert logits.shape == (1, 1, 512) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="no source grid"):
        write_synthetic_artifact(config, tmp_path / "source", quant="mixed:source")
