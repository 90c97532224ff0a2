"""A mixture-of-experts artifact: experts as blocks, LoRA merged per expert, INT8 per expert.

Each expert of a sparse layer is its own 4 KiB-aligned byte range (block `experts.{layer}.{expert}`)
holding INT8 `ew13` (gate rows then up rows) and `ew2`; the layer's dense part is one block. PEFT
adapters on expert projections merge per expert exactly as peft's merge_and_unload does, in both
forms peft 0.21 reads on transformers 5: LoRA on the fused 3-D expert parameters
(`target_parameters`, what training on transformers 5 saves) and per-expert Linear modules
(`experts.{e}.gate_proj` / Mixtral's `w1`, the layout of adapters trained on transformers 4, which
peft converts when it loads them).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiers import quick
from tests.tiny import MOE_CASES, make_case, prompt
from tierlm.blocks import expert_of, layer_index
from tierlm.cache import codec
from tierlm.cache.artifact import BLOCK_ALIGN, Artifact
from tierlm.cache.convert import ConversionRequest, artifacts_root, ensure_artifact
from tierlm.errors import TierlmError
from tierlm.lora.adapter import LoraAdapter
from tierlm.lora.merge import LoraMerger
from tierlm.models import family_class, read_config
from tierlm.runtime.loader import load_model
from tierlm.weights.checkpoint import Checkpoint

TOL = 1e-5
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ROUTER_AND_EXPERTS = ["mlp.gate.weight", *EXPERT_PARAMETERS]  # the router: a 2-D parameter, one "expert"
# transformers 4's per-expert Linear names, which adapters trained then (the hub's) target.
PER_EXPERT_MODULES = {"mixtral": ["w1", "w2", "w3"], "qwen2_moe": ["gate_proj", "up_proj", "down_proj"],
                      "qwen3_moe": ["gate_proj", "up_proj", "down_proj"]}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers reference) of a MOE_CASES checkpoint, built on first use."""
    made = {}

    def get(case: str, **overrides):
        key = (case, tuple(sorted(overrides.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(case)
            made[key] = folder, make_case(folder, {**MOE_CASES[case], **overrides})
            tiny_tokenizer(folder)
        return made[key]

    return get


def tiny_tokenizer(folder: Path) -> None:
    from tests.tiny import write_tokenizer

    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    write_tokenizer(folder, vocab)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))


def base_model(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def parameter_adapter(folder: Path, out: Path, *, target_parameters=EXPERT_PARAMETERS, seed: int = 0, **extra) -> Path:
    """An adapter trained the transformers 5 way: LoRA on the fused expert parameters (and on
    q_proj), every factor random, saved by peft."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj"], target_parameters=target_parameters,
                        init_lora_weights=False, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base_model(folder), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(out)
    return out


def per_expert_adapter(folder: Path, out: Path, *, rank: int = 2, alpha: float = 6.0, seed: int = 0) -> Path:
    """An adapter as transformers 4 training saved it for this model: Linear LoRA on every expert's
    projections, module by module (written here: transformers 5 has no such modules to train)."""
    config = json.loads((folder / "config.json").read_text())
    targets = PER_EXPERT_MODULES[config["model_type"]] + ["q_proj"]
    shapes = {name: tuple(t.shape) for name, t in load_file(str(folder / "model.safetensors")).items()}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (rows, cols) in ((n, s) for n, s in shapes.items() if len(s) == 2):
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in targets:
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.1 * torch.randn(rank, cols, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.1 * torch.randn(rows, rank, generator=generator)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "lora_dropout": 0.0,
        "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
    }))  # fmt: skip
    return out


def peft_merged(folder: Path, adapter: Path, out: Path):
    """peft's own merge (loaded onto transformers 5's fused experts, merge_and_unload), saved with
    transformers (per-expert names again); returns (model, {name: tensor})."""
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = PeftModel.from_pretrained(base_model(folder), adapter).merge_and_unload().eval()
        merged.save_pretrained(out)
    return merged, load_file(str(out / "model.safetensors"))


def tierlm_merged(folder: Path, adapter: Path) -> tuple[dict[str, torch.Tensor], LoraMerger]:
    checkpoint = Checkpoint(folder)
    merger = LoraMerger([(LoraAdapter.load(adapter), 1.0)])
    merger.validate(checkpoint)
    return {name: merger.merge(name, checkpoint.get(name)) for name in checkpoint.names()}, merger


# ----------------------------------------------------------------------------- experts as blocks


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_each_expert_is_its_own_aligned_int8_block(checkpoints, case):
    folder, _ = checkpoints(case)
    artifact = Artifact.open(ensure_artifact(ConversionRequest(folder, (), "int8")))
    config = read_config(folder)
    layout = family_class(config).checkpoint_layout(config)
    assert list(artifact.blocks) == list(layout)
    checkpoint = Checkpoint(folder)
    spans = []
    for block, record in artifact.blocks.items():
        assert record.offset % BLOCK_ALIGN == 0, block
        spans.append((record.offset, record.offset + record.nbytes, block))
        if expert_of(block) is None:
            continue
        layer, expert = expert_of(block)
        assert config.moe.is_sparse(layer) and set(record.tensors) == {"ew13", "ew2"}
        for name, sources in layout[block].items():
            tensor = record.tensors[name]
            assert tensor.encoding == "int8" and tensor.parts["qweight"].dtype == "int8"
            assert tensor.parts["qweight"].shape == tuple(family_class(config).canonical_shapes(config)[name])
            # The block decodes to this expert's own weights (gate rows then up rows for ew13).
            parts = artifact.read_block(block)[name][1]
            weight = codec.decode(tensor, parts)
            decoded = weight.linear(torch.eye(weight.shape[1])).T  # W~ itself: I @ W~ᵀ, transposed
            source = torch.cat([checkpoint.get(s).float() for s in sources])
            step = source.abs().amax(dim=1, keepdim=True) / 127
            assert ((decoded - source).abs() <= step / 2 + 1e-6).all(), f"{block}.{name}"
    spans.sort()
    assert all(end <= start for (_, end, _), (start, _, _) in zip(spans, spans[1:]))  # disjoint ranges
    for layer in range(config.num_hidden_layers):
        dense = artifact.blocks[f"layers.{layer}"].tensors
        if config.moe.is_sparse(layer):  # the dense part whole in one block: attention, norms, router, shared expert
            assert set(dense) == set(layout[f"layers.{layer}"]) and "router" in dense and "w13" not in dense
            # Routers (and Qwen2-MoE's shared gate) stay fp32, bit for bit: a flipped near-tie picks another expert.
            stored = artifact.read_block(f"layers.{layer}")
            for name in {"router", "shared_gate"} & set(dense):
                assert dense[name].encoding == "plain" and dense[name].parts["data"].dtype == "float32"
                source = torch.cat([checkpoint.get(s).float() for s in layout[f"layers.{layer}"][name]])
                assert torch.equal(codec.decode(dense[name], stored[name][1]), source), name
            experts = [b for b in layout if expert_of(b) and expert_of(b)[0] == layer]
            assert len(experts) == config.moe.experts
        else:
            assert "w13" in dense and "router" not in dense
    assert {layer_index(b) for b in layout if layer_index(b) is not None} == set(range(config.num_hidden_layers))


# ----------------------------------------------------------------------------- LoRA per expert


def lora_definition(folder: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """W + (alpha / r)·B@A for every Linear LoRA module in a per-expert adapter file."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    checkpoint = Checkpoint(folder)
    out = {}
    for key in saved:
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = saved[key.replace(".lora_A.", ".lora_B.")]
            out[f"{module}.weight"] = checkpoint.get(f"{module}.weight").float() + scale * (b @ saved[key])
    return out


def peft_gaps(case: str, names) -> set[str]:
    """Tensors peft 0.21.2 on transformers 5.24 leaves unmerged when it loads a per-expert adapter
    (found by this test): for qwen2_moe it converts no expert LoRA (its v4 -> v5 table has a
    'mixtral' entry but none for 'qwen2_moe' itself), and on qwen3_moe its conversion rewrites
    gate_proj/up_proj/down_proj targets into the fused expert parameters, dropping the LoRA on the
    dense layers' MLPs (mlp_only_layers)."""
    if case == "qwen2-moe-shared":
        return {n for n in names if ".mlp.experts." in n}
    if case == "qwen3-moe-dense-and-sparse":
        return {n for n in names if ".mlp." in n and ".experts." not in n and n.split(".")[2] in ("0", "2", "3", "4")}
    return set()


@pytest.mark.parametrize("style", ["parameters", "per-expert-modules"])
@pytest.mark.parametrize("case", quick(sorted(MOE_CASES), fast=["mixtral"]))
def test_expert_lora_merges_like_peft(checkpoints, tmp_path, case, style):
    folder, _ = checkpoints(case)
    if style == "parameters":
        adapter = parameter_adapter(folder, tmp_path / "adapter", target_parameters=ROUTER_AND_EXPERTS)
        saved = load_file(str(adapter / "adapter_model.safetensors"))
        assert any(".experts.base_layer.lora_A" in k for k in saved)  # gate_up_proj, wrapped first
    else:
        adapter = per_expert_adapter(folder, tmp_path / "adapter")
    _, oracle = peft_merged(folder, adapter, tmp_path / "merged")
    ours, merger = tierlm_merged(folder, adapter)
    base = {name: Checkpoint(folder).get(name).float() for name in ours}
    assert set(ours) == set(oracle)
    if style == "per-expert-modules":
        # Where peft drops the LoRA (it leaves the base tensor), the reference is LoRA's definition.
        defined = lora_definition(folder, adapter)
        gaps = {n for n in defined if torch.equal(oracle[n].float(), base[n])}
        assert gaps == peft_gaps(case, defined)
        oracle = {**oracle, **{n: defined[n] for n in gaps}}
    for name, tensor in ours.items():
        diff = (tensor - oracle[name].float()).abs().max().item()
        assert diff <= TOL, f"{name}: max abs diff {diff}"
    changed = {n for n in base if not torch.equal(oracle[n].float(), base[n])}
    experts_changed = {n for n in changed if ".experts." in n}
    assert len(experts_changed) == sum(1 for n in base if ".experts." in n)  # every expert projection
    if style == "parameters":  # Mixtral's router is saved as block_sparse_moe.gate, adapted as mlp.gate
        assert sum(n.endswith(".gate.weight") for n in changed) == len(read_config(folder).moe.sparse_layers)
    assert merger.touched_names() == changed


def test_only_down_proj_targeted_is_the_outer_wrapper(checkpoints, tmp_path):
    """With one parameter wrapped there is no `base_layer` level: `experts.lora_A` is down_proj's."""
    folder, _ = checkpoints("qwen2-moe-shared")
    adapter = parameter_adapter(folder, tmp_path / "adapter", target_parameters=["mlp.experts.down_proj"],
                                rank_pattern={r".*\.down_proj": 3}, alpha_pattern={r".*\.down_proj": 5})
    assert not any("base_layer" in k for k in load_file(str(adapter / "adapter_model.safetensors")))
    _, oracle = peft_merged(folder, adapter, tmp_path / "merged")
    ours, merger = tierlm_merged(folder, adapter)
    assert {n for n in merger.touched_names() if ".experts." in n} == {n for n in ours if "experts" in n
                                                                        and "down_proj" in n}
    for name, tensor in ours.items():
        assert (tensor - oracle[name].float()).abs().max().item() <= TOL, name


@pytest.mark.parametrize("case,style", [("mixtral", "per-expert-modules"), ("qwen3-moe-dense-and-sparse", "parameters")])
def test_int8_artifact_with_expert_lora_matches_transformers(checkpoints, tmp_path, case, style):
    """The adapter merged per expert then INT8-quantized per expert: logits within INT8 error of
    transformers running peft's merged model."""
    folder, _ = checkpoints(case)
    make = parameter_adapter if style == "parameters" else per_expert_adapter
    adapter = make(folder, tmp_path / "adapter", seed=3)
    merged, _ = peft_merged(folder, adapter, tmp_path / "merged")
    loaded = load_model(folder, device="cpu", dtype=torch.float32, quant="int8", adapters=((adapter, 1.0),))
    ids = prompt(merged.config.vocab_size, 16, seed=7)
    with torch.no_grad():
        expected = merged(ids).logits[0]
        base = base_model(folder)(ids).logits[0]
    actual = loaded.model.forward(ids, loaded.new_cache(), logits="all")[0]
    error = (actual - expected).abs().max()
    assert error < 0.05 * expected.abs().max()
    assert error < (base - expected).abs().max() / 2  # the adapter's effect is far above INT8's error
    assert torch.nn.functional.cosine_similarity(actual, expected, dim=-1).min() > 0.99


# ----------------------------------------------------------------------------- wrong adapters


def cache_entries() -> list[str]:
    root = artifacts_root()
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


def test_adapter_for_another_expert_count_is_refused_and_caches_nothing(checkpoints, tmp_path):
    folder, _ = checkpoints("mixtral")
    other, _ = checkpoints("mixtral", num_local_experts=6)
    adapter = parameter_adapter(other, tmp_path / "adapter")
    with pytest.raises(TierlmError, match=r"adapts 6 experts .* the base has 4"):
        ensure_artifact(ConversionRequest(folder, ((adapter, 1.0),), "int8"))
    assert cache_entries() == []


def test_adapter_for_another_expert_width_is_refused_and_caches_nothing(checkpoints, tmp_path):
    folder, _ = checkpoints("qwen2-moe-shared")
    other, _ = checkpoints("qwen2-moe-shared", moe_intermediate_size=16)
    for style, make in (("parameters", parameter_adapter), ("modules", per_expert_adapter)):
        adapter = make(other, tmp_path / style)
        with pytest.raises(TierlmError, match="does not fit the base model at .*experts"):
            ensure_artifact(ConversionRequest(folder, ((adapter, 1.0),), "int8"))
    assert cache_entries() == []


def test_per_expert_adapter_with_more_experts_than_the_base_is_refused(checkpoints, tmp_path):
    folder, _ = checkpoints("mixtral")
    other, _ = checkpoints("mixtral", num_local_experts=6)
    adapter = per_expert_adapter(other, tmp_path / "adapter")
    with pytest.raises(TierlmError, match=r"adapts 'model\.layers\.0\.block_sparse_moe\.experts\.[45]\.w\d'.* has no"):
        ensure_artifact(ConversionRequest(folder, ((adapter, 1.0),), "int8"))
    assert cache_entries() == []
