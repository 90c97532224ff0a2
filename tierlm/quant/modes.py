"""Quant mode names, as the CLI and profiles spell them, parsed into a frozen QuantMode.

    int8          int8 weights, one fp32 scale per output channel (row)
    int8-g<N>     int8 weights, one fp32 scale per group of N input columns (e.g. int8-g128)
    q8_0          GGUF's Q8_0: int8 weights, one fp16 scale per 32 input columns, symmetric
                  (8.5 bits a weight); rounds as llama.cpp does and carries a Q8_0 source as is
    int8-asym, int8-g<N>-asym   the same with a float offset per row/group (zero point): the
                  256 levels span [min, max] instead of [-max|w|, max|w|]. Costs 4 more bytes per
                  group; reproduces GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 sources (groups of 32) bit for bit.
    int4-g<N>     int4 weights (two per byte), one fp16 scale per group of N input columns, N a
                  multiple of 32 (int4-g32, int4-g64, int4-g128): W ~ (u - 8) * s, GGUF Q4_0's form
    int4-g<N>-asym  the same with an fp16 offset per group: W ~ u * s + o, GGUF Q4_1's form.
                  A weight whose input dim is not a multiple of 32 is stored as int8-g32(-asym).
    mixed:SIZE    int8 or int4 chosen per tensor so the weights fit SIZE (e.g. mixed:5.2GiB), the
                  most sensitive tensors kept at 8 bits (tierlm/quant/mixed.py)
    mixed:source  each tensor on the smallest grid that holds its source exactly: a GGUF Q4_0
                  tensor int4-g32, Q4_1 int4-g32-asym, Q8_0 q8_0, the other types in their own
                  layouts (q4_k, ...), a float or unknown grid int8-g32-asym
    q4_k          GGUF's Q4_K as stored (tierlm/quant/q4k.py), 4.625 bits a weight: carried
                  from Q4_K tensors only, never quantized from floats
    q6_k          GGUF's Q6_K as stored (tierlm/quant/q6k.py), 6.5625 bits: likewise
    q5_0, q5_1, q5_k  GGUF's 5-bit types as stored (tierlm/quant/q5.py), 5.5-6 bits: likewise
    iq4_nl, iq4_xs    GGUF's codebook 4-bit types as stored (tierlm/quant/iq4.py): likewise
    q2_k, q3_k    GGUF's 2- and 3-bit K-quants as stored (tierlm/quant/low_bit_k.py), 2.625 and
                  3.4375 bits: likewise
    MODE*ROWS+MODE*ROWS...   a weight fused from rows of several GGUF types, each run of rows in
                  its own type's mode (q4_k*5120+q6_k*1024: a Q4_K q and k with a Q6_K v;
                  tierlm/quant/row_stack.py): what mixed:source stores such a weight in
    fp16 / bf16 / fp32   no quantization: weights stored in that float dtype
    none          the checkpoint's weights as stored, in the compute dtype (`concrete_mode`)
    auto          a concrete mode chosen per model and device by `auto_quant` (the profiles'
                  default): weights already on a quantized grid keep it, float weights get int8

This module is the one list of mode names: profiles, the CLI's help and every error text take
theirs from MODE_NAMES. No torch import here: parsing a profile or `--help` must stay instant.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType

from tierlm.errors import TierlmError
from tierlm.units import parse_size

AUTO = "auto"
AS_STORED = "none"
# The names offered in help and errors; any int8-g<N>[-asym] (N a multiple of 16) parses too.
MODE_NAMES = (AUTO, "int8", "int8-g128", "q8_0", "int8-g32-asym", "int4-g32", "int4-g32-asym", "int4-g128",
              "mixed:SIZE", "fp16", "bf16", "fp32", AS_STORED)
# Canonical names use "-" (artifact names are BASE:QUANT); "mixed:" is how users write them.
MIXED_SOURCE = "mixed-source"
Q8_0, Q8_0_GROUP = "q8_0", 32  # GGUF's Q8_0: int8 and an fp16 scale per 32 columns
Q4_K = "q4_k"  # GGUF's Q4_K: nibbles and per 256 columns fp16 d, dmin and 6-bit sub-scales
Q6_K = "q6_k"  # GGUF's Q6_K: 6-bit codes and per 256 columns fp16 d and 16 int8 sub-scales
Q5_0, Q5_1, Q5_K = "q5_0", "q5_1", "q5_k"  # GGUF's 5-bit types (tierlm/quant/q5.py)
IQ4_NL, IQ4_XS = "iq4_nl", "iq4_xs"  # GGUF's codebook 4-bit types (tierlm/quant/iq4.py)
Q2_K, Q3_K = "q2_k", "q3_k"  # GGUF's 2- and 3-bit K-quants (tierlm/quant/low_bit_k.py)
# The modes that hold a GGUF type's own layout: carried from it, never quantized from floats.
CARRIED_ONLY = MappingProxyType({Q4_K: "Q4_K", Q6_K: "Q6_K", Q5_0: "Q5_0", Q5_1: "Q5_1", Q5_K: "Q5_K",
                                 IQ4_NL: "IQ4_NL", IQ4_XS: "IQ4_XS", Q2_K: "Q2_K", Q3_K: "Q3_K"})  # fmt: skip

_FLOATS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_INT8 = re.compile(r"int8(?:-g(\d+))?(-asym)?")
_INT4 = re.compile(r"int4-g(\d+)(-asym)?")
_INT4_GROUP = 32  # int4 groups are whole packed chunks (quant/int4.py)
# Group sizes are multiples of 16 so every group starts on a full 16-lane vector.
_MIN_GROUP, _MAX_GROUP = 16, 8192


@dataclass(frozen=True)
class QuantMode:
    """How weights are stored: `weight_dtype` is "int8", "int4", "mixed" (a choice per tensor) or
    a float dtype name (torch's spelling).

    `group_size` is None for per-channel int8, for float and mixed modes; `asymmetric` adds
    offsets; `target_bytes` is a mixed mode's size target (None: mixed:source); `half_scales`:
    int8 with fp16 scales (q8_0), else fp32; `super_blocks`: GGUF Q4_K's layout (q4_k); `rows`:
    a stack's (weight_dtype "stack") runs of rows, each (its mode, its row count), in order.
    """

    name: str
    weight_dtype: str
    group_size: int | None = None
    asymmetric: bool = False
    target_bytes: int | None = None
    half_scales: bool = False
    super_blocks: bool = False
    rows: tuple[tuple[QuantMode, int], ...] = ()

    @property
    def quantized(self) -> bool:
        return self.weight_dtype in ("int8", "int4", "mixed", "stack")

    @property
    def mixed(self) -> bool:
        return self.weight_dtype == "mixed"

    @property
    def key(self) -> str:
        """A stable string for content hashes (artifact keys)."""
        return self.name


def parse_quant_mode(name: str) -> QuantMode:
    """`int8`, `int8-g128` (any `int8-g<N>`, N a multiple of 16), `int4-g<N>` (N a multiple of
    32), either with `-asym`, `mixed:SIZE`, `mixed:source`, `fp16`, `bf16` or `fp32`."""
    text = name.strip().lower()
    if text in _FLOATS:
        return QuantMode(text, _FLOATS[text])
    if text == Q8_0:
        return QuantMode(Q8_0, "int8", Q8_0_GROUP, half_scales=True)
    if text == Q4_K:
        return QuantMode(Q4_K, "int4", 32, asymmetric=True, super_blocks=True)
    if text == Q6_K:
        return QuantMode(Q6_K, "int8", 16, super_blocks=True)
    if text in (Q5_0, Q5_1, Q5_K):
        return QuantMode(text, "int8", 32, asymmetric=text != Q5_0, super_blocks=True)
    if text in (IQ4_NL, IQ4_XS):
        return QuantMode(text, "int4", 32, super_blocks=True)
    if text in (Q2_K, Q3_K):
        return QuantMode(text, "int8", 16, asymmetric=text == Q2_K, super_blocks=True)
    if text.startswith(("mixed:", "mixed-")):
        return _mixed_mode(name, text)
    if "*" in text:
        return _stack_mode(name, text)
    int4 = _INT4.fullmatch(text)
    if int4:
        size = int(int4.group(1))
        if size % _INT4_GROUP == 0 and _INT4_GROUP <= size <= _MAX_GROUP:
            return QuantMode(text, "int4", size, bool(int4.group(2)))
        raise TierlmError(
            f"quant mode {name!r} has an unusable group size {size}",
            f"int4 groups are a multiple of {_INT4_GROUP} between {_INT4_GROUP} and {_MAX_GROUP}, e.g. int4-g128",
        )
    int8 = _INT8.fullmatch(text)
    if int8:
        group, asymmetric = int8.group(1), bool(int8.group(2))
        if group is None:
            return QuantMode(text, "int8", None, asymmetric)
        size = int(group)
        if size % 16 == 0 and _MIN_GROUP <= size <= _MAX_GROUP:
            return QuantMode(text, "int8", size, asymmetric)
        raise TierlmError(
            f"quant mode {name!r} has an unusable group size {size}",
            f"use a multiple of 16 between {_MIN_GROUP} and {_MAX_GROUP}, e.g. int8-g128",
        )
    raise TierlmError(f"unknown quant mode {name!r}", f"use one of: {mode_choices()}")


def _stack_mode(name: str, text: str) -> QuantMode:
    """MODE*ROWS+MODE*ROWS...: each run of rows in a mode of its own (never itself a stack)."""
    runs = []
    for run in text.split("+"):
        mode_name, _, count = run.partition("*")
        if not count.isdigit() or int(count) <= 0 or "*" in mode_name:
            raise TierlmError(f"quant mode {name!r}: {run!r} is not MODE*ROWS",
                              "a stack lists runs like q4_k*5120+q6_k*1024")  # fmt: skip
        mode = parse_quant_mode(mode_name)
        if mode.mixed:
            raise TierlmError(f"quant mode {name!r}: a run of rows needs a concrete mode, not {mode_name}")
        runs.append((mode, int(count)))
    return QuantMode("+".join(f"{m.name}*{n}" for m, n in runs), "stack", rows=tuple(runs))


def _mixed_mode(name: str, text: str) -> QuantMode:
    """mixed:source, or mixed:SIZE with SIZE in the profiles' units, canonically named in bytes
    (mixed:5GiB and mixed-5368709120 are one artifact)."""
    target = text[len("mixed:"):].strip()
    if target == "source":
        return QuantMode(MIXED_SOURCE, "mixed")
    try:
        size = parse_size(target, "mixed")
    except TierlmError:
        raise TierlmError(f"quant mode {name!r}: {target!r} is not a size",
                          "write it like mixed:5.2GiB or mixed:800MB, or use mixed:source") from None  # fmt: skip
    if size <= 0:
        raise TierlmError(f"quant mode {name!r}: the size must be positive", "e.g. mixed:5.2GiB")
    return QuantMode(f"mixed-{size}", "mixed", target_bytes=size)


def mode_text(mode: QuantMode) -> str:
    """`mode` as a user writes it: int8, mixed:source, mixed:60MiB, mixed:5.2GiB."""
    if not mode.mixed:
        return mode.name
    if mode.target_bytes is None:
        return "mixed:source"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if mode.target_bytes >= scale:
            return f"mixed:{mode.target_bytes / scale:.2f}".rstrip("0").rstrip(".") + unit
    return f"mixed:{mode.target_bytes}B"


def quant_text(name: str) -> str:
    """A mode name as stored (artifacts, profiles) written as users write it: mixed-83886080 ->
    mixed:80MiB, mixed-source -> mixed:source; a name that is no mode (a dtype) as it is."""
    try:
        return mode_text(parse_quant_mode(name))
    except TierlmError:
        return name


def int4_fits(shape: tuple[int, ...]) -> bool:
    """Whether a 2-D weight of `shape` can be stored as int4 (its input dim a multiple of 32)."""
    return len(shape) == 2 and shape[1] >= _INT4_GROUP and shape[1] % _INT4_GROUP == 0


def mode_choices() -> str:
    """The accepted names as one line, for help and error texts."""
    return (", ".join(MODE_NAMES) + " (int8-g<N>[-asym]: N any multiple of 16; int4-g<N>[-asym]: N a multiple"
            " of 32; mixed:SIZE e.g. mixed:5.2GiB, or mixed:source)")  # fmt: skip


def check_mode_name(name: str) -> str:
    """`name` in its canonical spelling if a profile or --quant may say it (auto, none or a
    concrete mode: lower-cased, a mixed size in bytes)."""
    text = name.strip().lower()
    if text not in (AUTO, AS_STORED):
        mode = parse_quant_mode(text)
        if mode.weight_dtype == "stack":
            raise TierlmError(f"{mode.name} is how mixed:source stores a weight fused from rows of several GGUF "
                              "types; it is no mode to convert with", "use auto (mixed:source) on such a GGUF")  # fmt: skip
        if mode.super_blocks:
            kind = CARRIED_ONLY[mode.name]
            raise TierlmError(f"{mode.name} holds a GGUF's {kind} tensors as they are; it does not quantize "
                              "other weights", f"use auto (mixed:source) on a GGUF with {kind} tensors, or "
                              "int4-g32-asym / int8-g32 to quantize")  # fmt: skip
        return mode.name
    return text


def concrete_mode(name: str, *, accelerator: bool, converted: bool) -> str:
    """A checked mode name (not "auto") with "none" replaced by what it means: weights loaded as
    stored are held in the compute dtype (bf16 on accelerators, fp32 on CPUs); weights that must
    be converted to an artifact (LoRA merged in, or too big to stay resident) are kept in fp32."""
    if name != AS_STORED:
        return name
    return "bf16" if accelerator and not converted else "fp32"


# GGUF tensor types that hold floats; every other type is a quantized grid.
FLOAT_SOURCE_TYPES = frozenset({"F64", "F32", "F16", "BF16"})
# A quantized GGUF source (llama.cpp's groups of 32) keeps its grid: int8-g32-asym reproduces
# Q4_1 and Q8_0 groups exactly and lands on any other 32-column grid with the least fresh
# rounding of the int8 modes (benchmarks/RESULTS.md, INT8 fidelity: 100% top-1 agreement on the
# embedded Q4_1 model, where per-channel int8 degrades it to 95.65%).
GRID_SOURCE_MODE = "int8-g32-asym"
# A source with 4-bit tensors (GGUF Q4_0/Q4_1) keeps them at 4 bits, each tensor on its own grid.
FOUR_BIT_SOURCE_TYPES = frozenset({"Q4_0", "Q4_1"})


# GGUF types mixed:source carries exactly at their own size (tierlm/weights/gguf_carry.py), each
# in the mode that holds it alone: its own layout, q8_0, or int4 for Q4_0/Q4_1.
_OWN_MODES = MappingProxyType({**{kind: mode for mode, kind in CARRIED_ONLY.items()},
                               "Q8_0": Q8_0, "Q4_0": "int4-g32", "Q4_1": "int4-g32-asym"})  # fmt: skip
# `auto` picks mixed:source for a source holding any of these.
CARRIED_SOURCE_TYPES = frozenset(_OWN_MODES)
# Float sources: per-channel int8. In RESULTS.md it is the only int8 mode measured to meet the
# speed targets (decode 0.76x llama.cpp Q8_0, 2.12x tierlm fp32; int8-g32-asym: 0.50x, 1.40x) and
# its perplexity cost (+0.42%) is well inside the +1.5% target. int8-g128 halves that cost (+0.20%)
# but its decode speed is unmeasured there, and the margin on the 0.7x target is only 9%.
FLOAT_SOURCE_MODE = "int8"
# Accelerators keep the mode the shipped profiles always gave them (torch dequantize + GEMM).
ACCELERATOR_MODE = "int8"


def own_mode(kind: str) -> str | None:
    """The mode that holds a GGUF type's tensors alone, each value and no more bytes (q4_k for
    Q4_K, q8_0 for Q8_0, int4-g32(-asym) for Q4_0/Q4_1), or None: the type has none."""
    return _OWN_MODES.get(kind.upper())


def source_grid_mode(source_types: Iterable[str], source_rows: Iterable[int] | None = None) -> str:
    """mixed:source's mode for a weight made of tensors stored as `source_types` (GGUF type names,
    "" where unknown) fused by rows: one carried type's own mode; Q4_0 with Q4_1 int4-g32-asym
    (one int4 form holds both); several carried types, their `source_rows` known, a row stack of
    each run's own mode (`MODE*ROWS+...`, tierlm/quant/row_stack.py); anything else int8-g32-asym."""
    source_types = [kind.upper() for kind in source_types]
    rows = list(source_rows) if source_rows is not None else []
    kinds = set(source_types)
    if len(kinds) == 1 and own_mode(source_types[0]):
        return own_mode(source_types[0])
    if kinds and kinds <= FOUR_BIT_SOURCE_TYPES:
        return "int4-g32-asym"
    if kinds and kinds <= CARRIED_SOURCE_TYPES and len(rows) == len(source_types):
        runs: list[list] = []
        for kind, count in zip(source_types, rows):
            if runs and runs[-1][0] == own_mode(kind):
                runs[-1][1] += count
            else:
                runs.append([own_mode(kind), count])
        return "+".join(f"{mode}*{count}" for mode, count in runs)
    return GRID_SOURCE_MODE


def auto_quant(source_types: Iterable[str] = (), *, accelerator: bool = False) -> str:
    """The concrete mode `auto` means for weights stored as `source_types` (the GGUF tensor types
    an import recorded; empty for a float checkpoint) on an accelerator or a CPU."""
    if accelerator:
        return ACCELERATOR_MODE
    kinds = {kind.upper() for kind in source_types}
    if kinds & CARRIED_SOURCE_TYPES:
        return MIXED_SOURCE
    if kinds - FLOAT_SOURCE_TYPES:
        return GRID_SOURCE_MODE
    return FLOAT_SOURCE_MODE
