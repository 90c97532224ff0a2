"""What may load without torch: config parsing, the family registry and descriptions, profiles, the
catalogue, the probe record, the baseline's record, block sizes, the planner and the plan's own steps,
so `tierlm list`, `show` and `plan` start without it (a plan whose baseline is recorded never loads
it, and places what the measuring plan placed); and each family's torch class is its description's
subclass (one registry)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierlm.device.resolve import accelerator_possible
from tierlm.models import FAMILIES, config_from_dict, family_class, family_description

DATA = Path(__file__).parent / "data"
TINY_LLAMA = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip

# Imports the pure layers, reads configs (a dense one and a MoE one) and sizes them; prints
# whether torch was imported on the way.
PURE = """
import sys
import tierlm.cache.catalog, tierlm.config, tierlm.models, tierlm.offload.planner, tierlm.offload.sizes
import tierlm.probe.record, tierlm.profile
import tierlm.cli.plan_view, tierlm.device.resolve, tierlm.probe.baseline, tierlm.probe.machine
import tierlm.runtime.planning, tierlm.runtime.source
import tierlm.cache.removal, tierlm.cli.running
from tierlm.models import read_config
from tierlm.offload.sizes import sizes_from_config
for folder in sys.argv[1:]:
    config = read_config(folder)
    for quant in ("int8", "int4-g32", "mixed-source"):
        assert sum(sizes_from_config(config, quant).nbytes.values()) > 0
print("torch" in sys.modules)
"""


# `tierlm plan --json` run in this process (typer's CliRunner): the placement, and whether torch
# was imported on the way.
PLAN_IN_PROCESS = """
import json, sys
from typer.testing import CliRunner
from tierlm.cli.app import app
result = CliRunner().invoke(app, ["plan", "--model", sys.argv[1], "--device", sys.argv[2], "--json"])
assert result.exit_code == 0, result.output
print(json.dumps({"placement": json.loads(result.stdout), "torch": "torch" in sys.modules}))
"""


def plan_in_a_fresh_process(model_dir: Path, device: str) -> dict:
    result = subprocess.run([sys.executable, "-c", PLAN_IN_PROCESS, str(model_dir), device],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.e2e
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_a_plan_charging_a_recorded_baseline_never_imports_torch(tmp_path, device):
    """The first plan of a model measures its baseline as a load does (importing the runtime) and
    records it; the next one charges the record without torch, and places the same blocks."""
    if device == "auto" and accelerator_possible():
        pytest.skip("auto-detection on a machine that may have an accelerator asks torch")
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    measured = plan_in_a_fresh_process(tmp_path, device)
    recorded = plan_in_a_fresh_process(tmp_path, device)
    assert measured["torch"] and not recorded["torch"]
    assert recorded["placement"] == measured["placement"]


@pytest.mark.e2e
def test_parsing_and_sizing_do_not_import_torch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    folders = [tmp_path, DATA / "qwen3-30b-a3b", DATA / "chatglm3-6b"]
    result = subprocess.run([sys.executable, "-c", PURE, *map(str, folders)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_model_class_is_its_description(model_type):
    config = config_from_dict({**TINY_LLAMA, "model_type": model_type, "padded_vocab_size": 320, "num_layers": 2,
                               "ffn_hidden_size": 96, "multi_query_attention": True, "num_experts": 4,
                               "num_experts_per_tok": 2, "num_local_experts": 4, "moe_intermediate_size": 32,
                               "shared_expert_intermediate_size": 48})  # fmt: skip
    model, description = family_class(config), family_description(config)
    assert issubclass(model, description)
    assert model.block_shapes(config) == description.block_shapes(config)
