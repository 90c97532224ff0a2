"""Compiled artifacts: keys, block byte ranges, crash safety, bounded conversion memory, LoRA + INT8."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.tiny import make_model
from tierlm.cache import codec
from tierlm.cache.artifact import BLOCK_ALIGN, Artifact
from tierlm.cache.convert import ConversionRequest, artifact_key, ensure_artifact, _merger
from tierlm.runtime.loader import load_model


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("artifact-base")
    make_model(path, layers=3, tied=True)
    return path


def make_adapter(base_dir: Path, out: Path, seed: int = 0, target_modules=("q_proj", "v_proj", "down_proj"),
                 **config) -> Path:  # fmt: skip
    """A peft LoRA adapter with random (non-zero) weights, saved in PEFT's format."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(target_modules), **config)
    peft_model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    peft_model.save_pretrained(out)
    return out


def greedy(loaded, prompt: list[int], steps: int = 16) -> list[int]:
    cache = loaded.new_cache()
    logits = loaded.model.forward(torch.tensor([prompt]), cache)
    out = []
    for _ in range(steps):
        out.append(int(logits[0, -1].argmax()))
        logits = loaded.model.forward(torch.tensor([[out[-1]]]), cache)
    return out


def test_same_inputs_same_key_and_adapter_byte_changes_key(base_dir, tmp_path):
    adapter = make_adapter(base_dir, tmp_path / "adapter")
    request = ConversionRequest(base_dir, ((adapter, 1.0),), "int8")
    key = artifact_key(request, _merger(request.adapters))
    assert key == artifact_key(request, _merger(request.adapters))
    assert key != artifact_key(ConversionRequest(base_dir, ((adapter, 0.5),), "int8"), _merger(((adapter, 0.5),)))
    assert key != artifact_key(ConversionRequest(base_dir, ((adapter, 1.0),), "int8-g32"), _merger(request.adapters))
    weights = adapter / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-7] ^= 0x01
    weights.write_bytes(bytes(data))
    assert key != artifact_key(request, _merger(request.adapters))


@pytest.mark.parametrize("quant", ["int8", "int8-g32", "q8_0", "int8-g32-asym", "fp16"])
def test_block_ranges_read_back_exactly_their_tensors(base_dir, quant):
    from tierlm.models import family_class, read_config
    from tierlm.weights.checkpoint import Checkpoint

    directory = ensure_artifact(ConversionRequest(base_dir, (), quant))
    artifact = Artifact.open(directory)
    config = read_config(base_dir)
    layout = family_class(config).checkpoint_layout(config)
    checkpoint = Checkpoint(base_dir)
    mode = codec.parse_mode(quant)
    previous_end = 0
    for block, entries in layout.items():
        record = artifact.blocks[block]
        assert record.offset % BLOCK_ALIGN == 0 and record.offset >= previous_end
        previous_end = record.offset + record.nbytes
        read = artifact.read_block(block)
        for name, sources in entries.items():
            if name in record.aliases:
                continue
            source = torch.cat([checkpoint.get(s).float() for s in sources])
            _, expected, _ = codec.encode(source, mode)
            _, parts = read[name]
            assert parts.keys() == expected.keys()
            for part, tensor in expected.items():
                assert torch.equal(parts[part], tensor), f"{block}/{name}/{part}"
    assert artifact.blocks["head"].aliases == {"head": "embed/embed"}


def test_int8_artifact_generates_like_fp32(base_dir):
    fp32 = load_model(base_dir, device="cpu", dtype=torch.float32)
    int8 = load_model(base_dir, device="cpu", dtype=torch.float32, quant="int8")
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 8]])
    ref = fp32.model.forward(ids, fp32.new_cache(), logits="all")
    got = int8.model.forward(ids, int8.new_cache(), logits="all")
    assert int8.store.nbytes() < fp32.store.nbytes() / 3
    # Per-channel int8 of a random model: logits stay close to fp32 (a loose sanity bound).
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_lora_int8_artifact_matches_quantized_peft_merge(base_dir, tmp_path):
    import transformers
    from peft import PeftModel

    adapter = make_adapter(base_dir, tmp_path / "adapter", seed=3, use_rslora=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged_dir = tmp_path / "peft-merged"
    merged.save_pretrained(merged_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (merged_dir / name).write_bytes((base_dir / name).read_bytes())
    ours = load_model(base_dir, device="cpu", dtype=torch.float32, quant="int8", adapters=((adapter, 1.0),))
    reference = load_model(merged_dir, device="cpu", dtype=torch.float32, quant="int8")
    prompt = [7, 99, 140, 3, 61, 200, 18, 5]
    assert greedy(ours, prompt) == greedy(reference, prompt)


@pytest.mark.e2e
def test_killed_conversion_leaves_no_usable_entry(base_dir, tmp_path):
    cache = tmp_path / "cache"
    script = textwrap.dedent(
        f"""
        import os, time
        os.environ["TIERLM_CACHE"] = {str(cache)!r}
        from tierlm.cache.convert import ConversionRequest, ensure_artifact
        def slow(done, total):
            if done == 0:
                return  # the first block is still being written
            print("block", done, flush=True)
            time.sleep(0.5)
        ensure_artifact(ConversionRequest({str(base_dir)!r}, (), "int8"), lambda label, unit="": slow)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().startswith("block")
    child.send_signal(signal.SIGKILL)
    child.wait()
    root = cache / "artifacts"
    assert [p for p in root.iterdir() if not p.name.startswith(".")] == []
    os.environ["TIERLM_CACHE"], saved = str(cache), os.environ["TIERLM_CACHE"]
    try:
        directory = ensure_artifact(ConversionRequest(base_dir, (), "int8"))
    finally:
        os.environ["TIERLM_CACHE"] = saved
    assert Artifact.open(directory).manifest["quant"] == "int8"
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == [directory.name]


@pytest.mark.e2e
def test_conversion_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """Peak RSS while converting stays within baseline + a few times the largest fused tensor."""
    model_dir = tmp_path / "wide"
    make_model(model_dir, hidden=256, intermediate=1024, layers=24, heads=8, kv_heads=4, vocab=2048,
               with_tokenizer=False)
    largest = 2 * 1024 * 256 * 4  # fused gate/up in fp32
    total = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    assert total > 20 * largest
    warmup_dir = tmp_path / "warmup"
    make_model(warmup_dir, hidden=256, intermediate=1024, layers=1, heads=8, kv_heads=4, vocab=2048,
               with_tokenizer=False)
    script = textwrap.dedent(
        f"""
        import os, json
        os.environ["TIERLM_CACHE"] = {str(tmp_path / "cache")!r}
        import torch
        from tierlm.cache.convert import ConversionRequest, ensure_artifact
        # A one-layer conversion of the same widths first: imports, kernel set-up and allocator
        # arenas are then in the baseline, and what remains is what conversion itself holds.
        ensure_artifact(ConversionRequest({str(warmup_dir)!r}, (), "int8"))
        def status(field):
            for line in open("/proc/self/status"):
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        baseline = status("VmHWM")
        ensure_artifact(ConversionRequest({str(model_dir)!r}, (), "int8"))
        print(json.dumps({{"baseline": baseline, "peak": status("VmHWM")}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    growth = measured["peak"] - measured["baseline"]
    # Quantizing one fused tensor needs a few fp32 temporaries of its size (pad, scale, round).
    assert growth <= 8 * largest, f"conversion grew RSS by {growth} bytes; model is {total}"
