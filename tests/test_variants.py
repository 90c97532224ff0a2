"""LoRA variants at run time (store/variants.py): rows of one batch on different variants.

The reference for every row is the same prompt run alone on that variant's own full artifact
(what `tierlm generate --lora` loads); the unmerged delta's reference is peft-checked merging.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_lora_merge import save_adapter
from tests.tiny import make_model, paged_cache, prompt
from tierlm.cache.convert import ConversionRequest, ensure_artifact
from tierlm.errors import TierlmError
from tierlm.lora.adapter import LoraAdapter
from tierlm.lora.merge import LoraMerger
from tierlm.runtime.loader import load_model
from tierlm.weights.checkpoint import Checkpoint
from tierlm.store.variants import (
    MERGED,
    UNMERGED,
    RowSwitched,
    VariantCost,
    VariantStore,
    choose_mode,
    overlay_for,
)

VOCAB = 320
STEPS = 4
# adapter -> LoraConfig kwargs: different targets, ranks, rsLoRA, DoRA
ADAPTERS = {
    "attn-rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj"]),
    "mlp-r8": dict(r=8, lora_alpha=16, target_modules=["k_proj", "gate_proj", "up_proj", "down_proj"]),
    "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "down_proj"]),
    "embed-head": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head"]),
    "k-bias": dict(r=2, lora_alpha=4, lora_bias=True, target_modules=["k_proj"]),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    model_dir = tmp_path_factory.mktemp("variants-base")
    make_model(model_dir, "llama", vocab=VOCAB, with_tokenizer=False, attention_bias=True)
    return model_dir


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory):
    from peft import LoraConfig

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            out = tmp_path_factory.mktemp(f"variant-{name}")
            made[name] = save_adapter(base, out, LoraConfig(**ADAPTERS[name]), seed=len(made) + 21)
        return made[name]

    return get


def artifact(base: Path, quant: str, adapters=()) -> Path:
    return ensure_artifact(ConversionRequest(base, tuple(adapters), quant))


def prompts() -> list[torch.Tensor]:
    return [prompt(VOCAB, length, seed) for length, seed in ((9, 1), (5, 2), (7, 3), (6, 4))]


def mixed_run(loaded, store: VariantStore, rows: list[str | None]) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Each row's prompt prefilled alone (its variant selected), then STEPS decode steps with every
    row in one batch: per step the logits [rows, V], and each row's greedy tokens."""
    model = type(loaded.model)(loaded.config, store, loaded.max_len, loaded.device, loaded.dtype)
    cache = paged_cache(loaded.config, loaded.max_len, len(rows))
    last = []
    for slot, (name, ids) in enumerate(zip(rows, prompts())):
        store.select([name])
        last.append(model.forward(ids, cache.slot(slot))[0, -1])
    steps, tokens = [torch.stack(last)], [[int(row.argmax())] for row in last]
    for _ in range(STEPS):
        store.select(rows)
        ids = torch.tensor([[t[-1]] for t in tokens])
        logits = model.forward(ids, cache.batch(list(range(len(rows)))))[:, -1]
        steps.append(logits)
        for row, t in zip(logits, tokens):
            t.append(int(row.argmax()))
    return steps, tokens


def solo_run(directory: Path, ids: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Logits [STEPS + 1, V] of `ids` then `tokens` fed one by one, on the artifact alone."""
    loaded = load_model(directory, device="cpu")
    cache = loaded.new_cache()
    rows = [loaded.model.forward(ids, cache)[0, -1]]
    for token in tokens[:-1]:
        rows.append(loaded.model.forward(torch.tensor([[token]]), cache)[0, -1])
    return torch.stack(rows)


def test_mixed_batch_rows_equal_their_solo_runs_fp32(base, adapter):
    """Rows of variant A (merged), B (unmerged), the base and E (two adapters: embedding and head
    LoRA, a lora_B bias; merged, as neither is low rank) in one decode step: each row's logits
    are those of its own full artifact run alone."""
    base_dir = artifact(base, "fp32")
    a, b = [(adapter("attn-rslora"), 1.0)], [(adapter("mlp-r8"), 0.7)]
    e = [(adapter("embed-head"), 1.0), (adapter("k-bias"), 0.5)]
    loaded = load_model(base_dir, device="cpu")
    store = VariantStore(loaded.store)
    store.add("a", overlay_for(base_dir, a, MERGED))
    store.add("b", overlay_for(base_dir, b, UNMERGED))
    store.add("e", overlay_for(base_dir, e))
    assert store.overlay("a").mode == MERGED and store.overlay("b").mode == UNMERGED
    assert store.overlay("e").mode == MERGED and "embedding" in store.overlay("e").why
    assert all(store.overlay(name).mixes for name in "abe")
    rows = ["a", "b", None, "e"]
    steps, tokens = mixed_run(loaded, store, rows)
    got = torch.stack(steps, dim=1)  # [rows, STEPS + 1, V]
    for row, (ids, adapters) in enumerate(zip(prompts(), (a, b, (), e))):
        want = solo_run(artifact(base, "fp32", adapters), ids, tokens[row])
        assert (got[row] - want).abs().max().item() < 1e-4, f"row {row} ({rows[row]})"
    # The variants differ from the base, or the comparison proves nothing.
    plain = solo_run(base_dir, prompts()[0], tokens[0])
    assert (got[0] - plain).abs().max().item() > 1e-2


def test_mixed_batch_int8_merged_gives_the_lora_artifacts_tokens(base, adapter):
    base_dir = artifact(base, "int8")
    a, d = [(adapter("attn-rslora"), 1.0)], [(adapter("dora"), 1.0)]
    loaded = load_model(base_dir, device="cpu")
    store = VariantStore(loaded.store, {"a": overlay_for(base_dir, a), "d": overlay_for(base_dir, d)})
    assert store.overlay("d").mode == MERGED
    rows = ["d", None, "a"]
    _, tokens = mixed_run(loaded, store, rows)
    for row, adapters in enumerate((d, (), a)):
        loaded_solo = load_model(artifact(base, "int8", adapters), device="cpu")
        cache = loaded_solo.new_cache()
        logits = loaded_solo.model.forward(prompts()[row], cache)
        solo = []
        for _ in range(STEPS + 1):
            solo.append(int(logits[0, -1].argmax()))
            logits = loaded_solo.model.forward(torch.tensor([[solo[-1]]]), cache)
        assert solo == tokens[row], f"row {row} ({rows[row]})"


def test_unmerged_delta_equals_merged_minus_base(base, adapter):
    """Σ B @ A from low_rank equals the peft-checked merge minus the base, in fp32, for weighted
    adapters with rsLoRA and plain scaling; DoRA's change is not low rank."""
    checkpoint = Checkpoint(base)
    merger = LoraMerger([(LoraAdapter.load(adapter("attn-rslora")), 0.6), (LoraAdapter.load(adapter("mlp-r8")), -1.3)])
    merger.validate(checkpoint)
    touched = merger.touched_names()
    assert len(touched) == 2 * 7  # every projection of both layers
    for name in touched:
        W = checkpoint.get(name).float()
        terms = merger.low_rank(name)
        assert terms, name
        delta = sum(B @ A for A, B in terms)
        assert (delta - (merger.merge(name, W) - W)).abs().max().item() < 1e-6, name
    assert merger.low_rank("model.norm.weight") == []

    dora = LoraMerger([(LoraAdapter.load(adapter("dora")), 1.0)])
    dora.validate(checkpoint)
    assert dora.low_rank("model.layers.0.self_attn.q_proj.weight") is None


def test_dora_forces_merged(base, adapter):
    base_dir = artifact(base, "fp32")
    overlay = overlay_for(base_dir, [(adapter("dora"), 1.0)], UNMERGED)
    assert overlay.mode == MERGED
    assert "cannot be added unmerged" in overlay.why and "DoRA" in overlay.why


def test_choose_mode_weighs_memory_and_time():
    small = VariantCost(merged_bytes=64 << 20, factor_bytes=2 << 20, flops_per_row=4_000_000)
    mode, why = choose_mode(small)
    assert mode == UNMERGED and "less memory and time" in why and "64.00 MiB" in why
    # A rank so high the factors outweigh the merged weights: merging holds less.
    huge = VariantCost(merged_bytes=8 << 20, factor_bytes=12 << 20, flops_per_row=6_000_000)
    assert choose_mode(huge) == (MERGED, choose_mode(huge)[1])
    assert "saves no memory" in choose_mode(huge)[1]
    # Fewer bytes but slow arithmetic (a weak device): the extra read of merged weights is cheaper.
    slow = choose_mode(small, flops=1e6)
    assert slow[0] == MERGED and "saves no time" in slow[1]
    assert choose_mode(small, MERGED)[0] == MERGED
    assert choose_mode(VariantCost(1, None, 0, "it is DoRA"), UNMERGED)[0] == MERGED


def test_selection_switches_rows_and_falls_back_from_fused_decode(base, adapter):
    """A mixed selection hands RowSwitched weights, which the fused decode step declines (the
    layer runs eagerly); a batch of one merged variant gets plain weights."""
    from tierlm.quant.native import describe_weight as _weight_words

    base_dir = artifact(base, "fp32")
    loaded = load_model(base_dir, device="cpu")
    store = VariantStore(loaded.store, {"a": overlay_for(base_dir, [(adapter("attn-rslora"), 1.0)], MERGED)})
    store.add("b", overlay_for(base_dir, [(adapter("mlp-r8"), 1.0)], UNMERGED))
    store.select(["a", None])
    w = store.acquire("layers.0")
    assert isinstance(w["wqkv"], RowSwitched) and isinstance(w["wo"], RowSwitched)
    assert isinstance(w["w13"], torch.Tensor)  # A does not touch the MLP
    assert _weight_words(w["wqkv"], w.get("bqkv"), tuple(w["wqkv"].shape), []) is None
    store.release("layers.0")
    store.select(["a", "a"])
    w = store.acquire("layers.0")
    assert w["wqkv"] is store.overlay("a").changes["layers.0"]["wqkv"]
    store.release("layers.0")
    store.select([None])
    assert store.acquire("layers.1") is loaded.store.acquire("layers.1")
    assert store.nbytes() > loaded.store.nbytes()


def test_names_add_remove_and_unknown(base, adapter):
    base_dir = artifact(base, "fp32")
    loaded = load_model(base_dir, device="cpu")
    overlay = overlay_for(base_dir, [(adapter("mlp-r8"), 1.0)])
    assert overlay.mode == UNMERGED  # low rank and smaller: the cost model's choice
    store = VariantStore(loaded.store, {"b": overlay})
    with pytest.raises(TierlmError, match="exists already"):
        store.add("b", overlay)
    with pytest.raises(TierlmError, match="not usable"):
        store.add("../x", overlay)
    with pytest.raises(TierlmError, match="no variant named 'c'"):
        store.select(["b", "c"])
    assert store.names() == ["b"]
    assert store.remove("b") is overlay and store.names() == []
    with pytest.raises(TierlmError, match="no variant named 'b'"):
        store.select(["b"])


def test_mixture_of_experts_variant_switches_whole_batches(tmp_path):
    """LoRA on the fused expert parameters (per expert, low rank): a batch all on the variant,
    merged or unmerged, gives its --lora artifact's logits; a batch mixing it with the base
    cannot split routed tokens by row and says so."""
    from tests.test_moe_artifact import parameter_adapter
    from tests.tiny import MOE_CASES, make_case

    folder = tmp_path / "mixtral"
    make_case(folder, MOE_CASES["mixtral"])
    adapters = [(parameter_adapter(folder, tmp_path / "experts-lora", seed=3), 1.0)]
    base_dir = artifact(folder, "fp32")
    loaded = load_model(base_dir, device="cpu")
    store = VariantStore(loaded.store)
    for mode in (MERGED, UNMERGED):
        store.add(mode, overlay_for(base_dir, adapters, mode))
    assert any(b.startswith("experts.") for b in store.overlay(UNMERGED).changes)
    assert not store.overlay(MERGED).mixes and not store.overlay(UNMERGED).mixes
    model = type(loaded.model)(loaded.config, store, loaded.max_len, loaded.device, loaded.dtype)
    ids = prompt(loaded.config.vocab_size, 6, seed=5)
    solo = load_model(artifact(folder, "fp32", adapters), device="cpu")
    want = solo.model.forward(ids, solo.new_cache())[0, -1]
    for mode in (MERGED, UNMERGED):
        store.select([mode])
        got = model.forward(ids, loaded.new_cache())[0, -1]
        assert (got - want).abs().max().item() < 1e-4, mode
    store.select([UNMERGED, None])
    with pytest.raises(TierlmError, match="routed"):
        model.forward(torch.cat([ids, ids]), loaded.new_cache(batch=2))


@pytest.mark.slow
def test_variants_come_and_go_while_forwards_run(base, adapter):
    """add/remove on another thread between and during forwards: the rows on a variant that stays
    keep their logits, and a forward never sees a half-changed set."""
    import threading

    base_dir = artifact(base, "fp32")
    loaded = load_model(base_dir, device="cpu")
    overlay = overlay_for(base_dir, [(adapter("mlp-r8"), 1.0)], UNMERGED)
    store = VariantStore(loaded.store, {"b": overlay})
    model = type(loaded.model)(loaded.config, store, loaded.max_len, loaded.device, loaded.dtype)
    ids = prompts()[0]
    store.select(["b"])
    want = model.forward(ids, loaded.new_cache())
    stop, failures = threading.Event(), []

    def churn():
        while not stop.is_set():
            try:
                store.add("other", overlay)
                store.remove("other")
            except Exception as err:  # noqa: BLE001 - reported below
                failures.append(err)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(5):
            store.select(["b"])
            assert torch.equal(model.forward(ids, loaded.new_cache()), want)
    finally:
        stop.set()
        thread.join()
    assert not failures and store.names() == ["b"]


def test_a_variant_store_over_streamed_experts_gives_the_resident_logits(tmp_path, monkeypatch):
    """Streamed INT8 experts are views of stream slots the cache refills: the wrapper must switch
    each expert when the model takes it, not all of a layer's up front (more misses than slots)."""
    from tierlm.blocks import expert_of
    from tierlm.cache.artifact import Artifact
    from tierlm.kv.cache import KVCache
    from tierlm.store.resident import load_resident_artifact
    from tierlm.models import family_class, read_config
    from tierlm.offload.placement import DEVICE, DISK, BlockPlacement, Placement
    from tierlm.store.tiered import TieredStore

    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "moe"
    make_model(folder, "qwen3_moe", layers=2, heads=4, kv_heads=2, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, with_tokenizer=False)  # fmt: skip
    config = read_config(folder)
    artifact = Artifact.open(ensure_artifact(ConversionRequest(folder, (), "int8")))
    # Expert 0 of each layer resident, the other seven read from disk through two stream slots.
    blocks = tuple(BlockPlacement(n, DISK if (expert_of(n) or (0, 0))[1] else DEVICE, r.nbytes)
                   for n, r in artifact.blocks.items())  # fmt: skip
    largest = max(b.nbytes for b in blocks if expert_of(b.name))
    placement = Placement(blocks, {}, {"device": {"weights": 1}}, ring_slots=2, expert_slots=2,
                          expert_stream_slots=2, expert_slot_bytes=largest)  # fmt: skip
    ids = torch.tensor([[5, 6, 7, 8, 100, 5, 40, 41, 9, 77, 3, 1]])

    def run(store):
        model = family_class(config)(config, store, 64, "cpu", torch.float32)
        return model.forward(ids, KVCache.for_model(config, 64))

    resident = run(load_resident_artifact(artifact.directory))
    wrapped = VariantStore(TieredStore(artifact, placement), device=torch.device("cpu"))
    try:
        assert torch.equal(run(wrapped), resident)
    finally:
        wrapped.close()
