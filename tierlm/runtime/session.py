"""From command-line choices to a ready engine: which model, which profile, which device."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from tierlm.config import GenerationDefaults
from tierlm.errors import TierlmError
from tierlm.profile import Profile
from tierlm.progress import ProgressFactory


@dataclass
class Session:
    """A loaded model with its tokenizer, the profile and directory it was opened for; it owns
    the model's lifetime.

    `profile` carries what the run resolved: the concrete quant mode and the thread count.
    `generation_defaults`: the model's sampling settings, for options the user left unset.
    `engine` (batch 1, for chat, generate and bench) is built on first use, so `serve`, whose
    worker keeps its own slotted cache, never allocates its KV cache.
    Use it as a context manager (`with open_session(...) as session:`), or call `close()`.
    """

    loaded: object  # runtime.loader.LoadedModel
    tokenizer: object
    profile: Profile
    model_dir: Path
    load_s: float
    generation_defaults: GenerationDefaults = GenerationDefaults()
    closed: bool = field(default=False, init=False)

    @cached_property
    def engine(self):
        from tierlm.runtime.engine import Engine

        return Engine(self.loaded, self.tokenizer)

    def close(self) -> None:
        """Release the weight store's reader threads and files and persist its hot-row
        statistics; a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        self.loaded.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resolve_model_dir(model: str | None, progress: ProgressFactory | None = None) -> Path:
    """A model directory from `--model`: None -> the embedded default, a name from `tierlm list`,
    a directory, or a .gguf (imported once). Records the use for `tierlm list`'s LAST USED."""
    from tierlm.cache import catalog

    model_dir = catalog.resolve_model(model, progress)
    catalog.mark_used(model_dir)
    return model_dir


def open_session(
    model: str | None,
    profile: Profile,
    *,
    device: str | None = None,
    dtype: str | None = None,
    quant: str | None = None,
    loras: tuple[str, ...] = (),
    threads: int | None = None,
    progress: ProgressFactory | None = None,
) -> Session:
    """Load the model within the profile's context and return a session over it.

    `quant` overrides the profile's quant mode; `loras` are `path[:weight]` adapter specs;
    `threads` (else the profile's; 0 or None: the CPUs this process may use) is set in torch
    before the INT8 kernels are calibrated for it.
    """
    import time

    import torch

    from tierlm.device.cpu import apply_threads
    from tierlm.offload.sizes import resolve_auto
    from tierlm.runtime.loader import load_model
    from tierlm.runtime.tokenizer import Tokenizer

    from tierlm.lora.spec import parse_lora_spec

    adapters = tuple(parse_lora_spec(spec) for spec in loras)
    model_dir = resolve_model_dir(model, progress)
    profile = replace(profile, threads=apply_threads(threads or profile.threads))
    started = time.perf_counter()
    tokenizer = Tokenizer.from_dir(model_dir)
    torch_dtype = _parse_dtype(dtype)
    loaded = load_model(
        model_dir,
        device=device,
        dtype=torch_dtype,
        quant=quant,
        profile=profile,
        adapters=adapters,
        progress=progress("loading weights") if progress else None,
        convert_progress=progress("converting (merge + quantize)") if progress else None,
    )
    requested = quant or profile.quant
    resolved = resolve_auto(requested, model_dir, accelerator=loaded.device.type != "cpu")
    profile = replace(profile, quant=requested, quant_resolved=resolved)
    defaults = GenerationDefaults.from_dir(model_dir)
    return Session(loaded, tokenizer, profile, model_dir, time.perf_counter() - started, defaults)


def _parse_dtype(name: str | None):
    import torch

    choices = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if name in (None, "auto"):
        return None
    if name not in choices:
        raise TierlmError(f"unknown dtype {name!r}", "use auto, fp32, fp16 or bf16")
    return choices[name]
