"""The CLI as users call it: instant help, profiles, piping generate, import-gguf, bench.

Help's imports and bench's peak RSS belong to a process of their own; the rest runs the CLI's
`main` in this process (tests/cli_runner.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.cli_runner import run_tierlm
from tests.tiny import make_model


def process(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tierlm", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


def tierlm(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return run_tierlm(*args, stdin=stdin)


@pytest.mark.e2e
def test_help_does_not_import_torch():
    code = "import sys, tierlm.cli.app; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    result = process("--help")
    assert result.returncode == 0 and "chat" in result.stdout and "generate" in result.stdout


def test_python_dash_m_tierlm_is_the_cli(monkeypatch, capsys):
    """tierlm/__main__.py, run as `python -m tierlm` runs it (here in this process)."""
    import runpy

    from tierlm import __version__

    monkeypatch.setattr(sys, "argv", ["tierlm", "--version"])
    monkeypatch.setattr("tierlm.cli.app._exit", sys.exit)  # not os._exit, should a pipeline have run here
    with pytest.raises(SystemExit) as done:
        runpy.run_module("tierlm", run_name="__main__")
    assert done.value.code == 0 and capsys.readouterr().out == f"tierlm {__version__}\n"


def test_profiles_lists_and_shows():
    listing = tierlm("profiles")
    assert listing.returncode == 0 and listing.stdout.startswith("24gb")
    shown = tierlm("profiles", "24gb")
    assert "context_length" in shown.stdout and "22.0 GiB" in shown.stdout


def test_generate_stdout_is_exactly_the_greedy_reply(tmp_path):
    from tierlm.runtime.engine import Engine
    from tierlm.runtime.loader import load_model
    from tierlm.runtime.model_defaults import model_generation_defaults
    from tierlm.runtime.sampling import resolve_sampling
    from tierlm.runtime.tokenizer import Tokenizer

    make_model(tmp_path)

    def greedy(tokens: int):
        """-t 0 with the model's other defaults (its repetition penalty among them), as the CLI resolves them."""
        return resolve_sampling(model_generation_defaults(tmp_path), temperature=0, max_new_tokens=tokens)

    result = tierlm("generate", "hello world", "--model", str(tmp_path), "-t", "0", "-n", "12", "--system", "be brief")
    assert result.returncode == 0, result.stderr
    tokenizer = Tokenizer.from_dir(tmp_path)
    # The default profile (24gb) stores weights as INT8; the in-process run uses the same artifact.
    engine = Engine(load_model(tmp_path, device="cpu", dtype=torch.float32, quant="int8"), tokenizer)
    ids = tokenizer.encode_chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    )
    expected = engine.generate(ids, greedy(12)).text()
    assert result.stdout == expected + "\n"
    raw = tierlm("generate", "-", "--raw", "--model", str(tmp_path), "-t", "0", "-n", "5", stdin="the quick")
    engine.reset()
    assert raw.stdout == engine.generate(tokenizer.encode("the quick", add_special_tokens=True), greedy(5)).text() + "\n"


@pytest.mark.slow
def test_import_gguf_prints_a_reusable_model_dir():
    from tierlm.weights.embedded import embedded_gguf_path

    first = tierlm("import-gguf", str(embedded_gguf_path()))
    assert first.returncode == 0, first.stderr
    model_dir = first.stdout.strip()
    second = tierlm("import-gguf", str(embedded_gguf_path()))
    assert second.stdout.strip() == model_dir
    reply = tierlm("generate", "Say hi", "--model", model_dir, "-t", "0", "-n", "8")
    assert reply.returncode == 0 and reply.stdout.strip()


@pytest.mark.e2e
def test_bench_reports_speed_memory_and_the_plan(tmp_path):
    import json

    make_model(tmp_path)
    result = process("bench", "--model", str(tmp_path), "--prompt-tokens", "20", "--tokens", "9", "--runs", "2", "--json")
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["profile"] == "24gb" and figures["runs"] == 2
    assert figures["prefill_tokens_per_s"] > 0 and figures["decode_tokens_per_s"] > 0
    assert figures["predicted_decode_tokens_per_s"] > 0 and figures["binding_limit"]
    assert abs(figures["decode_vs_predicted"] * figures["predicted_decode_tokens_per_s"] - figures["decode_tokens_per_s"]) < 1e-6 * figures["decode_tokens_per_s"]
    assert set(figures["placement_bytes"]) == {"device"}  # a tiny model is resident under 24gb
    assert 0 < figures["peak_rss_bytes"] <= figures["budget_bytes"]
    text = process("bench", "--model", str(tmp_path), "--prompt-tokens", "20", "--tokens", "9", "--runs", "1")
    assert "decode" in text.stdout and "within the profile's" in text.stdout
    too_long = process("bench", "--model", str(tmp_path), "--prompt-tokens", "5000", "--tokens", "9")
    assert too_long.returncode != 0 and "context" in too_long.stderr and "Traceback" not in too_long.stderr
