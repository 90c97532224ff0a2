"""Bad input through the CLI (its `main`, in this process): non-zero exit and one clear line on
stderr, no traceback."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.cli_runner import PROGRESS_LINE, run_tierlm
from tests.tiny import make_model

PROFILE = """description = "test"
device_memory = "2GiB"
host_memory = "2GiB"
disk_offload = false
headroom = "100MB"
quant = "none"
kv_cache = "auto"
context_length = {context}
batch_size = 1
prefetch_depth = 1
"""


def tierlm(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return run_tierlm(*args, stdin=stdin)


def assert_clean_failure(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    # Phases that ran before the failure report it (piped stderr); the error is one line.
    lines = [line for line in result.stderr.splitlines() if line.strip() and not PROGRESS_LINE.fullmatch(line)]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0]
    assert result.stdout == ""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli-model")
    make_model(path)
    return path


def copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for item in src.iterdir():
        (dst / item.name).write_bytes(item.read_bytes())
    return dst


def test_generate_on_tiny_model_prints_only_text(tiny_dir):
    result = tierlm("generate", "the quick", "--model", str(tiny_dir), "-t", "0", "-n", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n") and "error" not in result.stderr


def test_missing_safetensors(tiny_dir, tmp_path):
    broken = copy_model(tiny_dir, tmp_path / "m")
    (broken / "model.safetensors").unlink()
    assert_clean_failure(tierlm("generate", "hi", "--model", str(broken)), "model.safetensors")


def test_truncated_safetensors(tiny_dir, tmp_path):
    broken = copy_model(tiny_dir, tmp_path / "m")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    assert_clean_failure(tierlm("generate", "hi", "--model", str(broken)), "truncated")


def test_missing_shard(tiny_dir, tmp_path):
    import transformers

    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(tiny_dir).save_pretrained(sharded, max_shard_size="20KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((tiny_dir / name).read_bytes())
    next(sharded.glob("model-0000*-of-*.safetensors")).unlink()
    assert_clean_failure(tierlm("generate", "hi", "--model", str(sharded)), "missing")


def test_pickled_checkpoint_is_refused(tiny_dir, tmp_path):
    broken = copy_model(tiny_dir, tmp_path / "m")
    (broken / "model.safetensors").rename(broken / "pytorch_model.bin")
    assert_clean_failure(tierlm("generate", "hi", "--model", str(broken)), "safetensors")


def test_unknown_model_type(tiny_dir, tmp_path):
    broken = copy_model(tiny_dir, tmp_path / "m")
    config = json.loads((broken / "config.json").read_text())
    config["model_type"] = "gpt_bigcode"
    (broken / "config.json").write_text(json.dumps(config))
    assert_clean_failure(tierlm("generate", "hi", "--model", str(broken)), "gpt_bigcode", "llama", "qwen2")


def test_weights_that_disagree_with_config(tiny_dir, tmp_path):
    broken = copy_model(tiny_dir, tmp_path / "m")
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 128
    (broken / "config.json").write_text(json.dumps(config))
    assert_clean_failure(tierlm("generate", "hi", "--model", str(broken)), "shape")


def test_unknown_profile(tiny_dir):
    assert_clean_failure(tierlm("generate", "hi", "--model", str(tiny_dir), "--profile", "7gb"), "7gb", "24gb")


def test_invalid_profile_file(tiny_dir, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(PROFILE.format(context=64).replace('"2GiB"', '"lots"', 1))
    assert_clean_failure(tierlm("generate", "hi", "--model", str(tiny_dir), "--profile", str(bad)), "device_memory")
    bad.write_text(PROFILE.format(context=64) + "turbo = true\n")
    assert_clean_failure(tierlm("generate", "hi", "--model", str(tiny_dir), "--profile", str(bad)), "turbo")


def test_prompt_longer_than_context(tiny_dir, tmp_path):
    small = tmp_path / "small.toml"
    small.write_text(PROFILE.format(context=32))
    result = tierlm("generate", "the quick brown fox " * 20, "--model", str(tiny_dir), "--profile", str(small))
    assert_clean_failure(result, "context")


def test_missing_model_path():
    assert_clean_failure(tierlm("generate", "hi", "--model", "/nonexistent/model"), "not found")


@pytest.mark.parametrize("args,needle", [
    (("--context", "0"), "--context 0 is out of range"),
    (("--context", "-5"), "--context -5 is not a number of tokens"),
    (("--context", "1e12"), "--context 1e12 is not a number of tokens"),
    (("--kv-cache", "q3"), "--kv-cache q3 is not a KV cache type"),
    (("--context", "9000"), "--context 9000 is more than this model holds"),
    (("--kv-cache", "q8_0"), "--kv-cache q8_0 quantizes each head in blocks of 32 values"),
])  # fmt: skip
def test_bad_context_and_kv_cache_flags_get_one_line(tiny_dir, args, needle):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["max_position_embeddings"] < 9000 and config["hidden_size"] // config["num_attention_heads"] == 16
    assert_clean_failure(tierlm("generate", "hi", "--model", str(tiny_dir), *args), needle)
    assert_clean_failure(tierlm("plan", str(tiny_dir), *args), needle)


@pytest.mark.parametrize("value", ["lots", "-1GiB"])
def test_a_bad_kv_spill_disk_size_gets_one_line(tiny_dir, value):
    assert_clean_failure(tierlm("serve", "--model", str(tiny_dir), "--kv-spill-disk", value),
                         f"--kv-spill-disk {value} is not a size")  # fmt: skip
