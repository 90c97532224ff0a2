"""GGUF quantized blocks as int8 codes, scales and offsets, exactly (mixed:source's carry).

Each type's dequantization (the `gguf` package's, which mirrors ggml) is `scale * code (+ offset)`
per group of 16 or 32 columns, the scale and offset fp32 products of the block's fp16 d/dmin and
its small integer sub-scales. Every such product fits fp32's 24-bit significand (an 11-bit d
times at most 7 + 6 bits of sub-scale and code), so an int8 weight holding these codes, scales
and offsets dequantizes, with any rounding order, bit for bit to what `gguf` gives; the tests
check every type on random blocks. The forms are tierlm.quant.modes.INT8_FORMS.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import IQ4_NL, Q4_K

from tierlm.quant.modes import INT8_FORMS, Int8Form

QK_K = 256
_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))


@dataclass
class CarriedRows:
    """Rows of a tensor as int8 codes [rows, cols], scales [rows, cols / group] (fp16 when the
    form's scales are the blocks' own d, else fp32) and fp32 offsets (or None)."""

    codes: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None
    form: Int8Form


def carry_rows(kind: str, raw: np.ndarray, cols: int) -> CarriedRows:
    """`raw` uint8 [rows, row bytes] of GGUF type `kind` (a key of INT8_FORMS) in its int8 form."""
    qtype = getattr(GGMLQuantizationType, kind)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, type_size)
    codes, scales, offsets = _UNPACK[kind](blocks)
    form = INT8_FORMS[kind]
    return CarriedRows(
        codes.astype(np.int8).reshape(rows, cols),
        scales.reshape(rows, cols // form.group).astype(np.float16 if form.half_scales else np.float32),
        None if offsets is None else offsets.reshape(rows, cols // form.group).astype(np.float32),
        form,
    )


def as_form(rows: CarriedRows, form: Int8Form) -> CarriedRows:
    """`rows` in a finer or wider `form` (tierlm.quant.modes.combined_form of fused tensors): each
    scale repeated over the smaller groups, zero offsets added, fp16 scales widened to fp32 (all
    exact)."""
    repeat = rows.form.group // form.group
    scales = np.repeat(rows.scales, repeat, axis=1) if repeat > 1 else rows.scales
    offsets = rows.offsets if rows.offsets is None or repeat == 1 else np.repeat(rows.offsets, repeat, axis=1)
    if form.asymmetric and offsets is None:
        offsets = np.zeros(scales.shape, dtype=np.float32)
    scales = scales.astype(np.float16 if form.half_scales else np.float32)
    return CarriedRows(rows.codes, scales, offsets, form)


# ----------------------------------------------------------------------------- each type
# Each unpacker: blocks uint8 [n, type bytes] -> (codes [n, values], scales [n, groups],
# offsets [n, groups] or None), with the scales (and offsets) formed as gguf forms them.


def _half(field: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(field).view(np.float16).astype(np.float32)


def _low_high_nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per 32 values: low nibbles first, then high nibbles (Q4_0/Q4_1/Q5_x/IQ4_NL)."""
    n = qs.shape[0]
    return ((qs.reshape((n, -1, 1, 16)) >> _NIBBLE_SHIFTS) & np.uint8(0x0F)).reshape((n, -1))


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit i of the little-endian uint32 qh is value i's fifth bit."""
    bits = np.ascontiguousarray(qh).view(np.uint32).reshape((-1, 1)) >> np.arange(32, dtype=np.uint32).reshape((1, 32))
    return (bits & np.uint32(1)).astype(np.uint8)


def _q8_0(blocks):
    d, qs = np.hsplit(blocks, [2])
    return np.ascontiguousarray(qs).view(np.int8), d.copy().view(np.float16), None


def _q4_0(blocks):
    d, qs = np.hsplit(blocks, [2])
    return _low_high_nibbles(qs).astype(np.int8) - np.int8(8), d.copy().view(np.float16), None


def _q4_1(blocks):
    d, m, qs = np.hsplit(blocks, [2, 4])
    return _low_high_nibbles(qs), _half(d), _half(m)


def _q5_0(blocks):
    d, qh, qs = np.hsplit(blocks, [2, 6])
    codes = (_low_high_nibbles(qs) | (_fifth_bits(qh) << np.uint8(4))).astype(np.int8) - np.int8(16)
    return codes, d.copy().view(np.float16), None


def _q5_1(blocks):
    d, m, qh, qs = np.hsplit(blocks, [2, 4, 8])
    return _low_high_nibbles(qs) | (_fifth_bits(qh) << np.uint8(4)), _half(d), _half(m)


def _iq4_nl(blocks):
    d, qs = np.hsplit(blocks, [2])
    kvalues = np.array(IQ4_NL.kvalues, dtype=np.int8)
    return kvalues[_low_high_nibbles(qs)], d.copy().view(np.float16), None


def _iq4_xs(blocks):
    n = blocks.shape[0]
    d, scales_h, scales_l, qs = np.hsplit(blocks, [2, 4, 4 + QK_K // 64])
    low = ((scales_l.reshape((n, -1, 1)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2))) & np.uint8(0x0F))
    high = np.ascontiguousarray(scales_h).view(np.uint16).reshape((n, 1)) >> (2 * np.arange(8, dtype=np.uint16))
    sub = (low.reshape((n, 8)) | ((high.astype(np.uint8) & np.uint8(0x03)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    kvalues = np.array(IQ4_NL.kvalues, dtype=np.int8)
    return kvalues[_low_high_nibbles(qs)], _half(d) * sub.astype(np.float32), None


def _k_scales(blocks):
    """Q4_K/Q5_K: d, dmin and the 8 packed 6-bit (scale, min) pairs -> fp32 scales and offsets."""
    d, dmin, packed = blocks[:, 0:2], blocks[:, 2:4], blocks[:, 4:16]
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(packed))
    return _half(d) * sc.astype(np.float32), -(_half(dmin) * m.astype(np.float32))


def _q4_k(blocks):
    n = blocks.shape[0]
    qs = blocks[:, 16:]
    codes = (qs.reshape((n, -1, 1, 32)) >> _NIBBLE_SHIFTS) & np.uint8(0x0F)
    scales, offsets = _k_scales(blocks)
    return codes.reshape((n, QK_K)), scales, offsets


def _q5_k(blocks):
    n = blocks.shape[0]
    qh, qs = blocks[:, 16 : 16 + QK_K // 8], blocks[:, 16 + QK_K // 8 :]
    low = ((qs.reshape((n, -1, 1, 32)) >> _NIBBLE_SHIFTS) & np.uint8(0x0F)).reshape((n, -1, 32))
    high = ((qh.reshape((n, -1, 1, 32)) >> np.arange(8, dtype=np.uint8).reshape((1, 1, 8, 1))) & np.uint8(1))
    codes = low | (high.reshape((n, -1, 32)) << np.uint8(4))
    scales, offsets = _k_scales(blocks)
    return codes.reshape((n, QK_K)), scales, offsets


def _q6_k(blocks):
    n = blocks.shape[0]
    ql, qh, sub, d = np.hsplit(blocks, [QK_K // 2, QK_K // 2 + QK_K // 4, QK_K // 2 + QK_K // 4 + QK_K // 16])
    low = ((ql.reshape((n, -1, 1, 64)) >> _NIBBLE_SHIFTS) & np.uint8(0x0F)).reshape((n, -1, 32))
    high = ((qh.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1)))
            & np.uint8(0x03)).reshape((n, -1, 32))  # fmt: skip
    codes = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return codes.reshape((n, QK_K)), _half(d) * np.ascontiguousarray(sub).view(np.int8).astype(np.float32), None


def _q3_k(blocks):
    n = blocks.shape[0]
    hmask, qs, packed, d = np.hsplit(blocks, [QK_K // 8, QK_K // 8 + QK_K // 4, QK_K // 8 + QK_K // 4 + 12])
    low_scales, high_scales = np.hsplit(packed, [8])
    low_scales = (low_scales.reshape((n, 1, 8)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 2, 1))).reshape((n, 16))
    high_scales = (high_scales.reshape((n, 1, 4)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 4, 1)))
    sub = (low_scales & np.uint8(0x0F)) | ((high_scales.reshape((n, 16)) & np.uint8(0x03)) << np.uint8(4))
    sub = sub.astype(np.int8) - np.int8(32)
    low = ((qs.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1)))
           .reshape((n, 16, QK_K // 16)) & np.uint8(3))  # fmt: skip
    high = (hmask.reshape((n, -1, 1, 32)) >> np.arange(8, dtype=np.uint8).reshape((1, 1, 8, 1)))
    high = (high.reshape((n, 16, QK_K // 16)) & np.uint8(1)) ^ np.uint8(1)  # a set bit means no -4
    codes = low.astype(np.int8) - (high << np.uint8(2)).astype(np.int8)
    return codes.reshape((n, QK_K)), _half(d) * sub.astype(np.float32), None


def _q2_k(blocks):
    n = blocks.shape[0]
    sub, qs, d, dmin = np.hsplit(blocks, [QK_K // 16, QK_K // 16 + QK_K // 4, QK_K // 16 + QK_K // 4 + 2])
    codes = (qs.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))) & np.uint8(3)
    scales = _half(d) * (sub & np.uint8(0x0F)).astype(np.float32)
    offsets = -(_half(dmin) * (sub >> np.uint8(4)).astype(np.float32))
    return codes.reshape((n, QK_K)), scales, offsets


_UNPACK = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "Q3_K": _q3_k, "Q2_K": _q2_k,
}  # fmt: skip
