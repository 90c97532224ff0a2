"""How block tensors are encoded in an artifact and decoded for compute.

2-D weights (projections, embedding, head) take the quant mode's format: INT8 with scales (and
offsets when asymmetric), INT4 packed nibbles with fp16 scales (and offsets), or a float dtype.
A mixed mode is resolved per tensor before `encode` (quant/mixed.py); each record names its own
encoding and group size, so one artifact may hold several. 1-D tensors (norms, biases) always stay fp32: they
are tiny and precision-critical. So do the 2-D weights named in `FLOAT_WEIGHTS`.
"""

from __future__ import annotations

from typing import Any, Mapping

from tierlm.quant.modes import GRID_SOURCE_MODE, MIXED_SOURCE, QuantMode, parse_quant_mode

CODEC_VERSION = 2  # bump when the same inputs would encode to different bytes (2: asym modes carry Q4_0/Q5_x grids exactly)
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
# encoding -> (parts it must have, parts it may have)
ENCODINGS = {"plain": ({"data"}, set()), "int8": ({"qweight", "scales"}, {"offsets"}),
             "int4": ({"packed", "scales"}, {"offsets"})}  # fmt: skip

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
    if mode.name == MIXED_SOURCE:
        return _encode_on_source_grid(tensor)
    if mode.mixed:
        raise ValueError(f"{mode.name} is chosen per tensor: encode each with its concrete mode")
    if mode.weight_dtype == "int4":
        from tierlm.quant.int4 import int4_fits, quantize_int4

        if int4_fits(tuple(tensor.shape)):
            weight = quantize_int4(tensor, mode.group_size, asymmetric=mode.asymmetric)
            return "int4", weight.tensors(), {"group_size": mode.group_size}
        mode = int4_fallback(mode)
    if mode.quantized:
        from tierlm.quant.int8 import quantize_int8

        weight = quantize_int8(tensor, mode.group_size, asymmetric=mode.asymmetric)
        return "int8", weight.tensors(), {"group_size": mode.group_size}
    return "plain", {"data": tensor.to(getattr(torch, mode.weight_dtype))}, {}


_FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def part_bytes(shape: tuple[int, ...], mode: QuantMode, name: str | None = None) -> list[int]:
    """Bytes of each part `encode` writes for a tensor of `shape` (canonical `name`) in the
    concrete `mode`, in order."""
    elements = 1
    for dim in shape:
        elements *= dim
    if keeps_float(name, shape):
        return [elements * 4]  # norms, biases and routers stay fp32
    if mode.mixed:
        raise ValueError(f"{mode.name} is chosen per tensor: size each with its concrete mode")
    out_features, in_features = shape
    if mode.weight_dtype == "int4":
        from tierlm.quant.int4 import int4_fits

        if int4_fits(shape):
            groups = -(-in_features // mode.group_size)
            return [elements // 2, *[out_features * groups * 2] * (2 if mode.asymmetric else 1)]  # fp16
        mode = int4_fallback(mode)
    if not mode.quantized:
        return [elements * _FLOAT_BYTES[mode.weight_dtype]]
    groups = 1 if mode.group_size is None else -(-in_features // mode.group_size)
    return [elements, *[out_features * groups * 4] * (2 if mode.asymmetric else 1)]  # int8, fp32 scales


def _encode_on_source_grid(tensor):
    """mixed:source: int4-g32 where it holds the tensor exactly (a GGUF Q4_0 source), else
    int4-g32-asym where that does (Q4_1), else int8-g32-asym (exact for Q5_x and Q8_0 sources,
    the closest 8-bit grid for anything else)."""
    from tierlm.quant.int4 import int4_on_source_grid

    for asymmetric in (False, True):
        weight = int4_on_source_grid(tensor, asymmetric=asymmetric)
        if weight is not None:
            return "int4", weight.tensors(), {"group_size": 32}
    return encode(tensor, parse_quant_mode(GRID_SOURCE_MODE))


def int4_fallback(mode: QuantMode) -> QuantMode:
    """The int8 mode an int4 mode stores a weight in whose input dim is no multiple of 32."""
    return parse_quant_mode("int8-g32-asym" if mode.asymmetric else "int8-g32")


def record_mode(record) -> str:
    """The concrete quant mode a quantized record was stored in ("int4-g32-asym", "int8", ...)."""
    group = record.meta.get("group_size")
    asym = "-asym" if "offsets" in record.parts else ""
    if record.encoding in ("int4", "int8"):
        return f"{record.encoding}{'' if group is None else f'-g{group}'}{asym}"
    return record.parts["data"].dtype


def logical_shape(record) -> tuple[int, ...]:
    """The [out, in] (or 1-D) shape a record decodes to, whatever its encoding packs."""
    if record.encoding == "int4":
        rows, half = record.parts["packed"].shape
        return rows, 2 * half
    return tuple(record.parts["qweight" if record.encoding == "int8" else "data"].shape)


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
    if record.encoding == "int4":
        from tierlm.quant.int4 import Int4Weight

        weight = Int4Weight.from_tensors(parts, record.meta["group_size"], dtype=dtype)
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
    if record.encoding == "int4":
        return _int4_problem(record, shape)
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


def _int4_problem(record, shape) -> str | None:
    packed, group = record.parts["packed"], record.meta.get("group_size")
    if packed.dtype != "uint8" or len(packed.shape) != 2 or packed.shape[1] < 16 or packed.shape[1] % 16:
        return f"packed is {packed.dtype}{list(packed.shape)}, expected 2-D uint8 of whole 16-byte chunks"
    if not isinstance(group, int) or isinstance(group, bool) or group < 32 or group % 32:
        return f"int4 group_size {group!r} is not a positive multiple of 32"
    rows, columns = packed.shape[0], 2 * packed.shape[1]
    want = (rows, -(-columns // group))
    for part in [record.parts["scales"]] + ([record.parts["offsets"]] if "offsets" in record.parts else []):
        if part.dtype != "float16" or tuple(part.shape) != want:
            return f"int4 scales/offsets are {part.dtype}{list(part.shape)}, expected float16 {list(want)}"
    return _shape_problem((rows, columns), shape)


def _shape_problem(actual, expected) -> str | None:
    if expected is not None and tuple(actual) != tuple(expected):
        return f"shape {list(actual)}, config.json implies {list(expected)}"
    return None
