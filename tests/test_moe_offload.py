"""A tiny MoE model, INT8, with only some experts resident: the tiered store's expert cache gives the
resident run's tokens for every policy, with speculation on and off, in a batch, through the host
compute path; its counts persist beside the artifact and warm the next open; its figures move.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiers import quick
from tests.tiny import make_model
from tierlm.blocks import expert_block, expert_of, is_expert
from tierlm.cache.artifact import Artifact
from tierlm.cache.convert import ConversionRequest, ensure_artifact
from tierlm.kv.cache import KVCache
from tierlm.store.resident import load_resident_artifact
from tierlm.models import family_class, read_config
from tierlm.offload.placement import DEVICE, DISK, HOST, BlockPlacement, Placement
from tierlm.offload.routing_counts import COUNTS_NAME, RoutingCounts
from tierlm.store.tiered import TieredStore

LAYERS, EXPERTS, TOP_K = 4, 8, 2
RESIDENT = (0, 3, 5)  # of each layer's 8 experts, at open (without saved counts)
PROMPT = [5, 6, 7, 8, 100, 5, 40, 41]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("moe-offload")
    make_model(model_dir, "qwen3_moe", layers=LAYERS, heads=4, kv_heads=2, num_experts=EXPERTS,
               num_experts_per_tok=TOP_K, moe_intermediate_size=32, norm_topk_prob=True, with_tokenizer=False)  # fmt: skip
    config = read_config(model_dir)
    assert config.moe.sparse_layers == tuple(range(LAYERS))
    art = Artifact.open(ensure_artifact(ConversionRequest(model_dir, (), "int8")))
    resident = load_resident_artifact(art.directory)
    return config, art, greedy(config, resident), batch_greedy(config, resident)


def placement(art: Artifact, *, resident=RESIDENT, cold=DISK, compute=DEVICE, stream_slots=TOP_K,
              dense_on_disk=()) -> Placement:  # fmt: skip
    """Dense blocks on the device (but `dense_on_disk`, streamed through the ring); experts in
    `resident` too, the rest on `cold`."""
    blocks = []
    for name, record in art.blocks.items():
        where = expert_of(name)
        tier = DEVICE if where is None or where[1] in resident else cold
        tier = DISK if name in dense_on_disk else tier
        blocks.append(BlockPlacement(name, tier, record.nbytes, compute if tier == HOST else DEVICE))
    sizes = [r.nbytes for n, r in art.blocks.items() if is_expert(n)]
    return Placement(tuple(blocks), {}, {}, ring_slots=2, expert_slots=LAYERS * len(resident),
                     expert_stream_slots=stream_slots, expert_slot_bytes=max(sizes))  # fmt: skip


def greedy(config, store, steps: int = 10) -> list[int]:
    model = family_class(config)(config, store, 64, "cpu", torch.float32)
    cache = KVCache.for_model(config, 64)
    logits = model.forward(torch.tensor([PROMPT]), cache)
    out = []
    for _ in range(steps):
        out.append(int(logits[0, -1].argmax()))
        logits = model.forward(torch.tensor([[out[-1]]]), cache)
    return out


def batch_greedy(config, store, steps: int = 6) -> list[list[int]]:
    """Three prompts decoded together: each step's experts run once for all rows that chose them."""
    model = family_class(config)(config, store, 64, "cpu", torch.float32)
    cache = KVCache.for_model(config, 64, batch=3)
    ids = torch.tensor([PROMPT, PROMPT[::-1], [9] * len(PROMPT)])
    logits = model.forward(ids, cache)
    out = []
    for _ in range(steps):
        out.append(logits[:, -1].argmax(-1).tolist())
        logits = model.forward(torch.tensor(out[-1])[:, None], cache)
    return out


def open_store(art, place, **options) -> TieredStore:
    (art.directory / COUNTS_NAME).unlink(missing_ok=True)  # each test starts cold unless it says
    return TieredStore(art, place, **options)


@pytest.mark.parametrize("speculate", [True, False], ids=["speculate", "no-speculation"])
@pytest.mark.parametrize("policy", quick(["lfu", "lru", "stream"], fast=["lfu"]))
def test_offloaded_experts_give_the_resident_tokens(moe, policy, speculate):
    config, art, expected, _ = moe
    store = open_store(art, placement(art), expert_policy=policy, speculate=speculate)
    picks = count_picks(store)
    try:
        assert greedy(config, store) == expected
        ledger = store.ledger
        assert ledger.expert_hits + ledger.expert_misses == sum(picks), "every chosen expert counted once"
        assert ledger.expert_misses > 0 and ledger.bytes_read.get("disk", 0) > 0
        assert (ledger.expert_hits > 0) == (policy != "stream")
        assert (ledger.speculative_guesses > 0) == speculate
        assert store.speculates == speculate
    finally:
        store.close()


def test_expert_cache_options_come_from_the_environment(monkeypatch):
    from tierlm.errors import TierlmError
    from tierlm.runtime.loader import expert_options

    monkeypatch.delenv("TIERLM_EXPERT_CACHE", raising=False)
    monkeypatch.delenv("TIERLM_SPECULATE", raising=False)
    assert expert_options() == ("lfu", True)
    monkeypatch.setenv("TIERLM_EXPERT_CACHE", "LRU")
    monkeypatch.setenv("TIERLM_SPECULATE", "0")
    assert expert_options() == ("lru", False)
    monkeypatch.setenv("TIERLM_EXPERT_CACHE", "fifo")
    with pytest.raises(TierlmError, match="lfu, lru, stream"):
        expert_options()


def test_wrong_guesses_cost_bandwidth_never_tokens(moe):
    """Every guess turned into the experts the router did not pick: reads are wasted, tokens stay."""
    config, art, expected, _ = moe
    store = open_store(art, placement(art, resident=(0,), stream_slots=4), expert_policy="stream")
    hint = store.expert_cache.hint
    store.expert_cache.hint = lambda layer, guesses: hint(layer, [e for e in range(EXPERTS) if e not in guesses])
    try:
        assert greedy(config, store) == expected
        ledger = store.ledger
        assert ledger.speculative_guesses > 0 and ledger.speculative_accuracy < 0.5
        assert ledger.bytes_read["disk"] > ledger.expert_misses * min(
            art.blocks[b].nbytes for b in art.blocks if is_expert(b)), "the wrong guesses were read too"
    finally:
        store.close()


def test_cached_experts_compute_before_the_model_waits_for_a_read(moe):
    """Batch-1 decode asks for the cached experts first, so they compute while cold ones arrive."""
    config, art, expected, _ = moe
    store = open_store(art, placement(art), read_delay_s=0.002)
    asked: dict[int, tuple[object, list[bool]]] = {}  # batch id -> (batch, hit or not in the order asked)
    tensors_for = store.expert_cache.tensors_for

    def logged(batch, expert):
        asked.setdefault(id(batch), (batch, []))[1].append(expert in batch.hits)  # kept alive: ids stay unique
        return tensors_for(batch, expert)

    store.expert_cache.tensors_for = logged
    try:
        assert greedy(config, store) == expected
        decode = [hits for _, hits in list(asked.values())[LAYERS:]]  # after the prefill's layers
        assert all(len(hits) == TOP_K for hits in decode)
        mixed = [hits for hits in decode if any(hits) and not all(hits)]
        assert mixed and all(hits == sorted(hits, reverse=True) for hits in mixed)
    finally:
        store.close()


@pytest.mark.parametrize("policy", quick(["lfu", "lru", "stream"], fast=["lru"]))
def test_batch_decode_gives_the_resident_tokens(moe, policy):
    """Three rows choose up to six experts a layer, more than the three stream slots: reads come in
    waves as the model runs the experts, each once for all its rows."""
    config, art, _, expected = moe
    store = open_store(art, placement(art, stream_slots=3), expert_policy=policy)
    batches = record_batches(store)
    try:
        assert batch_greedy(config, store) == expected
        assert max(len(b.done) for b in batches) > 3, "some layer streamed more experts than it has slots"
    finally:
        store.close()


def test_one_stream_slot_and_misses_many_times_over(moe):
    """Every expert cold and a single stream slot: misses wait for the slot, tokens unchanged."""
    config, art, expected, _ = moe
    store = open_store(art, placement(art, resident=(), stream_slots=1), expert_policy="stream")
    try:
        assert greedy(config, store, steps=4) == expected[:4]
        assert store.ledger.expert_hits == 0
    finally:
        store.close()


def test_host_computed_experts_give_the_resident_tokens(moe):
    """Accelerator stand-ins with a host tier: cold experts are computed where they lie."""
    from tests.test_copy_stream import CpuStandIns

    config, art, expected, _ = moe
    store = open_store(art, placement(art, cold=HOST, compute=HOST), backend=CpuStandIns())
    try:
        assert len(store.expert_cache.host_computed) == LAYERS * (EXPERTS - len(RESIDENT))
        batches = record_batches(store)
        assert greedy(config, store) == expected
        assert sum(len(b.host) for b in batches) > 0, "some chosen experts were computed on the host"
        # Nothing is read from disk: the plan has no expert there, so no staging either, and the
        # resident experts (no host copy) stay; hot host experts were promoted by a copy.
        assert not any(b.done for b in batches) and store.expert_cache.staging_count == 0
        assert store.ledger.bytes_read.get("host", 0) > 0 and store.ledger.bytes_read.get("disk", 0) == 0
        assert set(store.expert_cache.cached) >= store.expert_cache.kept
    finally:
        store.close()


@pytest.mark.parametrize("cold", quick([HOST, DISK], fast=[DISK]))
def test_accelerator_copies_ordered_by_events(moe, cold):
    """The recording backend defers copies until an event forces them: cold experts from the host
    tier or from disk (through pinned staging) reach the device slots before compute reads them."""
    from tests.test_copy_stream import FakeBackend

    config, art, expected, _ = moe
    backend = FakeBackend()
    store = open_store(art, placement(art, cold=cold, compute=DEVICE), backend=backend)
    try:
        assert greedy(config, store) == expected
        assert store.ledger.bytes_read.get(cold, 0) > 0 and not store.expert_cache.host_computed
        assert any(entry[0] == "copy" for entry in backend.entries)
        assert (store.expert_cache.staging_count > 0) == (cold == DISK)
    finally:
        store.close()


def test_streamed_dense_layers_and_streamed_experts_together(moe):
    """Layers 1 and 2 through the prefetch ring, experts through the cache: no guesses for a layer
    whose router is not resident, tokens unchanged."""
    config, art, expected, _ = moe
    store = open_store(art, placement(art, dense_on_disk=("layers.1", "layers.2")))
    try:
        assert greedy(config, store) == expected
        assert store.ring is not None and not any(is_expert(b) for b in store.ring.order)
        assert set(store.ledger.expert_lookups) == set(range(LAYERS))
    finally:
        store.close()


def test_a_planned_placement_splits_the_experts_and_keeps_the_tokens(moe, tmp_path):
    """The planner's own placement (expert slots, stream slots, slot size) at a budget that keeps
    some of the experts resident: the store obeys it and the tokens stay the resident run's."""
    from tests.test_memory_profile import FIXED_BANDWIDTHS, write_profile
    from tierlm.offload.planner.search import plan
    from tierlm.offload.bandwidths import Bandwidths
    from tierlm.offload.sizes import sizes_from_artifact
    from tierlm.profile import load_profile

    config, art, expected, _ = moe
    sizes, total = sizes_from_artifact(art.directory), LAYERS * EXPERTS

    def placed(budget: int):
        profile = load_profile(str(write_profile(tmp_path / "p.toml", budget)))
        return plan(config, sizes, profile, Bandwidths(**FIXED_BANDWIDTHS), accelerator=False, baseline_bytes=0)

    low, high = 0, 64 << 20  # the smallest budget with half the experts resident
    while high - low > 4096:
        mid = (low + high) // 2
        try:
            enough = placed(mid).expert_slots >= total // 2
        except Exception:  # noqa: BLE001 - below the minimum the planner refuses; go higher
            enough = False
        low, high = (low, mid) if enough else (mid, high)
    placement = placed(high)
    assert total // 2 <= placement.expert_slots < total and placement.expert_stream_slots >= TOP_K
    store = open_store(art, placement)
    try:
        assert len(store.expert_cache.cached) == placement.expert_slots
        assert greedy(config, store) == expected
        assert store.ledger.expert_misses > 0 and store.ledger.bytes_read.get("disk", 0) > 0
    finally:
        store.close()


def test_counts_persist_and_warm_the_next_open(moe):
    config, art, expected, _ = moe
    store = open_store(art, placement(art))
    greedy(config, store)
    first = store.ledger.expert_hit_rate
    store.close()
    saved = RoutingCounts.load(art.directory / COUNTS_NAME, range(LAYERS), EXPERTS)
    assert sum(saved.count(layer, e) for layer in range(LAYERS) for e in range(EXPERTS)) > 0
    hottest = sorted(((saved.count(layer, e), layer, e) for layer in range(LAYERS) for e in range(EXPERTS)),
                     key=lambda c: -c[0])[: LAYERS * len(RESIDENT)]  # fmt: skip
    warm = TieredStore(art, placement(art))
    try:
        assert set(warm.expert_cache.cached) == {expert_block(layer, e) for _, layer, e in hottest}
        assert greedy(config, warm) == expected
        assert warm.ledger.expert_hit_rate >= first
    finally:
        warm.close()
        (art.directory / COUNTS_NAME).unlink(missing_ok=True)


def count_picks(store: TieredStore) -> list[int]:
    """Wrap the cache's lookups to count the experts the model chose (one entry per layer call)."""
    picks: list[int] = []
    opener = store.expert_cache.open

    def counted(layer, uses):
        picks.append(len(uses))
        return opener(layer, uses)

    store.expert_cache.open = counted
    return picks


def record_batches(store: TieredStore) -> list:
    """Keep every batch the cache opens, to see how each chosen expert was served."""
    batches: list = []
    opener = store.expert_cache.open

    def kept(layer, uses):
        batches.append(opener(layer, uses))
        return batches[-1]

    store.expert_cache.open = kept
    return batches


# A Qwen3-MoE-shaped synthetic model whose experts (~300 MB of INT8) dwarf its dense part.
SYNTHETIC_MOE = {
    "model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1024,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "num_experts": 48, "num_experts_per_tok": 4, "moe_intermediate_size": 1024, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [],
}  # fmt: skip


@pytest.mark.e2e
def test_offloaded_experts_inside_a_cgroup_capped_at_the_budget(tmp_path):
    """About half the experts resident, the rest read from disk, in a child whose cgroup v1 memory
    (and swap) limit equals the profile's budget: the resident run's tokens, peak RSS within it."""
    import json
    import uuid

    from tests.test_memory_profile import FIXED_BANDWIDTHS, _cgroup_root, run_child, write_profile
    from tierlm.cache.synthetic import write_synthetic_artifact
    from tierlm.offload.planner.search import plan
    from tierlm.offload.bandwidths import Bandwidths
    from tierlm.offload.sizes import sizes_from_artifact
    from tierlm.profile import load_profile

    root = _cgroup_root()
    if root is None:
        pytest.skip("no writable cgroup v1 memory controller on this machine")
    artifact = write_synthetic_artifact(SYNTHETIC_MOE, tmp_path / "qwen3-moe-synthetic-int8")
    config, sizes = read_config(artifact), sizes_from_artifact(artifact)
    experts = sum(1 for name in Artifact.open(artifact).blocks if is_expert(name))
    probe = run_child(artifact, write_profile(tmp_path / "p.toml", 2**30), steps=0)
    baseline = json.loads(probe.stdout)["baseline"] + (16 << 20)  # margin for run-to-run drift
    low, high = baseline, baseline + 2 * sizes.total
    while high - low > (4 << 20):  # the smallest budget whose plan keeps half the experts resident
        mid = (low + high) // 2
        try:
            placed = plan(config, sizes, load_profile(str(write_profile(tmp_path / "b.toml", mid))),
                          Bandwidths(**FIXED_BANDWIDTHS), accelerator=False, baseline_bytes=baseline)  # fmt: skip
            enough = placed.expert_slots >= experts // 2
        except Exception:  # noqa: BLE001 - below the minimum the planner refuses; go higher
            enough = False
        low, high = (low, mid) if enough else (mid, high)
    budget = high

    resident = run_child(artifact, write_profile(tmp_path / "big.toml", 16 * 2**30))
    assert resident.returncode == 0, resident.stderr[-2000:]
    resident_out = json.loads(resident.stdout)
    assert set(resident_out["tiers"]) == {"device"}
    assert resident_out["peak"] > budget, "the resident run needs more than the budget (so the cap means something)"
    (artifact / COUNTS_NAME).unlink(missing_ok=True)

    group = root / f"tierlm-moe-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(budget))
        if (group / "memory.memsw.limit_in_bytes").exists():
            (group / "memory.memsw.limit_in_bytes").write_text(str(budget))  # no escape into swap either
        capped = run_child(artifact, write_profile(tmp_path / "small.toml", budget), cgroup=group)
    finally:
        remove_cgroup(group)
    assert capped.returncode == 0, f"offloaded run failed under a {budget}-byte cap: {capped.stderr[-2000:]}"
    out = json.loads(capped.stdout)
    assert "disk" in out["tiers"] and out["read"].get("disk", 0) > 0, "cold experts were read from disk"
    assert out["tokens"] == resident_out["tokens"]
    assert out["peak"] <= budget, f"peak RSS {out['peak']} exceeds the {budget}-byte budget"
    assert (artifact / COUNTS_NAME).is_file(), "the run's routing counts were saved beside the artifact"


def remove_cgroup(group) -> None:
    import time

    for _ in range(50):  # the child's exit is charged a moment after it ends
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def test_a_failed_expert_read_is_a_clear_error_not_a_hang(moe, tmp_path):
    import shutil
    import threading

    from tierlm.errors import TierlmError

    config, art, _, _ = moe
    copy = Artifact.open(shutil.copytree(art.directory, tmp_path / "artifact"))
    store = open_store(copy, placement(copy))
    model = family_class(config)(config, store, 64, "cpu", torch.float32)
    cache = KVCache.for_model(config, 64)
    model.forward(torch.tensor([PROMPT]), cache)
    with open(copy.weights_path, "r+b") as handle:  # the disk "fails": layer 3's cold experts are gone
        handle.truncate(copy.blocks[expert_block(LAYERS - 1, 1)].offset + 16)
    outcome: dict = {}

    def step():
        try:
            for token in range(20):
                model.forward(torch.tensor([[token + 30]]), cache)
        except BaseException as err:  # noqa: BLE001 - the test inspects whatever came out
            outcome["error"] = err

    worker = threading.Thread(target=step, daemon=True)
    worker.start()
    worker.join(timeout=120)
    try:
        assert not worker.is_alive(), "a failed read must not hang the forward pass"
        assert isinstance(outcome.get("error"), TierlmError), outcome
        assert f"experts.{LAYERS - 1}." in str(outcome["error"])
    finally:
        store.close()
