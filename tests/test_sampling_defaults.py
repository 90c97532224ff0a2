"""Per-model sampling defaults (issue 24, item 1) and the repetition penalty's window.

Precedence, highest first: a flag or request field; the model's generation_config.json, where a
GGUF import writes the file's general.sampling.* keys; what tierlm ships for the model (the
embedded SmolLM2: greedy); the fallback. The penalty covers the last repeat_last_n tokens of
prompt and reply (0: off, -1: all), checked against transformers' processor on that window.
Whether the defaults answer well is a benchmark: benchmarks/bench_quickstart_answers.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.cli_runner import run_tierlm
from tests.tiny import make_model
from tierlm.config import FALLBACK_ORIGIN, GENERATION_CONFIG, GenerationDefaults
from tierlm.errors import TierlmError
from tierlm.runtime.model_defaults import model_generation_defaults
from tierlm.runtime.sampling import Sampler, SamplingParams, penalize_repetition
from tierlm.weights import embedded
from tierlm.weights.import_record import RECORD_NAME

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repeat_last_n")
SHIPPED = embedded.EMBEDDED_SAMPLING_ORIGIN
# llama.cpp's sampling keys as a GGUF writer stores them, and what tierlm reads them as.
GGUF_SAMPLING = {"temp": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05, "penalty_repeat": 1.15, "penalty_last_n": 128}


def settings(defaults: GenerationDefaults) -> dict:
    """field -> (value, where it came from)."""
    return {name: (getattr(defaults, name), defaults.origin(name)) for name in FIELDS}


def imported(model_dir: Path, source_name: str, **generation) -> Path:
    """`model_dir` made to look like an import of `source_name` (its receipt), with `generation`
    in its generation_config.json."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / RECORD_NAME).write_text(json.dumps({"format": 3, "source_name": source_name, "source_key": "k",
                                                     "source_bytes": 1}))  # fmt: skip
    (model_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **generation}))
    return model_dir


# ----------------------------------------------------------------------------- precedence


def test_embedded_model_gets_what_tierlm_ships_over_the_fallback_and_its_own_file_over_both(tmp_path):
    smol = imported(tmp_path / "smol", embedded.EMBEDDED_GGUF_FILE)
    assert settings(model_generation_defaults(smol)) == {
        "temperature": (0.0, SHIPPED), "top_p": (0.9, FALLBACK_ORIGIN), "top_k": (40, FALLBACK_ORIGIN),
        "min_p": (0.0, FALLBACK_ORIGIN), "repetition_penalty": (1.1, FALLBACK_ORIGIN),
        "repeat_last_n": (64, FALLBACK_ORIGIN),
    }  # fmt: skip
    own = imported(tmp_path / "own", embedded.EMBEDDED_GGUF_FILE, top_k=20, repetition_penalty=1.0)
    shown = settings(model_generation_defaults(own))
    assert shown["top_k"] == (20, GENERATION_CONFIG) and shown["repetition_penalty"] == (1.0, GENERATION_CONFIG)
    assert shown["temperature"] == (0.0, SHIPPED)  # what the file leaves out still comes from tierlm's setting
    sampled = imported(tmp_path / "sampled", embedded.EMBEDDED_GGUF_FILE, temperature=0.5)
    assert settings(model_generation_defaults(sampled))["temperature"] == (0.5, GENERATION_CONFIG)
    other = imported(tmp_path / "other", "Llama-3.2-1B.Q8_0.gguf")  # no shipped settings: the fallback
    assert settings(model_generation_defaults(other)) == {name: (getattr(GenerationDefaults(), name), FALLBACK_ORIGIN)
                                                          for name in FIELDS}  # fmt: skip
    assert model_generation_defaults(tmp_path / "no-such-dir") == GenerationDefaults()


def test_an_artifact_of_the_embedded_model_keeps_what_tierlm_ships(tmp_path, monkeypatch):
    from tierlm.cache.convert import ConversionRequest, ensure_artifact

    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    make_model(tmp_path / "smol")
    imported(tmp_path / "smol", embedded.EMBEDDED_GGUF_FILE, top_k=30)
    artifact = ensure_artifact(ConversionRequest(tmp_path / "smol", (), "int8"))
    shown = settings(model_generation_defaults(artifact))
    assert shown["temperature"] == (0.0, SHIPPED) and shown["top_k"] == (30, GENERATION_CONFIG)


def test_generation_config_values_and_do_sample_are_credited_to_the_file():
    greedy = GenerationDefaults.from_dict({"do_sample": False, "temperature": 0.6, "top_p": 0.8, "repeat_last_n": -1})
    assert settings(greedy)["temperature"] == (0.0, "generation_config.json (do_sample: false)")
    assert settings(greedy)["top_p"] == (0.8, GENERATION_CONFIG) and greedy.repeat_last_n == -1
    assert GenerationDefaults.from_dict({"repeat_last_n": -2, "repetition_penalty": 0}) == GenerationDefaults()


def test_gguf_sampling_keys_are_imported_and_win_over_what_tierlm_ships(tmp_path, monkeypatch):
    """A GGUF's general.sampling.* keys reach generation_config.json at import and come above
    what tierlm ships, even for a file named as the embedded one; `tierlm show` names each key."""
    import tests.test_gguf_import as gguf_tests
    from tests.test_models_by_name import pin_bandwidths

    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    pin_bandwidths()
    plain_writer = gguf_tests.gguf_writer

    def with_sampling(*args, **kwargs):
        writer = plain_writer(*args, **kwargs)
        for key, value in GGUF_SAMPLING.items():
            getattr(writer, f"add_sampling_{key}")(value)
        writer.add_sampling_mirostat(2)  # no such sampler here: not read
        return writer

    monkeypatch.setattr(gguf_tests, "gguf_writer", with_sampling)
    tokens, _, _ = gguf_tests.byte_level_vocab()
    model, config = gguf_tests.tiny_hf_model("llama", False, vocab_size=len(tokens))
    path = tmp_path / embedded.EMBEDDED_GGUF_FILE
    gguf_tests.write_tiny_gguf(path, model, config)
    model_dir = embedded.import_gguf_to_cache(path)

    written = json.loads((model_dir / "generation_config.json").read_text())
    assert {key: written[key] for key in FIELDS} == dict(temperature=0.6, top_k=20, top_p=0.95, min_p=0.05,
                                                         repetition_penalty=1.15, repeat_last_n=128)  # fmt: skip
    assert "mirostat" not in json.dumps(written)
    shown = settings(model_generation_defaults(model_dir))
    assert shown["temperature"] == (0.6, "the GGUF's general.sampling.temp")
    assert shown["repeat_last_n"] == (128, "the GGUF's general.sampling.penalty_last_n")

    result = run_tierlm("show", str(model_dir), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    for line in ("  temperature     0.6    the GGUF's general.sampling.temp\n",
                 "  top-p           0.95   the GGUF's general.sampling.top_p\n",
                 "  repeat-penalty  1.15   the GGUF's general.sampling.penalty_repeat\n",
                 "  repeat-last-n   128    the GGUF's general.sampling.penalty_last_n\n"):  # fmt: skip
        assert line in result.stdout, result.stdout


def test_show_prints_the_defaults_in_effect_and_where_each_comes_from(tmp_path, monkeypatch):
    from tests.test_models_by_name import pin_bandwidths

    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    pin_bandwidths()
    make_model(tmp_path / "smol")
    imported(tmp_path / "smol", embedded.EMBEDDED_GGUF_FILE, top_k=30)
    result = run_tierlm("show", str(tmp_path / "smol"), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    expected = (
        "sampling    defaults where no flag or request field sets one:\n"
        f"  temperature     0      {SHIPPED}\n"
        "  top-p           0.9    tierlm's fallback\n"
        "  top-k           30     generation_config.json\n"
        "  min-p           0      tierlm's fallback\n"
        "  repeat-penalty  1.1    tierlm's fallback\n"
        "  repeat-last-n   64     tierlm's fallback\n"
    )
    assert expected in result.stdout, result.stdout


# ----------------------------------------------------------------------------- the penalty's window


class RecordingSampler(Sampler):
    """A Sampler that keeps the ids each call penalized."""

    def __init__(self, params):
        super().__init__(params)
        self.windows = []

    def __call__(self, logits, seen=None):
        self.windows.append([] if seen is None else seen.tolist())
        return super().__call__(logits, seen)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tierlm.runtime.tokenizer import Tokenizer

    model_dir = tmp_path_factory.mktemp("tok")
    make_model(model_dir)
    return Tokenizer.from_dir(model_dir)


@pytest.mark.parametrize("last_n", [1, 5, 64, -1, 0, 10**30])
def test_the_penalty_covers_the_last_n_tokens_as_transformers_on_that_window(tokenizer, last_n):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from tierlm.runtime.sequence import SequenceState

    generator = torch.Generator().manual_seed(last_n % 1000)
    vocab = 320
    prompt = torch.randint(3, 40, (50,), generator=generator).tolist()  # repeats within a small range
    params = SamplingParams(temperature=0, repetition_penalty=1.5, repeat_last_n=last_n, max_new_tokens=100)
    sampler = RecordingSampler(params)
    state = SequenceState(prompt, params, tokenizer, context_length=200, sampler=sampler)
    history = list(prompt)
    for _ in range(12):
        logits = torch.randn(vocab, generator=generator) * 3
        logits[list(tokenizer.eos_token_ids)] = float("-inf")  # never end early
        token = state.sample(logits)
        window = [] if last_n == 0 else history if last_n in (-1, 10**30) else history[-last_n:]
        assert sampler.windows[-1] == window
        reference = logits[None].clone()
        if window:
            reference = RepetitionPenaltyLogitsProcessor(penalty=1.5)(torch.tensor([window]), reference)
            torch.testing.assert_close(penalize_repetition(logits, torch.tensor(window), 1.5), reference[0])
        assert token == int(reference.argmax())
        assert state.accept(token)[1] is None
        history.append(token)


def test_a_penalty_of_one_or_a_window_of_zero_is_off_and_bad_windows_are_refused():
    assert SamplingParams(repetition_penalty=1.0, repeat_last_n=64).penalty_window is None
    assert SamplingParams(repetition_penalty=1.3, repeat_last_n=0).penalty_window is None
    assert SamplingParams(repetition_penalty=1.3, repeat_last_n=-1).penalty_window == -1
    for bad in (-2, 1.5, True):
        with pytest.raises(TierlmError, match="repeat_last_n must be an integer ≥ -1"):
            SamplingParams(repeat_last_n=bad)


# ----------------------------------------------------------------------------- the flags and the APIs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model whose greedy reply repeats, and a reference engine over it."""
    from tierlm.runtime.engine import Engine
    from tierlm.runtime.loader import load_model
    from tierlm.runtime.tokenizer import Tokenizer

    model_dir = tmp_path_factory.mktemp("tiny") / "m"
    make_model(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    engine = Engine(load_model(model_dir, device="cpu", dtype=torch.float32, quant="fp32"), tokenizer)
    return model_dir, engine


def reference(tiny, **settings) -> str:
    model_dir, engine = tiny
    engine.reset()
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    return engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=24, **settings)).text() + "\n"


def test_repeat_penalty_and_repeat_last_n_flags_reach_the_sampler(tiny):
    run = ["generate", "hello", "--model", str(tiny[0]), "-n", "24", "-t", "0", "--quant", "fp32"]
    narrow = run_tierlm(*run, "--repeat-penalty", "3", "--repeat-last-n", "4")
    assert narrow.returncode == 0, narrow.stderr
    assert narrow.stdout == reference(tiny, repetition_penalty=3.0, repeat_last_n=4)
    whole = run_tierlm(*run, "--repetition-penalty", "3", "--repeat-last-n", "-1")  # the old name still works
    assert whole.stdout == reference(tiny, repetition_penalty=3.0, repeat_last_n=-1)
    unset = run_tierlm(*run)  # the fallback's penalty: 1.1 over 64 tokens
    assert unset.stdout == reference(tiny, repetition_penalty=1.1, repeat_last_n=64)
    off = run_tierlm(*run, "--repeat-last-n", "0")
    assert off.stdout == reference(tiny, repetition_penalty=1.0)
    assert len({narrow.stdout, whole.stdout, off.stdout}) == 3  # each setting changes the reply
    bad = run_tierlm(*run, "--repeat-last-n", "-2")
    assert bad.returncode == 2 and "--repeat-last-n" in bad.stderr


def test_serve_flags_become_the_defaults_requests_fall_back_on():
    from tierlm.cli.app import SamplingFlags

    defaults = GenerationDefaults().overridden({"temperature": 0.0}, SHIPPED)
    served = SamplingFlags.of({"repetition_penalty": 1.3, "repeat_last_n": 8}).over(defaults)
    assert settings(served)["repeat_last_n"] == (8, "a flag of `tierlm serve`")
    assert settings(served)["temperature"] == (0.0, SHIPPED)
    assert SamplingFlags.of({"repeat_last_n": 8}).params(defaults).repeat_last_n == 8


def test_openai_and_ollama_requests_set_the_window():
    from tierlm.server import ollama_schemas
    from tierlm.server.admission import sampling_params
    from tierlm.server.schemas import ApiError, parse_chat

    message = [{"role": "user", "content": "hi"}]
    defaults = GenerationDefaults()
    for last_n in (16, -1, 0):
        openai = parse_chat({"messages": message, "repetition_penalty": 1.2, "repeat_last_n": last_n}, max_messages=8)
        ollama = ollama_schemas.parse_chat({"model": "m", "messages": message, "options": {
            "repeat_penalty": 1.2, "repeat_last_n": last_n}}, max_messages=8)  # fmt: skip
        params = sampling_params(openai.sampling, 9, defaults)
        assert params == sampling_params(ollama.options.sampling, 9, defaults)
        assert (params.repetition_penalty, params.repeat_last_n) == (1.2, last_n)
    omitted = sampling_params(parse_chat({"messages": message}, max_messages=8).sampling, 9, defaults)
    assert (omitted.repetition_penalty, omitted.repeat_last_n) == (1.1, 64)
    with pytest.raises(ApiError, match="repeat_last_n must be at least -1"):
        parse_chat({"messages": message, "repeat_last_n": -2}, max_messages=8)
    with pytest.raises(ApiError, match="option repeat_last_n must be at least -1"):
        ollama_schemas.parse_chat({"model": "m", "messages": message, "options": {"repeat_last_n": -5}}, max_messages=8)
