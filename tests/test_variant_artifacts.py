"""Variant artifacts: a base plus LoRA adapters, storing only the tensors the adapters change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.test_artifact import make_adapter
from tests.tiny import make_model
from tierlm.cache.artifact import Artifact, VariantArtifact
from tierlm.cache.convert import ConversionRequest, ensure_artifact, ensure_variant_artifact
from tierlm.errors import TierlmError
from tierlm.runtime.loader import load_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("variant-base")
    make_model(path, layers=3, tied=True, intermediate=192)
    return path


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("variant-adapters")
    return {
        # q/v/down in every layer (test_artifact's default), rsLoRA
        "mixed": make_adapter(base_dir, root / "mixed", seed=1, use_rslora=True),
        "attention": make_adapter(base_dir, root / "attention", seed=2, target_modules=ATTENTION),
        "embed": make_adapter(base_dir, root / "embed", seed=3, target_modules=["embed_tokens"]),  # tied
        "layer1": make_adapter(base_dir, root / "layer1", seed=5, target_modules=["o_proj"],
                               layers_to_transform=[1]),
    }


def block_bytes(artifact: Artifact, name: str) -> bytes:
    """The bytes block `name` reads (a tied head's: its embedding's)."""
    return bytes(artifact.read_bytes(artifact.source_block(name)).numpy())


@pytest.mark.parametrize("case", ["mixed", "embed", "layer1"])
def test_blocks_read_as_the_full_lora_artifacts_byte_for_byte(base_dir, adapters, case):
    pairs = ((adapters[case], 1.0),)
    variant = Artifact.open(ensure_variant_artifact(ConversionRequest(base_dir, (), "int8"), pairs))
    full = Artifact.open(ensure_artifact(ConversionRequest(base_dir, pairs, "int8")))
    base = Artifact.open(ensure_artifact(ConversionRequest(base_dir, (), "int8")))
    assert isinstance(variant, VariantArtifact) and list(variant.blocks) == list(full.blocks)
    assert variant.own_blocks and variant.shared_blocks
    weights = variant.weights_path.read_bytes()
    for name in variant.blocks:
        ours = block_bytes(variant, name)
        assert ours == block_bytes(full, name)
        # A shared block is the base's; an own one differs from it (its adapter changed it).
        assert (ours == block_bytes(base, name)) == (name in variant.shared_blocks)
        if name in variant.shared_blocks:
            assert variant.blocks[name].digest == full.blocks[name].digest
        stored = variant.stored.get(name)
        for tensor, record in (stored.tensors if stored else {}).items():  # as the full stores it
            for part, place in full.blocks[name].tensors[tensor].parts.items():
                start = stored.offset + record.parts[part].offset
                assert weights[start : start + place.nbytes] == ours[place.offset : place.offset + place.nbytes]
    rows = [0, 7, 319, 7]  # embedding rows read from disk: the variant's own or the base's
    assert all(torch.equal(a, b) for a, b in zip(variant.read_rows("embed", "embed", rows).values(),
                                                 full.read_rows("embed", "embed", rows).values()))
    expected = {"mixed": ("layers.0", "layers.1", "layers.2"), "layer1": ("layers.1",),
                "embed": ("embed", "head")}  # the tied head borrows the embedding: both are own
    assert variant.own_blocks == expected[case]
    assert variant.own_bytes == sum(b.nbytes for b in variant.stored.values()) <= variant.weights_path.stat().st_size


def test_variant_loads_with_the_full_lora_artifacts_logits(base_dir, adapters):
    pairs = ((adapters["layer1"], 0.7), (adapters["embed"], 1.0))
    variant_dir = ensure_variant_artifact(ConversionRequest(base_dir, (), "int8"), pairs)
    ours = load_model(variant_dir, device="cpu", dtype=torch.float32)
    reference = load_model(base_dir, device="cpu", dtype=torch.float32, quant="int8", adapters=pairs)
    base = load_model(base_dir, device="cpu", dtype=torch.float32, quant="int8")
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 8]])
    got = ours.model.forward(ids, ours.new_cache(), logits="all")
    assert torch.equal(got, reference.model.forward(ids, reference.new_cache(), logits="all"))
    assert not torch.equal(got, base.model.forward(ids, base.new_cache(), logits="all"))


def test_attention_adapter_adds_only_layer_blocks(base_dir, adapters):
    variant = Artifact.open(ensure_variant_artifact(ConversionRequest(base_dir, (), "int8"),
                                                    ((adapters["attention"], 1.0),)))
    layers = sum(variant.blocks[n].nbytes for n in variant.own_blocks)
    assert set(variant.own_blocks) == {"layers.0", "layers.1", "layers.2"}
    attention = sum(part.nbytes for name in variant.own_blocks for tensor in ("wqkv", "wo")
                    for part in variant.blocks[name].tensors[tensor].parts.values())
    # Only the attention projections are stored: the MLP, norms, embedding and head are the base's.
    assert attention <= variant.own_bytes < attention + 3 * 4096 < layers
    full = Artifact.open(ensure_artifact(ConversionRequest(base_dir, ((adapters["attention"], 1.0),), "int8")))
    for block in variant.own_blocks:
        assert set(variant.changed_tensors(block)) == {"wqkv", "wo"}
        stored, reference = variant.read_stored(block), full.read_block(block)
        assert set(stored) == {"wqkv", "wo"}
        for tensor, (record, parts) in stored.items():
            assert record.encoding == reference[tensor][0].encoding
            assert all(torch.equal(view, reference[tensor][1][part]) for part, view in parts.items())
    assert variant.read_stored("embed") == {}


def test_variant_key_follows_adapter_weight_and_reuses_the_build(base_dir, adapters):
    request = ConversionRequest(base_dir, (), "int8")
    first = ensure_variant_artifact(request, ((adapters["attention"], 1.0),))
    stamp = (first / "weights.bin").stat().st_mtime_ns
    assert ensure_variant_artifact(request, ((adapters["attention"], 1.0),)) == first
    assert (first / "weights.bin").stat().st_mtime_ns == stamp
    assert ensure_variant_artifact(request, ((adapters["attention"], 0.5),)) != first


def test_adapter_for_another_base_writes_nothing(base_dir, tmp_path, tierlm_cache):
    other = tmp_path / "other"
    make_model(other, hidden=32, heads=2, kv_heads=1, layers=3, tied=True)
    adapter = make_adapter(other, tmp_path / "adapter", seed=4)
    before = sorted(tierlm_cache.rglob("*"))
    fresh = tmp_path / "fresh-base"
    shutil.copytree(base_dir, fresh)  # a base with no artifact yet: not even it may be built
    with pytest.raises(TierlmError, match="does not fit"):
        ensure_variant_artifact(ConversionRequest(fresh, (), "int8"), ((adapter, 1.0),))
    assert sorted(tierlm_cache.rglob("*")) == before  # not a lock file, not a digest


def test_missing_or_rebuilt_base_is_a_clear_error(base_dir, adapters, tmp_path):
    variant_dir = ensure_variant_artifact(ConversionRequest(base_dir, (), "int8"), ((adapters["attention"], 1.0),))
    copy = tmp_path / "artifacts"
    shutil.copytree(variant_dir, copy / variant_dir.name)
    with pytest.raises(TierlmError, match="needs its base artifact .* which is gone"):
        Artifact.open(copy / variant_dir.name)
    base_dir_name = json.loads((variant_dir / "manifest.json").read_text())["base"]
    shutil.copytree(variant_dir.parent / base_dir_name, copy / base_dir_name)
    assert Artifact.open(copy / variant_dir.name).own_blocks
    manifest_path = copy / base_dir_name / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "key": "0" * 64}))
    with pytest.raises(TierlmError, match="was built over another"):
        Artifact.open(copy / variant_dir.name)
    manifest_path.write_text(json.dumps(manifest))
    # A shared block's bytes damaged in the base: the base's checksums catch it through the variant.
    variant = Artifact.open(copy / variant_dir.name)
    shared = variant.blocks[variant.shared_blocks[0]]
    with open(copy / base_dir_name / "weights.bin", "r+b") as weights:
        weights.seek(shared.offset + 1)
        weights.write(b"\xff\xfe")
    with pytest.raises(TierlmError, match=f"{base_dir_name} is corrupt: block {variant.shared_blocks[0]!r}"):
        variant.verify()
    # And a changed tensor's bytes damaged in the variant: its own checksums catch it.
    variant = Artifact.open(copy / variant_dir.name)
    with open(copy / variant_dir.name / "weights.bin", "r+b") as weights:
        weights.seek(variant.stored[variant.own_blocks[0]].offset + 1)
        weights.write(b"\xff\xfe")
    with pytest.raises(TierlmError, match=f"{variant_dir.name} is corrupt: block {variant.own_blocks[0]!r}"):
        variant.read_block(variant.own_blocks[0])


def test_manifests_without_digests_still_open(base_dir, tmp_path):
    source = ensure_artifact(ConversionRequest(base_dir, (), "int8"))
    old = tmp_path / "old"
    shutil.copytree(source, old)
    manifest = json.loads((old / "manifest.json").read_text())
    assert all(len(block["digest"]) == 64 for block in manifest["blocks"].values())
    for block in manifest["blocks"].values():
        del block["digest"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    opened = Artifact.open(old)
    assert opened.blocks["embed"].digest is None and opened.own_blocks == tuple(opened.blocks)
    opened.verify()


def test_cache_list_shows_what_a_variant_adds_and_its_base(base_dir, adapters):
    from tierlm.cache.catalog import catalog, find_entry
    from tierlm.cli.models import render_cache_list
    from tierlm.profile import format_size

    variant_dir = ensure_variant_artifact(ConversionRequest(base_dir, (), "int8"), ((adapters["layer1"], 1.0),))
    base_name = json.loads((variant_dir / "manifest.json").read_text())["base"]
    entry = next(e for e in catalog() if e.path == variant_dir)
    linked = (variant_dir.parent / base_name / "tokenizer.json").stat().st_ino
    assert (variant_dir / "tokenizer.json").stat().st_ino == linked  # the base's file, not a copy
    added = (variant_dir / "weights.bin").stat().st_size + (variant_dir / "manifest.json").stat().st_size
    assert entry.shares == base_name
    assert entry.nbytes == added < (variant_dir.parent / base_name / "weights.bin").stat().st_size
    line = next(line for line in render_cache_list().splitlines() if variant_dir.name in line)
    assert line.startswith("variant ") and f"adds {format_size(added)} to base {base_name})" in line
    assert find_entry(variant_dir.name) == variant_dir


@pytest.mark.parametrize("tiers", ["all-disk", "three-tiers"])
def test_streamed_variant_gives_the_full_lora_artifacts_logits(base_dir, adapters, tiers):
    from tests.test_offload import LAYOUTS, placement
    from tierlm.kv.cache import KVCache
    from tierlm.store.resident import load_resident_artifact
    from tierlm.models import read_config
    from tierlm.models.llama import LlamaModel
    from tierlm.store.tiered import TieredStore

    pairs = ((adapters["embed"], 1.0), (adapters["layer1"], 1.0))  # the embedding's rows come from the variant
    variant = Artifact.open(ensure_variant_artifact(ConversionRequest(base_dir, (), "int8"), pairs))
    full = ensure_artifact(ConversionRequest(base_dir, pairs, "int8"))
    config, ids = read_config(base_dir), torch.tensor([[5, 17, 99, 3, 250, 41, 8]])

    def logits(store):
        model = LlamaModel(config, store, 32, "cpu", torch.float32)
        return model.forward(ids, KVCache.for_model(config, 32), logits="all")

    layout = {**LAYOUTS[tiers], "layers.2": "disk"}  # LAYOUTS name four layers, this model has three
    store = TieredStore(variant, placement(variant, {k: t for k, t in layout.items() if k in variant.blocks}, slots=1))
    try:
        assert torch.equal(logits(store), logits(load_resident_artifact(full)))
    finally:
        store.close()
