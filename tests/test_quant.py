"""INT8 weight-only quantization: error bounds, every kernel against dequantize-then-matmul,
serialization, quant mode names, and the fallback when a preferred kernel cannot load."""

from __future__ import annotations

import platform

import pytest
import torch

from tests.activation_rounding import rounding_bound
from tests.tiers import quick
from tierlm.errors import TierlmError
from tierlm.paths import kernels_root
from tierlm.quant.dispatch import DECODE_ROWS, INTEGER_GEMM_ROWS, KernelChoice, calibrate
from tierlm.quant.int8 import Int8Weight, quantize_int8, quantize_q8_0
from tierlm.quant.kernel_api import KernelUnavailable
from tierlm.quant.modes import parse_quant_mode
from tierlm.quant.native import FLAGS, load_native
from tierlm.quant.torch_kernels import BlasKernel, TorchKernel, dequantize_into

# Shapes that are no multiple of 16 or 64, so vector tails and ragged groups are exercised.
ODD = (577, 1531)


def _weight(out_features, in_features, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) * 0.05


def _element_scales(weight: Int8Weight) -> torch.Tensor:
    """The scale that applies to each element, [out, in]."""
    return weight.scales_2d.repeat_interleave(weight.group, dim=1)[:, : weight.shape[1]]


def _reference(x, weight: Int8Weight, bias=None):
    """x @ dequantize().T (+ bias) in float64: what every kernel must reproduce."""
    out = x.double() @ weight.dequantize().double().T
    return out + bias.double() if bias is not None else out


def _assert_matches(y, ref):
    # fp32 accumulation over ~1.5k terms: 1e-5 of the output's magnitude is a tight bound.
    scale = ref.abs().max().item()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * scale)


# -- quantization -----------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [None, 128, 64, 100])
def test_round_trip_error_is_at_most_half_a_step(group_size):
    w = _weight(*ODD)
    w[3] = 0.0  # an all-zero row
    w[7, 11] = 40.0  # an outlier
    qw = quantize_int8(w, group_size)
    scales = _element_scales(qw)
    error = (w.double() - qw.dequantize().double()).abs()
    # Half a step, plus the fp32 rounding of w / s and of q * s (a few ulps of |w|).
    slack = 4 * torch.finfo(torch.float32).eps * w.double().abs()
    assert (error <= scales.double() / 2 + slack).all()
    assert qw.qweight.abs().max() <= 127
    assert torch.equal(qw.dequantize()[3], torch.zeros(ODD[1]))
    assert (qw.scales_2d[3] == 0).all()
    # The largest magnitude of every non-zero row/group maps to +-127 exactly.
    nonzero = qw.scales_2d > 0
    pad = qw.scales_2d.shape[1] * qw.group - ODD[1]
    padded = torch.nn.functional.pad(qw.qweight.float().abs(), (0, pad))
    group_max = padded.unflatten(1, (-1, qw.group)).amax(-1)
    assert (group_max[nonzero] == 127).all()


def test_scale_shapes_and_ragged_last_group():
    w = _weight(16, 576)
    assert quantize_int8(w).scales.shape == (16,)
    grouped = quantize_int8(w, 128)
    assert grouped.scales.shape == (16, 5)  # 4 groups of 128 and one of 64
    assert grouped.group_size == 128


def test_groups_isolate_an_outlier():
    w = _weight(4, 512)
    w[0, 0] = 100.0
    per_channel = quantize_int8(w)
    grouped = quantize_int8(w, 128)
    tail = slice(128, 512)  # groups without the outlier
    err_channel = (w[0, tail] - per_channel.dequantize()[0, tail]).abs().max()
    err_grouped = (w[0, tail] - grouped.dequantize()[0, tail]).abs().max()
    assert err_grouped < err_channel / 50
    assert (w[0, 0] - grouped.dequantize()[0, 0]).abs() <= grouped.scales[0, 0] / 2


def test_quantize_refuses_non_finite_and_bad_shapes():
    w = _weight(4, 32)
    w[2, 5] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_int8(w)
    with pytest.raises(ValueError):
        quantize_int8(torch.zeros(4))
    with pytest.raises(ValueError):
        quantize_int8(_weight(4, 32), group_size=0)


def test_tensors_round_trip_without_copy_and_fp16_scales():
    qw = quantize_int8(_weight(*ODD), 128)
    parts = qw.tensors()
    assert parts["qweight"].dtype == torch.int8 and parts["qweight"].shape == ODD
    again = Int8Weight.from_tensors(parts, group_size=128)
    assert again.qweight.data_ptr() == qw.qweight.data_ptr()
    assert torch.equal(again.dequantize(), qw.dequantize())
    assert again.nbytes == qw.qweight.nbytes + qw.scales.nbytes
    half_parts = {"qweight": parts["qweight"], "scales": parts["scales"].half()}
    half = Int8Weight.from_tensors(half_parts, 128)
    # Symmetric fp16 scales (q8_0's form) reach the kernels as stored: no fp32 copy.
    assert half.scales.dtype == torch.float16 and half.scales_2d.data_ptr() == half.scales.data_ptr()
    assert torch.equal(half.dequantize(), qw.qweight.float() * parts["scales"].half().float().repeat_interleave(128, 1)[:, :ODD[1]])
    with pytest.raises(ValueError, match="scales must be"):
        Int8Weight.from_tensors(parts)  # grouped scales read as per-channel


def test_rows_equal_dequantized_rows():
    qw = quantize_int8(_weight(300, 200), 64)
    ids = torch.tensor([[0, 5, 299], [7, 7, 1]])
    rows = qw.rows(ids)
    assert rows.shape == (2, 3, 200) and rows.dtype == torch.float32
    assert torch.equal(rows, qw.dequantize()[ids])
    assert qw.rows(ids, dtype=torch.bfloat16).dtype == torch.bfloat16


# -- kernels ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernels():
    """Every kernel that can load here, by name; the torch ones always can. Their builds live in
    the machine's kernels directory (the native ones keyed per flags, numba's per version), so
    each is compiled once."""
    kernels = {
        "blas-torch": BlasKernel(),
        "blas-small-blocks": BlasKernel(block_bytes=1 << 14),  # many blocks, a ragged last one
        "torch": TorchKernel(),
    }
    build = kernels_root()
    try:
        native = load_native(build)
        kernels["native"] = native
        kernels["blas-native"] = BlasKernel(native.dequantize_into)
    except KernelUnavailable:
        pass
    if platform.machine() in ("x86_64", "AMD64"):
        # The portable vector-extension path (CPUs without AVX2), built for x86-64-v2 here.
        portable = tuple("-march=x86-64-v2" if f == "-march=native" else f for f in FLAGS)
        try:
            kernels["native-portable"] = load_native(build, portable)
            assert kernels["native-portable"].name == "native-simd"
        except KernelUnavailable:
            pass
    try:
        from tierlm.quant.numba_kernel import load_numba

        kernels["numba"] = load_numba(build)
    except KernelUnavailable:
        pass
    return kernels


@pytest.mark.parametrize("rows", quick([1, 3, 8, 37], fast=[1, 3]))
@pytest.mark.parametrize("group_size", [None, 128, 100])
def test_every_kernel_matches_dequantize_then_matmul(kernels, rows, group_size):
    qw = quantize_int8(_weight(*ODD, seed=rows), group_size)
    x = torch.randn(rows, ODD[1], generator=torch.Generator().manual_seed(1))
    bias = torch.randn(ODD[0])
    for name, kernel in kernels.items():
        for b in (None, bias):
            y = kernel.matmul(x, qw.qweight, qw.scales_2d, qw.group, b)
            assert y.shape == (rows, ODD[0]) and y.dtype == torch.float32, name
            _assert_matches(y, _reference(x, qw, b))


@pytest.mark.e2e
def test_native_kernel_builds_once_and_is_reused(tmp_path):
    try:
        first = load_native(tmp_path)
    except KernelUnavailable as err:
        pytest.skip(f"no native kernel here: {err}")
    stamp = first.library.stat().st_mtime_ns
    second = load_native(tmp_path)
    assert second.library == first.library and second.library.stat().st_mtime_ns == stamp


def test_missing_compiler_is_reported_not_raised_elsewhere(tmp_path, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler on PATH
    with pytest.raises(KernelUnavailable, match="no C\\+\\+ compiler"):
        load_native(tmp_path / "kernels")


# -- the weight object and dispatch -----------------------------------------------------------


def _fixed_choice(kernels, gemv="native", crossover=8):
    small = kernels.get(gemv, kernels["blas-torch"])
    large = kernels.get("blas-native", kernels["blas-torch"])
    return KernelChoice(gemv=small, gemm=large, crossover=crossover)


@pytest.mark.parametrize("group_size", [None, 128])
def test_linear_on_3d_input_with_and_without_bias(kernels, group_size):
    qw = quantize_int8(_weight(*ODD), group_size)
    qw.kernels = _fixed_choice(kernels)
    bias = torch.randn(ODD[0])
    for shape in ((1, 1, ODD[1]), (2, 3, ODD[1]), (2, 20, ODD[1])):  # decode, small, prefill
        x = torch.randn(shape)
        for b in (None, bias):
            y = qw.linear(x, b)
            assert y.shape == (*shape[:2], ODD[0])
            _assert_matches(y, _reference(x, qw, b))


def test_prompts_past_a_fixed_row_count_multiply_in_integers_whatever_was_timed(kernels):
    """The integer GEMM's numerics differ from the tiles' and BLAS's, so which one runs is a row
    count, not a timing: past INTEGER_GEMM_ROWS it runs whatever crossover calibration found."""
    if "native" not in kernels or kernels["native"].isa < 256:
        pytest.skip("no integer GEMM in this build")
    qw = quantize_q8_0(_weight(48, 96))
    for crossover in (2, 64):
        qw.kernels = _fixed_choice(kernels, crossover=crossover)
        x = torch.randn(INTEGER_GEMM_ROWS + 1, 96)
        assert torch.equal(qw.linear(x), kernels["native"].gemm(x, qw))
    qw.kernels = _fixed_choice(kernels, crossover=2)  # fewer rows past the crossover: BLAS
    x = torch.randn(INTEGER_GEMM_ROWS, 96)
    assert torch.equal(qw.linear(x), kernels["blas-native"].matmul(x, qw.qweight, qw.scales_2d, qw.group))


def test_bf16_activations_come_back_bf16(kernels):
    qw = quantize_int8(_weight(64, 96))
    qw.kernels = _fixed_choice(kernels)
    x = torch.randn(2, 5, 96, dtype=torch.bfloat16)
    y = qw.linear(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), _reference(x.float(), qw).float(), rtol=1e-2, atol=1e-2)


def test_accelerator_kernels_keep_half_precision_activations():
    # The accelerator path (dequantize to x's dtype + F.linear) runs on CPU tensors as well.
    from tierlm.quant.dispatch import accelerator_kernel_choice

    qw = quantize_int8(_weight(64, 96), 32)
    qw.kernels = accelerator_kernel_choice("cuda")
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(3, 96).to(dtype)
        y = qw.linear(x, torch.randn(64).to(dtype))
        assert y.dtype == dtype and y.shape == (3, 64)
    per_channel = quantize_int8(_weight(64, 96))
    per_channel.kernels = qw.kernels
    x = torch.randn(2, 96)
    _assert_matches(per_channel.linear(x), _reference(x, per_channel))
    assert qw.to("cpu").kernels is None


def test_empty_batch(kernels):
    qw = quantize_int8(_weight(*ODD))
    qw.kernels = _fixed_choice(kernels)
    assert qw.linear(torch.randn(0, ODD[1])).shape == (0, ODD[0])


def test_linear_through_model_base_uses_the_default_kernels():
    from tierlm.models import base

    qw = quantize_int8(_weight(96, 160), 32)
    x = torch.randn(1, 4, 160)
    # Four rows take the integer decode path: within its rounding bound (tests/test_a16_kernels.py).
    dense = qw.dequantize()
    error = (base.linear(x, qw).double() - _reference(x, qw)).abs()[0]
    size = (x[0].double().abs() @ dense.double().abs().T).max()
    assert bool((error <= rounding_bound(x[0], dense) + 1e-5 * size).all())
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(base.embed(qw, ids), qw.dequantize()[ids])


def test_calibration_skips_a_kernel_that_cannot_load(tmp_path):
    def broken(build_root):
        raise KernelUnavailable("simulated: compiler missing")

    choice = calibrate([("native", broken)], tmp_path, shape=(128, 256), reps=1)
    assert choice.skipped == ("native: simulated: compiler missing",)
    assert choice.gemv.name == "dequant-blas" and choice.gemm.name == "dequant-blas"
    qw = quantize_int8(_weight(*ODD), 128)
    qw.kernels = choice
    x = torch.randn(3, ODD[1])
    _assert_matches(qw.linear(x), _reference(x, qw))


def test_calibration_falls_back_to_the_next_candidate(tmp_path):
    class Slow:
        name = "second-choice"

        def matmul(self, x, qweight, scales, group, bias=None):
            return BlasKernel().matmul(x, qweight, scales, group, bias)

    def broken(build_root):
        raise KernelUnavailable("simulated: build failed")

    loaders = [("first", broken), ("second", lambda root: Slow())]
    choice = calibrate(loaders, tmp_path, shape=(128, 256), reps=1)
    assert choice.skipped == ("first: simulated: build failed",)
    measured = {name for name, _, _ in choice.timings}
    assert measured >= {"second-choice", "dequant-blas"}
    assert choice.crossover >= 1 and choice.kernel_for(10_000) is choice.gemm


def test_calibration_picks_the_measured_fastest(tmp_path, kernels):
    if "native" not in kernels:
        pytest.skip("no native kernel here")
    loaders = [("native", lambda root: kernels["native"])]
    choice = calibrate(loaders, tmp_path, shape=(512, 1024), reps=3)
    batch1 = {name: seconds for name, rows, seconds in choice.timings if rows == 1}
    assert set(batch1) == {kernels["native"].name, "native-dequant+blas"}
    assert choice.gemv.name == min(batch1, key=batch1.get)
    assert choice.gemm.name == "native-dequant+blas"
    # Every row count sent to gemv was measured no slower there than in the GEMM path (decode's
    # few rows stay on the native rows whatever was measured: their numerics are the integer path's).
    assert choice.crossover >= DECODE_ROWS
    for rows in {r for _, r, _ in choice.timings if DECODE_ROWS < r <= choice.crossover}:
        at = {name: seconds for name, r, seconds in choice.timings if r == rows}
        assert at[choice.gemv.name] <= at[choice.gemm.name]


# -- mode names -------------------------------------------------------------------------------


def test_parse_quant_mode():
    assert parse_quant_mode("int8") == parse_quant_mode("INT8")
    int8 = parse_quant_mode("int8")
    assert int8.quantized and int8.group_size is None and int8.weight_dtype == "int8"
    g128 = parse_quant_mode("int8-g128")
    assert g128.group_size == 128 and g128.name == "int8-g128" and g128.key == "int8-g128"
    fp16 = parse_quant_mode("fp16")
    assert fp16.weight_dtype == "float16" and not fp16.quantized
    assert parse_quant_mode("fp32").weight_dtype == "float32"


@pytest.mark.parametrize("name", ["int4", "int8-g", "int8-g100", "int8-g0", "q8_1", ""])
def test_parse_quant_mode_errors(name):
    with pytest.raises(TierlmError) as err:
        parse_quant_mode(name)
    assert err.value.hint and "int8-g128" in err.value.hint


def test_dequantize_into_matches_broadcast_multiply():
    qw = quantize_int8(_weight(5, 300), 128)
    out = dequantize_into(qw.qweight, qw.scales_2d, 128, torch.empty(5, 300))
    manual = qw.qweight.float() * _element_scales(qw)
    assert torch.equal(out, manual)


# -- asymmetric (zero-point) modes ------------------------------------------------------------


@pytest.mark.parametrize("group_size", [None, 128, 32, 100])
def test_asymmetric_round_trip_error_is_at_most_half_a_step(group_size):
    w = _weight(*ODD) + 0.03  # skewed: symmetric ranges waste levels on the side never used
    w[3] = 0.25  # a constant row: scale 0, the value kept exactly as offset
    w[7, 11] = 40.0
    qw = quantize_int8(w, group_size, asymmetric=True)
    assert qw.offsets is not None and qw.offsets.shape == qw.scales.shape
    error = (w.double() - qw.dequantize().double()).abs()
    slack = 8 * torch.finfo(torch.float32).eps * w.double().abs().clamp_min(1.0)
    assert (error <= _element_scales(qw).double() / 2 + slack).all()
    assert torch.equal(qw.dequantize()[3], torch.full((ODD[1],), 0.25))
    # Each affine group (offset != 0) spans the whole int8 range: its minimum maps to -128.
    pad = qw.scales_2d.shape[1] * qw.group - ODD[1]
    padded = torch.cat([qw.qweight.float(), qw.qweight.float()[:, -1:].expand(-1, pad)], 1)
    grouped = padded.unflatten(1, (-1, qw.group))
    affine = (qw.scales_2d > 0) & (qw.offsets_2d != 0)
    assert affine.float().mean() > 0.5  # skewed weights: affine wins most groups
    assert (grouped.amin(-1)[affine] == -128).all() and (grouped.amax(-1)[affine] == 127).all()
    symmetric = quantize_int8(w, group_size)
    assert (w - qw.dequantize()).square().sum() < 0.9 * (w - symmetric.dequantize()).square().sum()


def test_asymmetric_keeps_a_symmetric_grid_exactly():
    """GGUF Q8_0-style weights (w = d*q, q in -127..127 per 32 columns) also survive -asym."""
    gen = torch.Generator().manual_seed(4)
    q8 = torch.randint(-127, 128, (64, 576), generator=gen).float()
    q8[:, ::32] = 127  # every group reaches the top of the grid, as Q8_0's own scales make it
    d = torch.rand(64, 18, 1, generator=gen) * 0.001 + 1e-4
    w = (q8.unflatten(1, (18, 32)) * d).flatten(1)
    qw = quantize_int8(w, 32, asymmetric=True)
    torch.testing.assert_close(qw.dequantize(), w, rtol=0, atol=1e-8)
    assert (qw.offsets == 0).all()


def test_asymmetric_groups_reproduce_a_4bit_affine_grid_exactly():
    """GGUF Q4_1-style weights (w = d*q + m, q in 0..15 per 32 columns) survive int8-g32-asym."""
    gen = torch.Generator().manual_seed(3)
    q4 = torch.randint(0, 16, (64, 576), generator=gen).float()
    q4[:, ::32], q4[:, 1::32] = 0, 15  # every group spans the full 4-bit range
    d = torch.rand(64, 18, 1, generator=gen) * 0.01 + 0.001
    m = -torch.rand(64, 18, 1, generator=gen) * 0.05
    w = (q4.unflatten(1, (18, 32)) * d + m).flatten(1)
    asym = quantize_int8(w, 32, asymmetric=True).dequantize()
    torch.testing.assert_close(asym, w, rtol=0, atol=1e-7)
    assert (quantize_int8(w, 32).dequantize() - w).abs().max() > 1e-5  # symmetric cannot


@pytest.mark.parametrize("group_size", [None, 64, 100])
@pytest.mark.parametrize("rows", quick([1, 3, 40], fast=[1, 3]))
def test_asymmetric_linear_matches_dequantize_then_matmul(group_size, rows):
    qw = quantize_int8(_weight(*ODD) + 0.02, group_size, asymmetric=True)
    x = torch.randn(rows, ODD[1], generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(ODD[0])
    _assert_matches(qw.linear(x, bias), _reference(x, qw, bias))
    y3 = qw.linear(x.view(1, rows, -1))
    assert y3.shape == (1, rows, ODD[0])
    _assert_matches(y3[0], _reference(x, qw))


def test_asymmetric_rows_tensors_and_device_copy():
    qw = quantize_int8(_weight(300, 200) - 0.01, 64, asymmetric=True)
    ids = torch.tensor([[0, 5, 299], [7, 7, 1]])
    assert torch.equal(qw.rows(ids), qw.dequantize()[ids])
    parts = qw.tensors()
    assert set(parts) == {"qweight", "scales", "offsets"}
    again = Int8Weight.from_tensors(parts, 64)
    assert torch.equal(again.dequantize(), qw.dequantize())
    assert again.nbytes == qw.qweight.nbytes + 2 * qw.scales.nbytes
    assert torch.equal(qw.to("cpu").dequantize(), qw.dequantize())
    with pytest.raises(ValueError, match="offsets must be"):
        Int8Weight(qw.qweight, qw.scales, 64, offsets=qw.offsets[:, :1])


def test_parse_asymmetric_modes():
    g32 = parse_quant_mode("INT8-g32-asym")
    assert (g32.name, g32.group_size, g32.asymmetric, g32.quantized) == ("int8-g32-asym", 32, True, True)
    assert parse_quant_mode("int8-asym").group_size is None
    assert not parse_quant_mode("int8-g32").asymmetric
    assert g32.key != parse_quant_mode("int8-g32").key
    with pytest.raises(TierlmError, match="group size"):
        parse_quant_mode("int8-g100-asym")


@pytest.mark.parametrize("rows", quick([1, 3, 37], fast=[1, 3]))
@pytest.mark.parametrize("group_size", [None, 64, 100])
def test_every_kernel_adds_asymmetric_offsets(kernels, rows, group_size):
    qw = quantize_int8(_weight(*ODD, seed=rows) - 0.02, group_size, asymmetric=True)
    x = torch.randn(rows, ODD[1], generator=torch.Generator().manual_seed(2))
    bias = torch.randn(ODD[0])
    for name, kernel in kernels.items():
        y = kernel.matmul(x, qw.qweight, qw.scales_2d, qw.group, bias, offsets=qw.offsets_2d)
        _assert_matches(y, _reference(x, qw, bias))  # a failure shows `name` among the locals
