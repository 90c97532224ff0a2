"""The embedded SmolLM2 end to end: tierlm's logits against transformers on the same GGUF, and `run chat`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierlm.runtime.loader import load_model
from tierlm.weights.embedded import embedded_gguf_path, ensure_embedded_model


@pytest.fixture(scope="module")
def embedded_dir() -> Path:
    return ensure_embedded_model()


@pytest.mark.slow
def test_logits_match_transformers_reading_the_same_gguf(embedded_dir):
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    loaded = load_model(embedded_dir, device="cpu", dtype=torch.float32)
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 19556, 905, 30]])
    with torch.no_grad():
        expected = reference(ids).logits
    actual = loaded.model.forward(ids, loaded.new_cache(), logits="all")
    # Both sides dequantize the same Q4_1/Q8_0 blocks to fp32; only summation order differs.
    torch.testing.assert_close(actual, expected, atol=1e-3, rtol=1e-4)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


def run_script() -> str:
    """The installed `run` console script beside this interpreter, as a user would call it."""
    script = Path(sys.executable).with_name("run")
    return str(script) if script.exists() else shutil.which("run")


@pytest.mark.e2e
@pytest.mark.slow
def test_run_chat_two_turns_on_stdin_keeps_history(embedded_dir):
    from tierlm.runtime.tokenizer import Tokenizer

    first = "My name is Ada. Please remember it."
    turns = f"{first}\nWhat is my name?\n/stats\n"
    result = subprocess.run(
        [run_script(), "chat", "--profile", "24gb", "--temperature", "0", "--max-new-tokens", "48"],
        input=turns, capture_output=True, text=True, timeout=300, env=os.environ.copy(),
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    out = result.stdout
    stats_at = out.index("profile   24gb")
    replies = out[:stats_at]
    assert len([line for line in replies.split("\n") if line.strip()]) >= 2, out
    stats = out[stats_at:]
    assert "decode" in stats and "RSS" in stats
    # The second turn's prompt began with the whole first turn (it was found in the KV cache),
    # so the model saw the history.
    first_prompt = Tokenizer.from_dir(embedded_dir).encode_chat([{"role": "user", "content": first}])
    reused = int(stats.split("tokens (")[1].split(" reused")[0])
    assert reused >= len(first_prompt)
