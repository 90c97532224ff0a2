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
    progress: Callable[[int, int], None] | None = None,
    convert_progress: Callable[[int, int], None] | None = None,
) -> LoadedModel:
    """Load every block resident on `device` in `dtype` (defaults: the device's compute dtype).

    With a `quant` mode other than "none", or with LoRA `adapters` ((path, weight) pairs), the
    weights come from the compiled artifact for that combination, converted on first use.
    The context is `context_length` capped by the model's max_position_embeddings.
    """
    import torch

    from tierlm.device import compute_dtype, resolve_device
    from tierlm.models import family_class
    from tierlm.weights.checkpoint import Checkpoint
    from tierlm.weights.store import load_resident

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise TierlmError(f"model directory {model_dir} does not exist")
    config = ModelConfig.from_dir(model_dir)
    device = resolve_device(device) if not isinstance(device, torch.device) else device
    dtype = dtype or compute_dtype(device)
    max_len = min(context_length or config.max_position_embeddings, config.max_position_embeddings)
    family = family_class(config)
    if (quant or "none") != "none" or adapters:
        from tierlm.cache.convert import ConversionRequest, ensure_artifact
        from tierlm.cache.store import load_resident_artifact

        request = ConversionRequest(model_dir, tuple(adapters), quant if quant not in (None, "none") else "fp32")
        artifact_dir = ensure_artifact(request, convert_progress)
        store = load_resident_artifact(artifact_dir, device=device, dtype=dtype, progress=progress)
    else:
        checkpoint = Checkpoint(model_dir)
        store = load_resident(checkpoint, family.checkpoint_layout(config), device=device, dtype=dtype, progress=progress)
    check_shapes(config, store)
    model = family(config, store, max_len, device, dtype)
    return LoadedModel(config, model, store, max_len, device, dtype)


def check_shapes(config: ModelConfig, store) -> None:
    """Refuse weights whose shapes disagree with config.json before they meet a matmul."""
    hidden, inter = config.hidden_size, config.intermediate_size
    expected = {
        "embed": (config.vocab_size, hidden),
        "head": (config.vocab_size, hidden),
        "norm": (hidden,),
        "attn_norm": (hidden,),
        "mlp_norm": (hidden,),
        "wqkv": (config.q_size + 2 * config.kv_size, hidden),
        "wo": (hidden, config.q_size),
        "w13": (2 * inter, hidden),
        "w2": (hidden, inter),
    }
    for block in store.block_names():
        for name, tensor in store.acquire(block).items():
            want = expected.get(name)
            if want is not None and tuple(tensor.shape) != want:
                raise TierlmError(
                    f"weight {block}.{name} has shape {tuple(tensor.shape)}, "
                    f"config.json implies {want}",
                    "the checkpoint does not match its config.json",
                )
        store.release(block)
