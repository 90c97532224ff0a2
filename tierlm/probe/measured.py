"""Measured runs check the planner's prediction, and correct the cached probe when it was wrong.

The probe runs once per machine; taken while the machine was busy it predicts a fraction of the
real speed for every later plan. A measured decode (`tierlm bench`, chat's `/stats`) is compared
with the prediction for the same placement at batch 1, made with the cached figures as they are
now for its path (resident, streamed, MoE: offload/bandwidths.py `decode_path`). Beyond
CORRECTION_RATIO either way, that path's correction becomes the one that would have predicted the
measurement (offload/planner/cost.py `implied_bandwidths`: a slow streamed run blames the tier it
streamed from); other paths' predictions keep theirs. The probe's record keeps when, from what
run, and the figures it replaced. Within it, the run is recorded only (`tierlm plan` shows how far
it was off). So is a run deep in a long context: there attention over the KV cache, which the
probe does not measure (its compute, not only its bytes), takes a share of each step that the
figures must not be bent to explain.
"""

from __future__ import annotations

import time

from tierlm.offload.planner.cost import decode_terms, implied_bandwidths, placement_path, step_seconds
from tierlm.probe.record import record_measured_run

# Run-to-run spread of a decode measurement on a shared machine stays well inside 1.5x; a probe
# taken on a busy machine was off by 15x.
CORRECTION_RATIO = 1.5
MIN_DECODE_STEPS = 8  # fewer steps time mostly the first step's warm-up, not the model
# A run whose predicted step is more than this share KV-cache reading corrects nothing.
MAX_KV_SHARE = 0.25


def note_measured_decode(loaded, profile, tokens_per_s: float, steps: int, source: str, position: int = 0) -> dict | None:
    """Record a measured decode speed of `loaded` (at batch 1, over `steps` steps, attending over
    `position` positions on average) in the probe cache, correcting the cached figures when the
    prediction was off by more than CORRECTION_RATIO. Returns the recorded run (with
    "corrected"), or None when there is nothing to compare: no plan, too few steps, or no cached
    probe."""
    if loaded.placement is None or loaded.sizes is None or steps < MIN_DECODE_STEPS or tokens_per_s <= 0:
        return None
    record = record_measured_run(
        loaded.device, lambda figures: assess(loaded, profile, figures, tokens_per_s, source, position))
    return record.last_run if record is not None else None


def assess(loaded, profile, bandwidths, tokens_per_s: float, source: str, position: int = 0):
    """(the run as the probe records it, `bandwidths` with its path's correction replaced or None)
    for a measured speed at `position` (the KV cache a step reads is part of the prediction)."""
    accelerator = loaded.device.type != "cpu"
    path = placement_path(loaded.placement)
    terms = decode_terms(loaded.config, loaded.sizes, profile, bandwidths, loaded.placement, accelerator=accelerator,
                         position=position)  # fmt: skip
    predicted_s, limit = step_seconds(terms, profile.prefetch_depth)
    measured_s = 1.0 / tokens_per_s
    run = {"source": source, "measured_tok_s": tokens_per_s, "predicted_tok_s": 1.0 / predicted_s, "limit": limit,
           "path": path, "position": position}  # fmt: skip
    if 1 / CORRECTION_RATIO <= predicted_s / measured_s <= CORRECTION_RATIO:
        return run, None
    if position:
        start = decode_terms(loaded.config, loaded.sizes, profile, bandwidths, loaded.placement, accelerator=accelerator)
        if 1 - step_seconds(start, profile.prefetch_depth)[0] / predicted_s > MAX_KV_SHARE:
            return run, None
    fitted = implied_bandwidths(bandwidths.for_path(path), terms, measured_s, accelerator=accelerator,
                                prefetch_depth=profile.prefetch_depth)  # fmt: skip
    return run, bandwidths.corrected(path, fitted, source, time.time())
