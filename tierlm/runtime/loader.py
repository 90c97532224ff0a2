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
    is measured here, before any weight is loaded); blocks that do not fit are streamed by a
    TieredStore. "none" loads the checkpoint as stored when it fits resident.
    The context is the profile's (or `context_length`), capped by max_position_embeddings.
    """
    import torch

    from tierlm.device import compute_dtype, resolve_device
    from tierlm.models import family_class

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
    compiled = is_artifact(model_dir)
    baseline = runtime_baseline(device, quant.startswith("int8") or compiled, profile is not None)
    placement = None
    as_stored = not compiled and quant == "none" and not adapters
    if as_stored and profile is not None:
        # Weights as stored still obey the budget: when they do not fit resident, they are
        # converted to an fp32 artifact and tiered like any other.
        from tierlm.offload.sizes import sizes_from_config

        placement = _plan(config, sizes_from_config(config, "none", accelerator=device.type != "cpu"),
                          profile, device, bandwidths, baseline)
        as_stored = placement.fully_resident
    if as_stored:
        from tierlm.weights.checkpoint import Checkpoint
        from tierlm.weights.store import load_resident

        checkpoint = Checkpoint(model_dir)
        store = load_resident(checkpoint, family.checkpoint_layout(config), device=device, dtype=dtype, progress=progress)
        check_shapes(config, store, family)  # conversion checks artifacts as it writes them
    else:
        artifact_dir = model_dir if compiled else _artifact_for(
            model_dir, quant, adapters, convert_progress
        )
        if profile is not None:
            from tierlm.offload.sizes import sizes_from_artifact

            placement = _plan(config, sizes_from_artifact(artifact_dir), profile, device, bandwidths, baseline)
        store = _artifact_store(artifact_dir, placement, device, dtype, read_delay_s, progress)
    model = family(config, store, max_len, device, dtype)
    return LoadedModel(config, model, store, max_len, device, dtype, placement)


def runtime_baseline(device, int8: bool, planned: bool) -> int:
    """This process's RSS before any weight is loaded: what a profile's budget charges as baseline.

    What loading will need anyway happens first, so the budget charges it here rather than
    meeting it later: INT8 kernel calibration (a compiler run, timing buffers) and the offload
    modules' imports; then freed heap pages go back to the OS.
    """
    from tierlm.device import read_memory, trim_heap

    if int8:
        from tierlm.quant.dispatch import plan_for

        plan_for(device)
    if planned:
        import tierlm.cache.store  # noqa: F401
        import tierlm.offload.planner  # noqa: F401
        import tierlm.offload.tiered_store  # noqa: F401
    trim_heap()
    return read_memory().rss


def is_artifact(model_dir: Path) -> bool:
    from tierlm.cache.artifact import MANIFEST_NAME

    return (Path(model_dir) / MANIFEST_NAME).is_file()


def _artifact_for(model_dir: Path, quant: str, adapters, progress) -> Path:
    from tierlm.cache.convert import ConversionRequest, ensure_artifact

    # LoRA on an unquantized model: the merged weights are kept in fp32.
    mode = quant if quant != "none" else "fp32"
    return ensure_artifact(ConversionRequest(model_dir, tuple(adapters), mode), progress)


def _plan(config, sizes, profile, device, bandwidths, baseline: int):
    from tierlm.offload.planner import plan
    from tierlm.offload.probe import load_bandwidths

    return plan(
        config,
        sizes,
        profile,
        bandwidths or load_bandwidths(device),
        accelerator=device.type != "cpu",
        baseline_bytes=baseline,
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
