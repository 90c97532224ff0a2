"""int8-g32-asym carries GGUF 4/5/8-bit grids exactly (the source-grid candidate of
tierlm/quant/int8.py), and float weights come out no worse than the affine/symmetric rule."""

from __future__ import annotations

import math

import pytest
import torch

from tierlm.quant.int8 import quantize_int8

# name -> (lowest level, highest level, with a min m): values d*j (+ m), j in low..high,
# d and m fp16, the products formed in fp32 as GGUF's dequantize forms them.
GRIDS = {
    "Q4_0": (-8, 7, False),
    "Q5_0": (-16, 15, False),
    "Q8_0": (-127, 127, False),
    "Q8_0-partial": (-100, 90, False),  # never reaches +-127: the symmetric candidate misses it
    "Q4_1": (0, 15, True),
    "Q5_1": (0, 31, True),
    "Q4_1-inner": (1, 14, True),  # no group has its top or bottom level
    "Q5_1-inner": (2, 29, True),
}


def _grid_weight(kind, rows=64, groups=18, seed=0, sparse=False):
    low, high, with_min = GRIDS[kind]
    gen = torch.Generator().manual_seed(seed)
    j = torch.randint(low, high + 1, (rows, groups, 32), generator=gen).float()
    if sparse:  # mostly one level: a group shows few distinct values, e.g. -8, 0, 3
        keep = torch.rand(rows, groups, 32, generator=gen) < 0.1
        j = torch.where(keep, j, torch.full_like(j, (low + high) // 2))
    d = (torch.rand(rows, groups, 1, generator=gen) * 0.01 + 1e-4).half().float()
    if not with_min:  # GGUF's d = max / -8 is negative where the largest magnitude is positive
        sign = torch.where(torch.rand(rows, groups, 1, generator=gen) < 0.5, -1.0, 1.0)
        return (d * sign * j).flatten(1)
    m = (-torch.rand(rows, groups, 1, generator=gen) * 16 * d).half().float()
    return (d * j + m).flatten(1)


def _assert_exact(weight, restored):
    """Within 1e-6 of each group's largest magnitude, and in fact bit for bit."""
    error = (restored - weight).abs().unflatten(1, (-1, 32)).amax(-1)
    bound = 1e-6 * weight.abs().unflatten(1, (-1, 32)).amax(-1)
    assert (error <= bound).all(), f"max error {error.max().item():.3g}"
    assert torch.equal(restored, weight)


@pytest.mark.parametrize("kind", sorted(GRIDS))
@pytest.mark.parametrize("sparse", [False, True])
def test_gguf_grids_come_through_int8_g32_asym_exactly(kind, sparse):
    for seed in range(3):
        weight = _grid_weight(kind, seed=seed, sparse=sparse)
        _assert_exact(weight, quantize_int8(weight, 32, asymmetric=True).dequantize())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_gguf_package_round_trips_are_reproduced_exactly(kind):
    np = pytest.importorskip("numpy")
    quants = pytest.importorskip("gguf.quants")
    qtype = getattr(pytest.importorskip("gguf").GGMLQuantizationType, kind)
    rng = np.random.default_rng(7)
    sources = {
        "normal": rng.standard_normal((96, 512)),
        "heavy tails": rng.standard_t(3, (96, 512)),
        "skewed": rng.laplace(0.3, 1.0, (96, 512)),
        "sparse": rng.standard_normal((96, 512)) * (rng.random((96, 512)) < 0.1),
    }
    for name, values in sources.items():
        array = (values * 0.02).astype(np.float32)
        stored = quants.dequantize(quants.quantize(array, qtype), qtype).astype(np.float32)
        weight = torch.from_numpy(np.ascontiguousarray(stored)).reshape(96, 512)
        restored = quantize_int8(weight, 32, asymmetric=True).dequantize()
        assert torch.equal(restored, weight), f"{kind} {name}"


def test_the_conversion_codec_keeps_the_grid():
    from tierlm.cache.codec import encode
    from tierlm.quant.int8 import Int8Weight
    from tierlm.quant.modes import parse_quant_mode

    weight = torch.cat([_grid_weight("Q4_0"), _grid_weight("Q5_1", seed=1)])
    encoding, parts, meta = encode(weight, parse_quant_mode("int8-g32-asym"))
    assert encoding == "int8"
    restored = Int8Weight.from_tensors(parts, meta["group_size"]).dequantize()
    assert torch.equal(restored, weight)


def test_a_grid_found_across_whole_rows_and_short_groups():
    """Any group on a grid of <= 255 steps is kept: per channel, ragged last groups, g128."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randint(-3, 4, (40, 200), generator=gen).float() * 0.37 + 0.11
    for group_size in (None, 32, 128, 48):
        _assert_exact_any(weight, quantize_int8(weight, group_size, asymmetric=True).dequantize())


def _assert_exact_any(weight, restored):
    assert (restored - weight).abs().max() <= 1e-6 * weight.abs().max()


def test_degenerate_groups_stay_exact():
    weight = torch.zeros(4, 96)
    weight[1] = 0.25  # constant
    weight[2, ::2] = 0.5  # two levels
    weight[3, 5] = -3.0  # one outlier among zeros
    restored = quantize_int8(weight, 32, asymmetric=True).dequantize()
    assert torch.equal(restored, weight)


def _affine_or_symmetric_errors(weight, group_size):
    """Per-group squared error (real values only) of the rule before the source grid: per group
    the symmetric or the affine quantization, whichever has less error over the group padded
    with copies of the row's last value."""
    out_features, in_features = weight.shape
    group = in_features if group_size is None else group_size
    groups = math.ceil(in_features / group)
    pad = groups * group - in_features
    rows = weight.float()
    rows = torch.cat([rows, rows[:, -1:].expand(-1, pad)], 1) if pad else rows
    block = rows.unflatten(1, (groups, group))
    scale_sym = block.abs().amax(-1) / 127.0
    safe_sym = torch.where(scale_sym > 0, scale_sym, 1.0)
    q_sym = torch.round(block / safe_sym[..., None]).clamp(-127, 127)
    symmetric = q_sym * scale_sym[..., None]
    low, high = block.amin(-1), block.amax(-1)
    scale = (high - low) / 255.0
    q = torch.round((block - low[..., None]) / torch.where(scale > 0, scale, 1.0)[..., None])
    q = torch.where((scale > 0)[..., None], q.clamp(0, 255) - 128, 0.0)
    offset = torch.where(scale > 0, low + 128 * scale, low)
    affine = q * scale[..., None] + offset[..., None]
    use_symmetric = (symmetric - block).square().sum(-1) <= (affine - block).square().sum(-1)
    restored = torch.where(use_symmetric[..., None], symmetric, affine).flatten(1)[:, :in_features]
    return _group_errors(weight, restored, group)


def _group_errors(weight, restored, group):
    error = (restored.double() - weight.double()).square()
    pad = -weight.shape[1] % group
    return torch.nn.functional.pad(error, (0, pad)).unflatten(1, (-1, group)).sum(-1)


@pytest.mark.parametrize("group_size", [32, 128, 100, None])
def test_float_weights_are_no_worse_than_affine_or_symmetric(group_size):
    gen = torch.Generator().manual_seed(11)
    weights = [
        torch.randn(300, 1000, generator=gen) * 0.05,
        torch.rand(50, 77, generator=gen) - 0.2,  # skewed, a ragged last group
        (torch.randn(200, 256, generator=gen) * 0.02).to(torch.bfloat16),  # few distinct values
        torch.randn(64, 96, generator=gen) * 1e-3 + 0.01,
    ]
    for weight in weights:
        restored = quantize_int8(weight, group_size, asymmetric=True).dequantize()
        group = weight.shape[1] if group_size is None else group_size
        new = _group_errors(weight.float(), restored, group)
        before = _affine_or_symmetric_errors(weight.float(), group_size)
        assert (new <= before * (1 + 1e-6)).all()
