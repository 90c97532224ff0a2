"""A GGUF import without a float copy: the GGUF is the checkpoint (tierlm/weights/gguf_checkpoint.py).

The import writes config, tokenizer and receipt only; conversions, LoRA merges and float loads read
the GGUF tensor by tensor. Checked here: the scale fields an import scans are every fp16 field of
each block type (so the scan decides what dequantizing would), a LoRA variant built on an import
equals the same merge on the dequantized weights, and a GGUF that moves or changes after its
import is named, never read wrongly.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tests.test_artifact import make_adapter
from tests.test_gguf_import import byte_level_vocab, load_imported, tiny_hf_model, write_tiny_gguf
from tierlm.errors import TierlmError
from tierlm.weights.gguf_import import RECORD_NAME, SUPPORTED_TENSOR_TYPES
from tierlm.weights.gguf_tensors import FLOAT_TYPES, SCALE_FIELDS, _finite


def test_every_quantized_type_has_its_scale_fields():
    assert set(SCALE_FIELDS) == set(SUPPORTED_TENSOR_TYPES) - set(FLOAT_TYPES)


@pytest.mark.parametrize("kind", sorted(SCALE_FIELDS))
def test_scale_fields_decide_whether_a_block_dequantizes_to_finite_values(kind):
    """Random blocks whose listed fp16 fields are finite dequantize (by the `gguf` package) to
    finite values, whatever their other bytes: an fp16 field missing from the table would be NaN
    or Inf in ~1/32 of 4,096 random blocks. A NaN or Inf in any listed field makes the block's
    values non-finite, and the scan says so."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = getattr(GGMLQuantizationType, kind)
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, size=(4096, block_bytes), dtype=np.uint8)
    for offset in SCALE_FIELDS[kind]:
        assert offset + 2 <= block_bytes
        blocks[:, offset : offset + 2] = rng.uniform(-2, 2, size=(4096, 1)).astype(np.float16).view(np.uint8)
    assert np.isfinite(dequantize(blocks, qtype)).all()
    assert _finite(blocks.reshape(-1), kind, block_bytes)
    for offset in SCALE_FIELDS[kind]:
        for bad in (np.nan, np.inf, -np.inf):
            damaged = blocks.copy()
            damaged[1234, offset : offset + 2] = np.array([bad], dtype=np.float16).view(np.uint8)
            with np.errstate(invalid="ignore", over="ignore"):
                values = dequantize(damaged, qtype)
            assert not np.isfinite(values[1234]).all() and np.isfinite(values[:1234]).all(), (kind, offset, bad)
            assert not _finite(damaged.reshape(-1), kind, block_bytes)


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
def test_float_tensors_are_scanned_whole(kind):
    values = np.linspace(-3, 3, 1000, dtype=np.float32)
    raw = {"F32": values, "F16": values.astype(np.float16)}.get(kind)
    if raw is None:  # bfloat16: the high halves of float32
        raw = (values.view(np.uint32) >> 16).astype(np.uint16)
    raw = raw.view(np.uint8).copy()
    assert _finite(raw, kind, 1)
    width = raw.size // 1000
    bad = np.array([np.inf], dtype=np.float32)
    bad = {"F32": bad, "F16": bad.astype(np.float16), "BF16": (bad.view(np.uint32) >> 16).astype(np.uint16)}[kind]
    raw[500 * width : 501 * width] = bad.view(np.uint8)
    assert not _finite(raw, kind, 1)


def _import(tmp_path, monkeypatch, tied=True, qtype="Q8_0"):
    """A tiny llama GGUF imported into a private cache: (transformers model, gguf path, import dir)."""
    import gguf

    from tierlm.weights.embedded import import_gguf_to_cache

    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "cache"))
    tokens, _, _ = byte_level_vocab()
    model, config = tiny_hf_model("llama", tied, vocab_size=len(tokens))
    path = tmp_path / "downloads" / "tiny.gguf"
    path.parent.mkdir()
    write_tiny_gguf(path, model, config, matrix_qtype=getattr(gguf.GGMLQuantizationType, qtype))
    return model, path, import_gguf_to_cache(path)


def test_import_holds_no_weights_and_counts_its_parameters(tmp_path, monkeypatch):
    import gguf

    from tierlm.cache.catalog import parameter_count

    model, path, out = _import(tmp_path, monkeypatch)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", RECORD_NAME])
    assert sum(p.stat().st_size for p in out.iterdir()) < path.stat().st_size
    assert parameter_count(out) == sum(p.numel() for p in model.parameters())
    # Each tensor reads as the gguf package dequantizes it (un-permuted for Q/K by the importer).
    reader = gguf.GGUFReader(path)
    imported = load_imported(out)
    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    np.testing.assert_array_equal(imported["model.layers.1.mlp.down_proj.weight"],
                                  gguf.quants.dequantize(down.data, down.tensor_type))  # fmt: skip


def test_lora_variant_on_an_import_is_the_merge_of_its_dequantized_weights(tmp_path, monkeypatch):
    """A LoRA variant of a GGUF import reads its base from the GGUF: its logits equal those of
    the same variant built from a float copy of the dequantized weights (the old import's layout)."""
    from tests.test_gguf_import import hf_copy_of_import
    from tierlm.cache.convert import ConversionRequest, ensure_variant_artifact
    from tierlm.runtime.loader import load_model

    model, _, out = _import(tmp_path, monkeypatch)
    model.save_pretrained(tmp_path / "shapes")  # the adapter only needs the model's shapes
    adapter = make_adapter(tmp_path / "shapes", tmp_path / "adapter")
    float_copy = hf_copy_of_import(out, tmp_path / "float-copy")
    prompt = torch.tensor([[1, 70, 80, 90, 259, 260, 5, 44]])
    results = []
    for base in (out, float_copy):
        variant = ensure_variant_artifact(ConversionRequest(base, (), "int8"), ((adapter, 1.0),))
        loaded = load_model(variant, device="cpu", dtype=torch.float32)
        results.append(loaded.model.forward(prompt, loaded.new_cache(), logits="all"))
        loaded.close()
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_a_moved_gguf_is_named_and_followed_when_imported_again(tmp_path, monkeypatch):
    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.cache.verify import verify_entries
    from tierlm.runtime.loader import load_model
    from tierlm.weights.embedded import import_gguf_to_cache

    _, path, out = _import(tmp_path, monkeypatch)
    built = ensure_artifact(ConversionRequest(out, (), "int8"))
    moved = tmp_path / "models" / "tiny.gguf"
    moved.parent.mkdir()
    shutil.move(path, moved)

    # What was converted still runs; a new conversion names the missing file and caches nothing.
    loaded = load_model(out, device="cpu", dtype=torch.float32, quant="int8")
    assert loaded.artifact_dir == built
    loaded.close()
    def artifacts():  # finished ones: hidden names are locks and temporaries
        return sorted(p for p in (tmp_path / "cache" / "artifacts").iterdir() if not p.name.startswith("."))

    before = artifacts()
    with pytest.raises(TierlmError, match=r"was imported from .*tiny\.gguf, which is no longer there") as err:
        ensure_artifact(ConversionRequest(out, (), "int4-g32"))
    assert "import-gguf" in err.value.hint
    assert artifacts() == before
    verdict = {v.entry.path: v for v in verify_entries([])}[out]
    assert verdict.status == "corrupt" and "no longer there" in verdict.line()

    # Importing the moved file finds the same import (same content) and points it there.
    assert import_gguf_to_cache(moved) == out
    assert json.loads((out / RECORD_NAME).read_text())["source_path"] == str(moved.resolve())
    ensure_artifact(ConversionRequest(out, (), "int4-g32"))
    assert ensure_artifact(ConversionRequest(out, (), "int8")) == built  # same content, same artifact
    assert {v.entry.path: v for v in verify_entries([])}[out].status == "ok"


def test_a_gguf_changed_after_its_import_is_refused(tmp_path, monkeypatch):
    from tierlm.cache.convert import ConversionRequest, ensure_artifact

    _, path, out = _import(tmp_path, monkeypatch)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one weight byte
    path.write_bytes(bytes(data))
    with pytest.raises(TierlmError, match=r"which has changed since"):
        ensure_artifact(ConversionRequest(out, (), "int8"))


def test_show_and_plan_state_the_bytes_of_each_carried_type(tmp_path, monkeypatch):
    """The receipt lists each GGUF type's bytes (`tierlm show`), and the artifact's per-mode bytes
    (`tierlm plan`) show the Q8_0 tensors carried at the same size."""
    import gguf

    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.models import read_config
    from tierlm.offload.sizes import resolve_auto, sizes_from_artifact, sizes_from_config
    from tierlm.quant.mixed import mode_bytes

    _, path, out = _import(tmp_path, monkeypatch, tied=False)
    reader = gguf.GGUFReader(path)
    by_type = {}
    for tensor in reader.tensors:
        by_type[tensor.tensor_type.name] = by_type.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    assert json.loads((out / RECORD_NAME).read_text())["tensor_type_bytes"] == by_type
    assert resolve_auto("auto", out) == "mixed-source"  # what `auto` carries a Q8_0 GGUF as
    artifact = sizes_from_artifact(ensure_artifact(ConversionRequest(out, (), "mixed-source")))
    predicted = sizes_from_config(read_config(out), "mixed-source", model_dir=out)
    for sizes in (artifact, predicted):
        assert dict(mode_bytes(sizes.tensor_modes, sizes.tensor_bytes)) == {"q8_0": by_type["Q8_0"]}

