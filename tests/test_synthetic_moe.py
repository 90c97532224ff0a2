"""Synthetic MoE artifacts: they open and load, their random routing is near uniform, and the
documented router skew really skews what the model's routers choose, measured through the
model's own forward (the store's `experts` calls), not read off the weights."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

TINY_MOE = {
    "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "moe_intermediate_size": 32, "num_experts": 16, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
}
TOKENS = 512  # random token ids routed per artifact: 1024 choices per layer, 64 per expert if uniform


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    from tierlm.cache.synthetic import write_synthetic_artifact

    folder = tmp_path_factory.mktemp("synthetic-moe")
    return {
        skew: write_synthetic_artifact(TINY_MOE, folder / f"skew-{skew}", router_skew=skew)
        for skew in (None, 0.5)
    }


def routed_shares(artifact):
    """[layers, experts]: each expert's share of the choices the loaded model's routers make
    over TOKENS random tokens (counted where the model asks its store for the experts)."""
    import torch

    from tierlm.runtime.loader import load_model

    loaded = load_model(str(artifact), device="cpu", dtype=torch.float32)
    counts = torch.zeros(TINY_MOE["num_hidden_layers"], TINY_MOE["num_experts"])
    fetch = loaded.store.experts

    @contextmanager
    def counting(layer, uses):
        for expert, rows in uses.items():
            counts[layer, expert] += rows
        with fetch(layer, uses) as got:
            yield got

    loaded.store.experts = counting
    try:
        ids = torch.randint(0, TINY_MOE["vocab_size"], (TOKENS // 128, 128), generator=torch.Generator().manual_seed(1))
        for row in ids:
            loaded.model.forward(row[None], loaded.new_cache())
    finally:
        loaded.close()
    assert counts.sum() == TOKENS * TINY_MOE["num_experts_per_tok"] * TINY_MOE["num_hidden_layers"]
    return counts / counts.sum(dim=1, keepdim=True)


def top_half_share(shares):
    """Per layer, the share of choices the busier half of the experts gets (0.5 if uniform):
    the hit rate an ideal frequency cache holding half the experts would reach."""
    half = shares.shape[1] // 2
    return shares.sort(dim=1, descending=True).values[:, :half].sum(dim=1)


def test_random_routers_choose_almost_uniformly(artifacts):
    shares = top_half_share(routed_shares(artifacts[None]))
    assert (shares < 0.62).all(), shares  # sampling noise alone gives ~0.55 with 64 choices per expert


@pytest.mark.slow
def test_skewed_routers_favour_the_same_experts_in_every_layer(artifacts):
    shares = routed_shares(artifacts[0.5])
    assert (top_half_share(shares) > 0.75).all(), top_half_share(shares)
    top = shares.max(dim=1).values
    assert (top > 3 / TINY_MOE["num_experts"]).all(), top  # the hottest expert: > 3x its uniform share


def test_skew_changes_only_embedding_and_routers(artifacts):
    """Experts draw from their own seeds: the skewed and the uniform artifact share their bytes,
    so the two benchmark runs differ only in routing."""
    from tierlm.cache.artifact import Artifact

    plain, skewed = (Artifact.open(artifacts[s]) for s in (None, 0.5))
    try:
        assert bytes(plain.read_bytes("experts.1.3").numpy()) == bytes(skewed.read_bytes("experts.1.3").numpy())
        assert bytes(plain.read_bytes("embed").numpy()) != bytes(skewed.read_bytes("embed").numpy())
        assert skewed.blocks["layers.0"].tensors["router"].encoding == "plain"  # fp32, as conversion keeps it
    finally:
        plain.close(), skewed.close()


def test_weights_drawn_on_the_int8_grid_have_the_documented_std(artifacts):
    import math

    from tierlm.cache import codec
    from tierlm.cache.artifact import Artifact
    from tierlm.cache.synthetic import WEIGHT_STD

    artifact = Artifact.open(artifacts[None])
    try:
        views = artifact.read_block("experts.0.0")
        gate_up = codec.decode(*views["ew13"]).dequantize()
        down = codec.decode(*views["ew2"]).dequantize()
    finally:
        artifact.close()
    assert abs(gate_up.std().item() / WEIGHT_STD - 1) < 0.05
    residual = WEIGHT_STD / math.sqrt(2 * TINY_MOE["num_hidden_layers"])
    assert abs(down.std().item() / residual - 1) < 0.05
    assert gate_up.abs().max().item() <= 127 * WEIGHT_STD / 73.6 * 1.001  # nothing off the grid


def test_skew_needs_experts(tmp_path):
    from tierlm.cache.synthetic import write_synthetic_artifact

    dense = {k: v for k, v in TINY_MOE.items() if "expert" not in k and k not in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")}
    with pytest.raises(ValueError, match="mixture-of-experts"):
        write_synthetic_artifact({**dense, "model_type": "qwen3"}, tmp_path / "dense", router_skew=0.5)
