"""`mixed:SIZE`'s choice of int8 or int4 per weight, measured while converting.

Two passes over the source, one block at a time (the model is never held in float as a whole):

1. Activation statistics. The model runs one forward over `CALIBRATION_TOKENS` tokens of a
   calibration text (CPython's pydoc topics, shipped with Python itself; taken from the end of
   the text, so the fidelity benchmark, which scores its beginning, never sees them) on a
   `CalibrationStore`: each block is built from the source when the forward asks for it and
   dropped after, and every 2-D weight records the mean square of each input column it met
   (and the embedding how often each token was looked up).
2. Damage. Each weight is quantized in every option of `quant.mixed.OPTIONS`; an option's damage
   is its squared error weighted by those column statistics (quant/mixed.py says why).

`quant.mixed.allocate` then picks the options within the size target. Where the forward cannot
run (a family whose layers use their weights in ways the recorder does not follow), the damage is
weighted by weights alone and the manifest says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tierlm.cache import codec
from tierlm.progress import Progress
from tierlm.quant import mixed
from tierlm.quant.modes import QuantMode, parse_quant_mode

CALIBRATION_TOKENS = 512
SAMPLE_ROWS = 2048  # rows of a weight whose quantization error is measured (module doc)
ACTIVATIONS = "activations"  # the manifest's word for a measured choice
WEIGHTS_ONLY = "weights only"
# The calibration forward (tierlm/store/calibration.py `activation_stats`, which runs the model, so
# the conversion is handed it): (config, model_dir, layout, tensor_for, progress) -> "block/tensor" -> stats.
Calibrate = Callable[..., Mapping]


@dataclass(frozen=True)
class MixedChoice:
    """The per-weight modes ("block/tensor" -> mode name) and how their damage was weighed."""

    modes: Mapping[str, str]
    sensitivity: str  # ACTIVATIONS (with the token count) or WEIGHTS_ONLY (with the reason)


def choose_modes(config, model_dir, layout, tensor_for, mode: QuantMode, part_bytes: Callable,
                 block_padding: int = 0, calibrate: Calibrate | None = None,
                 calibrating: Progress | None = None, choosing: Progress | None = None) -> MixedChoice:  # fmt: skip
    """The modes `mode` (mixed:SIZE) gives each 2-D weight of `layout` (block -> {tensor:
    sources}); `tensor_for(block, name, sources)` makes its fp32 tensor; `part_bytes(shape,
    mode, name) -> int` its stored bytes; `block_padding` the most a block's alignment adds;
    `calibrate` runs the calibration forward (None: damage weighted by weights alone), reporting
    to `calibrating`; `choosing` counts the weights whose options are measured."""
    if calibrate is None:
        stats, how = {}, f"{WEIGHTS_ONLY} (no calibration forward was asked for)"
    else:
        try:
            stats = calibrate(config, model_dir, layout, tensor_for, calibrating)
            how = f"{ACTIVATIONS} ({CALIBRATION_TOKENS} tokens)"
        except Exception as err:  # noqa: BLE001 - any failure of the calibration forward: weigh by weights
            stats, how = {}, f"{WEIGHTS_ONLY} (the calibration forward failed: {type(err).__name__})"
    entries = _distinct_entries(layout)
    report = choosing or (lambda done, total: None)
    candidates, fixed = [], block_padding * len(layout)
    for done, (block, name, sources) in enumerate(entries):
        report(done, len(entries))
        tensor = tensor_for(block, name, sources)
        if codec.keeps_float(name, tuple(tensor.shape)):
            fixed += part_bytes(tuple(tensor.shape), mode, name)
            continue
        key = f"{block}/{name}"
        candidates.append(_candidate(key, tensor, stats.get(key), part_bytes))
        del tensor
    report(len(entries), len(entries))
    chosen = mixed.allocate(candidates, mode.target_bytes - fixed)
    return MixedChoice(chosen, how)


def _distinct_entries(layout) -> list[tuple[str, str, tuple[str, ...]]]:
    """(block, tensor, sources) of `layout` in order, a tied head left out (the embedding's tensor)."""
    out, seen = [], set()
    for block, entries in layout.items():
        for name, sources in entries.items():
            if sources not in seen:
                seen.add(sources)
                out.append((block, name, sources))
    return out


def _candidate(key: str, tensor: torch.Tensor, stats, part_bytes) -> mixed.Candidate:
    """Bytes and squared error of each option for one weight [out, in], weighted by `stats`
    (column weights, row weights) where measured, else uniformly.

    Groups lie within rows, so each row's error is its own: the column-weighted error is measured
    on every k-th row (at most `SAMPLE_ROWS` of them) and scaled by k, the row-weighted one on
    the rows the text looked up."""
    shape = tuple(tensor.shape)
    columns, rows = stats if stats is not None else (torch.ones(shape[1]), None)
    stride = -(-shape[0] // SAMPLE_ROWS)
    sampled = tensor[::stride].contiguous()
    used = rows.nonzero().squeeze(1) if rows is not None else None
    sizes, damage = {}, {}
    for option in mixed.OPTIONS:
        option_mode = parse_quant_mode(option)
        sizes[option] = part_bytes(shape, option_mode, None)
        total = 0.0
        if columns is not None:  # output error of a linear use
            total += stride * float((_squared_error(sampled, option_mode) @ columns).sum())
        if used is not None and used.numel():  # hidden-state error of the lookups
            total += float(rows[used] @ _squared_error(tensor[used], option_mode).sum(1))
        damage[option] = total
    return mixed.Candidate(key, sizes, damage)


def _squared_error(weight: torch.Tensor, mode: QuantMode) -> torch.Tensor:
    """(stored - weight)^2 elementwise for `weight` stored in the concrete `mode`."""
    encoding, parts, meta = codec.encode(weight, mode)
    return (codec.decode(_Record(encoding, meta), parts).dequantize() - weight).square_()


@dataclass(frozen=True)
class _Record:
    """What `codec.decode` reads of a record: its encoding and metadata."""

    encoding: str
    meta: Mapping
