"""Rank 0's side of a pipeline: a model with the family model's interface (`forward`,
`forward_batch`, `config`, `store`) whose forward runs rank 0's stage and then the rest of the
chain, so the engine and the server's batch runner drive a pipeline unchanged.

Rank 0 embeds and runs the first layers; each worker (distributed/worker.py) runs its layers on
its own KV cache, a twin of rank 0's cache holding only its layers; the last stage's logits come
back to rank 0, which samples. Batched decode is cut into micro-batches (groups of rows), so
while stage 1 runs group g rank 0 already computes group g + 1 and every stage is busy.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import replace
from pathlib import Path

import torch

from tierlm.device.resolve import resolve_device
from tierlm.distributed.launch import GroupSettings, start_group
from tierlm.distributed.stage_load import StageLoad, load_stage
from tierlm.distributed.wire import CONTIGUOUS, LOAD, RELEASE, SLOT_BATCH, SLOT_VIEW, StepHeader, control
from tierlm.errors import TierlmError
from tierlm.kv.paged import PagedBatch, PagedView
from tierlm.models import read_config
from tierlm.runtime.loader import context_for
from tierlm.stages import StageSpan, even_split


def plan_spans(config, stages: int) -> list[StageSpan]:
    """Each rank's layers: as many layers per stage as the split allows (earlier ranks larger)."""
    return even_split(config.num_hidden_layers, stages)


class PipelineModel:
    """Rank 0's stage (`loaded`, a LoadedModel of span 0) followed by the workers of `group`."""

    def __init__(self, loaded, group, spans: list[StageSpan], reports: list[dict], *, owns_group: bool):
        self.stage = loaded.model
        self.config = loaded.config
        self.store = loaded.store
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.max_len = loaded.max_len
        self.spans = spans
        self.reports = reports  # what each worker said when its stage loaded (rank order from 1)
        self.loads: list = []  # every rank's StageLoad: what a restart loads again (supervisor.py)
        self.group = group
        self.owns_group = owns_group
        self.link = group.link()
        self.world = group.world
        self.closed = False
        # Each of rank 0's caches has an id its twin on every worker goes by; a cache that is
        # garbage collected is named in the next step's header, so the workers drop their twin.
        self._cache_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next_id = itertools.count(1)
        self._dropped: list[int] = []

    @property
    def last(self) -> int:
        return self.world - 1

    def describe(self) -> list[str]:
        """One line per stage: its layers and what its rank reported."""
        lines = [self.spans[0].describe()]
        lines += [report["describe"] for report in self.reports]
        return lines

    def forward(self, ids: torch.Tensor, cache, logits: str = "last", *, as_steps: bool = False) -> torch.Tensor:
        """ids [B, T] through every stage; logits [B, T or 1, V] (fp32) as a whole model gives them.
        `as_steps` reaches this process's stage (the others compute a chunk as a prefill)."""
        step = self._header(cache, ids.shape[0], ids.shape[1], logits == "all")
        hidden = self.stage.forward(ids, cache, logits, as_steps=as_steps)
        sends = self._send(step, hidden)
        out = self._recv_logits(step)
        self.link.wait(sends, 1)
        return out

    def forward_batch(self, ids: torch.Tensor, batch) -> torch.Tensor:
        """One decode step over a PagedBatch: ids [B, 1] -> logits [B, V], in micro-batches: the
        rows split into min(B, stages) groups, each sent on while the next is computed."""
        rows = ids.shape[0]
        groups = [g for g in torch.arange(rows).tensor_split(min(rows, self.world)) if len(g)]
        if len(groups) == 1:
            return self.forward(ids, batch)[:, -1]
        sends, steps = [], []
        for group in groups:
            rows_of = group.tolist()
            sub = batch.parent.batch([batch.slots[i] for i in rows_of])
            step = self._header(sub, len(rows_of), 1, False)
            hidden = self.stage.forward(ids[rows_of[0] : rows_of[-1] + 1], sub)
            sends += self._send(step, hidden)
            steps.append(step)
        out = torch.cat([self._recv_logits(step) for step in steps])
        self.link.wait(sends, 1)
        return out[:, -1]

    def close(self) -> None:
        """Release every worker's stage; end the workers too when this model started them."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self.group.closed:
                self.link.send(control(RELEASE, self.link.device), 1)
        except TierlmError:
            pass  # a stage that is gone holds nothing to release
        finally:
            if self.owns_group:
                self.group.close()

    # -- the wire ------------------------------------------------------------------------------

    def _header(self, cache, rows: int, length: int, all_logits: bool) -> StepHeader:
        """Where `rows` x `length` new tokens go in `cache`: each row's length before the step."""
        root = cache.parent if isinstance(cache, (PagedView, PagedBatch)) else cache
        cache_id = self._cache_id(root)
        dropped, self._dropped = tuple(self._dropped), []
        common = dict(cache_id=cache_id, rows=rows, length=length, all_logits=all_logits, dtype=self.dtype,
                      max_len=root.max_len, dropped=dropped)  # fmt: skip
        if isinstance(cache, (PagedView, PagedBatch)):
            common["shrunk"], root.shrunk = tuple(sorted(root.shrunk.items())), {}
        if isinstance(cache, PagedBatch):
            lengths = tuple(root.lengths[s] for s in cache.slots)
            return StepHeader(kind=SLOT_BATCH, cache_rows=root.slots, slots=tuple(cache.slots), lengths=lengths, **common)
        if isinstance(cache, PagedView):
            return StepHeader(kind=SLOT_VIEW, cache_rows=root.slots, slot=cache.index, offset=cache.offset, **common)
        return StepHeader(kind=CONTIGUOUS, cache_rows=root.keys.shape[1], offset=cache.offset, **common)

    def _cache_id(self, root) -> int:
        cache_id = self._cache_ids.get(root)
        if cache_id is None:
            cache_id = self._cache_ids[root] = next(self._next_id)
            weakref.finalize(root, self._dropped.append, cache_id)
        return cache_id

    def _send(self, step: StepHeader, hidden: torch.Tensor) -> list:
        """Start sending a step to stage 1: header, extra, hidden states (sent as they are)."""
        header, extra = step.encode(self.link.device)
        works = [(self.link.isend(header, 1), header)]
        if extra is not None:
            works.append((self.link.isend(extra, 1), extra))
        hidden = hidden.contiguous()  # the stage's output already is: no copy
        works.append((self.link.isend(hidden, 1), hidden))
        return [work for work, _ in works]

    def _recv_logits(self, step: StepHeader) -> torch.Tensor:
        shape = (step.rows, step.length if step.all_logits else 1, self.config.vocab_size)
        return self.link.recv(shape, torch.float32, self.last)


def load_pipeline(group, loads: list[StageLoad], *, owns_group: bool = True, progress=None):
    """Every rank loads its stage of `loads` (one per rank, rank order) at once; returns rank 0's
    LoadedModel whose model is the PipelineModel over them all. A stage that fails to load fails
    the whole with a TierlmError naming it (the others release what they loaded)."""
    link = group.link()
    link.send(control(LOAD, link.device), 1)
    link.send_object(loads, 1)
    try:
        loaded = load_stage(loads[0], progress, set_threads=False)
    except BaseException as err:
        _collect_reports(link, group.world)  # the workers finish loading before they can release
        link.send(control(RELEASE, link.device), 1)
        if isinstance(err, TierlmError):
            raise TierlmError(f"pipeline stage 0: {err.message}", err.hint) from None
        raise
    reports = _collect_reports(link, group.world)
    failed = next((r for r in reports if not r["ok"]), None)
    mismatch = next((r for r in reports if r["ok"] and (r["max_len"], r["dtype"]) != (loaded.max_len, str(loaded.dtype))), None)
    if failed or mismatch:
        link.send(control(RELEASE, link.device), 1)
        loaded.close()
        if failed:
            raise TierlmError(f"pipeline stage {failed['rank']} failed to load: {failed['error']}", failed.get("hint"))
        raise TierlmError(f"pipeline stage {mismatch['rank']} loaded a context of {mismatch['max_len']} in "
                          f"{mismatch['dtype']}, stage 0 {loaded.max_len} in {loaded.dtype}",
                          "give every stage the same --dtype and context_length")  # fmt: skip
    loaded.model = PipelineModel(loaded, group, [load.span for load in loads], reports, owns_group=owns_group)
    loaded.model.loads = loads
    return loaded


def _collect_reports(link, world: int) -> list[dict]:
    return [link.recv_object(rank) for rank in range(1, world)]


def stage_loads(model_dir: Path, config, profiles: list, *, context_length: int | None = None, **common) -> list[StageLoad]:
    """One StageLoad per profile (one stage each): the layers split by `plan_spans`, every stage
    with the same context (the shortest its profiles allow) and `common` settings (device,
    dtype, quant, adapters, threads)."""
    if context_length is None and any(p is not None for p in profiles):
        context_length = min(context_for(config, None, p) for p in profiles)
    # Every stage keeps a KV cache for as many sequences as rank 0 serves (serve --batch-size).
    batch = profiles[0].batch_size if profiles[0] is not None else None
    profiles = [replace(p, batch_size=batch) if p is not None and batch else p for p in profiles]
    spans = plan_spans(config, len(profiles))
    return [StageLoad(str(model_dir), span, profile, context_length=context_length, **common)
            for span, profile in zip(spans, profiles)]  # fmt: skip


def pipeline_load(profiles: list, *, stage_timeout: float | None = None, **common):
    """runtime/session.py `open_session`'s `load` for a pipeline of len(profiles) stages: this
    process is rank 0, under the profile the session passes; `common` are the command's own
    settings (device, quant, threads), which every rank resolves for itself."""

    def load(source, *, profile, dtype=None, progress=None, **_):
        return open_pipeline(source.directory, [profile, *profiles[1:]], stage_timeout=stage_timeout, dtype=dtype,
                             adapters=source.adapters, progress=progress, **common)  # fmt: skip

    return load


def open_pipeline(model_dir: Path, profiles: list, *, progress=None, stage_timeout: float | None = None, **common):
    """Start a pipeline of len(profiles) stages (spawned here, or torchrun's processes) and load
    it; returns rank 0's LoadedModel (its model a PipelineModel that owns the group).
    `stage_timeout`: seconds a stage may go without a heartbeat (distributed/health.py)."""
    device = resolve_device(common.get("device"))
    config = read_config(Path(model_dir))
    loads = stage_loads(model_dir, config, profiles, **common)
    group = start_group(GroupSettings.of(len(profiles), device, stage_timeout=stage_timeout))
    try:
        loaded = load_pipeline(group, loads, owns_group=True, progress=progress)
    except BaseException:
        group.close()
        raise
    loaded.pipeline = loaded.model  # the session closes the stages with it
    return loaded
