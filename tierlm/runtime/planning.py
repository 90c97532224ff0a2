"""What a load would do, without loading: `tierlm plan` and `show` read these, as the loader's
own steps (runtime/loader.py) compute them.

The baseline charged is the loader's (probe/baseline.py), from a process in the state a session
is in when it loads: tokenizer loaded, the model's family imported, INT8 kernels calibrated. So
under a tight profile the plan streams the blocks the real load streams.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path


from tierlm.device.resolve import compute_dtype, resolve_device
from tierlm.errors import TierlmError
from tierlm.lora.spec import parse_lora_spec, split_variant_specs
from tierlm.offload.placement import Placement
from tierlm.offload.planner.search import resident_mixed_size
from tierlm.offload.stage_planner import Link, StagePlan, least_stages, split_stages
from tierlm.probe.machine import load_bandwidths, load_probe
from tierlm.probe.record import ProbeRecord
from tierlm.runtime.loader import (
    Budget,
    Planned,
    WeightSource,
    convert_source,
    expected_sizes,
    plan_load,
    read_budget,
    requested_quant,
    resolve_source,
)
from tierlm.runtime.session import plan_with_variants, variant_base_artifact
from tierlm.runtime.tokenizer import Tokenizer
from tierlm.store.variants import overlay_for


@dataclass(frozen=True)
class LoadPlan:
    """The placement a load of one model would make, with what it was made from."""

    source: WeightSource
    budget: Budget
    planned: Planned
    placement: Placement  # planned.placement with the variants beside the base and the resident mixed size
    variant_whys: dict[str, str]  # variant name -> why it is held merged or unmerged
    probe: ProbeRecord | None  # the record the bandwidths came from, for its age


@dataclass(frozen=True)
class StageLoadPlan:
    """The stages a pipeline's ranks would load, each planned as its rank's load plans it."""

    source: WeightSource
    budget: Budget  # rank 0's (every rank is assumed alike this machine)
    planned: StagePlan
    probe: ProbeRecord | None


def plan_model(model_dir: Path, profile, quant: str | None = None, device: str | None = None, loras=()) -> LoadPlan:
    """The plan for `model_dir` under `profile` (a Profile), from the loader's own steps (resolve
    the weight source, read the budget, plan). Reads no weights: block sizes come as the loader
    expects them, from an artifact's manifest or config.json. Raises TierlmError when it cannot fit.
    `loras`: `--lora` values as `serve` takes them: DIR[:WEIGHT] merges into the base, NAME=DIR[:WEIGHT]
    is a variant beside it, placed as `serve` places it (see `_with_variants`)."""
    target = resolve_device(device)
    merged, variants = split_variant_specs(loras)
    adapters = tuple(parse_lora_spec(spec) for spec in merged)
    source = resolve_source(model_dir, requested_quant(quant, profile), adapters, accelerator=target.type != "cpu")
    tokenizer = _tokenizer_as_a_session_holds_it(model_dir)  # noqa: F841 - held while measuring
    budget = read_budget(source, profile, target)
    planned = plan_load(source, budget)
    placement, whys = _with_variants(planned, budget, variants) if variants else (planned.placement, {})
    placement = _with_resident_mixed(placement, planned, budget)
    return LoadPlan(source, budget, planned, placement, whys, load_probe(target))


def plan_stages(model_dir: Path, profiles: list, link: Link, quant: str | None = None,
                device: str | None = None) -> StageLoadPlan:  # fmt: skip
    """`model_dir` split over one stage per profile, each stage planned as its rank's load plans
    it (block sizes, baseline and bandwidths as `plan_model` reads them; every rank assumed alike
    this machine)."""
    target = resolve_device(device)
    accelerator = target.type != "cpu"
    source = resolve_source(model_dir, requested_quant(quant, profiles[0]), accelerator=accelerator)
    tokenizer = _tokenizer_as_a_session_holds_it(model_dir)  # noqa: F841 - held while measuring
    budget = read_budget(source, profiles[0], target)
    probe = load_probe(target)

    def split(source):
        return split_stages(source.config, expected_sizes(source, accelerator), profiles, probe.bandwidths, link,
                            accelerator=accelerator, baseline_bytes=budget.baseline.charged, limits=budget.limits)  # fmt: skip

    planned = split(source)
    if source.as_stored and not all(s.placement.fully_resident for s in planned.stages):
        planned = split(replace(source, as_stored=False))  # as the loader does: streamed weights are converted
    return StageLoadPlan(source, budget, planned, probe)


def least_stages_for(model_dir: Path, profile, quant: str | None = None, device: str | None = None) -> int | None:
    """The fewest stages of `profile` that hold a model one process of it cannot (for a refusal's hint)."""
    target = resolve_device(device)
    accelerator = target.type != "cpu"
    source = resolve_source(model_dir, requested_quant(quant, profile), accelerator=accelerator)
    budget = read_budget(source, profile, target)
    return least_stages(source.config, expected_sizes(source, accelerator), [profile], load_bandwidths(target),
                        accelerator=accelerator, baseline_bytes=budget.baseline.charged, limits=budget.limits)  # fmt: skip


def _with_variants(planned: Planned, budget: Budget, variants) -> tuple[Placement, dict[str, str]]:
    """(the placement with `variants` {name: ((path, weight), ...)} placed beside the base, each
    variant's mode and why), computed as `serve` does: the base's artifact (the load converts to
    it first, once) and each variant's (built once, cached) are read to size them."""
    device = budget.device
    source = planned.source
    if not (source.as_stored or source.compiled):  # as the load does: convert, then plan the exact sizes
        planned = plan_load(convert_source(source, device.type != "cpu", None), budget)
    artifact_dir = planned.source.directory if planned.source.compiled else None
    base = variant_base_artifact(source.directory, artifact_dir, source.adapters, device)
    overlays = {name: overlay_for(base, adapters, device=device, dtype=compute_dtype(device), hold=False)
                for name, adapters in variants.items()}  # fmt: skip
    try:
        placement = plan_with_variants(source.config, planned.sizes, device, budget.profile, planned.placement, overlays)
    finally:
        for overlay in overlays.values():
            overlay.close()
    return placement, {name: overlay.why for name, overlay in overlays.items()}


def _with_resident_mixed(placement: Placement, planned: Planned, budget: Budget) -> Placement:
    """`placement` with the largest mixed:SIZE that would keep every block on the device, where
    some block is not there and the weights are not 4-bit already."""
    if placement.fully_resident or planned.sizes.quant.startswith(("int4", "mixed")):
        return placement
    size = resident_mixed_size(planned.source.config, budget.profile, budget.bandwidths or load_bandwidths(budget.device),
                               accelerator=budget.device.type != "cpu", baseline_bytes=budget.baseline.charged,
                               limits=budget.limits)  # fmt: skip
    return replace(placement, resident_mixed_bytes=size or 0)


def _tokenizer_as_a_session_holds_it(model_dir: Path) -> Tokenizer | None:
    """The model's tokenizer, loaded as a session loads it before the weights (its memory is
    part of the baseline); None for a directory without one (config.json alone)."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return None
    try:
        return Tokenizer.from_dir(model_dir)
    except TierlmError:
        return None  # a session would refuse it; the plan still stands
