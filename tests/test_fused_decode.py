"""The fused decode step (models/fused_decode.py, quant/csrc/fused_decode.h) against the eager
reference path (`TIERLM_FUSED=0`: the torch ops of LlamaModel.decoder_layer) on tiny random
models of every family, batch 1 and batched over KV slots, for fp32, int8 per-channel and
int8-g32-asym weights; and the native library's AVX2 and portable builds, both run here.

Tolerance: logits within 1e-4 absolute (both paths accumulate in fp32, in different orders;
observed differences are ~1e-6), and greedy tokens equal over 16 steps.
"""

from __future__ import annotations

import platform
import re
import subprocess

import pytest
import torch

from tests.tiers import quick
from tests.tiny import (DECODE_ATOL, DECODE_CASES, MOE_CASES, decode_slots, decode_steps, make_case, paged_cache,
                        scatter_pages, scattered_slot_prompts)
from tierlm.models import fused_decode
from tierlm.paths import kernels_root
from tierlm.quant.int8 import Int8Weight
from tierlm.quant.native import FLAGS, load_native
from tierlm.runtime.loader import load_model

ATOL = DECODE_ATOL
STEPS = 16

# Every family runs int8 (the CPU default); fp32 and grouped asymmetric int8 on a spread of them.
PAIRS = [(case, "int8") for case in DECODE_CASES] + [
    (case, quant)
    for quant in ("fp32", "int8-g32-asym")
    for case in ("llama-mqa-bias-head-dim-32", "qwen3-qk-norm", "glm-quarter-rotary", "mistral-window-3")
]
# `make test-fast`: int8 on every family but the window case, fp32 and grouped asymmetric on one each.
QUICK = [(case, "int8") for case in DECODE_CASES if case != "mistral-window-3"] + [
    ("qwen3-qk-norm", "fp32"), ("glm-quarter-rotary", "int8-g32-asym")]



@pytest.fixture(params=quick(PAIRS, fast=QUICK, ids="-".join, unpack=False))
def loaded(request, decode_checkpoint):
    case, quant = request.param
    if fused_decode.native_library() is None:
        pytest.skip("no native library here (no C++ compiler): decode runs the eager path only")
    model = load_model(decode_checkpoint(case), device="cpu", dtype=torch.float32, context_length=64, quant=quant)
    with model.model.store.block("layers.0") as w:
        assert isinstance(w["wqkv"], torch.Tensor if quant == "fp32" else Int8Weight)
        if quant == "int8-g32-asym":
            assert w["w13"].group == 32 and w["w13"].offsets_2d is not None
    return model


def _eager(monkeypatch, fn):
    """fn() on the eager path; afterwards the fused path is on (whatever the environment said)."""
    monkeypatch.setenv("TIERLM_FUSED", "0")
    try:
        return fn()
    finally:
        monkeypatch.setenv("TIERLM_FUSED", "1")


def test_fused_decode_matches_eager_batch_1(loaded, monkeypatch, fused_calls):
    ids = torch.randint(0, loaded.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    expected, expected_tokens = _eager(monkeypatch, lambda: decode_steps(loaded, ids, STEPS))
    assert fused_calls == []  # TIERLM_FUSED=0 ran no fused layer
    actual, tokens = decode_steps(loaded, ids, STEPS)
    assert fused_calls == [True] * ((STEPS + 1) * loaded.config.num_hidden_layers)  # the prefill chunk too
    assert tokens == expected_tokens
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def test_fused_batched_decode_matches_eager_over_slots_of_different_lengths(loaded, monkeypatch, fused_calls):
    """forward_batch over scattered slots (lengths 11, 3, 7: past the window of the window case)."""
    steps = 6
    prompts, slots = scattered_slot_prompts(loaded.config.vocab_size)

    def run():
        return decode_slots(loaded, paged_cache(loaded.config, loaded.max_len, 4), prompts, slots, steps)

    expected = _eager(monkeypatch, run)
    actual = run()
    assert fused_calls == [True] * ((steps + 3) * loaded.config.num_hidden_layers)  # 3 prefills, then steps
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


CHUNKS = ["llama-mqa-bias-head-dim-32", "qwen3-qk-norm", "mistral-window-3", "chatglm"]


@pytest.mark.parametrize("case", quick(CHUNKS, fast=["qwen3-qk-norm"]))
@pytest.mark.parametrize("paged", [False, True], ids=["slots", "scattered-pages"])
def test_fused_prefill_chunks_match_eager(case, paged, decode_checkpoint, monkeypatch, fused_calls):
    """A prompt of 100 tokens (past the 32 rows from which products run as the integer GEMM, and
    past one tile of 64 key positions: the online softmax carries over tiles; the window case's
    spans straddle a tile's edge), then a second chunk of 50 after it (its rows attend to the
    first's through the cache), then decode: every position's logits as the eager path's, in a
    batch-1 cache and in a paged slot whose pages lie scattered; both chunks and every step ran
    natively."""
    if fused_decode.native_library() is None:
        pytest.skip("no native library here (no C++ compiler): decode runs the eager path only")
    loaded = load_model(decode_checkpoint(case), device="cpu", dtype=torch.float32, context_length=192, quant="int8")
    ids = torch.randint(0, loaded.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(5))

    def run():
        if paged:
            cache = paged_cache(loaded.config, loaded.max_len, 2)
            scatter_pages(cache)
            cache = cache.slot(1)
        else:
            cache = loaded.new_cache()
        rows = [loaded.model.forward(ids[:, :100], cache, logits="all")[0],
                loaded.model.forward(ids[:, 100:], cache, logits="all")[0]]
        for _ in range(3):
            rows.append(loaded.model.forward(torch.tensor([[int(rows[-1][-1].argmax())]]), cache, logits="all")[0])
        return torch.cat(rows)

    expected = _eager(monkeypatch, run)
    assert fused_calls == []
    actual = run()
    assert fused_calls == [True] * (5 * loaded.config.num_hidden_layers)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def test_a_chunk_reaching_past_the_fused_span_runs_eagerly_and_one_past_the_cache_is_refused(
        decode_checkpoint, monkeypatch, fused_calls):  # fmt: skip
    """Past FUSED_CHUNK_SPAN positions a chunk runs the eager path (its blocked attention); past
    the cache, the fused path refuses it with the eager path's words, before writing anything."""
    if fused_decode.native_library() is None:
        pytest.skip("no native library here (no C++ compiler): decode runs the eager path only")
    loaded = load_model(decode_checkpoint("llama-gqa"), device="cpu", dtype=torch.float32, context_length=64, quant="int8")
    ids = torch.randint(0, loaded.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(6))
    monkeypatch.setattr(fused_decode, "FUSED_CHUNK_SPAN", 16)
    cache = loaded.new_cache()
    loaded.model.forward(ids[:, :12], cache)
    assert fused_calls == [True] * loaded.config.num_hidden_layers  # positions 0..11
    fused_calls.clear()
    loaded.model.forward(ids[:, 12:], cache)
    assert fused_calls == []  # positions 12..19: past the span of 16
    for fused in ("1", "0"):
        monkeypatch.setenv("TIERLM_FUSED", fused)
        full = loaded.new_cache()
        loaded.model.forward(ids[:, :12], full)
        with pytest.raises(ValueError, match=r"^76 positions exceed the KV cache \(64\)$"):
            loaded.model.forward(torch.randint(0, 9, (1, 64)), full)
        assert full.offset == 12


# -- the builds: AVX2 and portable run here, AVX-512 only compiles -----------------------------

X86 = platform.machine() in ("x86_64", "AMD64")


def _flags(march: str) -> tuple[str, ...]:
    return tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)


def _cpu_has(flag: str) -> bool:
    try:
        return re.search(rf"\b{flag}\b", open("/proc/cpuinfo").read()) is not None
    except OSError:
        return False


@pytest.fixture(scope="module", params=[("x86-64-v3", 256, "avx2"), ("x86-64-v2", 0, None)],
                ids=["avx2", "portable"])  # fmt: skip
def build(request):
    march, isa, needs = request.param
    if not X86:
        pytest.skip("x86 -march flags")
    if needs and not _cpu_has(needs):
        pytest.skip(f"this CPU has no {needs}")
    kernel = load_native(kernels_root(), _flags(march))
    assert kernel.isa == isa
    return kernel


@pytest.mark.parametrize("group_size,asym", [(None, False), (32, True), (100, False), (128, True)])
def test_build_matmul_matches_dequantized_reference(build, group_size, asym):
    from tierlm.quant.int8 import quantize_int8

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(77, 300, generator=gen)
    qw = quantize_int8(weight, group_size, asymmetric=asym)
    assert (qw.offsets_2d is not None) == asym
    for rows in (1, 3, 6):
        x = torch.randn(rows, 300, generator=gen)
        bias = torch.randn(77, generator=gen)
        y = build.matmul(x, qw.qweight, qw.scales_2d, qw.group, bias, offsets=qw.offsets_2d)
        torch.testing.assert_close(y, x @ qw.dequantize().T + bias, atol=1e-4, rtol=1e-5)


def test_build_runs_the_fused_step_like_eager(build, decode_checkpoint, monkeypatch, fused_calls):
    loaded = load_model(decode_checkpoint("qwen3-qk-norm"), device="cpu", dtype=torch.float32, context_length=64,
                        quant="int8-g32-asym")  # fmt: skip
    ids = torch.randint(0, loaded.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(5))
    expected, expected_tokens = _eager(monkeypatch, lambda: decode_steps(loaded, ids, 8))
    monkeypatch.setattr(fused_decode, "native_library", lambda: build.lib)
    actual, tokens = decode_steps(loaded, ids, 8)
    assert fused_calls and all(fused_calls)
    assert tokens == expected_tokens
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def test_avx512_build_compiles_and_exports_every_entry_point(avx512_library):
    """AVX-512 (`-march=x86-64-v4`) is only COMPILED here: this CPU may lack AVX-512, so the
    library is never loaded or run; the test asserts it builds, reports ISA 512 in its code
    path, and exports the entry points native.py binds. Running it needs an AVX-512 machine."""
    if not X86:
        pytest.skip("x86 -march flags")
    library = avx512_library  # conftest: built with _flags("x86-64-v4"), once per machine
    symbols = _dynamic_symbols(library)
    for name in ("tierlm_i8_isa", "tierlm_i8_matmul", "tierlm_i8_dequant", "tierlm_decode_layer",
                 "tierlm_decode_args_size"):  # fmt: skip
        assert name in symbols, name
    # The AVX-512 vector path was compiled in (not the portable one): zmm registers are used.
    disassembly = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True)
    if disassembly.returncode == 0:
        assert "zmm" in disassembly.stdout


def _dynamic_symbols(library) -> set[str]:
    done = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True)
    if done.returncode == 0:
        return {line.split()[-1] for line in done.stdout.splitlines() if line.strip()}
    # No binutils: the dynamic string table still holds every exported name.
    data = library.read_bytes()
    return {name.decode() for name in re.findall(rb"tierlm_[a-z0-9_]+", data)}


@pytest.fixture
def attention_calls(monkeypatch):
    """Counts the attention halves the fused path ran for mixture-of-experts layers."""
    calls = []
    run = fused_decode.FusedStep.run_attention

    def counting(self, w, x, layer):
        calls.append(run(self, w, x, layer))
        return calls[-1]

    monkeypatch.setattr(fused_decode.FusedStep, "run_attention", counting)
    return calls


@pytest.mark.parametrize("case", quick(list(MOE_CASES), fast=["qwen3-moe-dense-and-sparse"]))
def test_moe_layers_run_their_attention_natively_like_eager(case, tmp_path, monkeypatch, attention_calls):
    """A mixture-of-experts layer's attention half runs as one native call (its router and
    experts in torch after it); dense layers of the same model stay whole native layers."""
    if fused_decode.native_library() is None:
        pytest.skip("no native library here (no C++ compiler): decode runs the eager path only")
    make_case(tmp_path, MOE_CASES[case])
    loaded = load_model(tmp_path, device="cpu", dtype=torch.float32, context_length=64, quant="int8")
    ids = torch.randint(0, loaded.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    expected, expected_tokens = _eager(monkeypatch, lambda: decode_steps(loaded, ids, STEPS))
    assert attention_calls == []
    actual, tokens = decode_steps(loaded, ids, STEPS)
    sparse = len(loaded.config.moe.sparse_layers)
    assert attention_calls == [True] * ((STEPS + 1) * sparse)
    assert tokens == expected_tokens
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
