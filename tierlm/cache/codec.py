"""How block tensors are encoded in an artifact and decoded for compute.

Each tensor takes the encoding tierlm/cache/encodings.py describes for its mode (INT8 with scales,
INT4 packed nibbles, or a float dtype; norms, biases and routers fp32). A mixed mode is resolved
per tensor before `encode` (quant/mixed.py); each record names its own encoding and group size,
so one artifact may hold several.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

# The record rules are encodings.py's; check_record and the sizes stay importable here too.
from tierlm.cache.encodings import (  # noqa: F401
    check_record,
    int4_fallback,
    keeps_float,
    logical_shape,
    part_bytes,
    record_mode,
    stack_runs,
)
from tierlm.quant.int4 import Int4Weight, int4_on_source_grid, quantize_int4
from tierlm.quant.int8 import Int8Weight, q8_0_on_source_grid, quantize_int8, quantize_q8_0
from tierlm.quant.iq4 import IQ4Weight, quantize_iq4
from tierlm.quant.low_bit_k import LowBitKWeight, quantize_low_bit_k
from tierlm.quant.q4k import Q4KWeight, quantize_q4k
from tierlm.quant.q5 import FiveBitWeight, quantize_q5
from tierlm.quant.q6k import Q6KWeight, quantize_q6k
from tierlm.quant.row_stack import RowStack
from tierlm.quant.modes import (
    GRID_SOURCE_MODE,
    IQ4_NL,
    IQ4_XS,
    MIXED_SOURCE,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    QuantMode,
    int4_fits,
    parse_quant_mode,
)

# Bump when the same inputs would encode to different bytes (2: asym modes carry Q4_0/Q5_x grids
# exactly; 3: mixed:source carries Q8_0 tensors as q8_0; 4: mixed:source carries every GGUF
# type's codes exactly, read from its blocks: tierlm/weights/gguf_carry.py, Q4_K as q4_k; 5: Q2_K
# and Q3_K in their own layouts, weights fused from rows of several types as row stacks).
CODEC_VERSION = 5

parse_mode = parse_quant_mode


def encode(tensor, mode: QuantMode, name: str | None = None) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """fp32 tensor (canonical `name`) -> (encoding name, {part: tensor}, metadata) for
    `ArtifactWriter.add_tensor`."""
    if keeps_float(name, tuple(tensor.shape)):
        return "plain", {"data": tensor.to(torch.float32)}, {}
    if mode.name == MIXED_SOURCE:
        return _encode_on_source_grid(tensor)
    if mode.mixed:
        raise ValueError(f"{mode.name} is chosen per tensor: encode each with its concrete mode")
    if mode.weight_dtype == "stack":  # each run of rows in its own mode (quant/row_stack.py)
        runs, start = [], 0
        for run_mode, rows in mode.rows:
            runs.append((rows, *encode(tensor[start : start + rows], run_mode, name)))
            start += rows
        if start != tensor.shape[0]:
            raise ValueError(f"{mode.name} covers {start} rows, the weight has {tensor.shape[0]}")
        return _stack_record(runs)
    if mode.super_blocks:  # a GGUF type's own layout: a LoRA variant's changed weights of such a base
        return encode_carried(_OWN_LAYOUT_QUANTIZERS[mode.name](tensor))
    if mode.weight_dtype == "int4":
        if int4_fits(tuple(tensor.shape)):
            weight = quantize_int4(tensor, mode.group_size, asymmetric=mode.asymmetric)
            return "int4", weight.tensors(), {"group_size": mode.group_size}
        mode = int4_fallback(mode)
    if mode.half_scales:
        return "int8", quantize_q8_0(tensor).tensors(), {"group_size": mode.group_size}
    if mode.quantized:
        weight = quantize_int8(tensor, mode.group_size, asymmetric=mode.asymmetric)
        return "int8", weight.tensors(), {"group_size": mode.group_size}
    return "plain", {"data": tensor.to(getattr(torch, mode.weight_dtype))}, {}


_OWN_LAYOUT_QUANTIZERS = {
    Q4_K: quantize_q4k, Q6_K: quantize_q6k,
    Q5_0: lambda t: quantize_q5(t, "Q5_0"), Q5_1: lambda t: quantize_q5(t, "Q5_1"), Q5_K: lambda t: quantize_q5(t, "Q5_K"),
    IQ4_NL: lambda t: quantize_iq4(t, "IQ4_NL"), IQ4_XS: lambda t: quantize_iq4(t, "IQ4_XS"),
    Q2_K: lambda t: quantize_low_bit_k(t, "Q2_K"), Q3_K: lambda t: quantize_low_bit_k(t, "Q3_K"),
}  # fmt: skip


def _stack_record(runs) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(rows, encoding, parts, meta) per run as one `stack` record (cache/encodings.py stack_runs)."""
    parts = {f"{i}.{name}": part for i, (_, _, run_parts, _) in enumerate(runs) for name, part in run_parts.items()}
    meta = {"runs": [{"encoding": encoding, "rows": rows, "meta": run_meta} for rows, encoding, _, run_meta in runs]}
    return "stack", parts, meta


def encode_carried(weight) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A weight read from a GGUF's blocks (GgufCheckpoint.read_carried) as `encode` returns it."""
    if isinstance(weight, RowStack):
        return _stack_record([(run.shape[0], *encode_carried(run)) for run in weight.runs])
    if isinstance(weight, Int4Weight):  # a GGUF Q4_0 / Q4_1 run of a row stack
        return "int4", weight.tensors(), {"group_size": weight.group_size}
    if isinstance(weight, Q4KWeight):
        return "q4k", weight.tensors(), {}
    if isinstance(weight, Q6KWeight):
        return "q6k", weight.tensors(), {}
    if isinstance(weight, IQ4Weight):
        return ("iq4x" if weight.superblocks is not None else "iq4"), weight.tensors(), {}
    if isinstance(weight, LowBitKWeight):
        return ("q3k" if weight.highbits is not None else "q2k"), weight.tensors(), {}
    if isinstance(weight, FiveBitWeight):
        return ("q5k" if weight.superblocks is not None else "q5"), weight.tensors(), {}
    return "int8", weight.tensors(), {"group_size": weight.group_size}


def _encode_on_source_grid(tensor):
    """mixed:source: int4-g32 where it holds the tensor exactly (a GGUF Q4_0 source), else
    int4-g32-asym where that does (Q4_1), else q8_0 where that does (Q8_0), else int8-g32-asym
    (exact for Q5_x sources, the closest 8-bit grid for anything else)."""
    for asymmetric in (False, True):
        weight = int4_on_source_grid(tensor, asymmetric=asymmetric)
        if weight is not None:
            return "int4", weight.tensors(), {"group_size": 32}
    carried = q8_0_on_source_grid(tensor)
    if carried is not None:
        return "int8", carried.tensors(), {"group_size": carried.group_size}
    return encode(tensor, parse_quant_mode(GRID_SOURCE_MODE))


def decode(record, parts: Mapping[str, Any], *, device="cpu", dtype=None):
    """Parts read from an artifact -> what the model computes with, on `device`.

    Plain tensors already in the target dtype on the CPU stay views of the block buffer.
    """
    dtype = dtype or torch.float32
    if record.encoding == "stack":
        return RowStack([decode(run, {name: parts[f"{i}.{name}"] for name in run.parts}, device=device, dtype=dtype)
                         for i, run in enumerate(stack_runs(record))], dtype=dtype)  # fmt: skip
    if record.encoding == "int8":
        weight = Int8Weight.from_tensors(parts, record.meta.get("group_size"), dtype=dtype)
        return weight if torch.device(device).type == "cpu" else weight.to(device)
    if record.encoding == "int4":
        weight = Int4Weight.from_tensors(parts, record.meta["group_size"], dtype=dtype)
        return weight if torch.device(device).type == "cpu" else weight.to(device)
    if record.encoding in ("q4k", "q6k", "q5", "q5k", "iq4", "iq4x", "q2k", "q3k"):
        kind = {"q4k": Q4KWeight, "q6k": Q6KWeight, "iq4": IQ4Weight, "iq4x": IQ4Weight, "q2k": LowBitKWeight,
                "q3k": LowBitKWeight}.get(record.encoding, FiveBitWeight)  # fmt: skip
        weight = kind.from_tensors(parts, dtype=dtype)
        return weight if torch.device(device).type == "cpu" else weight.to(device)
    if record.encoding == "plain":
        return parts["data"].to(device=device, dtype=dtype)
    raise ValueError(f"unknown tensor encoding {record.encoding!r}")  # check_record refuses it first
