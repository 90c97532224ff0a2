"""tierlm's decoder against transformers on tiny random checkpoints of each family.

Each case: logits equal transformers', cached decode equals the full forward (prompts and chunks
longer than any sliding window), greedy tokens equal transformers' with and without the KV
cache, and a batched decode over KV slots gives each sequence what it gets alone. A ChatGLM
case is written in ChatGLM's names and config keys; its reference is transformers'
GlmForCausalLM holding the same weights under GLM's names.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiers import quick
from tests.tiny import MOE_CASES, greedy, make_case, make_model, paged_cache, prompt
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
    "qwen3-gqa-head-dim-32": dict(family="qwen3", hidden=64, heads=4, kv_heads=2, head_dim=32),
    "qwen3-mha-tied-bias": dict(family="qwen3", heads=4, kv_heads=4, tied=True, attention_bias=True),
    "glm-gqa-half-rotary": dict(family="glm", heads=4, kv_heads=2),
    "glm-mqa-quarter-rotary": dict(
        family="glm", hidden=64, heads=2, kv_heads=1, head_dim=32, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25},
    ),
    "mistral-window-6": dict(family="mistral", heads=4, kv_heads=2, sliding_window=6),
    "mistral-window-3-mqa": dict(family="mistral", heads=4, kv_heads=1, layers=3, sliding_window=3),
    "chatglm-mqa-rope-ratio": dict(family="chatglm", heads=4, groups=2, rope_ratio=2.5),
    "chatglm-one-group-no-bias": dict(family="chatglm", hidden=48, heads=3, groups=1, kv_channels=16,
                                      qkv_bias=False, layers=3),
    **MOE_CASES,  # Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE (dense and sparse layers)
}  # fmt: skip


# `make test-fast` runs each check on these cases; `make test` (-m slow too) on every case.
QUICK = {
    # All but the slowest window case (mistral-window-6 keeps the sliding window here).
    "logits": set(CASES) - {"mistral-window-3-mqa"},
    # transformers' generate takes seconds per case (sliding windows most): two cheap families.
    "greedy": {"llama-mha-tied", "qwen2-gqa-tied"},
    "batched": {"llama-gqa-untied", "llama-mha-tied", "qwen2-gqa-tied", "qwen3-gqa-head-dim-32",
                "glm-mqa-quarter-rotary", "chatglm-mqa-rope-ratio", "mixtral"},
}


def cases(check: str) -> list:
    """Every case, those beyond QUICK[check] marked slow."""
    return quick(sorted(CASES), fast=QUICK[check], ids=str)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """case -> (transformers model, tierlm LoadedModel) over the same saved checkpoint, built once
    per module."""
    made = {}

    def get(case: str):
        if case not in made:
            model_dir = tmp_path_factory.mktemp(case)
            reference = make_case(model_dir, CASES[case])
            made[case] = reference, load_model(model_dir, device="cpu", dtype=torch.float32, context_length=128)
        return made[case]

    return get


def assert_logits_match(reference, loaded) -> None:
    """tierlm's logits for a random prompt equal the transformers model's."""
    ids = prompt(loaded.config.vocab_size)
    with torch.no_grad():
        expected = reference(ids).logits
    actual = loaded.model.forward(ids, loaded.new_cache(), logits="all")
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", cases("logits"))
def test_logits_match_transformers(pairs, case):
    assert_logits_match(*pairs(case))


@pytest.mark.parametrize("case", cases("logits"))
def test_cached_decode_matches_full_forward(pairs, case):
    """A prefill, a multi-token chunk starting past any window, then one token at a time."""
    _, loaded = pairs(case)
    ids = prompt(loaded.config.vocab_size, 24, seed=2)
    full = loaded.model.forward(ids, loaded.new_cache(), logits="all")
    cache = loaded.new_cache()
    steps = [loaded.model.forward(ids[:, :9], cache, logits="all")]
    steps.append(loaded.model.forward(ids[:, 9:16], cache, logits="all"))
    steps += [loaded.model.forward(ids[:, t : t + 1], cache, logits="all") for t in range(16, 24)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", cases("greedy"))
def test_greedy_tokens_match_transformers_with_and_without_cache(pairs, case):
    reference, loaded = pairs(case)
    ids = prompt(loaded.config.vocab_size, length=8, seed=3)
    with torch.no_grad():
        # An explicit all-ones mask: otherwise transformers masks prompt ids equal to its pad id.
        expected = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0, ids.shape[1] :].tolist()
    assert greedy(loaded, ids, 32, use_cache=True) == expected
    assert greedy(loaded, ids, 32, use_cache=False) == expected


@pytest.mark.parametrize("case", cases("batched"))
def test_batched_decode_matches_each_sequence_alone(pairs, case):
    """forward_batch over scattered KV slots of different lengths (past any window)."""
    _, loaded = pairs(case)
    vocab, steps = loaded.config.vocab_size, 6
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (11, 3, 7)]
    expected = []
    for p in prompts:
        cache, rows = loaded.new_cache(), []
        logits = loaded.model.forward(torch.tensor([p]), cache)[0, -1]
        for _ in range(steps):
            rows.append(logits)
            logits = loaded.model.forward(torch.tensor([[int(logits.argmax())]]), cache)[0, -1]
        expected.append(rows)
    slots = [2, 0, 3]
    cache = paged_cache(loaded.config, loaded.max_len, 4)
    current = [loaded.model.forward(torch.tensor([p]), cache.slot(s))[0, -1] for p, s in zip(prompts, slots)]
    for step in range(steps):
        for i, logits in enumerate(current):
            torch.testing.assert_close(logits, expected[i][step], atol=1e-4, rtol=0)
        ids = torch.tensor([[int(logits.argmax())] for logits in current])
        current = list(loaded.model.forward_batch(ids, cache.batch(slots)))


@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_sources_load_as_fp32(tmp_path, source_dtype):
    import transformers

    make_model(tmp_path, with_tokenizer=False, dtype=source_dtype)
    # Reloaded in fp32 rather than cast: a cast model keeps its RoPE buffers rounded.
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert_logits_match(reference, load_model(tmp_path, device="cpu", dtype=torch.float32))


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
