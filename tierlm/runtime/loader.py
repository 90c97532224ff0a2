"""Open a model directory: config, family, weights in a store, KV cache sized for the context.

A load runs in named steps, each taking what the step before resolved: `resolve_source` (the
model's config, family and weight format, read once), `read_budget`, `plan_load`,
`convert_source`, `open_store`. `tierlm plan` (runtime/planning.py) runs the same steps but
the last two.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tierlm.cache.artifact import MANIFEST_NAME, Artifact
from tierlm.cache.convert import ConversionRequest, ensure_artifact
from tierlm.config import ModelConfig
from tierlm.device.resolve import compute_dtype, resolve_device
from tierlm.device.memory import MemoryLimits, process_limits
from tierlm.errors import TierlmError
from tierlm.kv.cache import KVCache, SlotKVCache
from tierlm.models import family_class, read_config
from tierlm.models.llama import LlamaModel
from tierlm.offload.placement import Placement
from tierlm.offload.planner.search import check_fits, plan
from tierlm.offload.sizes import BlockSizes, cached_artifact, expected_routing, resolve_auto, sizes_from_artifact, sizes_from_config
from tierlm.probe.baseline import Baseline, runtime_baseline
from tierlm.probe.machine import load_bandwidths
from tierlm.profile import Profile, load_profile, shipped_profiles
from tierlm.progress import Progress
from tierlm.quant.modes import AS_STORED, concrete_mode
from tierlm.stages import StageSpan, whole_model
from tierlm.store.calibration import activation_stats
from tierlm.store.expert_cache import POLICIES
from tierlm.store.resident import load_resident, load_resident_artifact
from tierlm.store.tiered import TieredStore
from tierlm.weights.checkpoint import Checkpoint
from tierlm.weights.store import WeightStore


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaModel  # a family Model (every family extends LlamaModel), or a pipeline's rank-0 PipelineModel
    store: WeightStore
    max_len: int
    device: torch.device
    dtype: torch.dtype
    placement: Placement | None = None  # the planner's Placement when a profile was given
    sizes: BlockSizes | None = None  # the BlockSizes it was planned from (measured runs are checked against it)
    weight_format: str = ""  # how the weights are held: a quant mode ("int8", "fp16") or, as stored, the dtype
    artifact_dir: Path | None = None  # the compiled artifact the weights come from (None: as stored)
    span: StageSpan | None = None  # the pipeline stage loaded (None: the whole model)
    source: "WeightSource | None" = None  # what the load resolved its weights from
    pipeline: object = None  # the stages in other processes (distributed/pipeline.py's PipelineModel); None: one process

    def __post_init__(self):
        if self.span is None:
            self.span = whole_model(self.config.num_hidden_layers)

    @property
    def formats(self) -> str:
        """How weights are stored and computed, e.g. "int8 weights, fp32 compute"."""
        return f"{self.weight_format or 'unknown'} weights, {dtype_name(self.dtype)} compute"

    def close(self) -> None:
        """Release what the store holds open (reader threads, files) and persist its statistics;
        a pipeline's workers release their stages (and exit, when this process started them)."""
        if self.pipeline is not None:
            self.pipeline.close()
        self.store.close()

    def new_cache(self, batch: int = 1, dtype=None):
        """A KV cache for this stage's layers (all of them for the whole model)."""
        return KVCache.for_model(self.config, self.max_len, batch=batch, device=self.device,
                                 dtype=dtype or self.dtype, layers=len(self.span.layers))  # fmt: skip

    def new_slot_cache(self, slots: int, dtype=None):
        """A SlotKVCache of `slots` sequences for this stage's layers (the server's batches)."""
        return SlotKVCache.for_model(self.config, self.max_len, slots, device=self.device,
                                     dtype=dtype or self.dtype, layers=len(self.span.layers))  # fmt: skip


@dataclass(frozen=True)
class WeightSource:
    """Where a load's weights come from, decided before any is read: the checkpoint as stored,
    or an artifact (compiled already, or to be converted for `quant` and `adapters`)."""

    directory: Path  # the model directory, or the artifact once converted
    config: ModelConfig
    family: type  # the family Model class (models/llama.py, ...)
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
    device: torch.device
    baseline: Baseline  # its `charged` bytes are charged
    limits: MemoryLimits  # the process's real limits, which budgets are capped at
    fallbacks: list[Profile]  # the shipped profiles a refusal may suggest instead
    bandwidths: object = None  # offload/bandwidths.py Bandwidths; None: the probe's, read after the fit check
    span: StageSpan | None = None  # the pipeline stage planned: only its blocks and layers are charged


@dataclass(frozen=True)
class Planned:
    """A plan's outcome, with the source and sizes it was made for."""

    source: WeightSource  # as resolved, or as an artifact when the weights as stored do not fit resident
    sizes: BlockSizes  # what the placement was made from
    placement: Placement


def load_model(model_dir: Path, *, device=None, quant: str | None = None, adapters: tuple[tuple[Path, float], ...] = (),
               profile=None, **load_options) -> LoadedModel:  # fmt: skip
    """Load a model for `device` (a name, a torch.device, or None: the best available).

    `model_dir` is a Hugging Face checkpoint or a compiled artifact directory; its weight source
    is resolved (`quant`, else the profile's, with LoRA `adapters` as (path, weight) pairs) and
    loaded by `load_source`, which documents `load_options` (dtype, context_length, bandwidths, ...).
    """
    device = device if isinstance(device, torch.device) else resolve_device(device)
    source = resolve_source(model_dir, requested_quant(quant, profile), adapters, accelerator=device.type != "cpu")
    return load_source(source, device=device, profile=profile, **load_options)


def load_source(
    source: "WeightSource",
    *,
    device: torch.device,
    dtype=None,
    context_length: int | None = None,
    profile=None,
    bandwidths=None,
    read_delay_s: float = 0.0,
    progress: Progress | None = None,
    convert_progress: Progress | None = None,
    stage=None,
) -> LoadedModel:
    """Load the resolved `source` in `dtype` (default: the device's compute dtype): plan it under
    the `profile` when one is given, convert to the artifact the source needs on first use, open
    the store. The context is the profile's (or
    `context_length`), capped by max_position_embeddings. `stage` (tierlm/stages.py StageSpan;
    None: the whole model) loads one pipeline stage: only its blocks are planned and opened, and
    its caches hold only its layers.
    """
    dtype = dtype or compute_dtype(device)
    span = stage_span(source.config, stage)
    budget = read_budget(source, profile, device, bandwidths, span) if profile is not None else None
    planned = plan_load(source, budget) if budget is not None else None
    if planned is not None:
        source = planned.source
    if not (source.as_stored or source.compiled):
        source = convert_source(source, device.type != "cpu", convert_progress)
        if budget is not None:
            planned = plan_load(source, budget)  # the artifact's exact sizes
    placement = planned.placement if planned is not None else None
    store = open_store(source, placement, device, dtype, span=span, read_delay_s=read_delay_s, progress=progress)
    max_len = context_for(source.config, context_length, profile)
    model = source.family(source.config, store, max_len, device, dtype, span=span)
    weight_format = dtype_name(dtype) if source.as_stored else source.quant  # as stored: converted as they load
    sizes = planned.sizes if planned is not None else None
    artifact_dir = source.directory if source.compiled else None
    return LoadedModel(source.config, model, store, max_len, device, dtype, placement, sizes, weight_format, artifact_dir,
                       span, source)  # fmt: skip


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


def requested_quant(quant: str | None, profile) -> str:
    """The quant mode asked for: `quant`, else the profile's, else "none" (weights as stored)."""
    return quant or (profile.quant if profile is not None else None) or AS_STORED


def context_for(config: ModelConfig, context_length: int | None, profile) -> int:
    """`context_length`, else the profile's, capped by max_position_embeddings."""
    context = context_length or (profile.context_length if profile is not None else None)
    return min(context or config.max_position_embeddings, config.max_position_embeddings)


def resolve_source(model_dir: Path, quant: str, adapters=(), *, accelerator: bool) -> WeightSource:
    """Step 1: the model's config and family, and the format its weights will be read in, each
    read once. The family is imported here, before any baseline is measured, as a session imports it."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise TierlmError(f"model directory {model_dir} does not exist")
    config = read_config(model_dir)
    family = family_class(config)
    resolved = resolve_auto(quant, model_dir, accelerator)  # before anything is keyed on the mode
    compiled = is_artifact(model_dir)
    mode = artifact_quant(model_dir) if compiled else resolved
    as_stored = not compiled and mode == AS_STORED and not adapters
    return WeightSource(model_dir, config, family, mode, quant, resolved, tuple(adapters), compiled, as_stored)


def read_budget(source: WeightSource, profile, device, bandwidths=None, span=None) -> Budget:
    """The baseline charged for the runtime, measured before any weight is loaded
    (probe/baseline.py), the process limits and the shipped fallback profiles."""
    baseline = runtime_baseline(device, source.quant, source.directory)
    return Budget(profile, device, baseline, process_limits(device), shipped_fallbacks(), bandwidths, span)


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


def convert_source(source: WeightSource, accelerator: bool, progress) -> WeightSource:
    """The artifact for `source`'s mode and adapters, converted on first use."""
    mode = concrete_mode(source.quant, accelerator=accelerator, converted=True)
    artifact_dir = Path(ensure_artifact(ConversionRequest(source.directory, source.adapters, mode), progress, activation_stats))
    return replace(source, directory=artifact_dir, quant=artifact_quant(artifact_dir), compiled=True)


def open_store(source: WeightSource, placement, device, dtype, *, span=None, read_delay_s: float = 0.0,
               progress=None):  # fmt: skip
    """Step 3: the WeightStore over `source`: the checkpoint as stored, resident in `dtype`; an
    artifact resident, or tiered by `placement` when some blocks are streamed. `span`: a pipeline
    stage, whose blocks alone are opened (a placement made for it places only those)."""
    span = stage_span(source.config, span)
    if not source.as_stored:
        return _artifact_store(source, placement, device, dtype, span, read_delay_s, progress)
    layout = source.family.checkpoint_layout(source.config)
    layout = {block: layout[block] for block in stage_blocks(source.config, span, list(layout))}
    store = load_resident(Checkpoint(source.directory), layout, device=device, dtype=dtype, progress=progress)
    check_shapes(source.config, store, source.family)  # conversion checks artifacts as it writes them
    return store


def artifact_quant(artifact_dir: Path) -> str:
    """The quant mode a compiled artifact's weights are stored in (its manifest's)."""
    return str(Artifact.open(Path(artifact_dir)).manifest.get("quant", "unknown"))


def dtype_name(dtype) -> str:
    """torch.float32 -> "fp32" (the CLI's spelling)."""
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(str(dtype).removeprefix("torch."), str(dtype))


def is_artifact(model_dir: Path) -> bool:
    return (Path(model_dir) / MANIFEST_NAME).is_file()


def _check_fits(config, sizes, budget: Budget) -> None:
    """Refuse as the planner would, before anything is probed."""
    check_fits(config, sizes, budget.profile, accelerator=budget.device.type != "cpu",
               baseline_bytes=budget.baseline.charged, limits=budget.limits, fallbacks=budget.fallbacks,
               **_stage_layers(budget))  # fmt: skip


def shipped_fallbacks() -> list:
    """The shipped profiles (Profile objects), which a refusal may suggest instead: read here, so
    that the planner reads no files (`tierlm plan` passes the same)."""
    return [load_profile(name) for name in shipped_profiles()]


def _plan(config, sizes, budget: Budget):
    _check_fits(config, sizes, budget)  # a missing probe runs in a child
    return plan(
        config,
        sizes,
        budget.profile,
        budget.bandwidths or load_bandwidths(budget.device),
        accelerator=budget.device.type != "cpu",
        baseline_bytes=budget.baseline.charged,
        limits=budget.limits,
        fallbacks=budget.fallbacks,
        routing=expected_routing(config, sizes),  # an MoE model's hottest experts become resident
        **_stage_layers(budget),
    )


def _stage_layers(budget: Budget) -> dict:
    """The planner's `layers` argument for a pipeline stage (its KV cache, workspace and overheads
    are charged for its layers only); nothing for a whole-model load."""
    span = budget.span
    return {} if span is None or span.world == 1 else {"layers": span.layers}


def _artifact_store(source: WeightSource, placement, device, dtype, span, read_delay_s: float, progress):
    artifact_dir = source.directory
    if placement is None or placement.fully_resident:
        only = None if span.world == 1 else lambda name: span.owns(name, source.config.tie_word_embeddings)
        return load_resident_artifact(artifact_dir, device=device, dtype=dtype, progress=progress, only=only)
    policy, speculate = expert_options()
    return TieredStore(Artifact.open(artifact_dir), placement, device=device, dtype=dtype, read_delay_s=read_delay_s,
                       expert_policy=policy, speculate=speculate)  # fmt: skip


def expert_options() -> tuple[str, bool]:
    """The expert cache's policy (TIERLM_EXPERT_CACHE=lfu|lru|stream, default lfu) and whether the
    model's guesses start reads (TIERLM_SPECULATE=0 turns them off): benchmarks compare them."""
    policy = os.environ.get("TIERLM_EXPERT_CACHE", "").strip().lower() or "lfu"
    if policy not in POLICIES:
        raise TierlmError(f"TIERLM_EXPERT_CACHE={policy!r} is not an expert cache policy",
                          f"use one of {', '.join(POLICIES)} (lfu is the default)")  # fmt: skip
    return policy, os.environ.get("TIERLM_SPECULATE", "1").strip() != "0"


def check_shapes(config: ModelConfig, store, family) -> None:
    """Refuse weights whose shapes disagree with config.json before they meet a matmul."""
    expected = family.canonical_shapes(config)
    for block in store.block_names():
        for name, tensor in store.acquire(block).items():
            want = expected.get(name)
            shape = getattr(tensor, "shape", None)
            if want is not None and shape is not None and tuple(shape) != want:
                raise TierlmError(
                    f"weight {block}.{name} has shape {tuple(shape)}, config.json implies {want}",
                    "the checkpoint does not match its config.json",
                )
        store.release(block)
