"""Open a model directory: config, family, weights in a store, KV cache sized for the context."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tierlm.config import ModelConfig
from tierlm.errors import TierlmError


@dataclass
class LoadedModel:
    config: ModelConfig
    model: object  # a family Model (models/llama.py, ...)
    store: object  # a WeightStore
    max_len: int
    device: object
    dtype: object
    placement: object = None  # the planner's Placement when a profile was given
    sizes: object = None  # the BlockSizes it was planned from (measured runs are checked against it)
    weight_format: str = ""  # how the weights are held: a quant mode ("int8", "fp16") or, as stored, the dtype

    @property
    def formats(self) -> str:
        """How weights are stored and computed, e.g. "int8 weights, fp32 compute"."""
        return f"{self.weight_format or 'unknown'} weights, {dtype_name(self.dtype)} compute"

    def close(self) -> None:
        """Release what the store holds open (reader threads, files) and persist its statistics."""
        self.store.close()

    def new_cache(self, batch: int = 1, dtype=None):
        from tierlm.cache.kv import KVCache

        return KVCache.for_model(
            self.config, self.max_len, batch=batch, device=self.device, dtype=dtype or self.dtype
        )


def load_model(
    model_dir: Path,
    *,
    device=None,
    dtype=None,
    context_length: int | None = None,
    quant: str | None = None,
    adapters: tuple[tuple[Path, float], ...] = (),
    profile=None,
    bandwidths=None,
    read_delay_s: float = 0.0,
    progress: Callable[[int, int], None] | None = None,
    convert_progress: Callable[[int, int], None] | None = None,
) -> LoadedModel:
    """Load a model for `device` in `dtype` (defaults: the device's compute dtype).

    `model_dir` is a Hugging Face checkpoint or a compiled artifact directory. With a quant
    mode other than "none" (`quant`, else the profile's) or LoRA `adapters` ((path, weight)
    pairs), weights come from the artifact for that combination, converted on first use.
    With a `profile`, the planner places every block within its budget (the process baseline
    is charged here, before any weight is loaded, by the `runtime_baseline` `tierlm plan` uses);
    blocks that do not fit are streamed by a TieredStore. "none" loads the checkpoint as stored
    when it fits resident.
    The context is the profile's (or `context_length`), capped by max_position_embeddings.
    """
    import torch

    from tierlm.device import compute_dtype, resolve_device
    from tierlm.models import family_class
    from tierlm.runtime.baseline import runtime_baseline

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise TierlmError(f"model directory {model_dir} does not exist")
    config = ModelConfig.from_dir(model_dir)
    device = resolve_device(device) if not isinstance(device, torch.device) else device
    dtype = dtype or compute_dtype(device)
    context = context_length or (profile.context_length if profile is not None else None)
    max_len = min(context or config.max_position_embeddings, config.max_position_embeddings)
    family = family_class(config)
    quant = quant or (profile.quant if profile is not None else None) or "none"
    from tierlm.offload.sizes import resolve_auto  # "auto" -> a concrete mode before anything is keyed on it

    quant = resolve_auto(quant, model_dir, accelerator=device.type != "cpu")
    compiled = is_artifact(model_dir)
    if compiled:
        quant = artifact_quant(model_dir)
    baseline = runtime_baseline(device, quant, model_dir).charged if profile is not None else 0
    # Read once per load: the real limits budgets are capped at, and the profiles a refusal may suggest.
    limits, fallbacks = (_process_limits(device), shipped_fallbacks()) if profile is not None else (None, ())
    placement = sizes = None
    as_stored = not compiled and quant == "none" and not adapters
    if as_stored and profile is not None:
        # Weights as stored still obey the budget: when they do not fit resident, they are
        # converted to an fp32 artifact and tiered like any other.
        from tierlm.offload.sizes import sizes_from_config

        sizes = sizes_from_config(config, "none", accelerator=device.type != "cpu")
        placement = _plan(config, sizes, profile, device, bandwidths, baseline, limits, fallbacks)
        as_stored = placement.fully_resident
    if as_stored:
        from tierlm.weights.checkpoint import Checkpoint
        from tierlm.weights.store import load_resident

        checkpoint = Checkpoint(model_dir)
        store = load_resident(checkpoint, family.checkpoint_layout(config), device=device, dtype=dtype, progress=progress)
        check_shapes(config, store, family)  # conversion checks artifacts as it writes them
        weight_format = dtype_name(dtype)  # converted to the compute dtype as they load
    else:
        if profile is not None and not compiled:
            # Refused before converting or probing: under a tight limit those are what gets killed.
            _check_fits(config, _expected_sizes(model_dir, config, quant, device), profile, device, baseline,
                        limits, fallbacks)  # fmt: skip
        artifact_dir = model_dir if compiled else _artifact_for(
            model_dir, quant, adapters, convert_progress
        )
        if profile is not None:
            from tierlm.offload.sizes import sizes_from_artifact

            sizes = sizes_from_artifact(artifact_dir)
            placement = _plan(config, sizes, profile, device, bandwidths, baseline, limits, fallbacks)
        store = _artifact_store(artifact_dir, placement, device, dtype, read_delay_s, progress)
        weight_format = artifact_quant(artifact_dir)
    model = family(config, store, max_len, device, dtype)
    return LoadedModel(config, model, store, max_len, device, dtype, placement, sizes, weight_format)


def artifact_quant(artifact_dir: Path) -> str:
    """The quant mode a compiled artifact's weights are stored in (its manifest's)."""
    from tierlm.cache.artifact import Artifact

    return str(Artifact.open(Path(artifact_dir)).manifest.get("quant", "unknown"))


def dtype_name(dtype) -> str:
    """torch.float32 -> "fp32" (the CLI's spelling)."""
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(str(dtype).removeprefix("torch."), str(dtype))


def is_artifact(model_dir: Path) -> bool:
    from tierlm.cache.artifact import MANIFEST_NAME

    return (Path(model_dir) / MANIFEST_NAME).is_file()


def _artifact_for(model_dir: Path, quant: str, adapters, progress) -> Path:
    from tierlm.cache.convert import ConversionRequest, ensure_artifact

    # LoRA on an unquantized model: the merged weights are kept in fp32.
    mode = quant if quant != "none" else "fp32"
    return ensure_artifact(ConversionRequest(model_dir, tuple(adapters), mode), progress)


def _expected_sizes(model_dir: Path, config: ModelConfig, quant: str, device):
    """The block sizes the artifact will have, as `tierlm plan` reckons them: a cached artifact's
    manifest, else predicted from config.json."""
    from tierlm.offload.sizes import cached_artifact, sizes_from_artifact, sizes_from_config

    mode = quant if quant != "none" else "fp32"  # as _artifact_for converts it
    artifact = cached_artifact(model_dir, mode)
    return sizes_from_artifact(artifact) if artifact else sizes_from_config(config, mode, accelerator=device.type != "cpu")


def _process_limits(device):
    """The cgroup limit, RLIMIT_AS and free device memory, as `tierlm plan` reads them."""
    from tierlm.device.memory import process_limits

    return process_limits(device)


def _check_fits(config, sizes, profile, device, baseline: int, limits, fallbacks) -> None:
    """Refuse as the planner would, before anything is probed."""
    from tierlm.offload.planner import check_fits

    check_fits(config, sizes, profile, accelerator=device.type != "cpu", baseline_bytes=baseline, limits=limits,
               fallbacks=fallbacks)  # fmt: skip


def shipped_fallbacks() -> list:
    """The shipped profiles (Profile objects), which a refusal may suggest instead: read here, so
    that the planner reads no files (`tierlm plan` passes the same)."""
    from tierlm.profile import load_profile, shipped_profiles

    return [load_profile(name) for name in shipped_profiles()]


def _plan(config, sizes, profile, device, bandwidths, baseline: int, limits, fallbacks):
    from tierlm.offload.planner import plan
    from tierlm.offload.probe import load_bandwidths

    _check_fits(config, sizes, profile, device, baseline, limits, fallbacks)  # a missing probe runs in a child
    return plan(
        config,
        sizes,
        profile,
        bandwidths or load_bandwidths(device),
        accelerator=device.type != "cpu",
        baseline_bytes=baseline,
        limits=limits,
        fallbacks=fallbacks,
    )


def _artifact_store(artifact_dir: Path, placement, device, dtype, read_delay_s: float, progress):
    from tierlm.cache.store import load_resident_artifact

    if placement is None or placement.fully_resident:
        return load_resident_artifact(artifact_dir, device=device, dtype=dtype, progress=progress)
    from tierlm.cache.artifact import Artifact
    from tierlm.offload.tiered_store import TieredStore

    return TieredStore(Artifact.open(artifact_dir), placement, device=device, dtype=dtype, read_delay_s=read_delay_s)


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
