"""Bytes from disk are untrusted: every damaged input is one clear error, never output or a cache entry.

The corpus (tests/corpus_bad_inputs.py) damages copies of good files one way at a time: model
safetensors, artifact manifests, LoRA adapters. Most cases run in process; a few go through the
CLI (its `main`, in this process too) to prove the user sees exit status 1 and one line. Artifact
blocks carry checksums: damaged bytes in a block are caught on the first read, wherever the block
is placed, and by `cache verify`.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
import torch

from tests import corpus_bad_inputs as corpus
from tests.cli_runner import PROGRESS_LINE, run_tierlm
from tests.tiny import make_model
from tierlm.cache.artifact import Artifact
from tierlm.cache.convert import ConversionRequest, artifacts_root, ensure_artifact
from tierlm.errors import TierlmError
from tierlm.runtime.loader import load_model

HIDDEN, VOCAB = 64, 320


def tierlm(*args: str) -> subprocess.CompletedProcess:
    return run_tierlm(*args)


def assert_one_line_failure(result: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit status 1, no traceback, stdout empty, and exactly one `error:` line holding `needles`
    (after the progress of phases that ran before the failure)."""
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and not PROGRESS_LINE.fullmatch(line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert result.stdout == ""
    return lines[0]


def artifact_entries() -> set[str]:
    root = artifacts_root()
    return {p.name for p in root.iterdir() if not p.name.startswith(".")} if root.is_dir() else set()


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def good_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bad-bytes") / "good"
    make_model(path, layers=3, hidden=HIDDEN, vocab=VOCAB)
    return path


@pytest.fixture(scope="module")
def good_artifact(good_model) -> Path:
    return ensure_artifact(ConversionRequest(good_model, (), "int8"))


# ----------------------------------------------------------------------------- safetensors


@pytest.mark.parametrize("case", corpus.SAFETENSORS_CASES, ids=[c[0] for c in corpus.SAFETENSORS_CASES])
def test_bad_safetensors_is_refused_on_both_load_paths(case, good_model, tmp_path):
    name, mutate, expected = case
    bad = copy_dir(good_model, tmp_path / f"bad-{name}")
    mutate(bad)
    with pytest.raises(TierlmError) as as_stored:
        load_model(bad, quant="none")
    assert expected in str(as_stored.value)
    before = artifact_entries()
    with pytest.raises(TierlmError) as converted:
        ensure_artifact(ConversionRequest(bad, (), "int8"))
    assert expected in str(converted.value)
    assert artifact_entries() == before, "a failed conversion left a cache entry"


@pytest.mark.parametrize("case", ["offsets-short", "zip-named-safetensors", "index-climbs-out"])
def test_bad_safetensors_through_the_cli(case, good_model, tmp_path):
    _, mutate, expected = next(c for c in corpus.SAFETENSORS_CASES if c[0] == case)
    bad = copy_dir(good_model, tmp_path / "bad")
    mutate(bad)
    assert_one_line_failure(tierlm("generate", "hi", "--model", str(bad), "-n", "2", "-t", "0"), expected)


def test_finite_weights_that_overflow_fp16_are_refused(good_model, tmp_path):
    """A sibling of NaN in the source: a finite fp32 value that the fp16 artifact cannot hold."""
    bad = copy_dir(good_model, tmp_path / "big")
    header, data = corpus.read_raw(bad / corpus.SAFETENSORS)
    begin = header["model.layers.0.mlp.up_proj.weight"]["data_offsets"][0]
    corpus.write_raw(bad / corpus.SAFETENSORS, header, data[:begin] + struct.pack("<f", 70000.0) + data[begin + 4 :])
    before = artifact_entries()
    with pytest.raises(TierlmError, match="overflow fp16"):
        ensure_artifact(ConversionRequest(bad, (), "fp16"))
    assert artifact_entries() == before


# ----------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("case", corpus.MANIFEST_CASES, ids=[c[0] for c in corpus.MANIFEST_CASES])
def test_bad_manifest_is_one_clear_error(case, good_artifact, tmp_path):
    name, mutate, expected = case
    bad = copy_dir(good_artifact, tmp_path / f"art-{name}")
    mutate(bad)
    with pytest.raises(TierlmError) as err:
        load_model(bad)
    message = str(err.value)
    assert "is unusable" in message and expected in message, message


@pytest.fixture(scope="module")
def good_int4_artifact(good_model) -> Path:
    return ensure_artifact(ConversionRequest(good_model, (), "int4-g32-asym"))


@pytest.mark.parametrize("case", corpus.INT4_MANIFEST_CASES, ids=[c[0] for c in corpus.INT4_MANIFEST_CASES])
def test_bad_int4_manifest_is_one_clear_error(case, good_int4_artifact, tmp_path):
    name, mutate, expected = case
    bad = copy_dir(good_int4_artifact, tmp_path / f"art-{name}")
    mutate(bad)
    with pytest.raises(TierlmError) as err:
        load_model(bad)
    message = str(err.value)
    assert "is unusable" in message and expected in message, message


def test_bad_manifest_through_the_cli(good_artifact, tmp_path):
    _, mutate, _ = next(c for c in corpus.MANIFEST_CASES if c[0] == "blocks-list")
    bad = copy_dir(good_artifact, tmp_path / "art")
    mutate(bad)
    assert_one_line_failure(tierlm("generate", "hi", "--model", str(bad), "-n", "2"), "blocks is a list")


def test_a_damaged_cache_entry_is_rebuilt_not_reused(good_model, good_artifact):
    """A manifest that no longer validates makes the entry incomplete: the next use rebuilds it."""
    (good_artifact / "manifest.json").write_text("[]")
    assert ensure_artifact(ConversionRequest(good_model, (), "int8")) == good_artifact
    Artifact.open(good_artifact).verify()  # rebuilt whole


# ----------------------------------------------------------------------------- LoRA adapters

ADAPTER_CASES = corpus.adapter_cases(HIDDEN, VOCAB)


def test_a_good_adapter_converts(good_model, tmp_path):
    """The control: the hand-written adapter the corpus damages is itself accepted."""
    adapter = corpus.write_adapter(tmp_path / "adapter", HIDDEN)
    Artifact.open(ensure_artifact(ConversionRequest(good_model, ((adapter, 1.0),), "int8")))


@pytest.mark.parametrize("case", ADAPTER_CASES, ids=[c[0] for c in ADAPTER_CASES])
def test_bad_adapter_is_refused_and_nothing_is_cached(case, good_model, tmp_path):
    name, write, weight, expected = case
    adapter = corpus.write_adapter(tmp_path / name, HIDDEN, **write)
    before = artifact_entries()
    with pytest.raises(TierlmError) as err:
        ensure_artifact(ConversionRequest(good_model, ((adapter, weight),), "int8"))
    assert expected in str(err.value), str(err.value)
    assert artifact_entries() == before, "a refused adapter left a cache entry"


def test_adapter_file_that_is_a_zip_is_refused(good_model, tmp_path):
    adapter = corpus.write_adapter(tmp_path / "zip", HIDDEN)
    corpus._torch_zip(adapter)
    (adapter / corpus.SAFETENSORS).rename(adapter / "adapter_model.safetensors")
    with pytest.raises(TierlmError, match="pickle/zip checkpoint") as err:
        ensure_artifact(ConversionRequest(good_model, ((adapter, 1.0),), "int8"))
    assert "safe_serialization=True" in str(err.value)


def test_bad_adapter_through_the_cli(good_model, tmp_path):
    name, write, weight, expected = next(c for c in ADAPTER_CASES if c[0] == "lora_B-1e30")
    adapter = corpus.write_adapter(tmp_path / name, HIDDEN, **write)
    result = tierlm("generate", "hi", "--model", str(good_model), "--lora", str(adapter), "-n", "2")
    assert_one_line_failure(result, expected)


# ----------------------------------------------------------------------------- block checksums


def damage(artifact_dir: Path, block: str, nbytes: int | None = 1 << 20, seed: int = 0) -> None:
    """Overwrite the start of `block` with random bytes (at most `nbytes`, at most the block)."""
    art = Artifact.open(artifact_dir)
    record = art.blocks[block]
    size = min(nbytes or record.nbytes, record.nbytes)
    noise = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    with open(art.weights_path, "r+b") as handle:
        handle.seek(record.offset)
        handle.write(noise.numpy().tobytes())


def flip_byte(artifact_dir: Path, block: str, at: int = 100) -> None:
    art = Artifact.open(artifact_dir)
    with open(art.weights_path, "r+b") as handle:
        handle.seek(art.blocks[block].offset + at)
        value = handle.read(1)[0]
        handle.seek(art.blocks[block].offset + at)
        handle.write(bytes([value ^ 0x10]))


@pytest.mark.slow
def test_corrupt_block_fails_generate_and_cache_verify_then_rm_fixes_it(good_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    victim = copy_dir(good_model, tmp_path / "victim")
    other = ensure_artifact(ConversionRequest(victim, (), "int8-g32"))
    artifact = ensure_artifact(ConversionRequest(victim, (), "int8"))
    damage(artifact, "layers.1")  # the middle layer of three
    generate = ("generate", "hi", "--model", str(victim), "--quant", "int8", "-n", "4", "-t", "0")
    assert_one_line_failure(tierlm(*generate), "block 'layers.1' fails its checksum", f"tierlm cache rm {artifact.name}")

    verify = tierlm("cache", "verify")
    assert verify.returncode == 1 and "Traceback" not in verify.stderr
    assert verify.stderr.strip() == (
        f"error: 1 of 2 cache entries failed verification (remove them with `tierlm cache rm {artifact.name}`; "
        "they are rebuilt on next use)"
    )
    lines = {line.split()[2].rstrip(":"): line for line in verify.stdout.splitlines()}
    assert lines[artifact.name].startswith("corrupt  artifact") and "'layers.1'" in lines[artifact.name]
    assert lines[other.name].startswith("ok       artifact")
    assert tierlm("cache", "verify", other.name).returncode == 0

    assert tierlm("cache", "rm", artifact.name).returncode == 0
    fixed = tierlm(*generate)
    assert fixed.returncode == 0 and fixed.stdout.strip(), fixed.stderr
    assert tierlm("cache", "verify").returncode == 0


def test_cache_verify_names_unknown_entries(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    assert_one_line_failure(tierlm("cache", "verify", "no-such-entry"), "no cache entry named 'no-such-entry'")


@pytest.fixture
def victim_artifact(good_model, tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    return ensure_artifact(ConversionRequest(copy_dir(good_model, tmp_path / "victim"), (), "int8"))


def tiered(artifact_dir: Path, tiers: dict[str, str]):
    """A TieredStore over `artifact_dir` with `tiers` (block -> tier; others on the device)."""
    from tierlm.offload.placement import DEVICE, BlockPlacement, Placement
    from tierlm.store.tiered import TieredStore

    art = Artifact.open(artifact_dir)
    blocks = tuple(BlockPlacement(n, tiers.get(n, DEVICE), art.blocks[n].nbytes) for n in art.blocks)
    return TieredStore(art, Placement(blocks, {}, {}, ring_slots=2, hot_cache_bytes=0))


def forward(artifact_dir: Path, store) -> None:
    from tierlm.kv.cache import KVCache
    from tierlm.models import read_config
    from tierlm.models.llama import LlamaModel

    config = read_config(artifact_dir)
    model = LlamaModel(config, store, 32, "cpu", torch.float32)
    model.forward(torch.tensor([[5, 6, 7]]), KVCache.for_model(config, 32))


@pytest.mark.parametrize("block,tier", [("layers.1", "device"), ("layers.1", "host"), ("layers.1", "disk"), ("embed", "disk"), ("head", "disk")])
def test_a_flipped_byte_is_caught_wherever_the_block_lives(victim_artifact, block, tier):
    flip_byte(victim_artifact, block)
    with pytest.raises(TierlmError, match=f"block '{block}' fails its checksum"):
        store = tiered(victim_artifact, {block: tier})
        try:
            forward(victim_artifact, store)
        finally:
            store.close()


def test_resident_load_checks_every_block(victim_artifact):
    from tierlm.store.resident import load_resident_artifact

    flip_byte(victim_artifact, "norm", at=0)
    with pytest.raises(TierlmError, match="block 'norm' fails its checksum"):
        load_resident_artifact(victim_artifact)


def test_a_streamed_block_is_checked_on_its_first_read_only(victim_artifact, monkeypatch):
    """Re-reading a streamed block every token must not pay the checksum again."""
    from tierlm.cache import artifact as artifact_module

    calls = []
    real = zlib.crc32
    monkeypatch.setattr(artifact_module.zlib, "crc32", lambda *a: calls.append(1) or real(*a))
    store = tiered(victim_artifact, {"layers.1": "disk"})
    try:
        at_load = len(calls)
        forward(victim_artifact, store)
        first = len(calls) - at_load
        forward(victim_artifact, store)
        assert first >= 1 and len(calls) - at_load == first
    finally:
        store.close()


def test_embedding_rows_outside_the_vocabulary_are_refused(victim_artifact):
    art = Artifact.open(victim_artifact)
    with pytest.raises(TierlmError, match=f"row {VOCAB} of embed/embed requested, but it has {VOCAB} rows"):
        art.read_rows("embed", "embed", [1, VOCAB])


def test_checksums_cover_every_byte_of_every_block(good_artifact):
    art = Artifact.open(good_artifact)
    data = art.weights_path.read_bytes()
    for name, block in art.blocks.items():
        chunks = [data[block.offset + i : block.offset + min(i + (1 << 20), block.nbytes)] for i in range(0, block.nbytes, 1 << 20)]
        assert list(block.crc32) == [zlib.crc32(c) for c in chunks], name
    art.verify()
    assert os.path.getsize(art.weights_path) == art.manifest["weights_bytes"]


def test_saved_hot_rows_outside_the_vocabulary_are_ignored(victim_artifact):
    """The hot-row statistics beside an artifact are bytes from disk too: a row the embedding lacks
    is dropped from the warm start, never read."""
    from tierlm.store.hot_rows import COUNTS_NAME
    from tierlm.offload.placement import DEVICE, DISK, BlockPlacement, Placement
    from tierlm.store.tiered import TieredStore

    (victim_artifact / COUNTS_NAME).write_text('{"3": 9, "999999": 8, "-2": 7}')
    art = Artifact.open(victim_artifact)
    blocks = tuple(BlockPlacement(n, DISK if n == "embed" else DEVICE, art.blocks[n].nbytes) for n in art.blocks)
    store = TieredStore(art, Placement(blocks, {}, {}, ring_slots=1, hot_cache_bytes=16 * HIDDEN * 4))
    try:
        assert set(store._embed_rows.cache.slot_of) == {3}
        forward(victim_artifact, store)
    finally:
        store.close()


def test_cache_verify_reports_older_formats_as_outdated_not_corrupt(good_artifact, tmp_path, monkeypatch):
    from tierlm.cache.verify import verify_entries

    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    old = copy_dir(good_artifact, artifacts_root() / "old-int8-0000")
    _, mutate, _ = next(c for c in corpus.MANIFEST_CASES if c[0] == "manifest-old-format")
    mutate(old)
    good = copy_dir(good_artifact, artifacts_root() / "good-int8-0000")
    verdicts = {v.entry.path.name: v for v in verify_entries([])}
    assert verdicts[old.name].status == "outdated" and "format version 1" in verdicts[old.name].line()
    assert verdicts[good.name].status == "ok"
