"""The integer paths: decode rows (quant/csrc/gemv_a16.h: up to four activation rows, or 16 four at a
time where the caller asks (decode batches, verification passes), quantized to int16 per 32 columns
and multiplied with the weights' codes in integers, for Q8_0, int8-g32 (with and without offsets),
Q5_0 and Q5_1, and on AVX2 int4 in groups of 32 and IQ4_NL/IQ4_XS; the K-quants' rows (Q4_K, Q5_K,
Q6_K) quantize them to int8 per 256 columns as llama.cpp does, gemv_a8.h; more rows and the other
kinds keep the fp32 tiles) and the prefill GEMM (quant/csrc/gemm_a16.h:
every stored kind, any number of rows), on the default build (-march=native) and the AVX2 build;
the portable build has neither.

The reference models the quantization exactly (scale = the group's largest magnitude / 32767, or
/ 127 per 256 columns, codes rounded half to even in fp32): the kernel must equal it within fp32
summation error, which activations with an outlier in every group put far below the
quantization's own effect, so the test tells the integer path from the fp32 one. Against the
unquantized product the error stays under the bound the rounding implies, sum_k |W[n, k]| *
(largest |x| of k's group) / 65534 (/ 254 for the int8 blocks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.activation_rounding import INT8_BLOCK_KINDS, activation_model, int16_activations, rounding_bound
from tests.test_gguf_carry import random_blocks, read_own_layout
from tierlm.quant.int4 import quantize_int4
from tierlm.quant.int8 import quantize_int8, quantize_q8_0
from tierlm.quant.modes import CARRIED_SOURCE_TYPES
from tierlm.quant.native import load_native
from tierlm.quant.row_stack import RowStack
from tierlm.weights.gguf_carry import carry_weight

FLOAT = 1e-6  # the fp32 tiles' summation error, of the output's magnitude
INTEGER = 3e-7  # the integer path's: its sums are exact, only each group's scaling rounds
COLS = 576  # SmolLM2's hidden size: 18 groups, no multiple of 256


def outlier_activations(rows: int, seed: int, cols: int) -> torch.Tensor:
    """Values ~1 with one of ~300 in every group: quantization moves the others by ~5e-3."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    x.unflatten(-1, (-1, 32))[..., 5] = 300.0
    return x


def weights(kind: str):
    """(dense [N, K], its offsets' share [N, K], matmul(native, x, bias)) for a weight of `kind`
    with 37 rows; K 576 (SmolLM2's hidden size, no multiple of 256), 768 for the super-block kinds.
    The kernels add the offsets' share from x summed per group, unquantized."""
    rows, gen = 37, torch.Generator().manual_seed(7)
    cols = 768 if kind in ("Q4_K", "Q6_K", "Q5_K", "IQ4_XS") else COLS
    offsets = torch.zeros(rows, cols)
    if kind in ("Q4_K", "Q6_K"):
        weight = read_own_layout(kind, random_blocks(kind, rows, cols, np.random.default_rng(3)))
        parts = weight.tensors()
        if kind == "Q4_K":  # W = u * d * sc - dmin * m: the share -dmin * m alone with d = 0
            no_d = parts["superblocks"].clone()
            no_d.view(rows, -1, 20)[..., :2] = 0
            load_native().dequantize4k_into(parts["packed"], no_d, offsets)
        name = "matmul4k" if kind == "Q4_K" else "matmul6k"
        return weight.dequantize(), offsets, lambda native, x, bias: getattr(native, name)(x, *parts.values(), bias)
    if kind.startswith("IQ4"):  # W = codebook value * s: no offsets
        weight = read_own_layout(kind, random_blocks(kind, rows, cols, np.random.default_rng(3)))
        parts = weight.tensors()
        return weight.dequantize(), offsets, lambda native, x, bias: native.matmul_iq4(
            x, parts["packed"], parts.get("scales"), parts.get("superblocks"), bias)
    if kind.startswith("Q5"):
        weight = read_own_layout(kind, random_blocks(kind, rows, cols, np.random.default_rng(3)))
        parts = {name: weight.tensors().get(name) for name in ("codes", "scales", "offsets", "superblocks")}
        if parts["superblocks"] is not None:  # Q5_K: as Q4_K, the share -dmin * m alone with d = 0
            no_d = parts["superblocks"].clone()
            no_d.view(rows, -1, 20)[..., :2] = 0
            load_native().dequantize5_into(parts["codes"], None, None, no_d, offsets)
        elif parts["offsets"] is not None:  # Q5_1: W = u * s + o, the share o alone with s = 0
            load_native().dequantize5_into(parts["codes"], torch.zeros_like(parts["scales"]), parts["offsets"], None,
                                           offsets)  # fmt: skip
        else:  # Q5_0: W = (u - 16) * s, the share -16 s added from x's sums as offsets are
            offsets = -16 * parts["scales"].float().repeat_interleave(32, 1)
        return weight.dequantize(), offsets, lambda native, x, bias: native.matmul5(x, *parts.values(), bias)
    values = torch.randn(rows, cols, generator=gen) * 0.05
    if kind.startswith("int4"):
        group = int(kind.split("-g")[1].split("-")[0])
        weight = quantize_int4(values, group, asymmetric=kind.endswith("asym"))
        if weight.offsets is not None:
            offsets = weight.offsets.float().repeat_interleave(group, 1)[:, :cols]
        else:  # (u - 8) * s: the share -8 s added from x's sums, as Q5_0's -16 s is
            offsets = -8 * weight.scales.float().repeat_interleave(group, 1)[:, :cols]
        return weight.dequantize(), offsets, lambda native, x, bias: native.matmul4(x, weight.packed, weight.scales,
                                                                                    weight.offsets, group, bias)  # fmt: skip
    weight = quantize_q8_0(values) if kind == "Q8_0" else quantize_int8(values, 32, asymmetric=kind == "int8-g32-asym")
    if weight.offsets_2d is not None:
        offsets = weight.offsets_2d.repeat_interleave(32, 1)
    return weight.dequantize(), offsets, lambda native, x, bias: native.matmul(x, weight.qweight, weight.scales_2d, 32, bias,
                                                                              weight.offsets_2d)  # fmt: skip


@pytest.fixture(scope="module")
def native_builds(native_build):
    """The default build (-march=native: AVX-512 here) and conftest's AVX2 or portable one."""
    return [load_native(), native_build]


INTEGER_KINDS = {"Q8_0", "int8-g32", "int8-g32-asym", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q4_K"}
# On the integer rows on AVX2 only (gemv_a16.h has_a16_path: AVX-512's fp32 tiles widen nibbles
# cheaply); int4 in groups of 128 keeps the fp32 tiles everywhere.
AVX2_INTEGER_KINDS = {"int4-g32", "int4-g32-asym", "IQ4_NL", "IQ4_XS"}
KINDS = ["Q8_0", "int8-g32", "int8-g32-asym", "Q5_0", "Q5_1", "Q5_K", "int4-g32", "int4-g32-asym", "int4-g128-asym",
         "Q4_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


@pytest.mark.parametrize("kind", KINDS)
def test_decode_rows_multiply_quantized_activations_exactly(native_builds, kind):
    dense, offsets, matmul = weights(kind)
    bias = torch.randn(dense.shape[0])
    quantize, bound = activation_model(kind)
    for native in native_builds:
        integer = native.isa >= 256 and kind in INTEGER_KINDS or native.isa == 256 and kind in AVX2_INTEGER_KINDS
        for rows in range(1, 7):
            x = outlier_activations(rows, rows, dense.shape[1])
            got = matmul(native, x, bias).double()
            exact = x.double() @ dense.double().T + bias.double()
            codes = (dense - offsets).double()
            if kind in INT8_BLOCK_KINDS:  # offsets from the int8 codes' sums too, as llama.cpp's
                rounded = dense.double()
                quantized = quantize(x) @ rounded.T + bias.double()
            else:  # offsets from x's own group sums
                rounded = codes
                quantized = quantize(x) @ codes.T + x.double() @ offsets.double().T + bias.double()
            size = float((x.double().abs() @ dense.abs().double().T).max())
            # The offsets' share is summed in fp32 from x's group sums, whose terms can be larger.
            integer_error = INTEGER * (size + float((x.double().abs() @ offsets.abs().double().T).max()))
            assert float((quantized - exact).abs().max()) > 10 * integer_error  # the paths are told apart
            if integer and rows <= 4:
                assert float((got - quantized).abs().max()) <= integer_error, (native.name, rows)
                assert bool(((got - exact).abs() <= bound(x, rounded) + FLOAT * size).all()), (native.name, rows)
            else:
                assert float((got - exact).abs().max()) <= FLOAT * size, (native.name, rows)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"])
def test_rows_asked_for_as_decode_steps_each_get_what_they_get_alone(native_builds, kind):
    """Decode batches and verification passes ask for up to 16 rows on the integer kernels
    (tierlm_weight_matmul_rows, as the fused step's `integer_rows` does): four at a time over each
    tile of weight rows, each row's result bit for bit its own alone, within the int16 activations'
    rounding of the fp32 tiles' product; past 16 rows, and when not asked, the fp32 tiles run."""
    from tierlm.quant import native as native_module

    weight = read_own_layout(kind, random_blocks(kind, 37, 768, np.random.default_rng(4), spread=0.05))
    keep: list = []
    words = (native_module.ctypes.c_int64 * 9)(*native_module.describe_weight(weight, None, tuple(weight.shape), keep))
    for native in native_builds:
        integer = native.isa >= 256 and (kind != "IQ4_NL" or native.isa == 256)

        def product(x: torch.Tensor, rows: int) -> torch.Tensor:
            y = torch.empty(x.shape[0], 37)
            assert native.lib.tierlm_weight_matmul_rows(x.data_ptr(), x.shape[0], words, y.data_ptr(), 2, rows) == 0
            return y

        for rows in (5, 9, 16, 17):
            x = outlier_activations(rows, rows, 768)
            tiles = product(x, 4).double()
            got = product(x, 16).double()
            if rows > 16 or not integer:
                assert torch.equal(got, tiles), (native.name, rows)
                continue
            alone = torch.cat([product(x[i : i + 1], 16) for i in range(rows)]).double()
            assert torch.equal(got, alone), (native.name, rows)
            size = float((x.double().abs() @ weight.dequantize().double().abs().T).max())
            # The K-quants' rows take x as int8 per 256 columns (llama.cpp's rounding), the rest int16 per 32.
            rounding = 2e-2 if kind in ("Q4_K", "Q5_K", "Q6_K") else 1e-4
            assert 0 < float((got - tiles).abs().max()) <= rounding * size, (native.name, rows)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q6_K"])
def test_values_the_integer_codes_cannot_carry_keep_the_float_path(native_builds, kind):
    """NaN and inf in the activations leave no output finite that torch's product has not (the
    fp32 tiles run); an all-zero group and a group of tiny values (whose 32767 / largest would
    overflow) are multiplied within the rounding bound; a 256-column block of tiny values (which
    int8 cannot scale either) keeps Q6_K's float path."""
    dense, _, matmul = weights(kind)
    _, bound = activation_model(kind)
    for native in native_builds:
        for bad in (float("nan"), float("inf"), -float("inf")):
            x = torch.randn(1, dense.shape[1])
            x[0, 40] = bad
            got, want = matmul(native, x, None), (x.double() @ dense.double().T)
            assert not got.isfinite().any() and not want.isfinite().any(), (native.name, bad)
        x = torch.randn(2, dense.shape[1])
        x[:, :32] = 0.0
        x[:, 32:64] = 1e-36
        got, want = matmul(native, x, None).double(), x.double() @ dense.double().T
        size = float((x.double().abs() @ dense.abs().double().T).max())
        assert bool(((got - want).abs() <= bound(x, dense) + FLOAT * size).all())
        x[1, :256] = 1e-36
        got, want = matmul(native, x, None).double(), x.double() @ dense.double().T
        if kind in INT8_BLOCK_KINDS:  # the fp32 tiles for both rows
            assert float((got - want).abs().max()) <= FLOAT * size, native.name
        assert bool(((got - want).abs() <= bound(x, dense) + FLOAT * size).all())


def stored_weight(kind: str, rows: int, cols: int, seed: int):
    """A weight of GGUF type `kind` from random blocks, or of a tierlm mode (int8 per channel or
    in groups, int4 with a ragged last group), as the kernels read it."""
    values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    if kind == "int8":
        return quantize_int8(values, cols)
    if kind == "int8-g64-asym":
        return quantize_int8(values, 64, asymmetric=True)
    if kind == "int4-g128-asym":
        return quantize_int4(values, 128, asymmetric=True)
    if kind == "stack":  # runs of 13, 16 and 16 rows: the first fills no whole panel
        rng = np.random.default_rng(seed)
        return RowStack([carry_weight(run, random_blocks(run, n, cols, rng, spread=0.05))
                         for run, n in (("Q4_K", 13), ("Q6_K", 16), ("Q8_0", rows - 29))])  # fmt: skip
    return carry_weight(kind, random_blocks(kind, rows, cols, np.random.default_rng(seed), spread=0.05))


def representable_activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    """x whose every group int16 codes carry exactly: integers times a power of two per group, one
    of them +-32767 (the group's scale is then the power of two itself), over a range of scales."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-32767, 32768, (rows, cols // 32, 32), generator=gen).double()
    codes[..., 3] = 32767.0 * torch.where(torch.rand(rows, cols // 32, generator=gen) < 0.5, -1.0, 1.0)
    scale = torch.pow(2.0, torch.randint(-30, -8, (rows, cols // 32, 1), generator=gen).double())
    return (codes * scale).flatten(-2).float()


# "stack": a weight fused from rows of three types (quant/row_stack.py), each run by its own panels.
GEMM_KINDS = sorted(CARRIED_SOURCE_TYPES) + ["int8", "int8-g64-asym", "int4-g128-asym", "stack"]


@pytest.mark.parametrize("kind", GEMM_KINDS)
def test_prefill_gemm_is_exact_where_int16_carries_the_activations(native_builds, kind):
    """On activations int16 codes carry exactly, the integer GEMM equals the float64 product up to
    each group's fp32 scaling, for every stored kind: codes, scales and offsets as gguf forms them.
    Rows that are no whole register block (37) or several passes over the panels (300), rows of
    the weight that fill no whole panel (45), a bias; the portable build has no integer GEMM."""
    cols = 768 if kind in ("int8", "int8-g64-asym", "int4-g128-asym") else 512
    weight = stored_weight(kind, 45, cols, 11)
    dense, bias = weight.dequantize().double(), torch.randn(45)
    for native in native_builds:
        for rows in (1, 37, 300):
            x = representable_activations(rows, cols, rows)
            got = native.gemm(x, weight, bias)
            if native.isa < 256:
                assert got is None
                continue
            exact = x.double() @ dense.T + bias.double()
            size = float((x.double().abs() @ dense.abs().T).max())
            assert float((got.double() - exact).abs().max()) <= 2 * INTEGER * size + 1e-6, (native.name, rows)


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "IQ4_NL"])
def test_prefill_gemm_rounds_activations_within_their_bound(native_builds, kind):
    """Activations with an outlier in every group: the GEMM is the int16 model of x (gemv_a16.h's
    numerics) within fp32 summation, far from the fp32 product, yet within the rounding's bound."""
    weight = stored_weight(kind, 40, 512, 5)
    dense = weight.dequantize()
    x = outlier_activations(20, 9, 512)
    for native in native_builds[:1] + [b for b in native_builds[1:] if b.isa >= 256]:
        got = native.gemm(x, weight).double()
        exact, quantized = x.double() @ dense.double().T, int16_activations(x) @ dense.double().T
        size = float((x.double().abs() @ dense.abs().double().T).max())
        assert float((quantized - exact).abs().max()) > 10 * INTEGER * size
        assert float((got - quantized).abs().max()) <= 2 * INTEGER * size, native.name
        assert bool(((got - exact).abs() <= rounding_bound(x, dense) + FLOAT * size).all())


def test_prefill_gemm_refuses_what_int16_cannot_carry_and_linear_falls_back():
    """NaN or inf in x: the native GEMM writes nothing (None) and `linear` dequantizes into BLAS,
    which carries them to the outputs as torch's product does; fp32 weights have no integer path."""
    native, weight = load_native(), stored_weight("Q8_0", 40, 512, 5)
    x = torch.randn(16, 512)
    x[3, 100] = float("nan")
    assert native.gemm(x, weight) is None
    got, want = weight.linear(x), x @ weight.dequantize().T
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[3].isnan().all())
    assert native.gemm(torch.randn(16, 512), weight.dequantize()) is None
    with pytest.raises(ValueError, match="no contiguous fp32 CPU"):
        native.gemm(torch.randn(16, 256), weight)

