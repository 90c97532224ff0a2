"""Honest defaults: sampling from the model's generation_config.json, `--quant auto` keeps a
quantized source's grid, and thread counts from the CPUs this process may really use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierlm.config import GenerationDefaults
from tierlm.errors import TierlmError
from tierlm.runtime.sampling import resolve_sampling

FALLBACK = dict(temperature=0.7, top_p=0.9, top_k=40, min_p=0.0, repetition_penalty=1.1, repeat_last_n=64)


def write_generation_config(model_dir: Path, **fields) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "generation_config.json").write_text(json.dumps(fields))
    return model_dir


def sampling_of(defaults: GenerationDefaults) -> dict:
    return {key: getattr(defaults, key) for key in FALLBACK}


# -- sampling defaults ---------------------------------------------------------------------


def test_without_generation_config_the_fallback_applies(tmp_path):
    assert sampling_of(GenerationDefaults.from_dir(tmp_path)) == FALLBACK
    # A GGUF import writes only token ids there: still the fallback.
    ids_only = write_generation_config(tmp_path / "gguf", bos_token_id=1, eos_token_id=[2, 3])
    assert sampling_of(GenerationDefaults.from_dir(ids_only)) == FALLBACK


def test_generation_config_values_win_field_by_field(tmp_path):
    # Qwen2.5-Instruct's generation_config.json.
    model = write_generation_config(tmp_path, do_sample=True, temperature=0.7, top_p=0.8, top_k=20,
                                    repetition_penalty=1.05)  # fmt: skip
    defaults = GenerationDefaults.from_dir(model)
    assert sampling_of(defaults) == dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, repetition_penalty=1.05,
                                         repeat_last_n=64)  # fmt: skip
    from_file = {key for key in FALLBACK if defaults.origin(key) == "generation_config.json"}
    assert from_file == {"repetition_penalty", "temperature", "top_k", "top_p"}
    only_temperature = GenerationDefaults.from_dict({"temperature": 0.6, "min_p": 0.05})
    assert sampling_of(only_temperature) == {**FALLBACK, "temperature": 0.6, "min_p": 0.05}


def test_do_sample_false_means_greedy_and_bad_values_are_ignored():
    greedy = GenerationDefaults.from_dict({"do_sample": False, "temperature": 0.6, "top_p": 0.9})
    assert greedy.temperature == 0 and greedy.origin("temperature") == "generation_config.json (do_sample: false)"
    assert greedy.origin("top_p") == "generation_config.json" and greedy.origin("top_k") == "tierlm's fallback"
    assert GenerationDefaults.from_dict({"do_sample": True}).temperature == 0.7
    junk = {"temperature": -1, "top_p": 0, "top_k": 2.5, "min_p": 3, "repetition_penalty": "x"}
    assert sampling_of(GenerationDefaults.from_dict(junk)) == FALLBACK
    assert sampling_of(GenerationDefaults.from_dict({"temperature": float("nan")})) == FALLBACK


def test_unset_options_take_the_model_defaults_and_set_ones_win():
    defaults = GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.1, repetition_penalty=1.1)
    params = resolve_sampling(defaults, max_new_tokens=5)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        0.6, 0.95, 20, 0.1, 1.1)  # fmt: skip
    explicit = resolve_sampling(defaults, temperature=0, top_k=0, min_p=0.0, max_new_tokens=5, seed=3)
    assert explicit.greedy and explicit.top_k == 0 and explicit.min_p == 0 and explicit.seed == 3
    assert explicit.top_p == 0.95  # what was not given still comes from the model


def test_server_requests_omitting_fields_get_the_model_defaults():
    from tierlm.server.admission import sampling_params
    from tierlm.server.schemas import ApiError, parse_chat, parse_completion

    defaults = GenerationDefaults(temperature=0.3, top_p=0.5, top_k=7, min_p=0.2, repetition_penalty=1.2)
    message = [{"role": "user", "content": "hi"}]
    omitted = sampling_params(parse_chat({"messages": message}, max_messages=8).sampling, 9, defaults)
    assert (omitted.temperature, omitted.top_p, omitted.top_k, omitted.min_p, omitted.repetition_penalty) == (
        0.3, 0.5, 7, 0.2, 1.2)  # fmt: skip
    sent = parse_completion({"prompt": "x", "temperature": 0, "min_p": 0.05, "top_k": 0}).sampling
    sent = sampling_params(sent, 9, defaults)
    assert sent.greedy and sent.min_p == 0.05 and sent.top_k == 0 and sent.top_p == 0.5
    with pytest.raises(ApiError, match="min_p"):
        parse_chat({"messages": message, "min_p": 1.5}, max_messages=8)


def test_both_apis_map_their_sampling_fields_onto_the_same_settings():
    """One mapping serves both dialects: Ollama's options (repeat_penalty, seed -1 = random) and
    OpenAI's fields that mean the same give the same SamplingParams; omitted ones the model's."""
    from tierlm.server import ollama_schemas
    from tierlm.server.admission import sampling_params
    from tierlm.server.schemas import parse_chat

    defaults = GenerationDefaults(temperature=0.3, top_p=0.5, top_k=7, min_p=0.2, repetition_penalty=1.2)
    message = [{"role": "user", "content": "hi"}]
    openai = parse_chat({"messages": message, "temperature": 0.8, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
                         "repetition_penalty": 1.1, "seed": 7, "stop": ["\n\n"]}, max_messages=8)
    ollama = ollama_schemas.parse_chat({"model": "m", "messages": message, "options": {
        "temperature": 0.8, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "repeat_penalty": 1.1, "seed": 7,
        "stop": ["\n\n"]}}, max_messages=8)
    assert sampling_params(openai.sampling, 9, defaults) == sampling_params(ollama.options.sampling, 9, defaults)
    random = ollama_schemas.parse_chat({"model": "m", "messages": message, "options": {"seed": -1}}, max_messages=8)
    plain = parse_chat({"messages": message}, max_messages=8)
    assert sampling_params(random.options.sampling, 9, defaults) == sampling_params(plain.sampling, 9, defaults)
    assert sampling_params(plain.sampling, 9, defaults).seed is None


def test_cli_sampling_flags_are_one_object_for_chat_and_serve():
    """chat/generate turn SamplingFlags into a reply's settings, serve into the model defaults
    requests fall back on: the same flags give the same sampler either way (--top-p 0: off)."""
    from tierlm.cli.app import SamplingFlags

    defaults = GenerationDefaults(temperature=0.3, top_p=0.5, top_k=7, min_p=0.2, repetition_penalty=1.2)
    command = dict(max_new_tokens=9, temperature=0.0, top_p=0.0, top_k=None, min_p=None, repetition_penalty=1.1,
                   seed=5, stop=["\n"], system="unrelated")  # a command's parameters, as typer passes them
    flags = SamplingFlags.of(command)
    assert (flags.top_p, flags.stop) == (1.0, ("\n",))
    params = flags.params(defaults)
    assert (params.max_new_tokens, params.greedy, params.top_p, params.top_k, params.repetition_penalty,
            params.seed, params.stop) == (9, True, 1.0, 7, 1.1, 5, ("\n",))  # fmt: skip
    served = flags.over(defaults)
    assert resolve_sampling(served, max_new_tokens=9, seed=5, stop=("\n",)) == params
    assert SamplingFlags.of({}).over(defaults) == defaults  # serve without sampling flags: the model's


# -- min_p ---------------------------------------------------------------------------------


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5])
def test_min_p_matches_transformers(min_p):
    from transformers.generation.logits_process import MinPLogitsWarper

    from tierlm.runtime.sampling import keep_min_p

    x = torch.randn(300, generator=torch.Generator().manual_seed(int(min_p * 100))) * 3
    expected = MinPLogitsWarper(min_p=min_p)(None, x[None].clone())[0]
    kept = keep_min_p(x, min_p)
    assert torch.equal(torch.isinf(kept), torch.isinf(expected))
    assert 1 < int((~torch.isinf(kept)).sum()) < 300  # the cut is neither nothing nor everything


def test_sampler_with_min_p_never_draws_below_the_threshold():
    from tierlm.runtime.sampling import Sampler, SamplingParams

    x = torch.tensor([4.0, 3.9, 3.0, 1.0, 0.0])  # p / p_max: 1, 0.90, 0.37, 0.05, 0.02
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.3, seed=0))
    drawn = {sampler(x) for _ in range(300)}
    assert drawn == {0, 1, 2}
    with pytest.raises(TierlmError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_cli_leaves_sampling_to_the_model_unless_told(tmp_path):
    """The CLI's unset flags resolve against the model's file: do_sample false there is greedy
    without -t 0, and -t 0 stays greedy whatever the file says."""
    from tests.cli_runner import run_tierlm
    from tests.tiny import make_model
    from tierlm.runtime.engine import Engine
    from tierlm.runtime.loader import load_model
    from tierlm.runtime.sampling import SamplingParams
    from tierlm.runtime.tokenizer import Tokenizer

    model = tmp_path / "greedy-model"
    make_model(model)
    write_generation_config(model, do_sample=False, temperature=1.5, eos_token_id=2)
    run = ["generate", "hello", "--model", str(model), "-n", "10", "--quant", "fp32"]
    unset = run_tierlm(*run)
    assert unset.returncode == 0, unset.stderr
    tokenizer = Tokenizer.from_dir(model)
    engine = Engine(load_model(model, device="cpu", dtype=torch.float32, quant="fp32"), tokenizer)
    ids = tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    greedy = SamplingParams(temperature=0, repetition_penalty=1.1, max_new_tokens=10)  # the fallback penalty applies
    assert unset.stdout == engine.generate(ids, greedy).text() + "\n"
    write_generation_config(model, temperature=5.0, top_k=0, top_p=1.0)  # wild sampling by default
    forced = run_tierlm(*run, "-t", "0")
    assert forced.stdout == unset.stdout


# -- quant auto ----------------------------------------------------------------------------


def test_auto_keeps_a_quantized_grid_and_gives_floats_int8():
    from tierlm.quant.modes import auto_quant

    assert auto_quant({"F32": 61, "Q4_1": 210, "Q8_0": 1}) == "mixed-source"  # 4-bit tensors stay 4-bit
    assert auto_quant({"F32": 10, "Q4_0": 20}) == "mixed-source"
    assert auto_quant({"F32": 10, "Q8_0": 20}) == "mixed-source"  # Q8_0 tensors carried as q8_0
    assert auto_quant({"F32": 10, "Q5_1": 20}) == "mixed-source"  # every type it carries exactly
    assert auto_quant({"F32": 10, "Q4_K": 20, "Q6_K": 5}) == "mixed-source"
    assert auto_quant({"F32": 10, "IQ2_XXS": 20}) == "int8-g32-asym"  # a grid it does not carry
    assert auto_quant({"F32": 10, "F16": 20}) == "int8"
    assert auto_quant() == "int8"
    assert auto_quant({"Q4_1": 1}, accelerator=True) == "int8"  # the accelerator rule stays


def test_auto_resolves_from_the_import_record_and_artifacts(tmp_path):
    from tierlm.offload.sizes import resolve_auto, resolve_quant
    from tierlm.weights.gguf_import import RECORD_NAME

    imported = tmp_path / "imported"
    imported.mkdir()
    (imported / RECORD_NAME).write_text(json.dumps({"format": 2, "tensor_types": {"F32": 3, "IQ3_S": 7}}))
    assert resolve_auto("auto", imported) == "int8-g32-asym"
    assert resolve_quant("AUTO", False, imported).group_size == 32
    (imported / RECORD_NAME).write_text(json.dumps({"format": 2, "tensor_types": {"F32": 3, "Q8_0": 7}}))
    assert resolve_auto("auto", imported) == "mixed-source"
    (imported / RECORD_NAME).write_text(json.dumps({"format": 2, "tensor_types": {"F32": 3, "Q4_1": 7}}))
    assert resolve_auto("auto", imported) == "mixed-source" and resolve_quant("auto", False, imported).mixed
    assert resolve_auto("auto", tmp_path) == "int8"  # no record: a float checkpoint
    assert resolve_auto("fp16", imported) == "fp16" and resolve_auto("none", imported) == "none"
    with pytest.raises(TierlmError, match="auto, int8, int8-g128, q8_0, int8-g32-asym, int4-g32, int4-g32-asym, int4-g128, "
                                          "mixed:SIZE, fp16, bf16, fp32, none"):  # fmt: skip
        resolve_auto("int4", imported)


def test_auto_on_an_artifact_is_the_artifact_own_mode(tmp_path):
    from tests.tiny import make_model
    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.offload.sizes import resolve_auto

    make_model(tmp_path / "m")
    artifact = ensure_artifact(ConversionRequest(tmp_path / "m", (), "int8-g32"))
    assert resolve_auto("auto", artifact) == "int8-g32"


def test_profiles_take_auto_and_every_mode_modes_py_accepts():
    from tierlm.profile import load_profile, profile_from_dict, shipped_profiles

    assert {load_profile(name).quant for name in shipped_profiles()} == {"auto"}
    base = dict(description="d", device_memory="1GiB", host_memory="1GiB", disk_offload=True, headroom="1MiB",
                kv_cache="auto", context_length=64, batch_size=1, prefetch_depth=1)  # fmt: skip
    for mode in ("auto", "int8-g32-asym", "int8-g64", "int4-g128-asym", "none", "BF16"):
        assert profile_from_dict("p", {**base, "quant": mode}).quant == mode.lower()
    assert profile_from_dict("p", {**base, "quant": "mixed:4GiB"}).quant == "mixed-4294967296"
    with pytest.raises(TierlmError, match="int8-g32-asym"):
        profile_from_dict("p", {**base, "quant": "int4"})
    with pytest.raises(TierlmError, match="threads"):
        profile_from_dict("p", {**base, "quant": "auto", "threads": -1})
    resolved = profile_from_dict("p", {**base, "quant": "auto", "threads": 3})
    assert resolved.threads == 3
    with pytest.raises(TierlmError, match="quant_resolved"):
        profile_from_dict("p", {**base, "quant": "auto", "quant_resolved": "int8"})  # not a file key


@pytest.mark.slow
def test_embedded_model_default_greedy_equals_its_fp32_weights():
    """The quick start's default (the 24gb profile's quant auto) must not change what the model
    says: greedy token ids equal those of the same weights in fp32."""
    from tierlm.offload.sizes import resolve_auto
    from tierlm.profile import load_profile
    from tierlm.runtime.engine import Engine
    from tierlm.runtime.loader import load_model
    from tierlm.runtime.sampling import SamplingParams
    from tierlm.runtime.tokenizer import Tokenizer
    from tierlm.weights.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    mode = resolve_auto(load_profile("24gb").quant, model_dir)
    assert mode == "mixed-source"  # a Q4_1 GGUF: each tensor keeps its grid, the Q4_1 ones at 4 bits
    tokenizer = Tokenizer.from_dir(model_dir)
    default = Engine(load_model(model_dir, device="cpu", quant=mode), tokenizer)
    fp32 = Engine(load_model(model_dir, device="cpu", quant="fp32"), tokenizer)
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    for text in ("Hello", "Name three colours", "What is 2+2?"):
        ids = tokenizer.encode_chat([{"role": "user", "content": text}])
        ours, reference = default.generate(ids, greedy), fp32.generate(ids, greedy)
        assert ours.text() == reference.text() and ours.token_ids == reference.token_ids, text
        default.reset(), fp32.reset()


def test_session_and_plan_name_the_resolved_mode(tmp_path, monkeypatch):
    """`auto` is shown with what it resolved to: /stats (the session's profile summary), plan."""
    from tests.cli_runner import run_tierlm
    from tests.test_models_by_name import pin_bandwidths
    from tests.tiny import make_model
    from tierlm.profile import profile_from_dict
    from tierlm.runtime.session import open_session

    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    pin_bandwidths()  # in this test's cache: no machine probe for `--threads 1` (nor the default)
    make_model(tmp_path / "m")
    profile = profile_from_dict("p", dict(description="d", device_memory="2GiB", host_memory="2GiB",
                                          disk_offload=False, headroom="64MiB", quant="auto", kv_cache="auto",
                                          context_length=64, batch_size=1, prefetch_depth=0))  # fmt: skip
    session = open_session(str(tmp_path / "m"), profile, device="cpu")
    assert session.profile.quant_label == "auto → int8" and "quant auto → int8" in session.profile.summary()
    session.engine.loaded.close()
    planned = run_tierlm("plan", "--model", str(tmp_path / "m"), "--profile", "24gb", "--threads", "1")
    assert planned.returncode == 0, planned.stderr
    assert "auto → int8 (the profile's)" in planned.stdout


# -- threads -------------------------------------------------------------------------------


def cgroup_tree(root: Path, files: dict[str, str], proc: str) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "proc-cgroup").write_text(proc)
    return root / "proc-cgroup"


@pytest.mark.parametrize(
    "files, proc, affinity, expected",
    [
        ({"cpu.max": "max 100000\n"}, "0::/\n", 8, 8),  # v2, no quota: the affinity mask
        ({"job/cpu.max": "150000 100000\n", "cpu.max": "max 100000\n"}, "0::/job\n", 8, 1),  # 1.5 -> 1
        ({"a/cpu.max": "400000 100000\n", "a/b/cpu.max": "max 100000\n"}, "0::/a/b\n", 16, 4),  # parent's
        ({"a/cpu.max": "400000 100000\n"}, "0::/a\n", 2, 2),  # affinity tighter than the quota
        ({"cpu,cpuacct/k8s/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/k8s/cpu.cfs_period_us": "100000\n"},
         "4:cpu,cpuacct:/k8s\n3:memory:/k8s\n", 32, 3),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, "2:cpu:/\n", 6, 6),  # v1, none
        ({}, "", 5, 5),  # no cgroup files at all
    ],
)
def test_usable_cpus_reads_affinity_and_cgroup_quota(tmp_path, files, proc, affinity, expected):
    from tierlm.device.cpu import usable_cpus

    proc_file = cgroup_tree(tmp_path, files, proc)
    assert usable_cpus(tmp_path, proc_file, affinity=affinity) == expected


@pytest.mark.e2e
def test_threads_flag_reaches_torch(tmp_path):
    """`--threads 1` is what torch runs with (the INT8 kernel choice is keyed on it); unset, the
    usable CPUs."""
    from tests.tiny import make_model
    from tierlm.device.cpu import usable_cpus

    make_model(tmp_path / "m")
    code = (
        "import sys, torch\n"
        "from tierlm.cli.app import app\n"
        "try:\n"
        "    app(sys.argv[1:])\n"
        "except SystemExit as done:\n"
        "    assert not done.code, done.code\n"
        "print('threads', torch.get_num_threads(), file=sys.stderr)\n"
    )
    args = ["generate", "hi", "--model", str(tmp_path / "m"), "-n", "2", "-t", "0"]
    for extra, expected in (["--threads", "1"], 1), ([], usable_cpus()):
        run = subprocess.run([sys.executable, "-c", code, *args, *extra], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert f"threads {expected}" in run.stderr.splitlines()[-1]
