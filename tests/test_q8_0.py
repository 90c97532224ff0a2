"""q8_0: GGUF's Q8_0 (int8 codes, an fp16 scale per 32 columns) carried at its own size.

`quantize_q8_0` against the `gguf` package's reference quantizer, codes and scale bits equal, on
random blocks and edge blocks (all zero, all equal, halves that round away from zero, tiny
scales that are subnormal in fp16, the largest finite scale); a Q8_0 source carried exactly by
`mixed:source` (and float weights not mistaken for one); the native kernels reading the fp16
scales as stored (AVX-512 or whatever `-march=native` gives, AVX2 and portable builds) against
the float64 reference; the fused decode step on q8_0 weights against eager; the artifact's and
the planner's bytes (8.5 bits a weight).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.activation_rounding import rounding_bound
from tests.tiny import DECODE_ATOL, decode_steps
from tierlm.cache import codec
from tierlm.cache.encodings import part_bytes
from tierlm.models import fused_decode
from tierlm.quant import native
from tierlm.quant.int8 import Int8Weight, q8_0_on_source_grid, quantize_q8_0
from tierlm.quant.modes import parse_quant_mode, source_grid_mode
from tierlm.runtime.loader import load_model

gguf = pytest.importorskip("gguf")
quants = pytest.importorskip("gguf.quants")
Q8_0 = gguf.GGMLQuantizationType.Q8_0
RTOL = 1e-5  # of the output's magnitude (as tests/test_int4_kernels.py)


def _gguf_parts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 codes [rows, cols], fp16 scales as uint16 bits [rows, cols / 32]) of gguf's Q8_0."""
    rows, cols = values.shape
    blocks = quants.quantize(values, Q8_0).reshape(rows, cols // 32, 34)
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.uint16)[..., 0]
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
    return codes, scales


def _edge_blocks() -> np.ndarray:
    """Rows of 64 values: each half a 32-value group of one edge kind."""
    rng = np.random.default_rng(7)
    groups = [
        np.zeros(32),  # scale 0, codes 0
        np.full(32, -0.375),  # all equal: every code -127
        np.arange(-16, 16) * 0.5 / 127 * 127 / 16,  # multiples of a step: exact halves after 1 / d
        (np.arange(32) - 15.5) * (127 / 15.5) / 127,  # x / d lands on .5 for many values
        rng.standard_normal(32) * 1e-7,  # d subnormal in fp16
        rng.standard_normal(32) * 1e-9,  # d underflows to fp16 zero
        np.concatenate([[65504.0 * 127], rng.standard_normal(31)]),  # the largest finite scale
        np.concatenate([[3.0], np.zeros(31)]),  # one nonzero value
    ]
    return np.stack(groups).reshape(-1, 64).astype(np.float32)


@pytest.mark.parametrize("kind", ["random", "edges"])
def test_quantize_q8_0_equals_gguf_bit_for_bit(kind):
    if kind == "random":
        rng = np.random.default_rng(3)
        values = (rng.standard_normal((37, 256)) * rng.uniform(0.001, 4, (37, 1))).astype(np.float32)
    else:
        values = _edge_blocks()
    codes, scales = _gguf_parts(values)
    weight = quantize_q8_0(torch.from_numpy(values))
    assert weight.scales.dtype == torch.float16 and weight.offsets is None and weight.group_size == 32
    np.testing.assert_array_equal(weight.qweight.numpy(), codes)
    np.testing.assert_array_equal(weight.scales.numpy().view(np.uint16), scales)
    reference = quants.dequantize(quants.quantize(values, Q8_0), Q8_0)
    np.testing.assert_array_equal(weight.dequantize().numpy(), reference)


def test_q8_0_refuses_what_it_cannot_hold():
    for bad in (float("nan"), float("inf"), 65504.0 * 128):
        values = torch.ones(2, 64)
        values[1, 40] = bad
        with pytest.raises(ValueError, match="rows 0..1 .*q8_0"):
            quantize_q8_0(values)
    with pytest.raises(ValueError, match="2-D float"):
        quantize_q8_0(torch.ones(64))


def test_a_short_last_group_is_quantized_on_its_own():
    values = torch.randn(5, 80, generator=torch.Generator().manual_seed(1))
    weight = quantize_q8_0(values)
    assert weight.scales.shape == (5, 3)
    tail = values[:, 64:]
    expected = (tail.abs().amax(1) / 127).half()
    assert torch.equal(weight.scales[:, 2], expected)
    assert (weight.dequantize() - values).abs().max() <= weight.scales.float().max() / 2 + 1e-6


def test_mixed_source_carries_a_q8_0_source_exactly_and_floats_stay_asymmetric():
    rng = np.random.default_rng(11)
    values = (rng.standard_normal((48, 192)) * 0.02).astype(np.float32)
    stored = torch.from_numpy(quants.dequantize(quants.quantize(values, Q8_0), Q8_0).astype(np.float32))
    codes, scales = _gguf_parts(values)
    carried = q8_0_on_source_grid(stored)
    assert carried is not None
    np.testing.assert_array_equal(carried.qweight.numpy(), codes)  # the file's own bytes
    np.testing.assert_array_equal(carried.scales.numpy().view(np.uint16), scales)
    encoding, parts, meta = codec.encode(stored, parse_quant_mode("mixed:source"), "w13")
    assert encoding == "int8" and meta == {"group_size": 32} and set(parts) == {"qweight", "scales"}
    assert parts["scales"].dtype == torch.float16
    assert torch.equal(Int8Weight.from_tensors(parts, 32).dequantize(), stored)
    # A float weight is no Q8_0 source: mixed:source keeps it on int8-g32-asym, as before.
    assert q8_0_on_source_grid(torch.from_numpy(values)) is None
    encoding, parts, _ = codec.encode(torch.from_numpy(values), parse_quant_mode("mixed:source"), "w13")
    assert encoding == "int8" and "offsets" in parts


def test_q8_0_bytes_are_8_5_bits_a_weight_in_the_artifact_and_the_plan():
    mode = parse_quant_mode("Q8_0")
    assert (mode.name, mode.weight_dtype, mode.group_size, mode.half_scales) == ("q8_0", "int8", 32, True)
    assert sum(part_bytes((64, 4096), mode, "w13")) * 8 == 64 * 4096 * 8.5
    assert source_grid_mode(["Q8_0"]) == "q8_0" and source_grid_mode(["Q5_1"]) == "q5_1"
    assert source_grid_mode(["Q5_1", "Q8_0"]) == "int8-g32-asym"  # rows of two types: the int8 form holding both
    encoding, parts, meta = codec.encode(torch.randn(64, 4096), mode, "w13")
    assert [p.nbytes for p in parts.values()] == part_bytes((64, 4096), mode, "w13")


def _reference(x, dense):
    ref = x.double() @ dense.double().T
    return ref, (x.double().abs() @ dense.double().abs().T).max().item()


SHAPES = [(33, 256), (7, 576), (1, 64), (9, 96), (5, 1088)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_native_matmul_reads_fp16_scales_as_stored(native_build, shape):
    gen = torch.Generator().manual_seed(shape[0])
    weight = quantize_q8_0(torch.randn(*shape, generator=gen) * 0.05)
    dense = weight.dequantize()
    for rows in (1, 2, 3, 5, 8):
        x = torch.randn(rows, shape[1], generator=gen)
        got = native_build.matmul(x, weight.qweight, weight.scales_2d, 32)
        ref, size = _reference(x, dense)
        # Up to four rows take the integer decode path: within its rounding bound besides.
        allowed = RTOL * size + (rounding_bound(x, dense).max().item() if rows <= 4 else 0.0)
        assert (got.double() - ref).abs().max().item() <= allowed, rows
    out = torch.empty(shape)
    native_build.dequantize_into(weight.qweight, weight.scales_2d, 32, out)
    assert torch.equal(out, dense)


def test_native_default_build_and_fp16_offsets_refusal():
    from tierlm.quant.native import load_native

    kernel = load_native()
    weight = quantize_q8_0(torch.randn(24, 160, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(4))
    ref, size = _reference(x, weight.dequantize())
    assert (kernel.matmul(x, weight.qweight, weight.scales_2d, 32).double() - ref).abs().max() <= RTOL * size
    with pytest.raises(ValueError, match="fp16 without offsets"):
        kernel.matmul(x, weight.qweight, weight.scales_2d, 32, offsets=torch.zeros(24, 5))


def _q8_0_model(checkpoint):
    """The checkpoint as q8_0 (every 2-D projection, the embedding and the head)."""
    return load_model(checkpoint, device="cpu", dtype=torch.float32, context_length=64, quant="q8_0")


@pytest.mark.parametrize("case", ["llama-mqa-bias-head-dim-32", "qwen3-qk-norm"])
def test_fused_decode_on_q8_0_weights_matches_eager(case, decode_checkpoint, monkeypatch, fused_calls):
    if fused_decode.native_library() is None:
        pytest.skip("no native library here (no C++ compiler): decode runs the eager path only")
    loaded = _q8_0_model(decode_checkpoint(case))
    with loaded.model.store.block("layers.0") as w:
        assert w["w13"].scales.dtype == torch.float16 and w["w13"].offsets is None
        words = native.describe_weight(w["w13"], None, tuple(w["w13"].shape), [])
        assert words[-2:] == (native.KIND_INT8, 1)  # read as stored: fp16 scales
    ids = torch.randint(0, loaded.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    monkeypatch.setenv("TIERLM_FUSED", "0")
    expected, expected_tokens = decode_steps(loaded, ids, 10)
    assert fused_calls == []
    monkeypatch.setenv("TIERLM_FUSED", "1")
    actual, tokens = decode_steps(loaded, ids, 10)
    assert fused_calls and all(fused_calls)
    assert tokens == expected_tokens
    torch.testing.assert_close(actual, expected, atol=DECODE_ATOL, rtol=0)
