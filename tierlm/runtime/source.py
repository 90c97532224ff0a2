"""The steps a load and a plan share, torch-free: which model directory, where its weights come
from (`resolve_source`), what a plan is charged against (`Budget`) and the placement (`plan_load`).

runtime/loader.py runs them before it converts and opens the weights; runtime/planning.py runs
them for `tierlm plan` and `show`, which start without torch. A family is named here by its
description (models/families.py); the loader imports its torch class.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from tierlm.cache import catalog
from tierlm.cache.manifest import MANIFEST_NAME, read_manifest
from tierlm.cache.mixed_estimate import check_mixed_size
from tierlm.cache.removal import retire_replaced_imports
from tierlm.config import ModelConfig
from tierlm.device.cpu import torch_threads
from tierlm.device.memory import MemoryLimits, process_limits
from tierlm.errors import TierlmError
from tierlm.models import family_description, read_config
from tierlm.offload.placement import Placement
from tierlm.offload.planner.search import check_fits, plan
from tierlm.offload.sizes import (
    BlockSizes,
    cached_artifact,
    check_context_asked,
    expected_routing,
    resolve_auto,
    sizes_from_artifact,
    sizes_from_config,
)
from tierlm.probe.baseline import Baseline
from tierlm.probe.machine import load_bandwidths
from tierlm.profile import Profile, load_profile, shipped_profiles
from tierlm.progress import ProgressFactory
from tierlm.quant.modes import AS_STORED, concrete_mode, parse_quant_mode
from tierlm.stages import StageSpan, whole_model


@dataclass(frozen=True)
class WeightSource:
    """Where a load's weights come from, decided before any is read: the checkpoint as stored,
    or an artifact (compiled already, or to be converted for `quant` and `adapters`)."""

    directory: Path  # the model directory, or the artifact once converted
    config: ModelConfig
    family: type  # the family's description (models/families.py); the loader imports its torch class
    quant: str  # a concrete mode ("auto" resolved; an artifact's own) or "none": as stored
    requested: str  # the mode asked for (--quant, else the profile's), as the user spelled it
    resolved: str  # `requested` with "auto" resolved, before an artifact's own mode overrides it
    adapters: tuple[tuple[Path, float], ...] = ()
    compiled: bool = False  # `directory` is an artifact
    as_stored: bool = False  # the checkpoint's tensors are loaded as they are, no artifact


@dataclass(frozen=True)
class Budget:
    """What a plan is charged against, read once per load (and by `tierlm plan`)."""

    profile: Profile
    device: object  # a torch.device (a plan's CPU: device/resolve.py CpuDevice)
    baseline: Baseline  # its `charged` bytes are charged
    limits: MemoryLimits  # the process's real limits, which budgets are capped at
    fallbacks: list[Profile]  # the shipped profiles a refusal may suggest instead
    bandwidths: object = None  # offload/bandwidths.py Bandwidths; None: the probe's, read after the fit check
    span: StageSpan | None = None  # the pipeline stage planned: only its blocks and layers are charged
    threads: int | None = None  # the compute threads the probe is read for; None: torch's (`torch_threads`)


@dataclass(frozen=True)
class Beside:
    """Memory a load will hold beside the model's own (a draft model): charged to its plan as part
    of the baseline, so the two fit the profile together."""

    what: str  # what holds it, as a refusal names it ("the draft model X")
    nbytes: int


def with_beside(budget: Budget, beside: Beside | None) -> Budget:
    """`budget` charging `beside` on top of its baseline."""
    if beside is None:
        return budget
    more = Baseline(budget.baseline.measured + beside.nbytes, budget.baseline.charged + beside.nbytes)
    return replace(budget, baseline=more)


def check_room_beside(config, sizes: BlockSizes, budget: Budget, beside: Beside, model: str) -> None:
    """Refuse, naming what is beside, a model that fits `budget` alone but not with `beside` (a
    model that does not fit alone gets the planner's own refusal)."""
    try:
        _check_fits(config, sizes, with_beside(budget, beside))
    except TierlmError as err:
        _check_fits(config, sizes, budget)
        from tierlm.units import format_size

        raise TierlmError(f"{model} with {beside.what} beside it ({format_size(beside.nbytes)}: its weights, its KV "
                          f"cache and its scratch) does not fit profile {budget.profile.name}: {err.message}",
                          "draft with a smaller model, or --draft ngram (no memory); or a shorter --context, "
                          "a larger --profile") from None  # fmt: skip


@dataclass(frozen=True)
class Planned:
    """A plan's outcome, with the source and sizes it was made for."""

    source: WeightSource  # as resolved, or as an artifact when the weights as stored do not fit resident
    sizes: BlockSizes  # what the placement was made from
    placement: Placement


def resolve_model_dir(model: str | None, progress: ProgressFactory | None = None) -> Path:
    """A model directory from `--model`: None -> the embedded default, a name from `tierlm list`,
    a directory, or a .gguf (imported once). Records the use for `tierlm list`'s LAST USED."""
    model_dir = catalog.resolve_model(model, progress, on_fresh=retire_replaced_imports)
    catalog.mark_used(model_dir)
    return model_dir


def requested_quant(quant: str | None, profile) -> str:
    """The quant mode asked for: `quant`, else the profile's, else "none" (weights as stored)."""
    return quant or (profile.quant if profile is not None else None) or AS_STORED


def context_for(config: ModelConfig, context_length: int | None, profile) -> int:
    """`context_length`, else the profile's, capped by max_position_embeddings (a `--context` past
    it is refused)."""
    if profile is not None:
        check_context_asked(config, profile)
    context = context_length or (profile.context_length if profile is not None else None)
    return min(context or config.max_position_embeddings, config.max_position_embeddings)


def resolve_source(model_dir: Path, quant: str, adapters=(), *, accelerator: bool) -> WeightSource:
    """Step 1: the model's config and family, and the format its weights will be read in, each
    read once."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise TierlmError(f"model directory {model_dir} does not exist")
    config = read_config(model_dir)
    family = family_description(config)
    resolved = resolve_auto(quant, model_dir, accelerator)  # before anything is keyed on the mode
    compiled = is_artifact(model_dir)
    mode = artifact_quant(model_dir) if compiled else resolved
    if not compiled and mode != AS_STORED:  # a mixed:SIZE below the model's floor: refused before anything runs
        check_mixed_size(config, parse_quant_mode(mode), catalog.model_name(model_dir))
    as_stored = not compiled and mode == AS_STORED and not adapters
    return WeightSource(model_dir, config, family, mode, quant, resolved, tuple(adapters), compiled, as_stored)


def charged_budget(source: WeightSource, profile, device, baseline: Baseline, *, bandwidths=None, span=None,
                   threads: int | None = None) -> Budget:  # fmt: skip
    """The Budget charging `baseline` for a load of `source` on `device`: with the process limits
    and the shipped fallback profiles."""
    return Budget(profile, device, baseline, process_limits(device), shipped_fallbacks(), bandwidths, span, threads)


def plan_load(source: WeightSource, budget: Budget) -> Planned:
    """Step 2: refuse what cannot fit (before probing or converting: under a tight limit those
    are what gets killed), then place every block within the budget. Weights as stored obey it
    too: when they do not fit resident, they are planned (and converted) as an artifact."""
    sizes = expected_sizes(source, budget.device.type != "cpu")
    if budget.span is not None and budget.span.world > 1:  # a pipeline stage plans its own blocks only
        sizes = sizes.only(stage_blocks(source.config, budget.span, sizes.names))
    placement = _plan(source.config, sizes, budget)
    if source.as_stored and not placement.fully_resident:
        return plan_load(replace(source, as_stored=False), budget)
    return Planned(source, sizes, placement)


def expected_sizes(source: WeightSource, accelerator: bool):
    """The BlockSizes `source` will have, without reading a weight: an artifact's manifest; as
    stored, predicted from config.json; to be converted, the cached artifact's for that mode, else
    predicted."""
    if source.compiled:
        return sizes_from_artifact(source.directory)
    if source.as_stored:
        return sizes_from_config(source.config, AS_STORED, accelerator=accelerator)
    mode = concrete_mode(source.quant, accelerator=accelerator, converted=True)
    if artifact := cached_artifact(source.directory, mode):
        return sizes_from_artifact(artifact)
    return sizes_from_config(source.config, mode, accelerator=accelerator)


def stage_span(config: ModelConfig, stage):
    """`stage`, checked against the model, or the whole model when None."""
    layers = config.num_hidden_layers
    if stage is None:
        return whole_model(layers)
    fits = 0 <= stage.first < stage.end <= layers and 0 <= stage.rank < stage.world
    if not fits or (stage.world == 1 and stage != whole_model(layers)):
        raise TierlmError(f"{stage.describe()} (rank {stage.rank} of {stage.world}) does not fit a model of "
                          f"{config.num_hidden_layers} layers", "split the stages over the model's own layers")  # fmt: skip
    return stage


def stage_blocks(config: ModelConfig, span, names) -> tuple[str, ...]:
    """The blocks among `names` that `span`'s stage holds (a tied head needs the embedding)."""
    return span.blocks(names, tied=config.tie_word_embeddings)


def artifact_quant(artifact_dir: Path) -> str:
    """The quant mode a compiled artifact's weights are stored in (its manifest's)."""
    return str(read_manifest(Path(artifact_dir)).get("quant", "unknown"))


def is_artifact(model_dir: Path) -> bool:
    return (Path(model_dir) / MANIFEST_NAME).is_file()


def shipped_fallbacks() -> list:
    """The shipped profiles (Profile objects), which a refusal may suggest instead: read here, so
    that the planner reads no files (`tierlm plan` passes the same)."""
    return [load_profile(name) for name in shipped_profiles()]


def _check_fits(config, sizes, budget: Budget) -> None:
    """Refuse as the planner would, before anything is probed."""
    check_fits(config, sizes, budget.profile, accelerator=budget.device.type != "cpu",
               baseline_bytes=budget.baseline.charged, limits=budget.limits, fallbacks=budget.fallbacks,
               **_stage_layers(budget))  # fmt: skip


def _plan(config, sizes, budget: Budget):
    _check_fits(config, sizes, budget)  # a missing probe runs in a child
    return plan(
        config,
        sizes,
        budget.profile,
        budget.bandwidths or load_bandwidths(budget.device, threads=budget_threads(budget)),
        accelerator=budget.device.type != "cpu",
        baseline_bytes=budget.baseline.charged,
        limits=budget.limits,
        fallbacks=budget.fallbacks,
        routing=expected_routing(config, sizes),  # an MoE model's hottest experts become resident
        **_stage_layers(budget),
    )


def budget_threads(budget: Budget) -> int:
    """The compute threads `budget`'s load runs with, which key the probe it reads."""
    return budget.threads if budget.threads is not None else torch_threads()


def _stage_layers(budget: Budget) -> dict:
    """The planner's `layers` argument for a pipeline stage (its KV cache, workspace and overheads
    are charged for its layers only); nothing for a whole-model load."""
    span = budget.span
    return {} if span is None or span.world == 1 else {"layers": span.layers}
