"""Open a model directory: config, family, weights in a store, KV cache sized for the context.

A load runs in named steps, each taking what the step before resolved: `resolve_source` (the
model's config, family and weight format, read once), `read_budget`, `plan_load`,
`convert_source`, `open_store`. All but `read_budget`'s measurement and the last two are
torch-free (runtime/source.py): `tierlm plan` (runtime/planning.py) runs them without loading.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tierlm.cache.artifact import Artifact
from tierlm.cache.convert import ConversionRequest, ensure_artifact
from tierlm.config import ModelConfig
from tierlm.device.resolve import compute_dtype, resolve_device
from tierlm.errors import TierlmError
from tierlm.kv.cache import KVCache, as_format
from tierlm.kv.paged import PagedKVCache, pages_for
from tierlm.kv.formats import KVFormat, model_format
from tierlm.models import family_class
from tierlm.models.llama import LlamaModel
from tierlm.offload.placement import Placement
from tierlm.offload.sizes import BlockSizes
from tierlm.probe.baseline import Baseline, measured_baseline
from tierlm.progress import Progress, ProgressFactory
from tierlm.quant.dispatch import kernel_choice
from tierlm.quant.kernel_api import KernelUnavailable
from tierlm.quant.modes import concrete_mode, quant_text
from tierlm.quant.native import built_library
from tierlm.runtime.source import (
    Beside,
    Budget,
    WeightSource,
    artifact_quant,
    charged_budget,
    check_room_beside,
    context_for,
    expected_sizes,
    plan_load,
    requested_quant,
    resolve_source,
    stage_blocks,
    stage_span,
    with_beside,
)
from tierlm.stages import StageSpan, whole_model
from tierlm.store.calibration import activation_stats
from tierlm.store.expert_cache import POLICIES
from tierlm.store.resident import load_resident, load_resident_artifact
from tierlm.store.tiered import TieredStore
from tierlm.weights.checkpoint import open_checkpoint
from tierlm.weights.store import WeightStore

# What a load imports besides what the caller holds, imported before the baseline is measured so
# that it is charged (by name: the engine is not used here).
LOAD_IMPORTS = ("tierlm.store.resident", "tierlm.store.tiered", "tierlm.offload.planner", "tierlm.runtime.engine")


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
    kv_format: KVFormat | None = None  # how its KV caches hold keys and values (None given: in `dtype`)

    def __post_init__(self):
        if self.span is None:
            self.span = whole_model(self.config.num_hidden_layers)
        self.kv_format = as_format(self.kv_format, self.dtype)

    @property
    def formats(self) -> str:
        """How weights are stored and computed, e.g. "int8 weights, fp32 compute"."""
        held = quant_text(self.weight_format) if self.weight_format else "unknown"
        return f"{held} weights, {dtype_name(self.dtype)} compute"

    def close(self) -> None:
        """Release what the store holds open (reader threads, files) and persist its statistics;
        a pipeline's workers release their stages (and exit, when this process started them)."""
        if self.pipeline is not None:
            self.pipeline.close()
        self.store.close()

    def new_cache(self, batch: int = 1, dtype=None):
        """A KV cache for this stage's layers (all of them for the whole model), in the load's KV
        format (`dtype` given: held in that dtype instead)."""
        return KVCache.for_model(self.config, self.max_len, batch=batch, device=self.device, dtype=dtype or self.dtype,
                                 layers=len(self.span.layers), kv_format=None if dtype else self.kv_format)  # fmt: skip

    def new_paged_cache(self, slots: int, contexts: int):
        """A PagedKVCache of `slots` page tables over a pool of `contexts` whole contexts for this
        stage's layers (the server's batches; the planner charges the pool as `contexts` sequences)."""
        return PagedKVCache.for_model(self.config, self.max_len, slots, contexts * pages_for(self.max_len),
                                      device=self.device, dtype=self.dtype, layers=len(self.span.layers),
                                      kv_format=self.kv_format)  # fmt: skip


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
    kv_cache: str | None = None,
    profile=None,
    bandwidths=None,
    read_delay_s: float = 0.0,
    progress: Progress | None = None,
    phases: ProgressFactory | None = None,
    stage=None,
    beside: Beside | None = None,
) -> LoadedModel:
    """Load the resolved `source` in `dtype` (default: the device's compute dtype): plan it under
    the `profile` when one is given, convert to the artifact the source needs on first use, open
    the store. The context is the profile's (or
    `context_length`), capped by max_position_embeddings; the KV cache's format the profile's
    `kv_cache` (or `kv_cache`; kv/formats.py). `stage` (tierlm/stages.py StageSpan;
    None: the whole model) loads one pipeline stage: only its blocks are planned and opened, and
    its caches hold only its layers. `progress` counts the blocks loaded; the one-time phases
    before (the kernel build, a conversion) go to `phases`. `beside`: memory the caller will hold
    beside the model (a draft model), charged to its plan; refused by name when it leaves no room.
    """
    if kv_cache is not None and profile is not None:
        profile = replace(profile, kv_cache=kv_cache)  # the planner charges the cache it will hold
    if source.compiled:
        checked_quant(source.directory)  # a damaged artifact is refused before anything is measured
    if device.type == "cpu":
        build_kernels(phases)
    dtype = dtype or compute_dtype(device)
    held = load_kv_format(source.config, kv_cache or (profile.kv_cache if profile is not None else None), device, dtype)
    span = stage_span(source.config, stage)
    budget = read_budget(source, profile, device, bandwidths, span) if profile is not None else None
    if budget is not None and beside is not None:
        check_room_beside(source.config, expected_sizes(source, device.type != "cpu"), budget, beside,
                          source.directory.name)  # fmt: skip
        budget = with_beside(budget, beside)
    planned = plan_load(source, budget) if budget is not None else None
    if planned is not None:
        source = planned.source
    if not (source.as_stored or source.compiled):
        source = convert_source(source, device.type != "cpu", phases)
        if budget is not None:
            planned = plan_load(source, budget)  # the artifact's exact sizes
    placement = planned.placement if planned is not None else None
    store = open_store(source, placement, device, dtype, span=span, read_delay_s=read_delay_s, progress=progress)
    max_len = context_for(source.config, context_length, profile)
    model = family_class(source.config)(source.config, store, max_len, device, dtype, span=span)
    weight_format = dtype_name(dtype) if source.as_stored else source.quant  # as stored: converted as they load
    sizes = planned.sizes if planned is not None else None
    artifact_dir = source.directory if source.compiled else None
    return LoadedModel(source.config, model, store, max_len, device, dtype, placement, sizes, weight_format, artifact_dir,
                       span, source, kv_format=held)  # fmt: skip


def load_kv_format(config: ModelConfig, choice: str | None, device: torch.device, dtype: torch.dtype) -> KVFormat:
    """The KV format `choice` ("auto" or None: the compute dtype) means for this model and device;
    one line when the model's heads cannot be held in it."""
    return model_format(choice or "auto", device.type != "cpu", config.head_dim, dtype_name(dtype))


def read_budget(source: WeightSource, profile, device, bandwidths=None, span=None) -> Budget:
    """The baseline charged for the runtime, measured before any weight is loaded (`runtime_baseline`)
    with the model's family imported, as a session holds it then; the process limits and the
    shipped fallback profiles."""
    family_class(source.config)  # its torch module is part of what a load holds when it measures
    baseline = runtime_baseline(device, source.quant, source.directory)
    return charged_budget(source, profile, device, baseline, bandwidths=bandwidths, span=span)


def runtime_baseline(device, quant: str, model_dir: Path | None = None) -> Baseline:
    """Prepare the runtime for loading `quant` weights on `device`, then measure and charge RSS
    (probe/baseline.py). `quant` is the weight format to be loaded ("int8...", "fp32", "none",
    ...): INT8 kernels are calibrated only for int8 weights. `model_dir` keys the record."""
    prepare_runtime(device, quant.startswith("int8"))
    return measured_baseline(device, quant, model_dir, torch.get_num_threads())


def prepare_runtime(device, int8: bool) -> None:
    """What loading will need anyway, done first so the baseline includes it rather than
    meeting it later: INT8 kernel calibration (a compiler run, timing buffers) and the imports
    of the store, planner and engine."""
    for module in LOAD_IMPORTS:
        importlib.import_module(module)
    if int8:
        kernel_choice(device)


def build_kernels(phases: ProgressFactory | None = None) -> None:
    """Compile the native CPU kernels now if they are not built, as a phase of its own: every CPU
    load runs them (decode steps, int8 and int4 weights), and the machine probe's child would
    otherwise build them unseen. A failed build is left for the kernels' loader to report."""
    try:
        built_library(progress=phases)
    except KernelUnavailable:
        pass


def convert_source(source: WeightSource, accelerator: bool, progress: ProgressFactory | None) -> WeightSource:
    """The artifact for `source`'s mode and adapters, converted on first use (its phases go to `progress`)."""
    mode = concrete_mode(source.quant, accelerator=accelerator, converted=True)
    artifact_dir = Path(ensure_artifact(ConversionRequest(source.directory, source.adapters, mode), progress, activation_stats))
    return replace(source, directory=artifact_dir, quant=checked_quant(artifact_dir), compiled=True)


def checked_quant(artifact_dir: Path) -> str:
    """The quant mode of the artifact in `artifact_dir`, opened as its store will open it: its
    weights file and layout are checked, so a damaged one is refused before it is planned."""
    Artifact.open(Path(artifact_dir))
    return artifact_quant(artifact_dir)


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
    store = load_resident(open_checkpoint(source.directory), layout, device=device, dtype=dtype, progress=progress)
    check_shapes(source.config, store, source.family)  # conversion checks artifacts as it writes them
    return store


def dtype_name(dtype) -> str:
    """torch.float32 -> "fp32" (the CLI's spelling)."""
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(str(dtype).removeprefix("torch."), str(dtype))


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
