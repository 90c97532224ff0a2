"""tierlm's decoder against transformers on tiny random checkpoints of each family."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_model
from tierlm.runtime.loader import load_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = {
    "llama-gqa-untied": dict(family="llama", heads=4, kv_heads=2),
    "llama-mha-tied": dict(family="llama", heads=4, kv_heads=4, tied=True),
    "llama-mqa-llama3-rope": dict(
        family="llama", hidden=96, heads=6, kv_heads=1, layers=3, rope_scaling=LLAMA3_ROPE
    ),
    "llama-head-dim-override-bias": dict(
        family="llama", hidden=64, heads=4, kv_heads=2, head_dim=32, attention_bias=True
    ),
    "qwen2-gqa-tied": dict(family="qwen2", heads=4, kv_heads=2, tied=True),
    "qwen2-mha-untied": dict(family="qwen2", hidden=48, heads=3, kv_heads=3, layers=3),
    "mistral-gqa": dict(family="mistral", heads=8, kv_heads=2, sliding_window=None),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(transformers model, tierlm LoadedModel) over the same saved checkpoint."""
    model_dir = tmp_path_factory.mktemp(request.param)
    reference = make_model(model_dir, with_tokenizer=False, **CASES[request.param])
    return reference, load_model(model_dir, device="cpu", dtype=torch.float32)


def prompt(vocab: int, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def test_logits_match_transformers(pair):
    reference, loaded = pair
    ids = prompt(loaded.config.vocab_size)
    with torch.no_grad():
        expected = reference(ids).logits
    actual = loaded.model.forward(ids, loaded.new_cache(), logits="all")
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def test_cached_decode_matches_full_forward(pair):
    """Prefill part of the prompt, then one token at a time: same logits as one full pass."""
    _, loaded = pair
    ids = prompt(loaded.config.vocab_size, length=20, seed=2)
    full = loaded.model.forward(ids, loaded.new_cache(), logits="all")
    cache = loaded.new_cache()
    steps = [loaded.model.forward(ids[:, :9], cache, logits="all")]
    steps += [loaded.model.forward(ids[:, t : t + 1], cache, logits="all") for t in range(9, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def greedy(loaded, ids: torch.Tensor, steps: int, use_cache: bool) -> list[int]:
    tokens = ids[0].tolist()
    cache = loaded.new_cache()
    logits = loaded.model.forward(ids, cache)
    out = []
    for _ in range(steps):
        token = int(logits[0, -1].argmax())
        out.append(token)
        tokens.append(token)
        if use_cache:
            logits = loaded.model.forward(torch.tensor([[token]]), cache)
        else:
            cache = loaded.new_cache()
            logits = loaded.model.forward(torch.tensor([tokens]), cache)
    return out


def test_greedy_tokens_match_transformers_with_and_without_cache(pair):
    reference, loaded = pair
    ids = prompt(loaded.config.vocab_size, length=8, seed=3)
    with torch.no_grad():
        # An explicit all-ones mask: otherwise transformers masks prompt ids equal to its pad id.
        expected = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
            do_sample=False, eos_token_id=None,
        )[0, ids.shape[1] :].tolist()
    assert greedy(loaded, ids, 32, use_cache=True) == expected
    assert greedy(loaded, ids, 32, use_cache=False) == expected


@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_sources_load_as_fp32(tmp_path, source_dtype):
    import transformers

    make_model(tmp_path, with_tokenizer=False, dtype=source_dtype)
    # Reloaded in fp32 rather than cast: a cast model keeps its RoPE buffers rounded.
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    loaded = load_model(tmp_path, device="cpu", dtype=torch.float32)
    ids = prompt(loaded.config.vocab_size)
    with torch.no_grad():
        expected = reference(ids).logits
    actual = loaded.model.forward(ids, loaded.new_cache(), logits="all")
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def test_sharded_checkpoint_matches_single_file(tmp_path):
    reference = make_model(tmp_path / "single", with_tokenizer=False)
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids = prompt(reference.config.vocab_size)
    outputs = []
    for name in ("single", "sharded"):
        loaded = load_model(tmp_path / name, device="cpu", dtype=torch.float32)
        outputs.append(loaded.model.forward(ids, loaded.new_cache(), logits="all"))
    torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)
