"""What each stored encoding of a block tensor holds and costs: its parts, their bytes, the checks
a manifest's records must pass, and which weights stay float.

2-D weights (projections, embedding, head) take the quant mode's format: INT8 with scales (and
offsets when asymmetric), INT4 packed nibbles with fp16 scales (and offsets), or a float dtype.
1-D tensors (norms, biases) always stay fp32: they are tiny and precision-critical. So do the 2-D
weights named in `FLOAT_WEIGHTS`. No torch here: the planner sizes an artifact and a manifest is
validated with these rules alone; tierlm/cache/codec.py encodes and decodes the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierlm.quant.modes import (
    IQ4_NL,
    IQ4_XS,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    Q8_0_GROUP,
    Q2_K,
    Q3_K,
    QuantMode,
    int4_fits,
    parse_quant_mode,
)

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
# encoding -> (parts it must have, parts it may have)
ENCODINGS = {"plain": ({"data"}, set()), "int8": ({"qweight", "scales"}, {"offsets"}),
             "int4": ({"packed", "scales"}, {"offsets"}), "q4k": ({"packed", "superblocks"}, set()),
             "q6k": ({"packed", "high", "superblocks"}, set()), "q5": ({"codes", "scales"}, {"offsets"}),
             "q5k": ({"codes", "superblocks"}, set()), "iq4": ({"packed", "scales"}, set()),
             "iq4x": ({"packed", "superblocks"}, set()), "q2k": ({"crumbs", "superblocks"}, set()),
             "q3k": ({"crumbs", "highbits", "superblocks"}, set())}  # fmt: skip
# Bytes per 256 columns of the super-blocks: q4k (GGUF Q4_K, quant/q4k.py) fp16 d and dmin, 8
# sub-scales, 8 sub-mins; q6k (GGUF Q6_K, quant/q6k.py) fp16 d and 16 int8 sub-scales.
# q2k/q3k (GGUF Q2_K/Q3_K, quant/low_bit_k.py): fp16 d, dmin and 16 bytes of sub-scales and mins;
# fp16 d and 12 bytes of 6-bit sub-scales.
SUPER_COLUMNS, SUPER_BYTES = 256, {"q4k": 20, "q6k": 18, "q5k": 20, "iq4x": 10, "q2k": 20, "q3k": 14}
FIVE_BIT_CHUNK = 20  # q5, q5k (GGUF Q5_0/Q5_1/Q5_K, quant/q5.py): per 32 columns 16 nibble bytes, 4 high-bit bytes

# Canonical names of 2-D weights kept in fp32 under every mode: an MoE router's near-tied logits
# choose experts, and an error that flips one changes the token (llama.cpp keeps ffn_gate_inp in F32).
FLOAT_WEIGHTS = frozenset({"router", "shared_gate"})


def keeps_float(name: str | None, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of canonical `name` and `shape` is stored in fp32 whatever the mode."""
    return len(shape) != 2 or name in FLOAT_WEIGHTS


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
    if mode.weight_dtype == "stack":
        if sum(rows for _, rows in mode.rows) != out_features:
            raise ValueError(f"{mode.name} covers {sum(r for _, r in mode.rows)} rows, the weight has {out_features}")
        return [part for run, rows in mode.rows for part in part_bytes((rows, in_features), run, name)]
    if mode.name == Q4_K:
        return [elements // 2, out_features * (in_features // SUPER_COLUMNS) * SUPER_BYTES["q4k"]]
    if mode.name == Q6_K:
        return [elements // 2, elements // 4, out_features * (in_features // SUPER_COLUMNS) * SUPER_BYTES["q6k"]]
    if mode.name == IQ4_NL:
        return [elements // 2, elements // 32 * 2]
    if mode.name in (Q2_K, Q3_K):
        superblocks = out_features * (in_features // SUPER_COLUMNS) * SUPER_BYTES["q2k" if mode.name == Q2_K else "q3k"]
        return [elements // 4, superblocks] if mode.name == Q2_K else [elements // 4, elements // 8, superblocks]
    if mode.name == IQ4_XS:
        return [elements // 2, out_features * (in_features // SUPER_COLUMNS) * SUPER_BYTES["iq4x"]]
    if mode.name in (Q5_0, Q5_1, Q5_K):
        codes = elements // 32 * FIVE_BIT_CHUNK
        if mode.name == Q5_K:
            return [codes, out_features * (in_features // SUPER_COLUMNS) * SUPER_BYTES["q5k"]]
        return [codes, *[elements // 32 * 2] * (2 if mode.name == Q5_1 else 1)]
    if mode.weight_dtype == "int4":
        if int4_fits(shape):
            groups = -(-in_features // mode.group_size)
            return [elements // 2, *[out_features * groups * 2] * (2 if mode.asymmetric else 1)]  # fp16
        mode = int4_fallback(mode)
    if not mode.quantized:
        return [elements * _FLOAT_BYTES[mode.weight_dtype]]
    groups = 1 if mode.group_size is None else -(-in_features // mode.group_size)
    scale_bytes = 2 if mode.half_scales else 4  # q8_0: fp16 scales
    return [elements, *[out_features * groups * scale_bytes] * (2 if mode.asymmetric else 1)]


def int4_fallback(mode: QuantMode) -> QuantMode:
    """The int8 mode an int4 mode stores a weight in whose input dim is no multiple of 32."""
    return parse_quant_mode("int8-g32-asym" if mode.asymmetric else "int8-g32")


@dataclass(frozen=True)
class StackRun:
    """One run of rows of a `stack` record, read as a record of its own: its encoding, its parts
    (their names without the run's "i." prefix) and its meta."""

    encoding: str
    parts: dict[str, Any]
    meta: dict[str, Any]
    rows: int


def stack_runs(record) -> list[StackRun]:
    """A `stack` record's runs (tierlm/quant/row_stack.py): meta["runs"] lists each one's
    encoding, rows and meta; its parts are named "i.<part>". ValueError if malformed."""
    runs = record.meta.get("runs")
    if not isinstance(runs, list) or len(runs) < 2:
        raise ValueError("a stack needs a list of at least two runs in its meta")
    out = []
    for i, run in enumerate(runs):
        if not isinstance(run, dict) or run.get("encoding") in (None, "stack", "plain") or \
                not isinstance(run.get("rows"), int) or run["rows"] <= 0:  # fmt: skip
            raise ValueError(f"run {i} is {run!r}, expected a quantized encoding and a positive row count")
        prefix = f"{i}."
        parts = {name[len(prefix):]: part for name, part in record.parts.items() if name.startswith(prefix)}
        out.append(StackRun(run["encoding"], parts, dict(run.get("meta") or {}), run["rows"]))
    if sum(len(run.parts) for run in out) != len(record.parts):
        raise ValueError(f"parts {sorted(record.parts)} are not all named after a run")
    return out


def record_mode(record) -> str:
    """The concrete quant mode a quantized record was stored in ("int4-g32-asym", "int8", ...)."""
    if record.encoding == "stack":
        return "+".join(f"{record_mode(run)}*{run.rows}" for run in stack_runs(record))
    group = record.meta.get("group_size")
    asym = "-asym" if "offsets" in record.parts else ""
    if record.encoding == "q4k":
        return Q4_K
    if record.encoding == "q6k":
        return Q6_K
    if record.encoding == "q5k":
        return Q5_K
    if record.encoding in ("iq4", "iq4x"):
        return IQ4_NL if record.encoding == "iq4" else IQ4_XS
    if record.encoding in ("q2k", "q3k"):
        return Q2_K if record.encoding == "q2k" else Q3_K
    if record.encoding == "q5":
        return Q5_1 if "offsets" in record.parts else Q5_0
    if record.encoding == "int8" and group == Q8_0_GROUP and not asym and record.parts["scales"].dtype == "float16":
        return Q8_0  # int8-g32 with fp16 scales
    if record.encoding in ("int4", "int8"):
        return f"{record.encoding}{'' if group is None else f'-g{group}'}{asym}"
    return record.parts["data"].dtype


def logical_shape(record) -> tuple[int, ...]:
    """The [out, in] (or 1-D) shape a record decodes to, whatever its encoding packs."""
    if record.encoding == "stack":
        runs = stack_runs(record)
        return sum(run.rows for run in runs), logical_shape(runs[0])[1]
    if record.encoding in ("int4", "q4k", "q6k", "iq4", "iq4x"):
        rows, half = record.parts["packed"].shape
        return rows, 2 * half
    if record.encoding in ("q5", "q5k"):
        rows, width = record.parts["codes"].shape
        return rows, width // FIVE_BIT_CHUNK * 32
    if record.encoding in ("q2k", "q3k"):
        rows, width = record.parts["crumbs"].shape
        return rows, 4 * width
    return tuple(record.parts["qweight" if record.encoding == "int8" else "data"].shape)


def check_record(record, shape: tuple[int, ...] | None = None) -> str | None:
    """Why `decode` could not turn `record` (an artifact's TensorRecord) into a tensor of
    `shape` (None: any shape), or None when it can. Manifests are checked with it on open."""
    if record.encoding == "stack":
        return _stack_problem(record, shape)
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
    if record.encoding in ("q5", "q5k"):
        return _five_bit_problem(record, shape)
    if record.encoding == "iq4":
        return _iq4_problem(record, shape)
    if record.encoding in SUPER_BYTES:
        return _super_block_problem(record, shape)
    return _int8_problem(record, shape)


def _stack_problem(record, shape) -> str | None:
    """A stack record: well-formed runs, each a valid record of the same width, rows adding up."""
    try:
        runs = stack_runs(record)
    except ValueError as err:
        return f"stack: {err}"
    width = None
    for i, run in enumerate(runs):
        problem = check_record(run)
        if problem is None:
            rows, columns = logical_shape(run)
            if rows != run.rows:
                problem = f"holds {rows} rows, its meta says {run.rows}"
            elif width not in (None, columns):
                problem = f"is {columns} columns wide, run 0 is {width}"
            width = columns
        if problem is not None:
            return f"stack run {i}: {problem}"
    return _shape_problem((sum(run.rows for run in runs), width), shape)


def _iq4_problem(record, shape) -> str | None:
    """An iq4 record (GGUF IQ4_NL): nibbles of whole 32-column groups, an fp16 scale per group."""
    packed, scales = record.parts["packed"], record.parts["scales"]
    if packed.dtype != "uint8" or len(packed.shape) != 2 or (2 * packed.shape[1]) % 32:
        return f"packed is {packed.dtype}{list(packed.shape)}, expected 2-D uint8 of whole 32-column groups"
    rows, columns = packed.shape[0], 2 * packed.shape[1]
    if scales.dtype != "float16" or tuple(scales.shape) != (rows, columns // 32):
        return f"scales are {scales.dtype}{list(scales.shape)}, expected float16 {[rows, columns // 32]}"
    return _shape_problem((rows, columns), shape)


def _five_bit_problem(record, shape) -> str | None:
    """A q5 or q5k record: whole 20-byte chunks; fp16 scales (offsets) per 32 columns, or
    super-blocks per 256."""
    codes = record.parts["codes"]
    if codes.dtype != "uint8" or len(codes.shape) != 2 or codes.shape[1] % FIVE_BIT_CHUNK:
        return f"codes are {codes.dtype}{list(codes.shape)}, expected 2-D uint8 of whole 20-byte chunks"
    rows, columns = codes.shape[0], codes.shape[1] // FIVE_BIT_CHUNK * 32
    if record.encoding == "q5k":
        want = (rows, columns // SUPER_COLUMNS * SUPER_BYTES["q5k"])
        blocks = record.parts["superblocks"]
        if columns % SUPER_COLUMNS or blocks.dtype != "uint8" or tuple(blocks.shape) != want:
            return f"superblocks are {blocks.dtype}{list(blocks.shape)}, expected uint8 {list(want)}"
    for name in ("scales", "offsets"):
        part = record.parts.get(name) if record.encoding == "q5" else None
        if part is not None and (part.dtype != "float16" or tuple(part.shape) != (rows, columns // 32)):
            return f"{name} are {part.dtype}{list(part.shape)}, expected float16 {[rows, columns // 32]}"
    return _shape_problem((rows, columns), shape)


# The part of each super-block layout that holds the codes' low bits, and columns per byte of it.
_CODE_PARTS = {"q4k": ("packed", 2), "q6k": ("packed", 2), "iq4x": ("packed", 2), "q2k": ("crumbs", 4),
               "q3k": ("crumbs", 4)}  # fmt: skip


def _super_block_problem(record, shape) -> str | None:
    """A q4k, q6k, q2k or q3k record: whole 256-column blocks, every part the width its layout
    implies (q6k's `high` 2 bits a column, q3k's `highbits` 1)."""
    name, per_byte = _CODE_PARTS[record.encoding]
    codes = record.parts[name]
    if codes.dtype != "uint8" or len(codes.shape) != 2 or (per_byte * codes.shape[1]) % SUPER_COLUMNS:
        return f"{name} is {codes.dtype}{list(codes.shape)}, expected 2-D uint8 of whole 256-column blocks"
    rows, columns = codes.shape[0], per_byte * codes.shape[1]
    widths = {"superblocks": columns // SUPER_COLUMNS * SUPER_BYTES[record.encoding], "high": columns // 4,
              "highbits": columns // 8}  # fmt: skip
    for name, part in record.parts.items():
        if name in widths and (part.dtype != "uint8" or tuple(part.shape) != (rows, widths[name])):
            return f"{name} are {part.dtype}{list(part.shape)}, expected uint8 {[rows, widths[name]]}"
    return _shape_problem((rows, columns), shape)


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
