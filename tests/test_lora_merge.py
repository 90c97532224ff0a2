"""LoRA merging against peft: every merged base tensor equals peft's merge_and_unload.

Adapters are made with peft on tiny random models, every adapter parameter randomized (lora_B
starts at zero), saved, and loaded back with PeftModel.from_pretrained for the oracle, so the
saved format is what both sides read.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from tests.tiers import quick
from tests.tiny import make_model
from tierlm.errors import TierlmError
from tierlm.lora.adapter import LoraAdapter
from tierlm.lora.merge import LoraMerger
from tierlm.lora.spec import parse_lora_spec
from tierlm.weights.checkpoint import Checkpoint

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOL = 1e-5

BASES = {
    "llama": dict(family="llama"),
    "llama-tied": dict(family="llama", tied=True),
    "llama-bf16": dict(family="llama", dtype=torch.bfloat16),
    "llama-h48": dict(family="llama", hidden=48),
    "llama-3layers": dict(family="llama", layers=3),
    "qwen2": dict(family="qwen2"),
}


def lora(**kwargs) -> dict:
    """LoraConfig kwargs with small defaults."""
    return {"r": 4, "lora_alpha": 8, **kwargs}


QKV = ["q_proj", "k_proj", "v_proj"]
TIED_PAIR = ["embed_tokens", "lm_head"]

# case -> (base, LoraConfig kwargs)
CASES = {
    "plain": ("llama", lora(r=8, lora_alpha=16, target_modules=ALL)),
    "rslora": ("llama", lora(r=8, lora_alpha=16, target_modules=ALL, use_rslora=True)),
    "patterns": (
        "llama",
        lora(
            target_modules=ALL,
            rank_pattern={"q_proj": 8, r"layers\.1\.mlp\.down_proj": 2},
            alpha_pattern={"v_proj": 32, r"model\.layers\.0\.self_attn\.o_proj": 3},
        ),
    ),
    "regex-targets": ("llama", lora(target_modules=r".*\.layers\.1\.(self_attn\.(q|v)_proj|mlp\.up_proj)")),
    "fan-in-fan-out": ("llama", lora(target_modules=["q_proj", "o_proj"])),
    "lora-bias": ("qwen2", lora(target_modules=QKV, lora_bias=True)),
    "dora": ("llama", lora(target_modules=ALL, use_dora=True)),
    "dora-rslora-qwen2": ("qwen2", lora(target_modules=QKV + ["o_proj"], use_dora=True, use_rslora=True)),
    "modules-to-save": ("llama", lora(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])),
    "embedding": ("llama", lora(target_modules=["embed_tokens", "q_proj"])),
    "embedding-dora": ("llama", lora(target_modules=["embed_tokens", "down_proj"], use_dora=True)),
    "qwen2": ("qwen2", lora(r=8, lora_alpha=16, target_modules=ALL)),
    "bf16": ("llama-bf16", lora(target_modules=ALL)),
    "tied-head": ("llama-tied", lora(target_modules=["q_proj", "lm_head"])),
    "tied-embed-and-head": ("llama-tied", lora(target_modules=TIED_PAIR)),
    "tied-dora-embed-and-head": ("llama-tied", lora(target_modules=TIED_PAIR, use_dora=True)),
    "tied-modules-to-save-tying": (
        "llama-tied",
        lora(target_modules=["q_proj"], modules_to_save=["lm_head"], ensure_weight_tying=True),
    ),
}
# `make test-fast`: plain, DoRA, patterns, biases, an embedding and a tied pair; `make test`: all.
QUICK_CASES = ["plain", "dora", "patterns", "lora-bias", "embedding", "tied-embed-and-head"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """base name -> saved checkpoint directory, each made once for the module."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = tmp_path_factory.mktemp(f"base-{name}")
            make_model(made[name], with_tokenizer=False, **BASES[name])
        return made[name]

    return get


@pytest.fixture(scope="module")
def adapter_dir(base_dir, tmp_path_factory):
    """case name -> saved adapter directory (shared by the single and the multi-adapter tests)."""
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in made:
            base, kwargs = CASES[case]
            from peft import LoraConfig

            made[case] = save_adapter(
                base_dir(base), tmp_path_factory.mktemp(f"adapter-{case}"), LoraConfig(**kwargs),
                seed=len(made) + 1, bf16=base.endswith("bf16"),
            )
        return made[case]

    return get


def save_adapter(base: Path, out: Path, config, seed: int, bf16: bool = False) -> Path:
    """Wrap a fresh copy of `base` with peft, randomize every adapter parameter, save to `out`."""
    import transformers
    from peft import get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            elif "lora_" in name or "modules_to_save" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    if bf16:
        peft_model = peft_model.to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model.save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path):
    """The saved adapter loaded by peft onto a float32 copy of the base."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PeftModel.from_pretrained(model, adapter).eval()


def peft_merged(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = peft_model(base, adapter).merge_and_unload()
    return {k: v.detach().float().clone() for k, v in merged.state_dict().items()}


def tierlm_merged(base: Path, specs) -> tuple[dict[str, torch.Tensor], LoraMerger]:
    checkpoint = Checkpoint(base)
    merger = LoraMerger([(LoraAdapter.load(path), weight) for path, weight in specs])
    merger.validate(checkpoint)
    return {name: merger.merge(name, checkpoint.get(name)) for name in checkpoint.names()}, merger


def base_tensors(base: Path) -> dict[str, torch.Tensor]:
    checkpoint = Checkpoint(base)
    return {name: checkpoint.get(name).float() for name in checkpoint.names()}


def assert_same(ours: dict[str, torch.Tensor], oracle: dict[str, torch.Tensor]) -> None:
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        diff = (tensor - oracle[name]).abs().max().item()
        assert diff <= TOL, f"{name}: max abs diff {diff}"


@pytest.mark.parametrize("case", quick(sorted(CASES), fast=QUICK_CASES))
def test_merge_matches_peft(case, base_dir, adapter_dir):
    base, adapter = base_dir(CASES[case][0]), adapter_dir(case)
    if case == "fan-in-fan-out":
        # peft saves False for nn.Linear; a config that says True (hand-written, other tools)
        # is reset by peft on load, and tierlm must merge the same way.
        edited = adapter.parent / "fifo-edited"
        shutil.copytree(adapter, edited, dirs_exist_ok=True)
        config = json.loads((edited / "adapter_config.json").read_text())
        config["fan_in_fan_out"] = True
        (edited / "adapter_config.json").write_text(json.dumps(config))
        adapter = edited

    ours, merger = tierlm_merged(base, [(adapter, 1.0)])
    oracle = peft_merged(base, adapter)
    assert_same(ours, oracle)

    original = base_tensors(base)
    changed = {n for n in original if not torch.equal(oracle[n], original[n])}
    assert changed, "the adapter changed nothing: the test would prove nothing"
    assert merger.touched_names() == changed
    if "tied" in case:
        # peft's merged model must still be tied for a tied checkpoint to represent it.
        assert torch.equal(oracle["lm_head.weight"], oracle["model.embed_tokens.weight"])


def test_weighted_adapters_sum_their_peft_deltas(base_dir, adapter_dir):
    """W + Σ wᵢ·(peft merge of adapter i − W) over plain LoRA, DoRA, embedding, modules_to_save."""
    base = base_dir("llama")
    specs = [
        (adapter_dir("plain"), 0.6),
        (adapter_dir("dora"), -0.7),
        (adapter_dir("embedding"), 1.0),
        (adapter_dir("modules-to-save"), 0.5),
    ]
    ours, _ = tierlm_merged(base, specs)
    original = base_tensors(base)
    expected = {name: tensor.clone() for name, tensor in original.items()}
    for adapter, weight in specs:
        merged = peft_merged(base, adapter)
        for name in expected:
            expected[name] += weight * (merged[name] - original[name])
    assert_same(ours, expected)


def test_weight_zero_leaves_base_unchanged(base_dir, adapter_dir):
    base = base_dir("llama")
    ours, merger = tierlm_merged(base, [(adapter_dir("dora"), 0.0)])
    assert merger.touched_names() == set()
    assert_same(ours, base_tensors(base))


def test_tied_lora_with_weight_tying_matches_the_unmerged_adapter(base_dir, tmp_path):
    """ensure_weight_tying: lm_head's LoRA is the embedding's, so the tied tensor gets it once.

    peft's merge_and_unload adds that delta twice (once per module, in place on the shared
    tensor); the reference here is peft's unmerged forward, which tierlm's tied merge reproduces.
    """
    import transformers
    from peft import LoraConfig

    base = base_dir("llama-tied")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], ensure_weight_tying=True)
    adapter = save_adapter(base, tmp_path / "ewt", config, seed=11)
    ours, _ = tierlm_merged(base, [(adapter, 1.0)])

    merged_model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    merged_model.load_state_dict(ours, strict=False)
    assert merged_model.lm_head.weight.data_ptr() == merged_model.model.embed_tokens.weight.data_ptr()
    tokens = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        want = peft_model(base, adapter)(tokens).logits
        got = merged_model(tokens).logits
    assert (got - want).abs().max().item() < 1e-4


def test_adapter_for_a_different_shape_is_refused(base_dir, tmp_path):
    from peft import LoraConfig

    config = LoraConfig(r=4, target_modules=["q_proj"])
    adapter = save_adapter(base_dir("llama-h48"), tmp_path / "h48", config, seed=3)
    merger = LoraMerger([(LoraAdapter.load(adapter), 1.0)])
    first = r"does not fit the base model at 'model\.layers\.0\.self_attn\.q_proj'"
    with pytest.raises(TierlmError, match=first):
        merger.validate(Checkpoint(base_dir("llama")))


def test_adapter_module_missing_from_base_is_refused(base_dir, tmp_path):
    from peft import LoraConfig

    config = LoraConfig(r=4, target_modules=r".*\.layers\.2\.mlp\.up_proj")
    adapter = save_adapter(base_dir("llama-3layers"), tmp_path / "l3", config, seed=4)
    merger = LoraMerger([(LoraAdapter.load(adapter), 1.0)])
    with pytest.raises(TierlmError, match=r"adapts 'model\.layers\.2\.mlp\.up_proj'.*no tensor"):
        merger.validate(Checkpoint(base_dir("llama")))


def test_lora_bias_without_a_base_bias_is_refused(base_dir, tmp_path):
    from peft import LoraConfig

    config = LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True)
    adapter = save_adapter(base_dir("llama"), tmp_path / "bias", config, seed=5)
    merger = LoraMerger([(LoraAdapter.load(adapter), 1.0)])
    with pytest.raises(TierlmError, match=r"no 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        merger.validate(Checkpoint(base_dir("llama")))


def test_tied_modules_to_save_without_weight_tying_is_refused(base_dir, tmp_path):
    """peft unties embed_tokens and lm_head when it merges this; a tied checkpoint cannot hold that."""
    from peft import LoraConfig

    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    adapter = save_adapter(base_dir("llama-tied"), tmp_path / "mts", config, seed=6)
    merger = LoraMerger([(LoraAdapter.load(adapter), 1.0)])
    with pytest.raises(TierlmError, match="ties lm_head to embed_tokens"):
        merger.validate(Checkpoint(base_dir("llama-tied")))


def test_two_replacements_of_one_tensor_are_refused(base_dir, adapter_dir):
    adapter = LoraAdapter.load(adapter_dir("modules-to-save"))
    merger = LoraMerger([(adapter, 1.0), (adapter, 0.5)])
    with pytest.raises(TierlmError, match="both replace 'lm_head.weight'"):
        merger.validate(Checkpoint(base_dir("llama")))


def test_non_lora_adapter_is_refused(base_dir, tmp_path):
    from peft import IA3Config

    config = IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    adapter = save_adapter(base_dir("llama"), tmp_path / "ia3", config, seed=7)
    with pytest.raises(TierlmError, match="IA3 adapter; tierlm merges only LoRA"):
        LoraAdapter.load(adapter)


def test_pickled_adapter_is_refused(base_dir, tmp_path):
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir("llama"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(
            tmp_path / "bin", safe_serialization=False
        )
    assert (tmp_path / "bin" / "adapter_model.bin").is_file()
    with pytest.raises(TierlmError, match="requires adapter_model.safetensors"):
        LoraAdapter.load(tmp_path / "bin")


def test_unsupported_lora_variant_is_refused(adapter_dir, tmp_path):
    edited = tmp_path / "arrow"
    shutil.copytree(adapter_dir("plain"), edited)
    config = json.loads((edited / "adapter_config.json").read_text())
    config["arrow_config"] = {"top_k": 3}
    (edited / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(TierlmError, match="Arrow routing"):
        LoraAdapter.load(edited)


def test_targets_missing_from_base_are_refused(base_dir, adapter_dir, tmp_path):
    """peft refuses an adapter whose target_modules match nothing in the model."""
    edited = tmp_path / "gpt2-targets"
    shutil.copytree(adapter_dir("plain"), edited)
    config = json.loads((edited / "adapter_config.json").read_text())
    config["target_modules"] = ["c_attn", "c_proj"]
    (edited / "adapter_config.json").write_text(json.dumps(config))
    merger = LoraMerger([(LoraAdapter.load(edited), 1.0)])
    with pytest.raises(TierlmError, match="match no module of the base model"):
        merger.validate(Checkpoint(base_dir("llama")))


def test_merge_before_validate_is_a_programming_error(adapter_dir):
    merger = LoraMerger([(LoraAdapter.load(adapter_dir("plain")), 1.0)])
    with pytest.raises(RuntimeError, match="validate"):
        merger.merge("lm_head.weight", torch.zeros(320, 64))


def test_fingerprint_follows_content_order_and_weights(adapter_dir, tmp_path):
    plain, dora = LoraAdapter.load(adapter_dir("plain")), LoraAdapter.load(adapter_dir("dora"))
    fingerprint = LoraMerger([(plain, 1.0), (dora, 0.5)]).content_fingerprint()
    reloaded = LoraAdapter.load(adapter_dir("plain"))
    assert fingerprint == LoraMerger([(reloaded, 1.0), (dora, 0.5)]).content_fingerprint()
    assert fingerprint != LoraMerger([(dora, 0.5), (plain, 1.0)]).content_fingerprint()
    assert fingerprint != LoraMerger([(plain, 1.0), (dora, 0.25)]).content_fingerprint()

    edited = tmp_path / "alpha"
    shutil.copytree(adapter_dir("plain"), edited)
    config = json.loads((edited / "adapter_config.json").read_text())
    config["lora_alpha"] = 3
    (edited / "adapter_config.json").write_text(json.dumps(config))
    assert fingerprint != LoraMerger([(LoraAdapter.load(edited), 1.0), (dora, 0.5)]).content_fingerprint()


def test_parse_lora_spec(tmp_path):
    adapter = tmp_path / "chat"
    adapter.mkdir()
    assert parse_lora_spec(str(adapter)) == (adapter, 1.0)
    assert parse_lora_spec(f"{adapter}:0.5") == (adapter, 0.5)
    assert parse_lora_spec(f"{adapter}:-1e-1") == (adapter, -0.1)
    # A colon followed by something that is not a number belongs to the path.
    odd = tmp_path / "run:2024-05"
    odd.mkdir()
    assert parse_lora_spec(str(odd)) == (odd, 1.0)
    assert parse_lora_spec(f"{odd}:2") == (odd, 2.0)

    with pytest.raises(TierlmError, match="does not exist"):
        parse_lora_spec(str(tmp_path / "missing"))
    with pytest.raises(TierlmError, match="'half' after the last ':' is not a number"):
        parse_lora_spec(f"{adapter}:half")
    with pytest.raises(TierlmError, match="not a finite number"):
        parse_lora_spec(f"{adapter}:nan")
    with pytest.raises(TierlmError, match="empty"):
        parse_lora_spec("  ")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(TierlmError, match="not a directory"):
        parse_lora_spec(str(tmp_path / "file.txt"))
