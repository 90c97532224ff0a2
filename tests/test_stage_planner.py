"""Planning a pipeline stage (issue 16): a stage's blocks under its own budget, and the split of
a model's layers over several stages (offload/stage_planner.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tierlm.config import ModelConfig
from tierlm.distributed.stages import even_split
from tierlm.errors import TierlmError
from tierlm.offload.placement import DEVICE, DISK, placement_to_dict
from tierlm.offload.planner import plan
from tierlm.offload.probe import Bandwidths
from tierlm.offload.sizes import kv_cache_bytes, sizes_from_config, workspace_bytes
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
    config = ModelConfig.from_dir(LLAMA_70B)
    return config, sizes_from_config(config, "int8", accelerator=True)


@pytest.fixture(scope="module")
def tied3b(tmp_path_factory):
    import json

    folder = tmp_path_factory.mktemp("tied")
    (folder / "config.json").write_text(json.dumps(TIED_3B))
    config = ModelConfig.from_dir(folder)
    return config, sizes_from_config(config, "int8")


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
