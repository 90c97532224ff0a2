"""Loading in named steps (runtime/loader.py): what quant "none" means, decided once, and the
plan's switch from weights as stored to the fp32 artifact the load converts when they do not fit.

Config-only model directories (Llama-2-7B's public config.json): nothing here reads a weight.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tierlm.offload.bandwidths import Bandwidths
from tierlm.offload.sizes import resolve_quant
from tierlm.profile import load_profile
from tierlm.quant.modes import concrete_mode
from tierlm.probe.baseline import Baseline
from tierlm.runtime.source import Budget, plan_load, requested_quant, resolve_source

GiB = 2**30
LLAMA_2_7B = {"model_type": "llama", "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096}  # fmt: skip
GPU = Bandwidths(device_bytes_per_s=800e9, host_bytes_per_s=40e9, link_bytes_per_s=25e9, disk_bytes_per_s=3e9,
                 device_flops=100e12, host_flops=1e12, per_block_overhead_s=30e-6, device="cuda")  # fmt: skip
# 4096*32000*2 + 32 layers * (4*4096^2 + 3*4096*11008) + norms: 6.74e9 parameters.
PARAMS_7B = 2 * 4096 * 32000 + 32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 4096


@pytest.mark.parametrize(("accelerator", "converted", "means"),
                         [(False, False, "fp32"), (True, False, "bf16"), (False, True, "fp32"), (True, True, "fp32")])  # fmt: skip
def test_none_means_the_compute_dtype_as_stored_and_fp32_once_converted(accelerator, converted, means):
    assert concrete_mode("none", accelerator=accelerator, converted=converted) == means
    assert concrete_mode("int8-g128", accelerator=accelerator, converted=converted) == "int8-g128"


def test_sizing_weights_as_stored_asks_the_same_function():
    assert resolve_quant("none", accelerator=True).name == "bf16"
    assert resolve_quant("none", accelerator=False).name == "fp32"
    assert requested_quant(None, None) == "none"
    assert requested_quant(None, SimpleNamespace(quant="int8")) == "int8"


def _profile(tmp_path, device_gib: int):
    path = tmp_path / f"gpu{device_gib}.toml"
    path.write_text("\n".join([
        'description = "load-steps test"', f'device_memory = "{device_gib}GiB"', 'host_memory = "64GiB"',
        "disk_offload = true", 'headroom = "256MiB"', 'quant = "none"', 'kv_cache = "auto"', "context_length = 256",
        "batch_size = 1", "prefetch_depth = 1",
    ]) + "\n")  # fmt: skip
    return load_profile(str(path))


@pytest.mark.parametrize(("device_gib", "as_stored", "quant", "bytes_per_param"), [(40, True, "bf16", 2),
                                                                                   (8, False, "fp32", 4)])  # fmt: skip
def test_weights_as_stored_stay_so_only_when_they_fit_resident(tmp_path, device_gib, as_stored, quant, bytes_per_param):
    """On an accelerator, 7B bf16 weights (13.5 GB) stay as stored in 40 GiB; in 8 GiB they are
    planned as the fp32 artifact the load then converts, not as bf16."""
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(LLAMA_2_7B))
    source = resolve_source(tmp_path / "llama", "none", accelerator=True)
    assert source.as_stored and source.quant == "none"
    budget = Budget(_profile(tmp_path, device_gib), SimpleNamespace(type="cuda"), Baseline(GiB, GiB), None, [], GPU)
    planned = plan_load(source, budget)
    assert planned.source.as_stored is as_stored
    assert planned.placement.fully_resident is as_stored
    assert planned.sizes.quant == quant
    assert planned.sizes.total == pytest.approx(bytes_per_param * PARAMS_7B, rel=1e-3)
