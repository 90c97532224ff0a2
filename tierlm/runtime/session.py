"""From command-line choices to a ready engine: which model, which profile, which device."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Callable

import torch

from tierlm.cache.artifact import Artifact
from tierlm.cache.convert import ConversionRequest, ensure_artifact
from tierlm.config import GenerationDefaults
from tierlm.device.resolve import resolve_device
from tierlm.device.cpu import apply_threads
from tierlm.device.memory import process_limits
from tierlm.errors import TierlmError
from tierlm.lora.adapter import LoraAdapter
from tierlm.lora.merge import LoraMerger
from tierlm.lora.spec import parse_lora_spec
from tierlm.offload.placement import DEVICE, HOST
from tierlm.offload.planner.search import plan
from tierlm.offload.planner.context import VariantCharge
from tierlm.offload.sizes import expected_routing
from tierlm.probe.machine import load_bandwidths
from tierlm.profile import Profile
from tierlm.progress import ProgressFactory
from tierlm.quant.modes import AS_STORED, concrete_mode
from tierlm.runtime.acceptance import Acceptance, record_acceptance
from tierlm.runtime.draft_model import DraftModel, resolve_draft
from tierlm.runtime.engine import Engine
from tierlm.runtime.loader import LoadedModel, load_source
from tierlm.runtime.model_defaults import model_generation_defaults
from tierlm.runtime.speculative import DraftSettings
from tierlm.runtime.source import is_artifact, requested_quant, resolve_model_dir, resolve_source
from tierlm.runtime.tokenizer import Tokenizer
from tierlm.store.calibration import activation_stats
from tierlm.store.variants import VariantStore, overlay_for
from tierlm.weights.checkpoint import open_checkpoint

# How a session loads its resolved source: runtime/loader.py `load_source` in this process, or a
# pipeline of stages (distributed/pipeline.py `pipeline_load`), with load_source's keywords.
Load = Callable[..., LoadedModel]


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

    loaded: LoadedModel
    tokenizer: Tokenizer
    profile: Profile
    model_dir: Path
    load_s: float
    generation_defaults: GenerationDefaults = GenerationDefaults()
    # Adapters merged into the served base: a variant's adapters come on top of these.
    base_adapters: tuple[tuple[Path, float], ...] = ()
    # The variants added so far: name -> (its own adapters, its overlay in the variant store).
    variants: dict = field(default_factory=dict)
    # Held while the set of variants and the plan change: the server adds on one thread, removes on another.
    _variants_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    closed: bool = field(default=False, init=False)
    # The draft model held beside the model (--draft MODEL; runtime/draft_model.py), or None.
    draft_model: object = None

    @cached_property
    def engine(self) -> Engine:
        return Engine(self.loaded, self.tokenizer, draft_model=self.draft_model)

    @property
    def pipeline(self):
        """The stages in other processes (distributed/pipeline.py's PipelineModel, also
        loaded.model); None: one process."""
        return self.loaded.pipeline

    def variant_store(self):
        """The weight store as a VariantStore (store/variants.py), wrapping the base store on
        first use. Call it before the model runs on another thread: the server does, before its
        worker starts, so variants can be added while it serves."""
        store = self.loaded.store
        if not isinstance(store, VariantStore):
            store = VariantStore(store, device=self.loaded.device)
            self.loaded.store = self.loaded.model.store = store
        return store

    def check_variant(self, adapters) -> None:
        """Check a variant's `adapters` [(path, weight)] against the base checkpoint; a TierlmError
        names the first misfit. Reads the adapters and the checkpoint's headers; writes nothing (the server's 400)."""
        merger = LoraMerger([(LoraAdapter.load(Path(path)), weight) for path, weight in adapters])
        merger.validate(open_checkpoint(self._checkpoint_dir()), tied=self.loaded.config.tie_word_embeddings)

    def add_variant(self, name: str, adapters, progress: ProgressFactory | None = None):
        """Build the variant `name` (its `adapters` [(path, weight)] on top of the served base,
        merged or unmerged as store/variants.py's cost model chooses), place it where the
        planner says (held, or read from disk per use) and add it to the variant store; returns
        its Overlay (mode, why, nbytes, tier). Slow: it may convert."""
        store = self.variant_store()
        base = self._base_artifact(progress)
        # Not held yet: a merged variant is only sized, so a variant placed on disk never is in memory.
        overlay = overlay_for(base, tuple(adapters), device=self.loaded.device, dtype=self.loaded.dtype, hold=False,
                              progress=progress(f"converting variant {name}") if progress else None)  # fmt: skip
        with self._variants_lock:
            overlays = {n: o for n, (_, o) in self.variants.items()} | {name: overlay}
            placement = self._replan(overlays, name)  # refuses before the variant is served
            placed = _placed(overlays, placement)
            self._move_variants(placed)
            store.add(name, placed[name])
            self.variants[name] = (tuple(adapters), placed[name])
            self.loaded.placement = placement
        return placed[name]

    def _move_variants(self, placed) -> None:
        """Swap each served overlay whose tier the new plan changed (colder ones first, so the
        memory they free is there for the warmer ones)."""
        store = self.variant_store()
        moved = [(n, o) for n, o in placed.items() if n in self.variants and self.variants[n][1] is not o]
        for name, overlay in sorted(moved, key=lambda item: item[1].held_bytes):
            store.replace(name, overlay)  # the same variant artifact: its reader stays open
            self.variants[name] = (self.variants[name][0], overlay)

    def _replan(self, overlays, adding: str | None):
        """The load's placement re-made with `overlays` {name: Overlay} placed beside the base (the
        planner's "variants"); a TierlmError when `adding` would move a base block to another tier
        (blocks are placed once, at load) or no longer fit. None when the load had no plan."""
        placement = self.loaded.placement
        if placement is None:
            return None
        hint = "serve fewer variants, or a larger --profile"
        try:
            loaded = self.loaded
            replanned = plan_with_variants(loaded.config, loaded.sizes, loaded.device, self.profile, placement, overlays)
        except TierlmError as err:
            if adding is None:
                raise
            raise TierlmError(f"variant {adding} cannot be served: {err.message}", err.hint or hint) from None
        if adding is not None and _tiers(replanned) != _tiers(placement):
            moved = sorted(b for b, tier in _tiers(replanned).items() if _tiers(placement)[b] != tier)
            raise TierlmError(f"variant {adding} needs room the base's blocks hold: with it, {', '.join(moved[:3])} "
                              f"would no longer stay where the model was loaded", hint)
        return replanned

    def _checkpoint_dir(self) -> Path:
        if not is_artifact(self.model_dir):
            return self.model_dir
        artifact = Artifact.open(self.model_dir)
        try:
            return Path(artifact.manifest["source"])
        finally:
            artifact.close()

    def _base_artifact(self, progress: ProgressFactory | None) -> Path:
        """The artifact the base's weights come from; weights loaded as stored get one in their
        own format (converted once, cached), which variants are read against."""
        return variant_base_artifact(self.model_dir, self.loaded.artifact_dir, self.base_adapters, self.loaded.device,
                                     progress)  # fmt: skip

    def remove_variant(self, name: str) -> None:
        """Drop the variant `name` from the store; only between forwards (the server's worker).
        A variant the freed room now holds is loaded into it."""
        with self._variants_lock:
            self.variant_store().remove(name).close()
            self.variants.pop(name, None)
            overlays = {n: o for n, (_, o) in self.variants.items()}
            placement = self._replan(overlays, None)
            self._move_variants(_placed(overlays, placement))
            self.loaded.placement = placement

    def close(self) -> None:
        """Release the weight store's reader threads and files and persist its hot-row
        statistics; a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        self._record_acceptance()
        if self.draft_model is not None:
            self.draft_model.close()
        self.loaded.close()

    def _record_acceptance(self) -> None:
        """What the engine's drafts achieved, added to the model's record (`tierlm plan --draft`)."""
        engine = self.__dict__.get("engine")  # never built (serve): nothing drafted here
        for drafter, (passes, stood, checked, misses) in (engine.drafting_counts.items() if engine else ()):
            record_acceptance(self.model_dir, drafter, Acceptance(stood, checked, passes, misses))

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_session(
    model: str | None,
    profile: Profile,
    *,
    device: str | None = None,
    dtype: str | None = None,
    quant: str | None = None,
    loras: tuple[str, ...] = (),
    variants=None,
    threads: int | None = None,
    progress: ProgressFactory | None = None,
    load: Load = load_source,
    draft: DraftSettings | None = None,
    draft_caches: int = 1,
) -> Session:
    """Load the model within the profile's context and return a session over it.

    `quant` overrides the profile's quant mode; `loras` are `path[:weight]` adapter specs merged
    into the model; `variants` ({name: ((path, weight), ...)}) are built over it and served
    beside it (`serve --lora NAME=PATH`);
    `threads` (else the profile's; 0 or None: the CPUs this process may use) is set in torch
    before the INT8 kernels are calibrated for it.
    `load` loads the resolved source: in this process, or as a pipeline of stages with this
    process as rank 0 under `profile` (distributed/pipeline.py `pipeline_load`).
    `draft` naming a draft model (--draft MODEL): it is checked against the model and charged to its
    plan before either loads, then loaded beside it, resident (one process only), with
    `draft_caches` KV caches charged (the server's: one per sequence drafting at once).
    """
    adapters = tuple(parse_lora_spec(spec) for spec in loras)
    model_dir = resolve_model_dir(model, progress)
    profile = replace(profile, threads=apply_threads(threads or profile.threads))
    started = time.perf_counter()
    tokenizer = Tokenizer.from_dir(model_dir)
    target = resolve_device(device)
    source = resolve_source(model_dir, requested_quant(quant, profile), adapters, accelerator=target.type != "cpu")
    drafting = None
    if draft is not None and draft.uses_model:
        drafting = resolve_draft(draft.model, source, tokenizer, profile, accelerator=target.type != "cpu",
                                 caches=draft_caches)  # fmt: skip
    loaded = load(source, device=target, dtype=_parse_dtype(dtype), profile=profile,
                  progress=progress("loading weights") if progress else None,
                  phases=progress, **({"beside": drafting.beside} if drafting else {}))  # fmt: skip
    # The profile says the quant mode asked for and what it resolved to.
    profile = replace(profile, quant=quant or profile.quant, quant_resolved=source.resolved)
    defaults = model_generation_defaults(model_dir)
    session = Session(loaded, tokenizer, profile, model_dir, time.perf_counter() - started, defaults, adapters)
    try:
        if drafting is not None:
            session.draft_model = load_draft(drafting, loaded, profile, progress)
        for name, variant in (variants or {}).items():
            session.add_variant(name, variant, progress)
    except BaseException:
        session.close()
        raise
    session.load_s = time.perf_counter() - started
    return session


def load_draft(drafting, target: LoadedModel, profile: Profile, progress: ProgressFactory | None = None):
    """The draft model `drafting` (a checked DraftSource) loaded resident beside `target`, in its
    device, dtype and KV format; its conversion, if any, goes to `progress`."""
    loaded = load_source(drafting.source, device=target.device, dtype=target.dtype, context_length=drafting.context,
                         kv_cache=profile.kv_cache, phases=progress)  # fmt: skip
    return DraftModel(loaded, drafting.name, vocab_limit=target.config.vocab_size)


def variant_base_artifact(model_dir: Path, artifact_dir, base_adapters, device, progress: ProgressFactory | None = None) -> Path:
    """The artifact variants are read against: the one a load's weights come from (`artifact_dir`),
    else, for weights loaded as stored, one in their own format (converted once, cached; its
    phases go to `progress`)."""
    if artifact_dir is not None:
        return Path(artifact_dir)
    mode = concrete_mode(AS_STORED, accelerator=device.type != "cpu", converted=True)
    return Path(ensure_artifact(ConversionRequest(model_dir, tuple(base_adapters), mode), progress, activation_stats))


def plan_with_variants(config, sizes, device, profile, placement, overlays):
    """The placement of a load (`placement`, made from `sizes` under `profile` for `device`)
    re-made with `overlays` {name: Overlay} placed beside the base, as `serve` charges them and
    `tierlm plan --lora NAME=PATH` shows them. The baseline is the one the load charged."""
    baseline = (placement.charges.get(HOST) or placement.charges[DEVICE])["baseline"]
    return plan(config, sizes, profile, load_bandwidths(device), accelerator=device.type != "cpu",
                baseline_bytes=baseline, limits=process_limits(device), routing=expected_routing(config, sizes),
                variants=variant_charges(overlays))  # fmt: skip


def variant_charges(overlays, uses=None) -> list:
    """The planner's VariantCharges for `overlays` {name: Overlay}, in their order; `uses`
    {name: requests} makes the more used ones hotter (none kept yet: the order given)."""
    uses = uses or {}
    return [VariantCharge(name, o.mode, o.nbytes, o.largest, uses.get(name, 0)) for name, o in overlays.items()]


def _placed(overlays, placement) -> dict:
    """Each overlay on the tier `placement` gives it (without a plan, no budget: held)."""
    if placement is None:
        return {name: overlay.placed("device") for name, overlay in overlays.items()}
    tiers = {v.name: v.tier for v in placement.variants}
    return {name: overlay.placed(tiers[name]) for name, overlay in overlays.items()}


def _tiers(placement) -> dict[str, str]:
    return {block.name: block.tier for block in placement.blocks}


def _parse_dtype(name: str | None):
    choices = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if name in (None, "auto"):
        return None
    if name not in choices:
        raise TierlmError(f"unknown dtype {name!r}", "use auto, fp32, fp16 or bf16")
    return choices[name]
