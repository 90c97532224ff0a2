"""The native W4A16 (INT4) kernels (quant/csrc/gemv.h `tile4`, library.cpp `tierlm_i4_*`) against
the fp32 reference `int4.dequantize4`: `matmul4` for 1-8 activation rows, symmetric and
asymmetric, groups of 32, 64 and 128, a ragged last group, with and without bias, row counts
that are no multiple of the tile; `dequantize4_into` bit for bit (every fp16 bit pattern as a
scale and as an offset, which checks the portable build's scalar fp16 conversion); and the
fused decode step on models whose layer weights are Int4Weight, against the eager path.

Builds: AVX2 (`-march=x86-64-v3`) and portable vector extensions (`-march=x86-64-v2`) are built
and run here; AVX-512 (`-march=x86-64-v4`) is only compiled (this CPU may lack it).

Tolerance of `matmul4`: both sides accumulate in fp32/fp64 in different orders, and the kernel
forms each group as s * (sum u x - 8 sum x) (or + o * sum x), so it is compared with a float64
reference within 1e-5 of the output's magnitude, max over outputs of sum_k |x_k| |W_nk|
(observed differences ~2e-7 of it); on AVX2, groups of 32 and up to 4 rows run the integer decode
rows (csrc/gemv_a16.h), held to x's int16 rounding bound besides. Fused decode logits: within 1e-4
absolute, as tests/test_fused_decode.py (1e-3 on those integer rows), greedy tokens equal.
"""

from __future__ import annotations

import platform
import re
import subprocess
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.activation_rounding import rounding_bound
from tests.tiny import decode_steps
from tierlm.models import fused_decode
from tierlm.quant import native
from tierlm.quant.int4 import Int4Weight, dequantize4, quantize_int4
from tierlm.runtime.loader import load_model

X86 = platform.machine() in ("x86_64", "AMD64")
RTOL = 1e-5  # of the output's magnitude, see the module docstring
ATOL_LOGITS = 1e-4
# The integer decode rows (AVX2, groups of 32) round x to int16 per 32 columns: logits then agree
# within the GGUF logits tests' tolerance against transformers.
ATOL_INT16_LOGITS = 1e-3
ROWS = (1, 2, 3, 4, 5, 8)
# (out, in, group): every group size, ragged last groups (576 = 4 x 128 + 64, 160 = 2 x 64 + 32),
# out counts that are no multiple of any tile (1, 7, 33), and group counts past the 4, 8 or 16
# groups whose scales the kernels widen at once, with some left over (11, 17).
SHAPES = [(33, 256, 32), (33, 256, 64), (33, 256, 128), (7, 576, 128), (1, 64, 32), (7, 160, 64), (16, 96, 96),
          (9, 352, 32), (5, 1088, 64), (3, 2144, 128)]  # fmt: skip


@pytest.fixture
def build(native_build):
    """conftest's `native_build`: the AVX2 and portable builds, each loaded."""
    return native_build


def _weight(out_features, in_features, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) * 0.05


def _integer_rows(isa: int, group: int, rows: int = 1) -> bool:
    """Whether matmul4 runs csrc/gemv_a16.h's integer rows (AVX2 builds, groups of 32, up to 4
    activation rows), whose error adds x's int16 rounding (tests/test_a16_kernels.py)."""
    return isa == 256 and group == 32 and rows <= 4


def _reference(x, dense, bias):
    """x @ dense.T (+ bias) in float64, and the magnitude max_n sum_k |x_k| |W_nk| (+ |bias|)."""
    ref = x.double() @ dense.double().T
    size = x.double().abs() @ dense.double().abs().T
    if bias is not None:
        ref, size = ref + bias.double(), size + bias.double().abs()
    return ref, size.max().item()


@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}-g{g}" for n, k, g in SHAPES])
def test_matmul4_matches_dequantized_reference(build, shape, asym):
    out_features, in_features, group = shape
    qw = quantize_int4(_weight(out_features, in_features, seed=in_features + group), group, asymmetric=asym)
    assert (qw.offsets is not None) == asym
    dense = dequantize4(qw.packed, qw.scales, group, qw.offsets)
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(out_features, generator=gen)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=gen)
        for b in (None, bias):
            y = build.matmul4(x, qw.packed, qw.scales, qw.offsets, group, b)
            assert y.shape == (rows, out_features) and y.dtype == torch.float32
            ref, size = _reference(x, dense, b)
            if _integer_rows(build.isa, group, rows):
                bound = rounding_bound(x, dense) + RTOL * size
                assert bool(((y.double() - ref).abs() <= bound).all()), f"rows {rows}"
            else:
                torch.testing.assert_close(y.double(), ref, rtol=0, atol=RTOL * size, msg=lambda m: f"rows {rows}: {m}")


def test_matmul4_handles_outlier_scales_and_zero_groups(build):
    """Groups that are all zero (s = 0), a huge outlier group and tiny (fp16 subnormal) scales."""
    weight = _weight(9, 256, seed=7)
    weight[2] = 0.0
    weight[4, 32:64] = 300.0 * torch.linspace(-1, 1, 32)
    weight[5, :128] *= 1e-5
    for asym in (False, True):
        qw = quantize_int4(weight, 32, asymmetric=asym)
        dense = dequantize4(qw.packed, qw.scales, 32, qw.offsets)
        x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
        y = build.matmul4(x, qw.packed, qw.scales, qw.offsets, 32)
        ref = x.double() @ dense.double().T
        size = (x.double().abs() @ dense.double().abs().T).clamp_min(1e-30)
        rounding = rounding_bound(x, dense) if _integer_rows(build.isa, 32, 3) else 0.0
        assert ((y.double() - ref).abs() <= RTOL * size + rounding).all()  # per output: row 5 is tiny
        assert torch.equal(y[:, 2], torch.zeros(3))


@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("shape", [(33, 256, 32), (7, 576, 128), (5, 160, 64)],
                         ids=["g32", "g128-ragged", "g64-ragged"])  # fmt: skip
def test_dequantize4_into_equals_the_reference_exactly(build, shape, asym):
    out_features, in_features, group = shape
    qw = quantize_int4(_weight(out_features, in_features, seed=3), group, asymmetric=asym)
    out = torch.full((out_features, in_features), float("nan"))
    assert build.dequantize4_into(qw.packed, qw.scales, qw.offsets, group, out) is out
    assert torch.equal(out, dequantize4(qw.packed, qw.scales, group, qw.offsets))


def test_every_fp16_bit_pattern_converts_exactly(build):
    """All 65536 fp16 values (subnormals, +-0, +-inf, NaNs) as offsets (u = 0, s = 1) and as
    scales (u = 1, o = 0): the kernels' fp16 reads equal torch's conversion."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    patterns = bits.view(2048, 32)  # 2048 rows x 32 groups of 32 columns
    ones, zeros = torch.ones_like(patterns), torch.zeros_like(patterns)
    for packed_byte, scales, offsets in ((0x00, ones, patterns), (0x11, patterns, zeros)):
        packed = torch.full((2048, 512), packed_byte, dtype=torch.uint8)
        out = torch.empty(2048, 1024)
        build.dequantize4_into(packed, scales, offsets, 32, out)
        expected = dequantize4(packed, scales, 32, offsets)
        torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


def test_every_finite_fp16_scale_is_read_exactly_by_matmul4(build):
    """matmul4's own fp16 reads (scales widened a vector at a time, the symmetric offsets' dot):
    nibbles u = 1 and one-hot activations, one per group, make y[g, n] = s - 8 s = -7 s[n, g]
    exactly, for every finite fp16 value (subnormals and -0 included) as a scale."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    finite = bits[torch.isfinite(bits)]
    scales = torch.cat([finite, finite[: 2048 * 32 - finite.numel()]]).view(2048, 32)
    packed = torch.full((2048, 512), 0x11, dtype=torch.uint8)
    x = torch.zeros(32, 1024)
    x[torch.arange(32), torch.arange(32) * 32] = 1.0  # row g: column 0 of group g
    y = build.matmul4(x, packed, scales, None, 32)
    assert torch.equal(y, -7.0 * scales.float().T)


def test_matmul4_refuses_groups_and_widths_that_are_no_multiple_of_32(build):
    packed = torch.zeros(4, 32, dtype=torch.uint8)
    scales = torch.ones(4, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="multiples of 32"):
        build.matmul4(torch.zeros(1, 64), packed, scales, None, 48)
    with pytest.raises(ValueError, match="multiples of 32"):
        build.dequantize4_into(packed, scales, None, 48, torch.empty(4, 64))


# -- the fused decode step with INT4 layer weights ---------------------------------------------


class _DequantizedReference:
    """The eager path's kernel for the Int4Weights below: F.linear on `dequantize()` (so the
    comparison is against the reference, whatever kernels dispatch would choose)."""

    name = "int4-reference"

    def linear(self, x, weight, bias=None):
        return F.linear(x, weight.dequantize().to(x.dtype), bias)


def _int4_model(checkpoint, group: int, asym: bool):
    """The checkpoint loaded as fp32, then every layer's 2-D projection replaced in the resident
    store by `quantize_int4` of it (pinned to the dequantized reference for the eager path)."""
    loaded = load_model(checkpoint, device="cpu", dtype=torch.float32, context_length=64, quant="fp32")
    store = loaded.model.store
    for name in store.block_names():
        if not name.startswith("layers."):
            continue
        with store.block(name) as w:
            for key in ("wqkv", "wo", "w13", "w2"):
                qw = quantize_int4(w[key], group, asymmetric=asym)
                w[key] = Int4Weight(qw.packed, qw.scales, group, offsets=qw.offsets, kernels=_DequantizedReference())
        with store.block(name) as w:
            assert all(isinstance(w[key], Int4Weight) for key in ("wqkv", "wo", "w13", "w2"))
    return loaded


def _eager(monkeypatch, fn):
    monkeypatch.setenv("TIERLM_FUSED", "0")
    try:
        return fn()
    finally:
        monkeypatch.setenv("TIERLM_FUSED", "1")


# (case, group, asymmetric): head_dim 16 and 32, q/k norms, biases, a window; w2's 96 inputs
# make group 64 ragged (64 + 32).
FUSED = [("llama-mqa-bias-head-dim-32", 32, False), ("qwen3-qk-norm", 64, True), ("mistral-window-3", 32, True),
         ("qwen2-bias", 64, False)]  # fmt: skip


@pytest.mark.parametrize("case,group,asym", FUSED, ids=[f"{c}-g{g}{'-asym' if a else ''}" for c, g, a in FUSED])
def test_fused_decode_with_int4_weights_matches_eager(case, group, asym, decode_checkpoint, monkeypatch, fused_calls):
    if fused_decode.native_library() is None:
        pytest.skip("no native library here (no C++ compiler): decode runs the eager path only")
    loaded = _int4_model(decode_checkpoint(case), group, asym)
    ids = torch.randint(0, loaded.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    steps = 12
    expected, expected_tokens = _eager(monkeypatch, lambda: decode_steps(loaded, ids, steps))
    assert fused_calls == []
    actual, tokens = decode_steps(loaded, ids, steps)
    assert fused_calls == [True] * ((steps + 1) * loaded.config.num_hidden_layers)  # the prefill chunk too
    assert tokens == expected_tokens
    atol = ATOL_INT16_LOGITS if _integer_rows(native.load_native().isa, group) else ATOL_LOGITS
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def test_build_runs_the_int4_fused_step_like_eager(build, decode_checkpoint, monkeypatch, fused_calls):
    loaded = _int4_model(decode_checkpoint("qwen3-qk-norm"), 32, True)
    ids = torch.randint(0, loaded.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(5))
    expected, expected_tokens = _eager(monkeypatch, lambda: decode_steps(loaded, ids, 8))
    monkeypatch.setattr(fused_decode, "native_library", lambda: build.lib)
    actual, tokens = decode_steps(loaded, ids, 8)
    assert fused_calls and all(fused_calls)
    assert tokens == expected_tokens
    atol = ATOL_INT16_LOGITS if _integer_rows(build.isa, 32) else ATOL_LOGITS
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def test_weight_words_describe_int4_and_refuse_what_the_native_code_cannot_read():
    qw = quantize_int4(_weight(8, 64, seed=0), 32, asymmetric=True)
    words = native.describe_weight(qw, None, (8, 64), [])
    assert words == (qw.packed.data_ptr(), qw.scales.data_ptr(), qw.offsets.data_ptr(), 0, 8, 64, 32,
                     native.KIND_INT4, 1)  # fmt: skip
    assert native.describe_weight(qw, None, (8, 32), []) is None  # another shape
    fake = SimpleNamespace(packed=qw.packed, scales=qw.scales.float(), offsets=None, group_size=32, shape=qw.shape)
    assert native.describe_weight(fake, None, (8, 64), []) is None  # fp32 scales
    one_group = qw.scales[:, :1].contiguous()
    fake = SimpleNamespace(packed=qw.packed, scales=one_group, offsets=None, group_size=64, shape=qw.shape)
    assert native.describe_weight(fake, None, (8, 64), []) is not None  # one group of 64
    fake.group_size = 48
    assert native.describe_weight(fake, None, (8, 64), []) is None  # no multiple of 32
    fake = SimpleNamespace(packed=qw.packed.t().contiguous().t(), scales=qw.scales, offsets=None, group_size=32,
                           shape=qw.shape)  # fmt: skip
    assert native.describe_weight(fake, None, (8, 64), []) is None  # not contiguous


# -- AVX-512: compiled only ----------------------------------------------------------------------


def test_avx512_build_compiles_and_exports_the_int4_entry_points(avx512_library):
    """`-march=x86-64-v4` is only COMPILED here: the library must build, export the int4 entry
    points beside the int8 ones, and use zmm registers with fp16 conversions (vcvtph2ps).
    Running it needs an AVX-512 machine."""
    if not X86:
        pytest.skip("x86 -march flags")
    library = avx512_library  # conftest: built with _flags("x86-64-v4"), once per machine
    data = library.read_bytes()
    names = {name.decode() for name in re.findall(rb"tierlm_[a-z0-9_]+", data)}
    for name in ("tierlm_i4_matmul", "tierlm_i4_dequant", "tierlm_i8_matmul", "tierlm_decode_layer"):
        assert name in names, name
    disassembly = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True)
    if disassembly.returncode == 0:
        assert re.search(r"vcvtph2ps\s+\S+,%zmm", disassembly.stdout), "no 16-wide fp16 conversion"
        assert "zmm" in disassembly.stdout
