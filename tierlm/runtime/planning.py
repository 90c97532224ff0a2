"""What a load would do, without loading: `tierlm plan` and `show` read these, as the loader's
own steps (runtime/source.py, which runtime/loader.py runs too) compute them. No torch here.

The baseline charged is the loader's (probe/baseline.py). A plan command's process, which has not
loaded torch, is charged the figure recorded for this machine, model, weight format and threads,
which a load charges while its measurement lies in the record's band. Without a record (or in a
process that has loaded torch) the plan measures it as a load does, in the state a session is in
when it loads: threads set, the runtime imported, tokenizer loaded, the model's family imported,
INT8 kernels calibrated. So under a tight profile the plan streams the blocks the real load streams.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from tierlm.device.cpu import apply_threads, torch_threads
from tierlm.device.resolve import plan_device
from tierlm.errors import TierlmError
from tierlm.lora.spec import parse_lora_spec, split_variant_specs
from tierlm.offload.placement import Placement
from tierlm.offload.planner.search import resident_mixed_size
from tierlm.offload.stage_planner import Link, StagePlan, least_stages, split_stages
from tierlm.probe.baseline import recorded_baseline
from tierlm.probe.machine import load_bandwidths, load_probe
from tierlm.probe.record import ProbeRecord, bandwidths_path
from tierlm.runtime.source import (
    Budget,
    Planned,
    WeightSource,
    charged_budget,
    expected_sizes,
    plan_load,
    requested_quant,
    resolve_source,
)
from tierlm.runtime.tokenizer import Tokenizer

# How `NAME=DIR` variants are placed beside a plan's base: (planned, budget, {name: adapters}) ->
# (placement, {name: why}); runtime/plan_variants.py `place_variants`, which loads torch.
PlaceVariants = Callable[[Planned, Budget, dict], tuple[Placement, dict[str, str]]]


@dataclass(frozen=True)
class LoadPlan:
    """The placement a load of one model would make, with what it was made from."""

    source: WeightSource
    budget: Budget
    planned: Planned
    placement: Placement  # planned.placement with the variants beside the base and the resident mixed size
    variant_whys: dict[str, str]  # variant name -> why it is held merged or unmerged
    probe: ProbeRecord | None  # the record the bandwidths came from, for its age
    probe_path: Path  # its file, whose name says the device and thread count it was probed for


@dataclass(frozen=True)
class StageLoadPlan:
    """The stages a pipeline's ranks would load, each planned as its rank's load plans it."""

    source: WeightSource
    budget: Budget  # rank 0's (every rank is assumed alike this machine)
    planned: StagePlan
    probe: ProbeRecord | None
    probe_path: Path


def plan_model(model_dir: Path, profile, quant: str | None = None, device: str | None = None, loras=(),
               place_variants: PlaceVariants | None = None) -> LoadPlan:  # fmt: skip
    """The plan for `model_dir` under `profile` (a Profile), from the loader's own steps (resolve
    the weight source, read the budget, plan). Reads no weights: block sizes come as the loader
    expects them, from an artifact's manifest or config.json. Raises TierlmError when it cannot fit.
    `loras`: `--lora` values as `serve` takes them: DIR[:WEIGHT] merges into the base, NAME=DIR[:WEIGHT]
    is a variant beside it, placed by `place_variants` as `serve` places it."""
    target = plan_device(device)
    merged, variants = split_variant_specs(loras)
    if variants and place_variants is None:
        raise ValueError("variants are placed by runtime/plan_variants.py: pass its place_variants")
    adapters = tuple(parse_lora_spec(spec) for spec in merged)
    source = resolve_source(model_dir, requested_quant(quant, profile), adapters, accelerator=target.type != "cpu")
    budget = plan_budget(source, profile, target)
    planned = plan_load(source, budget)
    placement, whys = place_variants(planned, budget, variants) if variants else (planned.placement, {})
    placement = _with_resident_mixed(placement, planned, budget)
    probe = load_probe(target, threads=budget.threads)
    return LoadPlan(source, budget, planned, placement, whys, probe, bandwidths_path(target, budget.threads))


def plan_stages(model_dir: Path, profiles: list, link: Link, quant: str | None = None,
                device: str | None = None) -> StageLoadPlan:  # fmt: skip
    """`model_dir` split over one stage per profile, each stage planned as its rank's load plans
    it (block sizes, baseline and bandwidths as `plan_model` reads them; every rank assumed alike
    this machine)."""
    target = plan_device(device)
    accelerator = target.type != "cpu"
    source = resolve_source(model_dir, requested_quant(quant, profiles[0]), accelerator=accelerator)
    budget = plan_budget(source, profiles[0], target)
    probe = load_probe(target, threads=budget.threads)

    def split(source):
        return split_stages(source.config, expected_sizes(source, accelerator), profiles, probe.bandwidths, link,
                            accelerator=accelerator, baseline_bytes=budget.baseline.charged, limits=budget.limits)  # fmt: skip

    planned = split(source)
    if source.as_stored and not all(s.placement.fully_resident for s in planned.stages):
        planned = split(replace(source, as_stored=False))  # as the loader does: streamed weights are converted
    return StageLoadPlan(source, budget, planned, probe, bandwidths_path(target, budget.threads))


def least_stages_for(model_dir: Path, profile, quant: str | None = None, device: str | None = None) -> int | None:
    """The fewest stages of `profile` that hold a model one process of it cannot (for a refusal's hint)."""
    target = plan_device(device)
    accelerator = target.type != "cpu"
    source = resolve_source(model_dir, requested_quant(quant, profile), accelerator=accelerator)
    budget = plan_budget(source, profile, target)
    return least_stages(source.config, expected_sizes(source, accelerator), [profile],
                        load_bandwidths(target, threads=budget.threads), accelerator=accelerator,
                        baseline_bytes=budget.baseline.charged, limits=budget.limits)  # fmt: skip


def plan_budget(source: WeightSource, profile, device) -> Budget:
    """The budget a load of `source` under `profile` would read. A process without torch (a plan
    command's) is in the state the record was measured in, and is charged the baseline recorded
    for this key, the figure such a load is charged. Without a record, or in a process that has
    loaded torch (it may hold more: models, tensors), the baseline is measured as the load
    measures it (`_measured_baseline`), which records it."""
    threads = profile.threads or torch_threads()  # a command resolves its threads into the profile
    baseline = None if "torch" in sys.modules else recorded_baseline(device, source.quant, source.directory, threads)
    if baseline is None:
        baseline = _measured_baseline(source, profile, device, threads)
    return charged_budget(source, profile, device, baseline, threads=threads)


def _measured_baseline(source: WeightSource, profile, device, threads: int):
    """The baseline of a load of `source`, measured and recorded in the state a session is in
    when its load measures: torch at `threads`, the runtime imported, the tokenizer held."""
    apply_threads(threads)  # before the kernels are calibrated: their choice is keyed on it
    # The runtime loads torch, so it is imported only here, where the baseline must be measured:
    # the session too, as a session process holds it (its modules are part of the RSS measured).
    from tierlm.runtime import loader, session  # noqa: F401

    tokenizer = _tokenizer_as_a_session_holds_it(source.directory)  # noqa: F841 - held while measuring
    return loader.read_budget(source, profile, device).baseline


def _with_resident_mixed(placement: Placement, planned: Planned, budget: Budget) -> Placement:
    """`placement` with the largest mixed:SIZE that would keep every block on the device, where
    some block is not there and the weights are not 4-bit already."""
    if placement.fully_resident or planned.sizes.quant.startswith(("int4", "mixed")):
        return placement
    bandwidths = budget.bandwidths or load_bandwidths(budget.device, threads=budget.threads)
    size = resident_mixed_size(planned.source.config, budget.profile, bandwidths, accelerator=budget.device.type != "cpu",
                               baseline_bytes=budget.baseline.charged, limits=budget.limits)  # fmt: skip
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
