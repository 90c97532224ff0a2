"""How block tensors are encoded in an artifact and decoded for compute.

2-D weights (projections, embedding, head) take the quant mode's format: INT8 with scales (and
offsets when asymmetric), or a float dtype. 1-D tensors (norms, biases) always stay fp32: they
are tiny and precision-critical. So do the 2-D weights named in `FLOAT_WEIGHTS`.
"""

from __future__ import annotations

from typing import Any, Mapping

from tierlm.quant.modes import QuantMode, parse_quant_mode

CODEC_VERSION = 2  # bump when the same inputs would encode to different bytes (2: asym modes carry Q4_0/Q5_x grids exactly)
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
# encoding -> (parts it must have, parts it may have)
ENCODINGS = {"plain": ({"data"}, set()), "int8": ({"qweight", "scales"}, {"offsets"})}

# Canonical names of 2-D weights kept in fp32 under every mode: an MoE router's near-tied logits
# choose experts, and an error that flips one changes the token (llama.cpp keeps ffn_gate_inp in F32).
FLOAT_WEIGHTS = frozenset({"router", "shared_gate"})

parse_mode = parse_quant_mode


def keeps_float(name: str | None, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of canonical `name` and `shape` is stored in fp32 whatever the mode."""
    return len(shape) != 2 or name in FLOAT_WEIGHTS


def encode(tensor, mode: QuantMode, name: str | None = None) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """fp32 tensor (canonical `name`) -> (encoding name, {part: tensor}, metadata) for
    `ArtifactWriter.add_tensor`."""
    import torch

    if keeps_float(name, tuple(tensor.shape)):
        return "plain", {"data": tensor.to(torch.float32)}, {}
    if mode.quantized:
        from tierlm.quant.int8 import quantize_int8

        weight = quantize_int8(tensor, mode.group_size, asymmetric=mode.asymmetric)
        return "int8", weight.tensors(), {"group_size": mode.group_size}
    return "plain", {"data": tensor.to(getattr(torch, mode.weight_dtype))}, {}


def decode(record, parts: Mapping[str, Any], *, device="cpu", dtype=None):
    """Parts read from an artifact -> what the model computes with, on `device`.

    Plain tensors already in the target dtype on the CPU stay views of the block buffer.
    """
    import torch

    dtype = dtype or torch.float32
    if record.encoding == "int8":
        from tierlm.quant.int8 import Int8Weight

        weight = Int8Weight.from_tensors(parts, record.meta.get("group_size"), dtype=dtype)
        return weight if torch.device(device).type == "cpu" else weight.to(device)
    if record.encoding == "plain":
        return parts["data"].to(device=device, dtype=dtype)
    raise ValueError(f"unknown tensor encoding {record.encoding!r}")  # check_record refuses it first


def check_record(record, shape: tuple[int, ...] | None = None) -> str | None:
    """Why `decode` could not turn `record` (an artifact's TensorRecord) into a tensor of
    `shape` (None: any shape), or None when it can. Manifests are checked with it on open."""
    if record.encoding not in ENCODINGS:
        return f"unknown encoding {record.encoding!r}"
    required, optional = ENCODINGS[record.encoding]
    names = set(record.parts)
    if not required <= names <= required | optional:
        return f"{record.encoding} tensor has parts {sorted(names)}, expected {sorted(required)}"
    if record.encoding == "plain":
        data = record.parts["data"]
        if data.dtype not in FLOAT_DTYPES:
            return f"plain tensor stored as {data.dtype}, expected one of {', '.join(FLOAT_DTYPES)}"
        return _shape_problem(data.shape, shape)
    return _int8_problem(record, shape)


def _int8_problem(record, shape) -> str | None:
    qweight, scales = record.parts["qweight"], record.parts["scales"]
    group = record.meta.get("group_size")
    if qweight.dtype != "int8" or len(qweight.shape) != 2:
        return f"qweight is {qweight.dtype}{list(qweight.shape)}, expected 2-D int8"
    if group is not None and (not isinstance(group, int) or isinstance(group, bool) or group < 1):
        return f"group_size {group!r} is not a positive integer"
    rows, columns = qweight.shape
    want = (rows,) if group is None else (rows, -(-columns // group))
    for part in [scales] + ([record.parts["offsets"]] if "offsets" in record.parts else []):
        if part.dtype not in FLOAT_DTYPES or tuple(part.shape) != want:
            return f"scales/offsets are {part.dtype}{list(part.shape)}, expected float {list(want)}"
    return _shape_problem(qweight.shape, shape)


def _shape_problem(actual, expected) -> str | None:
    if expected is not None and tuple(actual) != tuple(expected):
        return f"shape {list(actual)}, config.json implies {list(expected)}"
    return None
