"""The tiered store against the resident one: same tokens whatever the placement; prefetch faults."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.tiny import make_model
from tierlm.cache.artifact import Artifact
from tierlm.cache.convert import ConversionRequest, ensure_artifact
from tierlm.kv.cache import KVCache
from tierlm.store.resident import load_resident_artifact
from tierlm.models import read_config
from tierlm.errors import TierlmError
from tierlm.models.llama import LlamaModel
from tierlm.offload.placement import DEVICE, DISK, HOST, BlockPlacement, Placement
from tierlm.store.tiered import TieredStore


@pytest.fixture(scope="module", params=["untied", "tied"])
def artifact(request, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp(f"offload-{request.param}")
    make_model(model_dir, layers=4, tied=request.param == "tied", with_tokenizer=False)
    return read_config(model_dir), Artifact.open(ensure_artifact(ConversionRequest(model_dir, (), "int8")))


def placement(art: Artifact, tiers: dict[str, str], *, slots: int = 3, hot_rows: int = 16) -> Placement:
    width = art.blocks["embed"].tensors["embed"].parts["qweight"].shape[1]
    blocks = tuple(BlockPlacement(name, tiers.get(name, DEVICE), art.blocks[name].nbytes) for name in art.blocks)
    return Placement(blocks, {}, {}, ring_slots=slots, hot_cache_bytes=hot_rows * width * 4)


def greedy(config, store, steps: int = 12) -> list[int]:
    model = LlamaModel(config, store, 96, "cpu", torch.float32)
    cache = KVCache.for_model(config, 96)
    logits = model.forward(torch.tensor([[5, 6, 7, 8, 100, 5]]), cache)
    out = []
    for _ in range(steps):
        out.append(int(logits[0, -1].argmax()))
        logits = model.forward(torch.tensor([[out[-1]]]), cache)
    return out


LAYOUTS = {
    "all-disk": {"embed": DISK, "layers.0": DISK, "layers.1": DISK, "layers.2": DISK, "layers.3": DISK, "norm": DISK, "head": DISK},
    "tail-layers-on-disk": {"layers.2": DISK, "layers.3": DISK},
    "three-tiers": {"embed": HOST, "layers.0": HOST, "layers.1": DISK, "layers.3": DISK, "head": DISK},
    "embedding-off-device": {"embed": DISK},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("slots", [1, 3])
def test_offloaded_tokens_equal_resident(artifact, layout, slots):
    config, art = artifact
    expected = greedy(config, load_resident_artifact(art.directory))
    store = TieredStore(art, placement(art, LAYOUTS[layout], slots=slots))
    try:
        assert greedy(config, store) == expected
        streamed = store.ledger.bytes_per_forward()
        if config.tie_word_embeddings and layout == "embedding-off-device":
            # A resident tied head is the embedding matrix, so rows come from it: no reads.
            assert store.acquire("embed")["embed"] is store.acquire("head")["head"]
        else:
            assert sum(streamed.values()) > 0
    finally:
        store.close()


@pytest.mark.slow
def test_read_delay_changes_nothing_but_is_reported_as_stall(artifact):
    config, art = artifact
    expected = greedy(config, load_resident_artifact(art.directory))
    store = TieredStore(art, placement(art, LAYOUTS["three-tiers"], slots=2), read_delay_s=0.02)
    try:
        assert greedy(config, store, steps=6) == expected[:6]
        assert store.ledger.stall_s > 0
        assert 0.0 <= store.ledger.overlap < 1.0
    finally:
        store.close()


def test_hot_row_cache_counts_persist_and_warm_the_next_start(artifact):
    from tierlm.store.hot_rows import COUNTS_NAME

    config, art = artifact
    (art.directory / COUNTS_NAME).unlink(missing_ok=True)  # other tests ran with this artifact
    off_device = {"embed": DISK, "head": DISK}  # a tied head would otherwise serve the rows
    store = TieredStore(art, placement(art, off_device, hot_rows=8))
    greedy(config, store, steps=10)
    assert store.ledger.hot_hits > 0 and 0 < store.ledger.hit_rate < 1
    store.close()
    warm = TieredStore(art, placement(art, off_device, hot_rows=8))
    try:
        assert len(warm._embed_rows.cache.slot_of) > 0, "the persisted hot rows were pre-loaded"
        greedy(config, warm, steps=10)
        assert warm.ledger.hit_rate > store.ledger.hit_rate
    finally:
        warm.close()


def test_read_error_mid_generation_is_a_clear_error_not_a_hang(tmp_path):
    model_dir = tmp_path / "model"
    make_model(model_dir, layers=4, with_tokenizer=False)
    import os

    os.environ["TIERLM_CACHE"], saved = str(tmp_path / "cache"), os.environ["TIERLM_CACHE"]
    try:
        art = Artifact.open(ensure_artifact(ConversionRequest(model_dir, (), "int8")))
    finally:
        os.environ["TIERLM_CACHE"] = saved
    config = read_config(model_dir)
    store = TieredStore(art, placement(art, {"layers.2": DISK, "layers.3": DISK}, slots=2))
    model = LlamaModel(config, store, 64, "cpu", torch.float32)
    cache = KVCache.for_model(config, 64)
    model.forward(torch.tensor([[5, 6, 7]]), cache)
    with open(art.weights_path, "r+b") as handle:  # the disk "fails": layer 2 onward is gone
        handle.truncate(art.blocks["layers.2"].offset + 16)
    outcome: dict = {}

    def step():
        try:
            for _ in range(3):
                model.forward(torch.tensor([[9]]), cache)
        except BaseException as err:  # noqa: BLE001 - the test inspects whatever came out
            outcome["error"] = err

    worker = threading.Thread(target=step, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "a failed read must not hang the forward pass"
    assert isinstance(outcome.get("error"), TierlmError)
    assert "layers.2" in str(outcome["error"]) or "layers.3" in str(outcome["error"])
    store.close()


@pytest.mark.parametrize("damage", ["[1, 2, 3]", '{"a": 1}', '{"1": [2]}', "not json", '{"1": null}'])
def test_damaged_hot_row_statistics_cost_only_a_cold_start(tmp_path, damage):
    from tierlm.store.hot_rows import HotRowCache

    path = tmp_path / "hot_rows.json"
    path.write_text(damage)
    cache = HotRowCache(4, 8, device="cpu", dtype=torch.float32, counts_path=path)
    assert not cache.counts


def test_fused_decode_runs_resident_layers_in_one_call_and_streamed_ones_alone(artifact, fused_spy, monkeypatch):
    """Layers 0-1 on the device run as one native call (`run_resident`), the streamed layers 2-3
    one by one through the ring, every one natively; the tokens are the resident store's."""
    from tierlm.models import fused_decode

    if fused_decode.native_library() is None:
        pytest.skip("no native library here (no C++ compiler): decode runs the eager path only")
    config, art = artifact
    expected = greedy(config, load_resident_artifact(art.directory))
    calls, layers = fused_spy
    calls.clear(), layers.clear()
    runs = []
    run_resident = fused_decode.FusedStep.run_resident
    monkeypatch.setattr(fused_decode.FusedStep, "run_resident",
                        lambda self, *a: runs.append(run_resident(self, *a)) or runs[-1])  # fmt: skip
    store = TieredStore(art, placement(art, LAYOUTS["tail-layers-on-disk"]))
    try:
        assert greedy(config, store) == expected
    finally:
        store.close()
    assert all(calls) and layers == [0, 1, 2, 3] * 13  # the prefill chunk and 12 decode steps, each layer native
    assert runs == [2, 0, 0] * 13  # one call for the resident pair; the streamed ones are offered alone
