"""Long contexts in a fixed budget: `--context N` with `--kv-cache TYPE` charged by the planner,
the context each format leaves room for beside the placed weights (`tierlm plan`), and prefill
attention taken in query blocks so its scores stay bounded whatever the context."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from tests.test_planner import BASELINE, CPU, FALLBACKS, MODELS, config_and_sizes
from tierlm.errors import TierlmError
from tierlm.kv.formats import FORMATS
from tierlm.models import attention_blocks, base
from tierlm.offload.placement import DEVICE
from tierlm.offload.planner.search import plan
from tierlm.offload.sizes import kv_cache_bytes, workspace_bytes
from tierlm.profile import load_profile, with_run_settings

GiB = 2**30
# Llama-3.1-8B's shape: 128k positions, 8 KV heads of 128.
LLAMA_31_8B = {**MODELS["llama-3-8b"], "max_position_embeddings": 131072}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return config_and_sizes(tmp_path_factory.mktemp("llama-3.1-8b"), LLAMA_31_8B)


def _plan(llama, profile):
    config, sizes = llama
    return plan(config, sizes, profile, CPU, accelerator=False, baseline_bytes=BASELINE, fallbacks=FALLBACKS)


@pytest.mark.parametrize("name,context", [("8gb", "32k"), ("24gb", "128k")])
def test_an_8b_model_holds_32k_under_8gb_and_128k_under_24gb_at_q8_0(llama, name, context):
    profile = with_run_settings(load_profile(name), context, "q8_0")
    placement = _plan(llama, profile)
    tokens = profile.context_length
    # 32 layers x 2 x 8 heads x (128 int8 codes + 4 fp16 scales) a token
    assert placement.charges[DEVICE]["kv_cache"] == tokens * 32 * 2 * 8 * 136
    assert placement.total(DEVICE) <= placement.budgets[DEVICE]
    assert dict(placement.context_room)["q8_0"] >= tokens
    with pytest.raises(TierlmError, match="does not fit"):  # the same context in fp32 does not
        _plan(llama, with_run_settings(load_profile(name), context, "f32"))


def test_the_room_per_format_is_the_longest_context_that_fits_beside_the_placed_weights(llama):
    config, sizes = llama
    placement = _plan(llama, load_profile("8gb"))
    device = dict(placement.charges[DEVICE])
    fixed = sum(device.values()) - device["kv_cache"] - device["workspace"]
    room = dict(placement.context_room)
    assert list(room) == list(FORMATS)
    assert room["f32"] < room["f16"] == room["bf16"] < room["q8_0"] < room["q4_0"] < config.max_position_embeddings

    def charged(name, tokens):
        profile = replace(load_profile("8gb"), kv_cache=name, context_length=tokens)
        return fixed + kv_cache_bytes(config, profile, False) + workspace_bytes(config, sizes, profile, False)

    for name, tokens in room.items():
        assert charged(name, tokens) <= placement.budgets[DEVICE] < charged(name, tokens + 1), name
    assert room["f32"] >= load_profile("8gb").context_length  # the profile's own context fits, as planned


def test_a_context_the_model_does_not_hold_is_refused_by_name(llama):
    with pytest.raises(TierlmError, match=r"--context 262144 is more than this model holds \(131,072 positions"):
        _plan(llama, with_run_settings(load_profile("24gb"), "256k"))


@pytest.mark.parametrize("value", ["0", "-5", "1e12", "15", "20000000", "lots"])
def test_bad_contexts_get_one_line_each(value):
    with pytest.raises(TierlmError, match=f"--context {value} is "):
        with_run_settings(load_profile("8gb"), value)


@pytest.mark.parametrize("window", [None, 5])
def test_attention_in_query_blocks_equals_one_call(monkeypatch, window):
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, length, past, dim = 1, 8, 2, 37, 20, 16
    q = torch.randn(batch, heads, length, dim, generator=gen)
    k = torch.randn(batch, kv_heads, past + length, dim, generator=gen)
    v = torch.randn(batch, kv_heads, past + length, dim, generator=gen)
    mask = base.attention_mask(length, past + length, heads // kv_heads, window, "cpu")
    whole = base.grouped_attention(q, k, v, mask)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(base.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    monkeypatch.setattr(attention_blocks, "SCORE_ELEMENTS", heads * 6 * (past + length))  # 6 queries a call
    blocked = base.grouped_attention(q, k, v, mask)
    assert len(calls) == 7 and all(shape[2] <= (heads // kv_heads) * 6 for shape in calls)
    torch.testing.assert_close(blocked, whole, atol=1e-6, rtol=1e-6)


def test_a_context_too_long_for_the_budget_is_refused_with_the_longest_that_fits(llama):
    asked = with_run_settings(load_profile("8gb"), "128k", "q8_0")
    with pytest.raises(TierlmError) as refused:
        _plan(llama, asked)
    found = re.search(r"--context (\d+) fits it \(KV cache q8_0\); --kv-cache q4_0 holds --context (\d+)", refused.value.hint)
    assert found, refused.value.hint
    longest, in_q4 = int(found.group(1)), int(found.group(2))
    assert 32768 <= longest < in_q4 < 131072
    _plan(llama, with_run_settings(load_profile("8gb"), str(longest), "q8_0"))  # fits, as said
    with pytest.raises(TierlmError):
        _plan(llama, with_run_settings(load_profile("8gb"), str(longest + 1), "q8_0"))
    _plan(llama, with_run_settings(load_profile("8gb"), str(in_q4), "q4_0"))
    # A shipped profile is suggested for the context asked, not for its own shorter one.
    assert "--profile 16gb" in refused.value.hint
    _plan(llama, with_run_settings(load_profile("16gb"), "128k", "q8_0"))
