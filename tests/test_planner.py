"""Memory-profile test 1: the planner's placements for real model shapes under every shipped profile.

Model shapes are the public config.json values of Llama-2-7B, Qwen2.5-7B, Llama-3-8B and
Qwen2.5-14B, written to temporary directories (no weights). Bandwidths and the baseline are
fixed, so nothing here probes the machine and every number is reproducible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tierlm.models import read_config
from tierlm.errors import TierlmError
from tierlm.offload.placement import DEVICE, DISK, HOST
from tierlm.offload.placement import placement_to_dict
from tierlm.offload.planner.search import plan
from tierlm.offload.bandwidths import Bandwidths
from tierlm.offload.sizes import kv_cache_bytes, sizes_from_config
from tierlm.profile import load_profile, shipped_profiles

MiB, GiB = 2**20, 2**30
BASELINE = 400 * MiB  # a CPU runtime's RSS after importing torch is ~270-400 MiB

_LLAMA = {"model_type": "llama", "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
_QWEN = {"model_type": "qwen2", "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
         "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False}  # fmt: skip
MODELS = {
    "llama-2-7b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                   "max_position_embeddings": 4096},  # fmt: skip
    "qwen2.5-7b": {**_QWEN, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "max_position_embeddings": 32768},  # fmt: skip
    "llama-3-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0},  # fmt: skip
    "qwen2.5-14b": {**_QWEN, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
                    "max_position_embeddings": 32768},  # fmt: skip
}
# A tied model, to check that the head (= the embedding) is placed as one unit with it.
QWEN_3B_TIED = {**_QWEN, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936,
                "max_position_embeddings": 32768, "tie_word_embeddings": True}  # fmt: skip

# A desktop CPU (DDR5, NVMe) and a consumer GPU (PCIe 4.0 x16) as the cost model sees them.
CPU = Bandwidths(device_bytes_per_s=20e9, host_bytes_per_s=20e9, link_bytes_per_s=10e9, disk_bytes_per_s=2e9,
                 device_flops=500e9, host_flops=500e9, per_block_overhead_s=50e-6)  # fmt: skip
GPU = Bandwidths(device_bytes_per_s=800e9, host_bytes_per_s=40e9, link_bytes_per_s=25e9, disk_bytes_per_s=3e9,
                 device_flops=100e12, host_flops=1e12, per_block_overhead_s=30e-6, device="cuda")  # fmt: skip
PROFILES = shipped_profiles()  # largest first
FALLBACKS = [load_profile(name) for name in PROFILES]  # what a refusal may suggest, as the loader passes them
MODES = [pytest.param(False, id="cpu-only"), pytest.param(True, id="accelerator")]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("configs")
    dirs = {}
    for name, raw in {**MODELS, "qwen2.5-3b": QWEN_3B_TIED}.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(raw))
        dirs[name] = root / name
    return dirs


def config_and_sizes(folder: Path, raw: dict, quant: str = "int8", accelerator: bool = False):
    """(config, block sizes) of a model that is only its config.json `raw`, written to `folder`."""
    (folder / "config.json").write_text(json.dumps(raw))
    config = read_config(folder)
    return config, sizes_from_config(config, quant, accelerator=accelerator)


def make_plan(model_dirs, model: str, profile, accelerator: bool, quant: str = "int8"):
    config = read_config(model_dirs[model])
    profile = load_profile(profile) if isinstance(profile, str) else profile
    sizes = sizes_from_config(config, quant, accelerator=accelerator)
    return plan(config, sizes, profile, GPU if accelerator else CPU, accelerator=accelerator, baseline_bytes=BASELINE,
                fallbacks=FALLBACKS)  # fmt: skip


def layer_tiers(placement) -> list[str]:
    return [b.tier for b in placement.blocks if b.name.startswith("layers.")]


def resident_layers(placement) -> int:
    return layer_tiers(placement).count(DEVICE)


# -- every shipped profile: budgets hold, and blocks spill in the expected order ------------------


@pytest.mark.parametrize("accelerator", MODES)
@pytest.mark.parametrize("model", list(MODELS))
def test_every_shipped_profile_stays_within_budget_and_spills_in_order(model_dirs, model, accelerator):
    config = read_config(model_dirs[model])
    weights = sizes_from_config(config, "int8", accelerator=accelerator).total
    resident_before = config.num_hidden_layers
    for name in PROFILES:
        profile = load_profile(name)
        try:
            placement = make_plan(model_dirs, model, profile, accelerator)
        except TierlmError as err:
            # The only refusal among these: Qwen2.5-14B INT8 on a 4 GB GPU, where the int8 head
            # (152064 x 5120) dequantized to bf16 by the torch kernel needs 1.5 GiB of scratch.
            assert (model, name, accelerator) == ("qwen2.5-14b", "4gb", True), err
            assert "short by" in str(err) and "--profile 6gb" in str(err)
            continue
        for tier, budget in placement.budgets.items():
            if budget is not None:
                assert placement.total(tier) <= budget, (name, tier, placement.charges[tier])
        assert (HOST in placement.budgets) is accelerator  # CPU-only: one RAM tier
        # Every weight byte is charged exactly once, on the tier that holds it.
        assert sum(placement.charges[t].get("weights", 0) for t in placement.charges) == weights
        assert placement.charges[DEVICE]["kv_cache"] == kv_cache_bytes(config, profile, accelerator)
        baseline_tier = HOST if accelerator else DEVICE
        assert placement.charges[baseline_tier]["baseline"] == BASELINE
        assert placement.charges[DEVICE]["headroom"] == profile.headroom

        # Spill order: the final norm and the head stay resident longest, layers spill from the
        # end (the resident ones are a prefix), the untied embedding spills first.
        tiers = layer_tiers(placement)
        resident = tiers.count(DEVICE)
        assert placement.tier_of("norm") == DEVICE and placement.tier_of("head") == DEVICE
        assert tiers[:resident] == [DEVICE] * resident
        assert all(t in (HOST, DISK) for t in tiers[resident:])
        assert tiers[resident:] == sorted(tiers[resident:], key=[HOST, DISK].index)  # host before disk
        if not placement.fully_resident:
            assert placement.tier_of("embed") != DEVICE
            assert placement.hot_cache_bytes > 0 and placement.ring_slots == profile.prefetch_depth + 1
        # A smaller profile never keeps more layers resident than a larger one.
        assert resident <= resident_before, name
        resident_before = resident


@pytest.mark.parametrize("accelerator", MODES)
@pytest.mark.parametrize("model", ["llama-2-7b", "qwen2.5-7b"])
def test_a_7b_in_int8_fits_24gb_fully_resident_with_its_context(model_dirs, model, accelerator):
    placement = make_plan(model_dirs, model, "24gb", accelerator, quant="int8")
    assert placement.fully_resident
    assert placement.ring_slots == 0 and placement.hot_cache_bytes == 0
    raw = MODELS[model]
    head_dim = raw["hidden_size"] // raw["num_attention_heads"]
    kv = raw["num_hidden_layers"] * 2 * raw["num_key_value_heads"] * head_dim * 4096 * 1 * (2 if accelerator else 4)
    assert placement.charges[DEVICE]["kv_cache"] == kv  # the profile's 4096 tokens, batch 1
    assert placement.binding_limit == "device bandwidth"


# Golden placements: Llama-2-7B INT8, layers per tier (device, host, disk), embedding tier.
# One layer is 193.2 MiB (int8 wqkv/wo/w13/w2 + fp32 scales and norms), head and embedding are
# 125.1 MiB each. E.g. CPU-only `8gb`: 7 GiB - baseline 400 MiB - KV 2048 MiB (32 x 2 x 4096 x
# 2048 tokens x fp32) - workspace 226 MiB - ring 3 x 193.2 MiB - hot cache 64 MiB - headroom
# 512 MiB leaves 3338 MiB: norm + head + 16 layers (3216 MiB); a 17th would need 3409 MiB.
# (12gb, 6gb: attention takes a 512-token chunk's queries in blocks over its 4096 positions,
# models/attention_blocks.py, which leaves room for one more layer.)
# On a GPU the KV cache is bf16 (half), and layers that do not fit go to host RAM first.
GOLDEN_LLAMA2_INT8 = {
    False: {
        "24gb": ((32, 0, 0), DEVICE), "16gb": ((32, 0, 0), DEVICE), "12gb": ((23, 0, 9), DISK),
        "8gb": ((16, 0, 16), DISK), "6gb": ((6, 0, 26), DISK), "4gb": ((3, 0, 29), DISK),
    },
    True: {
        "24gb": ((32, 0, 0), DEVICE), "16gb": ((32, 0, 0), DEVICE), "12gb": ((32, 0, 0), DEVICE),
        "8gb": ((22, 10, 0), HOST), "6gb": ((12, 20, 0), HOST), "4gb": ((7, 19, 6), DISK),
    },
}  # fmt: skip


@pytest.mark.parametrize("accelerator", MODES)
def test_golden_placements_llama2_7b_int8(model_dirs, accelerator):
    for name, (counts, embed_tier) in GOLDEN_LLAMA2_INT8[accelerator].items():
        placement = make_plan(model_dirs, "llama-2-7b", name, accelerator)
        tiers = layer_tiers(placement)
        assert (tiers.count(DEVICE), tiers.count(HOST), tiers.count(DISK)) == counts, name
        assert placement.tier_of("embed") == embed_tier, name


def test_disk_streaming_on_cpu_is_bound_by_the_disk(model_dirs):
    placement = make_plan(model_dirs, "llama-2-7b", "4gb", False)
    assert placement.binding_limit == "disk"
    disk_bytes = sum(b.nbytes for b in placement.blocks if b.tier == DISK and b.name != "embed")
    assert placement.predicted_decode_tokens_per_s == pytest.approx(CPU.disk_bytes_per_s / disk_bytes)
    assert placement.ring_slots == 2 and placement.ring_slot_bytes == placement.block("layers.31").nbytes


def test_accelerator_splits_host_layers_between_cpu_compute_and_streaming(model_dirs):
    """At batch 1 the CPU computes most host layers; a batch makes CPU compute costlier, so more stream."""
    slow_cpu = replace(GPU, host_flops=200e9)
    config = read_config(model_dirs["llama-2-7b"])
    sizes = sizes_from_config(config, "int8", accelerator=True)
    on_cpu = {}
    for batch, context in ((1, 2048), (8, 256)):  # the same KV cache bytes
        profile = replace(load_profile("8gb"), batch_size=batch, context_length=context)
        placement = plan(config, sizes, profile, slow_cpu, accelerator=True, baseline_bytes=BASELINE)
        host = [b for b in placement.blocks if b.tier == HOST and b.name.startswith("layers.")]
        assert host, "the 8gb GPU plan keeps layers in host RAM"
        on_cpu[batch] = sum(1 for b in host if not b.streamed) / len(host)
    assert on_cpu[1] > 0.5 and on_cpu[8] < on_cpu[1]


def test_tied_head_is_placed_with_the_embedding(model_dirs):
    config = read_config(model_dirs["qwen2.5-3b"])
    sizes = sizes_from_config(config, "int8")
    assert sizes.aliases == {"head": "embed"} and sizes.nbytes["head"] == 0
    # Room for the embedding (= the head, read whole every token) and a few layers only.
    profile = replace(load_profile("4gb"), name="small", device_memory=2 * GiB, headroom=128 * MiB)
    placement = plan(config, sizes, profile, CPU, accelerator=False, baseline_bytes=BASELINE)
    assert placement.tier_of("embed") == placement.tier_of("head") == DEVICE
    assert placement.block("head").nbytes == 0 and 0 < resident_layers(placement) < config.num_hidden_layers
    assert placement.charges[DEVICE]["hot_cache"] == 0  # the resident embedding serves the rows
    # Streaming it would cost a ring of embedding-sized slots, more than keeping it: with no
    # room for any layer it is still resident, and below that the model is refused.
    tight = replace(profile, device_memory=int(1.2 * GiB))
    placement = plan(config, sizes, tight, CPU, accelerator=False, baseline_bytes=BASELINE)
    assert placement.tier_of("head") == DEVICE and resident_layers(placement) == 0
    with pytest.raises(TierlmError, match="resident: norm, embed"):
        plan(config, sizes, replace(tight, device_memory=GiB), CPU, accelerator=False, baseline_bytes=BASELINE)


def test_emulated_host_tier_on_cpu_streams_host_blocks_through_the_ring(model_dirs):
    profile = replace(load_profile("6gb"), device_memory=4 * GiB, host_memory=3 * GiB, emulate_host_tier=True)
    placement = make_plan(model_dirs, "llama-2-7b", profile, False)
    assert placement.budgets[HOST] == 3 * GiB
    assert placement.charges[HOST]["baseline"] == BASELINE and "baseline" not in placement.charges[DEVICE]
    host = [b for b in placement.blocks if b.tier == HOST and b.name != "embed"]
    assert host and all(b.streamed for b in host)  # copied into the device tier, never CPU-computed
    assert placement.total(DEVICE) <= 4 * GiB and placement.total(HOST) <= 3 * GiB
    assert placement.charges[HOST]["staging"] == 0  # on a CPU disk reads land in the ring itself
    assert placement.binding_limit in ("disk", "link", "device bandwidth")


# -- refusals ----------------------------------------------------------------------------------------


def test_14b_fp16_on_4gb_without_disk_is_refused_naming_what_fits(model_dirs):
    profile = replace(load_profile("4gb"), disk_offload=False)
    with pytest.raises(TierlmError) as refused:
        make_plan(model_dirs, "qwen2.5-14b", profile, False, quant="fp16")
    message = str(refused.value)
    assert "disk_offload is false" in message and "27.51 GiB" in message and "more than" in message
    # The hint names a shipped profile that really fits.
    suggested = refused.value.hint.split("--profile ")[1].split()[0]
    quant = refused.value.hint.split("--quant ")[-1].split()[0]
    assert make_plan(model_dirs, "qwen2.5-14b", suggested, False, quant=quant).total(DEVICE) > 0


@pytest.mark.parametrize("accelerator", MODES)
def test_budget_below_the_fixed_charges_is_refused_with_the_shortfall(model_dirs, accelerator):
    profile = replace(load_profile("4gb"), name="tiny", device_memory=1 * GiB, headroom=128 * MiB)
    with pytest.raises(TierlmError, match=r"short by \d+\.\d\d GiB") as refused:
        make_plan(model_dirs, "llama-2-7b", profile, accelerator)
    assert "kv_cache" in str(refused.value) and "staging" in str(refused.value)
    suggested = refused.value.hint.split("--profile ")[1].split()[0]
    assert suggested in PROFILES
    make_plan(model_dirs, "llama-2-7b", suggested, accelerator)  # does not raise


def test_refusal_suggests_a_smaller_quant_for_the_same_profile(model_dirs):
    profile = replace(load_profile("16gb"), disk_offload=False)
    with pytest.raises(TierlmError, match="--quant int8 fits profile '16gb'"):
        make_plan(model_dirs, "llama-2-7b", profile, False, quant="fp16")


# -- sizes from config.json equal the artifact's ------------------------------------------------------


@pytest.mark.parametrize(
    "family, tied, quant, extra",
    [("llama", False, "int8", {}), ("qwen2", True, "int8-g32", {}), ("llama", False, "int8-g32-asym", {}),
     ("llama", True, "fp16", {"attention_bias": True, "mlp_bias": True}),
     ("qwen2", False, "int8", {"mlp_bias": True})],  # Qwen2's layout has no MLP biases, whatever config.json says
)
def test_sizes_from_config_match_the_converted_artifact(tmp_path, family, tied, quant, extra):
    from tests.tiny import make_model
    from tierlm.cache.artifact import PART_ALIGN, Artifact
    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.offload.sizes import sizes_from_artifact

    make_model(tmp_path, family, tied=tied, with_tokenizer=False, **extra)
    artifact_dir = ensure_artifact(ConversionRequest(tmp_path, (), quant))
    measured = sizes_from_artifact(artifact_dir)
    predicted = sizes_from_config(read_config(tmp_path), quant)
    assert predicted.names == measured.names and predicted.quant == measured.quant == quant
    blocks = Artifact.open(artifact_dir).blocks
    for name in measured.names:
        parts = sum(len(t.parts) for t in blocks[name].tensors.values())
        assert abs(predicted.nbytes[name] - measured.nbytes[name]) <= PART_ALIGN * parts, name
    assert predicted.params == measured.params and predicted.aliases == measured.aliases
    assert predicted.row_bytes == measured.row_bytes


# -- `tierlm plan` ----------------------------------------------------------------------------------


def tierlm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierlm", *args], capture_output=True, text=True, timeout=300,
                          env=os.environ.copy())  # fmt: skip


@pytest.mark.e2e
def test_plan_cli_json_for_a_config_only_directory_matches_the_function(model_dirs):
    from tierlm.probe.record import save_bandwidths

    # Pin the bandwidths the CLI finds in its cache (the path depends on the child's thread count).
    where = subprocess.run(
        [sys.executable, "-c", "from tierlm.probe.record import bandwidths_path; print(bandwidths_path('cpu'))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    save_bandwidths(CPU, "cpu")
    assert Path(where.stdout.strip()).is_file(), "the child computes the same probe cache path"

    result = tierlm("plan", "--model", str(model_dirs["llama-2-7b"]), "--profile", "8gb", "--device", "cpu", "--json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    baseline = shown["charges"]["device"]["baseline"]  # the child's RSS after importing torch
    assert 50 * MiB < baseline < 2 * GiB
    config = read_config(model_dirs["llama-2-7b"])
    expected = plan(config, sizes_from_config(config, "int8"), load_profile("8gb"), CPU, accelerator=False, baseline_bytes=baseline)
    # The CLI adds the mixed:SIZE that would keep every block on the device: the function's figure.
    from tierlm.offload.planner.search import resident_mixed_size

    resident = resident_mixed_size(config, load_profile("8gb"), CPU, accelerator=False, baseline_bytes=baseline)
    assert resident and not expected.fully_resident
    expected = replace(expected, resident_mixed_bytes=resident)
    assert shown == json.loads(json.dumps(placement_to_dict(expected)))

    table = tierlm("plan", "--model", str(model_dirs["qwen2.5-14b"]), "--profile", "12gb", "--device", "cpu")
    assert table.returncode == 0, table.stderr
    assert "layers.0-" in table.stdout and "disk, streamed" in table.stdout and "bound by disk" in table.stdout
    refused = tierlm("plan", "--model", str(model_dirs["qwen2.5-14b"]), "--profile", "4gb", "--quant", "fp32", "--device", "cpu")
    assert refused.returncode == 1 and "short by" in refused.stderr and "Traceback" not in refused.stderr


def test_probe_pieces_run_and_the_cache_round_trips(tmp_path):
    """The probe's parts on this machine (small sizes), and a cached probe is reused as written."""
    import torch

    from tierlm.probe import bandwidth, machine, record

    cpu = torch.device("cpu")
    speed, dropped = bandwidth.disk_bytes_per_s(tmp_path, nbytes=8 * MiB)
    assert speed > 0 and isinstance(dropped, bool) and not list(tmp_path.iterdir())  # temp file removed
    assert bandwidth.link_bytes_per_s(cpu) > 0 and bandwidth.row_seconds(10e9, 7e9) > 0
    record.save_bandwidths(CPU, cpu)
    assert machine.load_bandwidths(cpu) == CPU
    assert Bandwidths.from_dict(json.loads(json.dumps(GPU.to_dict()))) == GPU


@pytest.mark.e2e
def test_a_missing_probe_runs_in_a_child_and_costs_the_caller_no_memory(tmp_path):
    """The probe cycles weights past the last-level cache (hundreds of MiB here); that must not
    land in the process whose budget the planner is about to charge."""
    code = (
        "import json, torch\n"
        "from tierlm.device.memory import read_memory\n"
        "from tierlm.probe.bandwidth import last_level_cache_bytes\n"
        "from tierlm.probe.record import bandwidths_path\n"
        "from tierlm.probe.machine import load_bandwidths\n"
        "before = read_memory().peak_rss\n"
        "measured = load_bandwidths('cpu')\n"
        "print(json.dumps({'growth': read_memory().peak_rss - before, 'llc': last_level_cache_bytes(),\n"
        "                  'path': str(bandwidths_path('cpu')), 'disk': measured.disk_bytes_per_s,\n"
        "                  'device': measured.device_bytes_per_s}))\n"
    )
    env = {**os.environ, "TIERLM_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert Path(out["path"]).is_file() and Path(out["path"]).is_relative_to(tmp_path)
    assert out["disk"] > 0 and out["device"] > 0
    # The probe's weights alone are at least 64 MiB (2x the LLC when larger); the caller grew by
    # far less than that.
    assert out["growth"] < 32 * MiB, f"the probe raised the caller's peak RSS by {out['growth'] >> 20} MiB"
