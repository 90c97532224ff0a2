"""What each rank of a pipeline loads: its span of the model under its own profile, with the
settings every stage must share (weights, dtype, context). Rank 0 decides them all and sends each
worker its StageLoad, so a worker needs no command line of its own."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tierlm.device.cpu import apply_threads
from tierlm.kv.cache import KVCache
from tierlm.kv.paged import PagedKVCache, pages_for
from tierlm.runtime.loader import load_model
from tierlm.stages import StageSpan


@dataclass(frozen=True)
class StageLoad:
    """Rank `span.rank`'s load: `span` of `model_dir` under `profile` (None: no plan, every block
    resident). `context_length` is the pipeline's: every stage's KV cache has the same length."""

    model_dir: str
    span: StageSpan
    profile: object = None  # a Profile
    device: str | None = None
    dtype: object = None  # a torch.dtype; None: the device's compute dtype
    quant: str | None = None
    adapters: tuple = ()
    context_length: int | None = None
    threads: int | None = None  # None: the profile's, else the CPUs this process may use


def load_stage(load: StageLoad, progress=None, *, set_threads: bool = True):
    """The LoadedModel of `load`'s stage: only its blocks, planned under its profile. A worker
    sets its thread count first; rank 0 (`set_threads` False) keeps the one its session set."""
    profile = load.profile
    wanted = load.threads or (profile.threads if profile is not None else None)
    threads = apply_threads(wanted) if set_threads else torch.get_num_threads()
    if profile is not None:
        profile = replace(profile, threads=threads)
    return load_model(Path(load.model_dir), device=load.device, dtype=load.dtype, context_length=load.context_length,
                      quant=load.quant, adapters=load.adapters, profile=profile, stage=load.span,
                      progress=progress)  # fmt: skip


def stage_cache(loaded, slotted: bool, rows: int, max_len: int):
    """A KV cache for `loaded`'s stage alone (its layers only), the twin of one of rank 0's: a
    PagedKVCache of `rows` page tables, or a KVCache of batch `rows`, `max_len` positions long,
    in the stage's KV format (its profile's kv_cache). The twin's pool could hold every slot's
    whole context, but it takes pages only as rank 0's lengths grow (no pipeline shares pages),
    so it touches no more memory than rank 0's pool holds."""
    common = dict(device=loaded.device, dtype=loaded.dtype, layers=len(loaded.span.layers), kv_format=loaded.kv_format)
    if slotted:
        return PagedKVCache.for_model(loaded.config, max_len, rows, rows * pages_for(max_len), **common)
    return KVCache.for_model(loaded.config, max_len, batch=rows, **common)
