"""Mixtral, Qwen2-MoE and Qwen3-MoE (models/moe.py): config.json mapping and refusals, expert blocks
in the layout and the INT8 artifact, each chosen expert borrowed once per layer per step, the fused
decode step beside eager sparse layers, speculation hints, and `tierlm generate` end to end. Their
logits, cached, greedy and batched decode against transformers are in tests/test_model_parity.py
(tests/tiny.MOE_CASES are among its CASES).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.cli_runner import run_tierlm
from tests.tiny import MOE_CASES, greedy, make_case, make_model, paged_cache, prompt, scattered_slot_prompts
from tierlm.blocks import expert_of
from tierlm.errors import TierlmError
from tierlm.models import config_from_dict, family_class
from tierlm.runtime.loader import load_model
from tierlm.weights.store import WeightStore

QWEN3_30B_A3B = Path(__file__).parent / "data" / "qwen3-30b-a3b" / "config.json"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers reference) of each MOE_CASES checkpoint, built on first use."""
    made = {}

    def get(case: str):
        if case not in made:
            folder = tmp_path_factory.mktemp(case)
            made[case] = folder, make_case(folder, MOE_CASES[case])
        return made[case]

    return get


# -- config.json and layout ----------------------------------------------------------------------


def test_qwen3_30b_a3b_config_and_its_expert_blocks():
    config = config_from_dict(json.loads(QWEN3_30B_A3B.read_text()))
    moe = config.moe
    assert (moe.experts, moe.top_k, moe.expert_intermediate, moe.shared_intermediate) == (128, 8, 768, 0)
    assert moe.norm_topk_prob and moe.sparse_layers == tuple(range(48))
    family = family_class(config)
    names = list(family.checkpoint_layout(config))
    assert names[:3] == ["embed", "layers.0", "experts.0.0"] and names[-2:] == ["norm", "head"]
    assert names.index("layers.1") == 2 + 128 and len(names) == 3 + 48 * 129
    shapes = family.block_shapes(config)
    assert shapes["experts.47.127"] == {"ew13": (1536, 2048), "ew2": (2048, 768)}
    assert shapes["layers.0"]["router"] == (128, 2048) and "w13" not in shapes["layers.0"]
    assert shapes["layers.0"]["q_norm"] == (128,)


def test_dense_and_sparse_layers_follow_step_and_mlp_only_layers(checkpoints):
    folder, _ = checkpoints("qwen3-moe-dense-and-sparse")
    raw = json.loads((folder / "config.json").read_text())
    assert "num_local_experts" in raw and "num_experts" not in raw  # what transformers 5 writes
    config = config_from_dict(raw)
    assert config.moe.sparse_layers == (1, 5) and config.moe.experts == 8 and config.moe.norm_topk_prob
    hub_style = {k: v for k, v in raw.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert config_from_dict(hub_style).moe == config.moe
    layout = family_class(config).checkpoint_layout(config)
    assert "w13" in layout["layers.0"] and "router" not in layout["layers.0"]
    assert "router" in layout["layers.1"] and "w13" not in layout["layers.1"]
    assert [expert_of(b) for b in layout if expert_of(b)] == [(i, e) for i in (1, 5) for e in range(8)]


def test_qwen2_moe_shared_expert_and_mixtral_names():
    base = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_experts_per_tok": 2}  # fmt: skip
    qwen2 = config_from_dict({**base, "model_type": "qwen2_moe", "num_experts": 4,
                                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48})
    assert qwen2.moe.shared_intermediate == 48 and not qwen2.moe.norm_topk_prob and qwen2.attention_bias
    layer = family_class(qwen2).checkpoint_layout(qwen2)["layers.0"]
    assert layer["shared_gate"] == ("model.layers.0.mlp.shared_expert_gate.weight",) and "bqkv" in layer
    assert family_class(qwen2).block_shapes(qwen2)["layers.0"]["shared_w13"] == (96, 64)
    mixtral = config_from_dict({**base, "model_type": "mixtral", "num_local_experts": 4,
                                     "norm_topk_prob": False})  # fmt: skip
    assert mixtral.moe.norm_topk_prob and mixtral.moe.expert_intermediate == 96  # Mixtral always renormalizes
    expert = family_class(mixtral).checkpoint_layout(mixtral)["experts.1.3"]
    assert expert["ew13"] == tuple(f"model.layers.1.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w3"))
    assert config_from_dict({**base, "model_type": "qwen3"}).moe is None


QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32}  # fmt: skip


@pytest.mark.parametrize(
    "override, match",
    [
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) exceeds num_experts \(8\)"),
        ({"mlp_only_layers": [4]}, r"mlp_only_layers = \[4\].*layer indices in \[0, 3\]"),
        ({"mlp_only_layers": "1"}, "mlp_only_layers"),
        ({"mlp_only_layers": [True]}, "mlp_only_layers"),
        ({"num_experts": 0}, "num_experts = 0"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size"),
        ({"num_experts": None}, "num_local_experts"),
    ],
)
def test_bad_moe_settings_are_refused_by_name(override, match):
    raw = {k: v for k, v in {**QWEN3_MOE, **override}.items() if v is not None}
    with pytest.raises(TierlmError, match=match):
        config_from_dict(raw)


# -- each chosen expert borrowed once ----------------------------------------------------------


class CountingStore(WeightStore):
    """Delegates to a store and records every block acquired (WeightStore's default `experts`)."""

    def __init__(self, inner):
        self.inner, self.acquired = inner, []

    def acquire(self, block):
        self.acquired.append(block)
        return self.inner.acquire(block)

    def release(self, block):
        self.inner.release(block)

    def block_names(self):
        return self.inner.block_names()

    def experts_by_layer(self) -> dict[int, Counter]:
        """{layer: Counter(expert: acquisitions)} since the last call."""
        out: dict[int, Counter] = {}
        for block in self.acquired:
            if expert_of(block):
                layer, expert = expert_of(block)
                out.setdefault(layer, Counter())[expert] += 1
        self.acquired = []
        return out


def routed_by_transformers(reference, ids) -> dict[int, set[int]]:
    """{layer: experts transformers' routers choose for any position of ids [1, T]}."""
    chosen: dict[int, set[int]] = {}
    hooks = []
    for name, module in reference.named_modules():
        if type(module).__name__.endswith("TopKRouter"):
            layer = int(name.split(".layers.")[1].split(".")[0])
            hook = lambda m, args, out, layer=layer: chosen.setdefault(layer, set()).update(out[2].flatten().tolist())
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        reference(ids)
    for hook in hooks:
        hook.remove()
    return chosen


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_each_chosen_expert_is_borrowed_once_per_layer_per_step(checkpoints, case):
    folder, reference = checkpoints(case)
    loaded = load_model(folder, device="cpu", dtype=torch.float32, context_length=64)
    store = loaded.model.store = CountingStore(loaded.model.store)
    sparse = loaded.config.moe.sparse_layers
    # A prefill: exactly the experts transformers routes to, each once.
    ids = prompt(loaded.config.vocab_size, 12, seed=7)
    loaded.model.forward(ids, loaded.new_cache())
    got = store.experts_by_layer()
    assert {layer: set(c) for layer, c in got.items()} == routed_by_transformers(reference, ids)
    assert sorted(got) == list(sparse) and all(set(c.values()) == {1} for c in got.values())
    # A batched decode step over scattered slots: each expert once, the union of the rows' own.
    prompts, slots = scattered_slot_prompts(loaded.config.vocab_size)
    cache = paged_cache(loaded.config, loaded.max_len, 4)
    tokens = [int(loaded.model.forward(torch.tensor([p]), cache.slot(s))[0, -1].argmax()) for p, s in zip(prompts, slots)]
    store.experts_by_layer()
    loaded.model.forward_batch(torch.tensor([[t] for t in tokens]), cache.batch(slots))
    batched = store.experts_by_layer()
    solo: dict[int, set[int]] = {}
    for p, t in zip(prompts, tokens):
        alone = loaded.new_cache()
        loaded.model.forward(torch.tensor([p]), alone)
        store.experts_by_layer()
        loaded.model.forward(torch.tensor([[t]]), alone)
        for layer, counts in store.experts_by_layer().items():
            assert sum(counts.values()) == loaded.config.moe.top_k
            solo.setdefault(layer, set()).update(counts)
    assert {layer: set(c) for layer, c in batched.items()} == solo
    assert all(set(c.values()) == {1} for c in batched.values())
    # Three rows choosing top_k each share experts somewhere: grouped, not borrowed per row.
    assert sum(map(len, batched.values())) < 3 * loaded.config.moe.top_k * len(sparse)


# -- speculation, fused decode, INT8, the CLI ----------------------------------------------------


class HintedStore(CountingStore):
    speculates = True

    def __init__(self, inner):
        super().__init__(inner)
        self.hints = []

    def peek(self, block):
        return self.inner.peek(block)

    def hint_experts(self, layer, experts):
        self.hints.append((layer, list(experts)))


@pytest.mark.parametrize("case", ["mixtral", "qwen3-moe-dense-and-sparse"])
def test_speculation_hints_the_next_sparse_layer_and_never_changes_tokens(checkpoints, case):
    folder, _ = checkpoints(case)
    loaded = load_model(folder, device="cpu", dtype=torch.float32, context_length=64)
    ids = prompt(loaded.config.vocab_size, 6, seed=9)
    plain = greedy(loaded, ids, 8, use_cache=True)
    store = loaded.model.store = HintedStore(loaded.model.store)
    assert greedy(loaded, ids, 8, use_cache=True) == plain
    moe = loaded.config.moe
    followed = [i + 1 for i in moe.sparse_layers if i + 1 in moe.sparse_layers]
    assert sorted({layer for layer, _ in store.hints}) == followed  # qwen3 case: 1 -> 2 is dense, no hint
    for layer, experts in store.hints:
        assert experts == sorted(set(experts)) and all(0 <= e < moe.experts for e in experts)
    if followed:
        # A decode step hints top_k guesses for one row.
        assert store.hints and all(len(experts) <= moe.top_k for _, experts in store.hints[-len(followed):])


def test_fused_step_runs_dense_layers_and_leaves_sparse_layers_eager(checkpoints, monkeypatch, fused_calls):
    from tierlm.models import fused_decode
    from tests.tiny import decode_steps

    if fused_decode.native_library() is None:
        pytest.skip("no native library here (no C++ compiler): decode runs the eager path only")
    folder, _ = checkpoints("qwen3-moe-dense-and-sparse")
    loaded = load_model(folder, device="cpu", dtype=torch.float32, context_length=64, quant="int8")
    ids = prompt(loaded.config.vocab_size, 9, seed=3)
    monkeypatch.setenv("TIERLM_FUSED", "0")
    expected, expected_tokens = decode_steps(loaded, ids, 8)
    monkeypatch.setenv("TIERLM_FUSED", "1")
    actual, tokens = decode_steps(loaded, ids, 8)
    assert fused_calls == [True, False, True, True, True, False] * 9  # the prefill and 8 steps; sparse layers 1 and 5 eagerly
    assert tokens == expected_tokens
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["qwen2-moe-shared", "mixtral"])
def test_int8_artifact_keeps_each_expert_in_its_own_block(checkpoints, case):
    from tierlm.cache.artifact import Artifact
    from tierlm.cache.convert import ConversionRequest, ensure_artifact

    folder, _ = checkpoints(case)
    artifact_dir = ensure_artifact(ConversionRequest(folder, (), "int8"))
    blocks = Artifact.open(artifact_dir).blocks
    assert set(blocks["experts.1.3"].tensors) == {"ew13", "ew2"}
    assert blocks["experts.1.3"].tensors["ew13"].encoding == "int8"
    assert "router" in blocks["layers.1"].tensors and "w13" not in blocks["layers.1"].tensors
    full = load_model(folder, device="cpu", dtype=torch.float32)
    int8 = load_model(artifact_dir, device="cpu", dtype=torch.float32)
    ids = prompt(full.config.vocab_size, 16, seed=5)
    expected = full.model.forward(ids, full.new_cache(), logits="all")[0]
    actual = int8.model.forward(ids, int8.new_cache(), logits="all")[0]
    assert torch.nn.functional.cosine_similarity(actual, expected, dim=-1).min() > 0.99


def test_generate_runs_a_moe_model_end_to_end(tmp_path):
    from tierlm.runtime.engine import Engine
    from tierlm.runtime.model_defaults import model_generation_defaults
    from tierlm.runtime.sampling import resolve_sampling
    from tierlm.runtime.tokenizer import Tokenizer

    args = dict(MOE_CASES["qwen3-moe-dense-and-sparse"])
    make_model(tmp_path, args.pop("family"), **args)
    tokenizer = Tokenizer.from_dir(tmp_path)
    ids = tokenizer.encode("the quick", add_special_tokens=True)
    for quant in ("none", "int8"):
        result = run_tierlm("generate", "the quick", "--raw", "--model", str(tmp_path), "-t", "0", "-n", "6",
                            "-q", quant)  # fmt: skip
        assert result.returncode == 0, result.stderr
        engine = Engine(load_model(tmp_path, device="cpu", dtype=torch.float32, quant=quant), tokenizer)
        # -t 0 with the model's other defaults (its repetition penalty among them), as the CLI resolves them.
        greedy = resolve_sampling(model_generation_defaults(tmp_path), temperature=0, max_new_tokens=6)
        expected = engine.generate(ids, greedy).text()
        assert result.stdout == expected + "\n", quant


def test_a_one_token_sparse_layer_does_the_same_work_for_8_or_128_experts():
    """Batch-1 decode touches the k chosen experts only: the torch calls of a layer do not grow with E."""
    from types import SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode

    from tierlm.blocks import expert_block
    from tierlm.config import MoeConfig
    from tierlm.models.moe import sparse_mlp
    from tierlm.store.resident import ResidentStore

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    hidden, inter, top_k = 16, 8, 4
    counts = []
    for experts in (8, 128):
        store = CountingStore(ResidentStore({expert_block(0, e): {"ew13": torch.randn(2 * inter, hidden),
                                                                  "ew2": torch.randn(hidden, inter)}
                                             for e in range(experts)}))  # fmt: skip
        moe = MoeConfig(experts, top_k, inter, norm_topk_prob=True, sparse_layers=(0,))
        model = SimpleNamespace(config=SimpleNamespace(moe=moe), store=store, sparse=[True])
        h = torch.randn(1, 1, hidden)
        with Calls() as calls:
            sparse_mlp(model, {"router": torch.randn(experts, hidden)}, h, 0)
        counts.append(calls.count)
        assert len(store.experts_by_layer()[0]) == top_k
    assert counts[0] == counts[1]


def test_decode_graphs_refuse_a_moe_model(monkeypatch):
    """Routing picks experts per token on the host, so an accelerator's captured step cannot hold it."""
    from types import SimpleNamespace

    from tierlm.models import graph_decode

    monkeypatch.delenv("TIERLM_GRAPHS", raising=False)
    config = config_from_dict(json.loads(QWEN3_30B_A3B.read_text()))
    model = SimpleNamespace(device=torch.device("cuda"), config=config, store=object())
    assert "mixture-of-experts" in graph_decode.refusal(model)
    dense = SimpleNamespace(device=torch.device("cuda"), config=config_from_dict({**QWEN3_MOE, "model_type": "qwen3"}),
                            store=object())  # fmt: skip
    assert graph_decode.refusal(dense) is None
