"""Pipeline stages over torch.distributed (gloo, local processes): 2 and 3 stages give the
single-process logits and greedy tokens on tiny random models of every family and on the embedded
model, batch 1 (prefill + decode) and batched over scattered KV slots (micro-batched); the CLI's
`generate --stages 2` prints the single-process text; no worker outlives its pipeline.

One group of worker processes per world size serves every model of this module (a stage is
loaded and released per case), so the processes start twice, not once per case.
Tolerance: logits within 1e-4 (stages compute what one process does; micro-batches change only
the matmul row counts), greedy tokens equal.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny import (DECODE_CASES, MOE_CASES, checkpoint_maker, make_model, paged_cache, scattered_slot_prompts,
                        write_profile)
from tierlm.models import read_config
from tierlm.distributed.launch import GroupSettings, start_group
from tierlm.distributed.pipeline import load_pipeline, stage_loads
from tierlm.profile import load_profile, with_run_settings
from tierlm.runtime.loader import load_model

pytestmark = pytest.mark.e2e  # stages are processes

# Logits of the same runs in one process and across ranks (stages run one thread each; rank 0
# and the single process two): on the embedded model up to 3.8e-5 at prefill and 8.4e-5 after
# four batched steps on the eager path, 1.05e-4 on the fused one (logits ~20: 5e-6 of them).
ATOL = 2e-4
STEPS = 4
CONTEXT = 64
# Every family at 4 layers (3 stages split them 2 + 1 + 1), int8 as a CPU runs by default.
CASES = {name: dict(case, layers=max(case.get("layers", 2), 4)) for name, case in {**DECODE_CASES, **MOE_CASES}.items()}


@pytest.fixture(scope="module", params=[2, 3], ids=["2-stages", "3-stages"])
def group(request):
    """Workers for a pipeline of 2, then 3 stages, shared by the module's cases."""
    group = start_group(GroupSettings.of(request.param, "cpu", timeout=120))
    yield group
    workers = list(group.workers)
    group.close()
    assert all(proc.poll() is not None for proc in workers)  # no worker outlives its pipeline


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_maker(tmp_path_factory, CASES)


def open_both(model_dir, group, quant):
    """(the single-process model, the pipeline over `group`) of `model_dir`, both fp32 compute."""
    common = dict(device="cpu", dtype=torch.float32, quant=quant)
    reference = load_model(model_dir, context_length=CONTEXT, **common)
    loads = stage_loads(model_dir, read_config(model_dir), [None] * group.world, context_length=CONTEXT,
                        threads=1, **common)  # fmt: skip
    return reference, load_pipeline(group, loads, owns_group=False)


def batch_one(loaded, ids: torch.Tensor):
    """(prefill logits of every position, then each decode step's [V]; greedy tokens)."""
    cache = loaded.new_cache()
    prefill = loaded.model.forward(ids, cache, logits="all")[0]
    rows, tokens = [prefill[-1]], [int(prefill[-1].argmax())]
    for _ in range(STEPS):
        rows.append(loaded.model.forward(torch.tensor([[tokens[-1]]]), cache)[0, -1])
        tokens.append(int(rows[-1].argmax()))
    return prefill, torch.stack(rows), tokens


def batched(loaded, prompts, slots):
    """Each prompt prefilled alone into its slot (two chunks), then STEPS decode steps of all
    rows together, as the server's batch runner runs them: (logits [STEPS + 1, rows, V], tokens)."""
    cache = paged_cache(loaded.config, CONTEXT, 4, dtype=loaded.dtype)
    last = []
    for prompt, slot in zip(prompts, slots):
        half = max(len(prompt) // 2, 1)
        loaded.model.forward(torch.tensor([prompt[:half]]), cache.slot(slot))
        last.append(loaded.model.forward(torch.tensor([prompt[half:]]), cache.slot(slot))[0, -1])
    steps = [torch.stack(last)]
    order = sorted(range(len(slots)), key=lambda i: slots[i])  # as the runner does: slots ascending
    tokens = [[int(row.argmax())] for row in steps[0]]
    for _ in range(STEPS):
        ids = torch.tensor([[tokens[i][-1]] for i in order])
        out = loaded.model.forward_batch(ids, cache.batch([slots[i] for i in order]))
        row_of = {i: out[k] for k, i in enumerate(order)}
        steps.append(torch.stack([row_of[i] for i in range(len(slots))]))
        for i in range(len(slots)):
            tokens[i].append(int(steps[-1][i].argmax()))
    return torch.stack(steps), tokens


def assert_same_runs(reference, pipeline, vocab: int):
    ids = torch.randint(0, vocab, (1, 9), generator=torch.Generator().manual_seed(3))
    want_prefill, want_rows, want_tokens = batch_one(reference, ids)
    got_prefill, got_rows, got_tokens = batch_one(pipeline, ids)
    torch.testing.assert_close(got_prefill, want_prefill, atol=ATOL, rtol=0)
    torch.testing.assert_close(got_rows, want_rows, atol=ATOL, rtol=0)
    assert got_tokens == want_tokens
    prompts, slots = scattered_slot_prompts(vocab)
    want_steps, want_batch_tokens = batched(reference, prompts, slots)
    got_steps, got_batch_tokens = batched(pipeline, prompts, slots)
    torch.testing.assert_close(got_steps, want_steps, atol=ATOL, rtol=0)
    assert got_batch_tokens == want_batch_tokens


@pytest.mark.parametrize("case", list(CASES))
def test_stages_match_one_process(group, checkpoint, case):
    reference, pipeline = open_both(checkpoint(case), group, "int8")
    try:
        spans = pipeline.model.spans
        assert [s.rank for s in spans] == list(range(group.world)) and spans[-1].end == CASES[case]["layers"]
        assert_same_runs(reference, pipeline, reference.config.vocab_size)
    finally:
        pipeline.model.close()
        pipeline.close()
        reference.close()


@pytest.mark.parametrize("case", ["llama-gqa", "mixtral"])
def test_speculative_decoding_over_stages_gives_the_tokens_without_it(group, checkpoint, case, monkeypatch):
    """Verification passes cross every stage as one forward (the first stage's rows as steps) and
    the stages' caches roll back with rank 0's: drafted greedy tokens are the undrafted ones."""
    import tierlm.runtime.engine as engine_module
    from tests.test_speculative import EveryPass, ScriptedDrafts
    from tests.tiny import write_tokenizer
    from tierlm.runtime.engine import Engine
    from tierlm.runtime.sampling import SamplingParams
    from tierlm.runtime.speculative import DraftSettings
    from tierlm.runtime.tokenizer import Tokenizer

    folder = checkpoint(case)
    if not (folder / "tokenizer.json").exists():
        write_tokenizer(folder, 320)
    reference, pipeline = open_both(folder, group, "int8")
    try:
        tokenizer = Tokenizer.from_dir(folder)
        prompt = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(5)).tolist()
        params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
        plain = Engine(pipeline, tokenizer).generate(prompt, params)
        plain.text()
        want = list(plain.token_ids)
        monkeypatch.setattr(engine_module, "DraftPolicy", EveryPass)
        monkeypatch.setattr(engine_module, "PromptLookup", lambda tokens: ScriptedDrafts(prompt + want, tokens))
        drafted = Engine(pipeline, tokenizer).generate(prompt, params, draft=DraftSettings("ngram", 5))
        drafted.text()
        assert list(drafted.token_ids) == want
        assert 0 < drafted.stats.accepted < drafted.stats.drafted
    finally:
        pipeline.model.close()
        pipeline.close()
        reference.close()


@pytest.mark.slow
def test_embedded_model_text_and_logits(group):
    from tierlm.runtime.engine import Engine
    from tierlm.runtime.sampling import SamplingParams
    from tierlm.runtime.tokenizer import Tokenizer
    from tierlm.weights.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    reference, pipeline = open_both(model_dir, group, None)
    try:
        assert_same_runs(reference, pipeline, 2000)  # ids below 2000: ordinary tokens
        tokenizer = Tokenizer.from_dir(model_dir)
        ids = tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}], add_generation_prompt=True)
        params = SamplingParams(max_new_tokens=12, temperature=0.0)
        want = Engine(reference, tokenizer).generate(ids, params).text()
        assert Engine(pipeline, tokenizer).generate(ids, params).text() == want and want
    finally:
        pipeline.model.close()
        pipeline.close()
        reference.close()


def test_generate_with_two_stages_prints_the_one_process_text(tmp_path):
    model_dir = tmp_path / "model"
    make_model(model_dir, "llama", layers=3)
    profile = write_profile(tmp_path / "tiny.toml", context_length=CONTEXT, batch_size=1)
    base = [sys.executable, "-m", "tierlm", "generate", "hello world", "--model", str(model_dir), "--temperature", "0",
            "-n", "8", "--threads", "1"]  # fmt: skip
    env = dict(os.environ, TIERLM_PIPELINE_TIMEOUT="60")
    one = subprocess.run(base + ["--profile", str(profile)], capture_output=True, text=True, timeout=120, env=env)
    assert one.returncode == 0, one.stderr
    two = subprocess.run(base + ["--profile", f"{profile},{profile}", "--stages", "2"], capture_output=True,
                         text=True, timeout=120, env=env)  # fmt: skip
    assert two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and one.stdout.strip()


def test_stages_run_from_a_folder_that_holds_another_tierlm_package(tmp_path):
    """A spawned stage does not import from the working directory: `tierlm generate --stages 2`
    started where a `tierlm/` folder lies (a checkout; here a decoy that fails on import) runs its
    stages on the installed package."""
    model_dir = tmp_path / "model"
    make_model(model_dir, "llama", layers=3)
    profile = write_profile(tmp_path / "tiny.toml", context_length=CONTEXT, batch_size=1)
    checkout = tmp_path / "checkout"
    (checkout / "tierlm").mkdir(parents=True)
    (checkout / "tierlm" / "__init__.py").write_text('raise ImportError("the decoy tierlm/ of the working directory")\n')
    naive = subprocess.run([sys.executable, "-m", "tierlm.distributed.worker"], cwd=checkout, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert "the decoy tierlm/" in naive.stderr  # what `python -m` there imports
    # The console script, as a user runs it: its own sys.path starts with its folder, not the working directory.
    script = Path(sys.executable).with_name("tierlm")
    command = [str(script) if script.exists() else shutil.which("tierlm"), "generate", "hello world", "--model",
               str(model_dir), "--profile", f"{profile},{profile}", "--stages", "2", "--temperature", "0", "-n", "8",
               "--threads", "1"]  # fmt: skip
    run = subprocess.run(command, cwd=checkout, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TIERLM_PIPELINE_TIMEOUT="60"))  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() and "decoy" not in run.stderr


def test_stages_hold_a_quantized_kv_cache_as_one_process_does(group, checkpoint, tmp_path):
    """`--kv-cache q8_0` over stages: every stage's cache is q8_0 (its profile's), and the run is
    the one-process run with the same format."""
    folder = checkpoint("qwen3-qk-norm")  # heads of 32: a block of q8_0
    profile = with_run_settings(load_profile(str(write_profile(tmp_path / "p.toml", context_length=CONTEXT,
                                                                batch_size=1))), kv_cache="q8_0")  # fmt: skip
    common = dict(device="cpu", dtype=torch.float32, quant="int8")
    reference = load_model(folder, context_length=CONTEXT, kv_cache="q8_0", **common)
    loads = stage_loads(folder, read_config(folder), [profile] * group.world, context_length=CONTEXT, threads=1, **common)
    pipeline = load_pipeline(group, loads, owns_group=False)
    try:
        assert pipeline.new_cache().format.name == reference.new_cache().format.name == "q8_0"
        ids = torch.randint(0, reference.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
        want_prefill, want_rows, want_tokens = batch_one(reference, ids)
        got_prefill, got_rows, got_tokens = batch_one(pipeline, ids)
        torch.testing.assert_close(got_prefill, want_prefill, atol=ATOL, rtol=0)
        torch.testing.assert_close(got_rows, want_rows, atol=ATOL, rtol=0)
        assert got_tokens == want_tokens
    finally:
        pipeline.model.close()
        pipeline.close()
        reference.close()
