"""The artifact behind its API: one alias parser, a hot-row reader handed in, forwards counted."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_model
from tierlm.cache.artifact import Artifact, split_alias
from tierlm.cache.convert import ConversionRequest, ensure_artifact
from tierlm.kv.cache import KVCache
from tierlm.store.resident import load_resident_artifact
from tierlm.models import read_config
from tierlm.models.llama import LlamaModel
from tierlm.weights.ledger import Ledger
from tierlm.offload.placement import DEVICE, DISK, HOST, BlockPlacement, Placement
from tierlm.store.tiered import EmbeddingRows, TieredStore
from tierlm.server.metrics import store_metrics


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("artifact-api")
    make_model(model_dir, layers=2, tied=True, with_tokenizer=False)
    return read_config(model_dir), Artifact.open(ensure_artifact(ConversionRequest(model_dir, (), "int8")))


def placement(art: Artifact, tiers: dict[str, str], hot_rows: int = 0) -> Placement:
    width = art.blocks["embed"].tensors["embed"].parts["qweight"].shape[1]
    blocks = tuple(BlockPlacement(name, tiers.get(name, DEVICE), art.blocks[name].nbytes) for name in art.blocks)
    charges = {tier: {"weights": sum(b.nbytes for b in blocks if b.tier == tier)} for tier in {b.tier for b in blocks}}
    return Placement(blocks, {}, charges, ring_slots=2, hot_cache_bytes=hot_rows * width * 4)


def test_alias_string_has_one_parser(tied):
    _, art = tied
    assert split_alias("embed/embed") == ("embed", "embed")
    assert art.blocks["head"].alias_targets() == {"head": ("embed", "embed")}
    assert art.blocks["head"].borrowed_from == "embed" and art.blocks["layers.0"].borrowed_from is None
    assert art.source_block("head") == "embed" and art.source_block("layers.1") == "layers.1"


def test_embedding_rows_read_only_through_the_handed_reader(tied):
    _, art = tied
    asked: list[list[int]] = []

    def read_rows(rows):
        asked.append(list(rows))
        return art.read_rows("embed", "embed", rows)

    ledger = Ledger()
    embedding = EmbeddingRows(art.blocks["embed"].tensors["embed"], read_rows, ledger=ledger,
                              device=torch.device("cpu"), dtype=torch.float32, cache_bytes=0)  # fmt: skip
    ids = torch.tensor([[3, 9, 3, 40]])
    reference = load_resident_artifact(art.directory).acquire("embed")["embed"]
    dense = reference if isinstance(reference, torch.Tensor) else reference.dequantize()
    torch.testing.assert_close(embedding.rows(ids), dense[ids[0]].unsqueeze(0))
    assert asked == [[3, 9, 3, 40]] and ledger.hot_misses == 4


@pytest.mark.parametrize("tiers", [{}, {"embed": HOST, "head": HOST, "layers.1": DISK}], ids=["resident", "tiered"])
def test_ledger_counts_each_forward_and_its_tokens(tied, tiers):
    config, art = tied
    store = TieredStore(art, placement(art, tiers, hot_rows=4))
    try:
        model = LlamaModel(config, store, 64, "cpu", torch.float32)
        cache = KVCache.for_model(config, 64)
        logits = model.forward(torch.tensor([[5, 6, 7, 8, 100]]), cache)
        assert (store.ledger.forwards, store.ledger.tokens) == (1, 5)
        for _ in range(3):
            logits = model.forward(logits[:, -1:].argmax(-1), cache)
        snapshot = store.stats().snapshot()
        assert (snapshot["forwards"], snapshot["tokens"]) == (4, 8)
        read = store.ledger.bytes_read
        assert snapshot["bytes_read_per_token"] == {tier: n / 8 for tier, n in read.items()}
        assert bool(read) == bool(tiers)  # only a placement off the device streams bytes
        metrics = store_metrics(store)  # what /metrics shows
        assert (metrics["tierlm_forwards"], metrics["tierlm_forward_tokens"]) == (4, 8)
        for tier, nbytes in read.items():
            assert metrics[f'tierlm_weight_bytes_read_per_token{{tier="{tier}"}}'] == nbytes / 8
    finally:
        store.close()
