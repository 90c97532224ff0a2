"""Continuous batching over one model: each sequence in its own KV slot, decoded together.

The KV cache is paged (kv/paged.py): every slot is a page table over one pool sized by the
memory plan (the profile's batch_size contexts), so up to `parallel` sequences run at once as
long as their pages fit, and a slot holds only the pages its positions need. Before a step
takes pages, the runner makes room: first from slots no sequence runs in (their conversation's
rows spilled to host RAM first, oldest first), then by preempting the youngest running
sequence (its pages freed; it computes its prompt and tokens so far again when room returns,
and goes on with the same state). A prefill starts only when its whole prompt and a page for
each decoding sequence fit; until then it waits, and no new sequence is admitted.

A new sequence is prefilled alone into its slot (one chunk per step, so running sequences
keep decoding meanwhile), then joins the shared decode step: one forward over ids [n, 1] at
each sequence's own position (`LlamaModel.forward` over a `PagedBatch`, via `forward_batch`).
Each sequence carries its LoRA variant (None: the base); before each forward the runner tells
a variant store (store/variants.py) the variant of every row, so rows of different variants
share one decode step. A plain store has no variants and is not told.
Every sequence keeps its own `SequenceState` (sampler and seed, stop matcher, stream decoder,
limits), the one the engine uses too, so its tokens, text and finish reason are the ones it
would get decoded alone. Only the worker thread touches a runner.

A slot keeps what it last held after its sequence ends: the ids whose keys and values it holds,
for the variant they were computed with. A new job takes the free slot sharing the longest
prefix with its prompt and prefills only the rest, as the engine reuses its cache within a chat:
a chat client resending the whole conversation each turn pays for the new turn only. With no
prefix to share it takes the slot used longest ago, so several conversations keep their own.
When another slot, free or running, holds a longer prefix of the prompt (a system prompt every
conversation of a chat app starts with), its pages are shared into the job's slot instead of
being computed again: rows below a running sequence's length are final, a shared page is held
by both tables and copied before either writes into it, so a prefix costs no memory twice. When a slot
is taken from a conversation, its rows are copied out to a host-RAM store first (kv/spill.py,
within the room the memory plan leaves free) and copied back when that conversation returns.

A job with drafts on (`serve --draft ngram|MODEL`, or the request's `draft`) runs speculatively: when
its drafts find tokens (prompt lookup, or the draft model through a cache of the job's own while it
runs; runtime/speculative.py, runtime/draft_model.py), its pending token and the drafts are
verified by a forward over its own slot instead of the shared step, the rejection rule picks its
tokens as the engine's does, and the slot is cut back to the positions the sequence kept. Its
policy times those passes against its share of the shared step (a batch of B reads the weights
once for B tokens) and pauses drafting when they do not pay.

Failures are contained where they happen: an exception in one sequence's own work (admission,
its prefill or verification pass, sampling, detokenizing, stop matching, emitting) ends that
sequence alone with a 500; the shared decode forward's failure, and a pipeline stage's failure in
any forward, reach the caller, which fails the batch.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from tierlm.distributed.health import StageFailed
from tierlm.distributed.wire import StageUnreachable
from tierlm.kv.paged import pages_for
from tierlm.kv.spill import HeldRows, SpillStore
from tierlm.runtime.sampling import Sampler
from tierlm.runtime.sequence import PREFILL_CHUNK, SequenceState
from tierlm.runtime.speculative import DraftPolicy, PromptLookup, Verification, draft_limit
from tierlm.runtime.stopping import StopMatcher
from tierlm.server.jobs import Job


@dataclass(eq=False)  # identity, not field equality (it holds tensors)
class ActiveSequence:
    """A job's decoding state in slot `slot` (named apart from typing.Sequence)."""

    job: Job
    slot: int
    state: SequenceState  # sampling, stops and limits: the decisions
    admitted: int = 0  # admission order: the youngest is preempted first
    prefilled: int = 0  # ids of `prefill_ids` already in the slot (reused from its last sequence, then computed)
    pending: int | None = None  # the newest token, to be fed by the next decode step
    intact: bool = True  # False once a failure may have left the slot's keys and values half written
    resume: list[int] | None = None  # after a preemption: every id fed so far, computed again
    resume_token: int | None = None  # and the token to feed after them
    drafting: Drafting | None = None  # the job drafts tokens (speculative decoding); None: it does not

    @property
    def variant(self) -> str | None:
        return self.job.variant

    @property
    def prefill_ids(self) -> list[int]:
        return self.resume if self.resume is not None else self.job.prompt_ids

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prefill_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.state.token_ids


@dataclass
class Drafting:
    """A speculative sequence's drafts: what drafts over its tokens (prompt lookup, or a draft
    model's cache of its own) and the policy timing its passes."""

    drafter: object  # PromptLookup or runtime/draft_model.py ModelDrafts: extend, draft, take_overhead
    policy: DraftPolicy
    draft_model: object = None  # the DraftModel whose cache it holds, given back when it ends


@dataclass
class StepReport:
    """What one `step()` did, for the metrics."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    batch: int = 0  # sequences in the decode step (0: no decode step ran)
    decode_s: float = 0.0
    sampled: int = 0  # tokens generated (a finished prefill samples one too)
    drafted: int = 0  # tokens drafted and verified (speculative sequences)
    accepted: int = 0  # of those, the ones that stood


class BatchRunner:
    """Up to `parallel` sequences over one model and one paged KV cache of `contexts` full contexts."""

    def __init__(self, loaded, tokenizer, contexts: int = 1, spill_bytes: int = 0, spill_disk=None, *,
                 parallel: int | None = None, slots: int | None = None, draft_model=None):  # fmt: skip
        """`contexts`: the pool's size in full contexts (the profile's batch_size: what the plan
        charges); `parallel`: the most sequences run at once (default PARALLEL_PER_CONTEXT per
        context); `slots`: page tables, running or keeping an idle conversation's rows (default
        twice `parallel`); `spill_bytes`: host RAM for the rows of conversations whose pages were
        taken (0: none); `spill_disk`: a kv/spill.py DiskSpill where they go on to (None: dropped);
        `draft_model`: the DraftModel jobs drafting with a model use, one cache per running sequence
        (its twins share its weights; the plan charged them)."""
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = tokenizer
        self.parallel = sequences_at_once(contexts, parallel)
        self.contexts = contexts
        tables = slots or 2 * self.parallel
        self.cache = loaded.new_paged_cache(tables, contexts)  # this stage's layers
        self.active: list[ActiveSequence] = []
        self._free = list(range(tables))
        self._held = [HeldRows() for _ in range(tables)]
        self._sampled = 0
        self._admissions = 0
        self._starved = False  # a prefill waits for pages: admit nothing more until it runs
        self.counts = PageCounts()
        # What verification passes cost here, per drafter (DraftPolicy): a draft model's include its steps.
        self.pass_costs: dict[str, dict[int, float]] = {}
        self.draft_model = draft_model
        self._draft_models = [draft_model] if draft_model is not None else []  # free ones
        self._draft_twins = self.parallel - 1 if draft_model is not None else 0  # yet to be made
        # A pipeline's other stages keep twins of each slot that only ever compute their rows.
        self._copies_rows = getattr(loaded, "pipeline", None) is None
        self.spill = SpillStore(spill_bytes, spill_disk) if self._copies_rows else SpillStore(0)

    @property
    def context_length(self) -> int:
        return self.cache.max_len

    @property
    def has_room(self) -> bool:
        return len(self.active) < self.parallel and bool(self._free) and not self._starved

    def page_stats(self) -> dict:
        """The KV pool's pages: in use (and of those, shared by several slots or kept only for
        idle conversations), free, and what was taken back (idle slots, preempted sequences)."""
        cache, pool = self.cache, self.cache.pool
        running = {s.slot for s in self.active}
        held_by_running = {page for slot in running for page in cache.tables[slot]}
        return {"page_tokens": cache.page_tokens, "total": pool.size, "used": pool.used, "free": pool.free,
                "shared": sum(1 for n in pool.holders if n > 1), "idle": pool.used - len(held_by_running),
                "parallel": self.parallel, "running": len(running), "reclaimed": self.counts.reclaimed,
                "preempted": self.counts.preempted}  # fmt: skip

    def jobs(self) -> list[Job]:
        return [s.job for s in list(self.active)]

    def admit(self, job: Job) -> ActiveSequence | None:
        """Give `job` a free slot (cheap: no model work until `step`); None if it failed to start."""
        try:
            self._check_variant(job)
            slot, reused = self._pick_slot(job)
            seq = self._sequence(job, slot)
        except VariantGone as err:
            job.fail(str(err), status=404, code="model_not_found")
            return None
        except Exception as err:  # noqa: BLE001 - this job's settings, not the batch, are at fault
            _fail_job(job, err)
            return None
        self._free.remove(slot)
        self._spill_out(slot, reused)
        self.cache.set_length(slot, reused)  # the rest of its pages go back to the pool
        try:
            reused = max(reused, self._copy_prefix(job, slot, reused))
        except Exception:  # noqa: BLE001 - the rows may be half copied: compute them all instead
            logging.getLogger("tierlm.server").exception("taking a prefix into slot %d failed", slot)
            reused = 0
        # The last prompt token always runs: its logits pick the first new token.
        seq.prefilled = job.cached_tokens = min(reused, len(job.prompt_ids) - 1)
        self.cache.slot(slot).trim(seq.prefilled)
        self._admissions += 1
        seq.admitted = self._admissions
        self.active.append(seq)
        return seq

    def _pick_slot(self, job: Job) -> tuple[int, int]:
        """The free slot for `job` and how many of its prompt's ids that slot holds already.

        A slot whose held ids the prompt mostly continues (more shared than thrown away) is taken,
        the best such first; otherwise the slot used longest ago: a prompt sharing only the chat
        template's first tokens must not take another conversation's slot while an older one is free.
        """
        overlay = self._overlay(job.variant)
        shared = {slot: self._held[slot].shared_prefix(job.prompt_ids, job.variant, overlay) for slot in self._free}
        gain = {slot: 2 * shared[slot] - len(self._held[slot].ids) for slot in self._free}  # kept - dropped
        slot = max(self._free, key=lambda s: (gain[s], -self._held[s].used_at))
        if gain[slot] <= 0:
            slot = min(self._free, key=lambda s: self._held[s].used_at)
        return slot, min(shared[slot], self.cache.lengths[slot])

    def _copy_prefix(self, job: Job, slot: int, reused: int) -> int:
        """Copy into `slot` the rows of the slot holding the longest prefix of `job`'s prompt
        (same variant) when that beats the `reused` rows `slot` holds; the rows `slot` now holds
        of the prompt."""
        overlay = self._overlay(job.variant)
        held = {s: self._held[s] for s in self._free if s != slot}
        held.update({seq.slot: self._history(seq, keep=True) for seq in self.active})
        shared = {s: min(h.shared_prefix(job.prompt_ids, job.variant, overlay), self.cache.lengths[s])
                  for s, h in held.items()}  # fmt: skip
        donor = max(shared, key=shared.get, default=None)
        spilled, kept = self.spill.best(job.prompt_ids, job.variant, overlay)
        kept = min(kept, self.context_length)
        if not self._copies_rows or max(shared.get(donor, 0), kept) < reused + MIN_COPIED_ROWS:
            return reused
        if kept > shared.get(donor, 0) and self._room(pages_for(kept), keep={slot}):
            # The conversation's own rows, back from host RAM or disk.
            rows = self.cache.empty_rows(kept)
            if self.spill.take(spilled, rows, kept):
                self.cache.write_rows(slot, rows, kept)
                return kept
        if shared.get(donor, 0) < reused + MIN_COPIED_ROWS or not self._room(1, keep={slot, donor}):
            return reused  # a damaged file, or no page for the copy: computed again
        self.cache.share_rows(donor, slot, shared[donor])
        return shared[donor]

    def _spill_out(self, slot: int, kept: int) -> None:
        """Before `slot` is overwritten past its first `kept` rows, keep a copy of all it holds
        (a conversation that may come back) when it holds enough to be worth it."""
        held = self._held[slot]
        length = min(len(held.ids), self.cache.lengths[slot])
        if (self.spill.capacity or self.spill.disk is not None) and length >= kept + MIN_COPIED_ROWS:
            try:
                self.spill.put(held.ids[:length], held.variant, held.overlay, self.cache.rows_of(slot, length))
            except Exception:  # noqa: BLE001 - a lost copy costs a recomputation later, never this request
                logging.getLogger("tierlm.server").exception("keeping slot %d's rows failed", slot)

    def _overlay(self, variant: str | None):
        """The variant's current overlay object (its identity tells a re-added variant apart)."""
        overlay = getattr(self.model.store, "overlay", None)
        return overlay(variant) if variant is not None and overlay is not None else None

    def step(self) -> StepReport:
        """One prefill chunk for the oldest sequence still prefilling, then one decode step for
        every sequence that has a token to feed."""
        report = StepReport()
        sampled_before = self._sampled
        self._starved = False
        prefilling = next((s for s in self.active if s.prefilling), None)
        if prefilling is not None:
            # Room for the rest of its prompt and a page for each sequence decoding: a prefill that
            # would soon be preempted again by the older sequences' growth waits instead.
            decoding = sum(1 for s in self.active if s.pending is not None)
            needed = self.cache.pages_needed(prefilling.slot, len(prefilling.prefill_ids)) + decoding
            self._starved = not self._room(needed, prefilling)
        if prefilling is not None and not self._starved:
            started = time.perf_counter()
            # A prefill writes only its own slot, so its failure is that sequence's alone.
            report.prefill_tokens = self._contained(prefilling, self._prefill_chunk) or 0
            report.prefill_s = time.perf_counter() - started
        ready = self._ready()
        if ready:
            started = time.perf_counter()
            drafts, drafting_s = {}, {}
            for seq in (s for s in ready if s.drafting is not None):
                began = time.perf_counter()
                drafts[seq] = self._contained(seq, self._drafts)  # a draft model's failure is this sequence's
                # What a pass pays to draft (a draft model's steps), its catch-up on a pause left out.
                drafting_s[seq] = time.perf_counter() - began - seq.drafting.drafter.take_overhead()
            ready = [seq for seq in ready if seq in self.active]
            verifying = [seq for seq in ready if drafts.get(seq)]
            plain = [seq for seq in ready if not drafts.get(seq)]
            decode_began = time.perf_counter()
            for group in self._decode_groups(plain) if plain else ():
                self._decode(group)
            # What a token of the shared step costs the machine: its share of the step. A pass runs
            # alone, so drafting pays only where it beats that share (batched, it seldom does).
            token_s = (time.perf_counter() - decode_began) / max(len(plain), 1)
            for seq in plain:
                if seq.drafting is not None:
                    seq.drafting.policy.plain_step(token_s)
            for seq in verifying:
                counts = self._contained(seq, self._verify, drafts[seq], drafting_s[seq])
                if counts is not None:
                    report.drafted += counts[0]
                    report.accepted += counts[1]
            report.batch = len(ready)
            report.decode_s = time.perf_counter() - started
        report.sampled = self._sampled - sampled_before
        return report

    def end(self, seq: ActiveSequence, reason: str) -> None:
        """End a sequence early (deadline: the text so far is flushed; cancel: nothing more)."""
        if reason != "cancelled":
            self._contained(seq, self._flush)
        seq.job.finish(reason, len(seq.token_ids))
        self._release(seq)

    def fail_all(self, message: str) -> None:
        for seq in list(self.active):
            seq.job.fail(message)
            seq.intact = False  # the failed forward may have written some layers of the step
            self._release(seq)

    # -- internals -------------------------------------------------------------------------

    def _check_variant(self, job: Job) -> None:
        """A job for a variant removed since its request was accepted ends with a 404."""
        names = getattr(self.model.store, "names", None)
        if job.variant is not None and (names is None or job.variant not in names()):
            raise VariantGone(f"The model `{job.variant}` was removed from this server before this request "
                              "started; GET /v1/models lists what it serves")

    def _sequence(self, job: Job, slot: int) -> ActiveSequence:
        params = job.params
        # Sampler and StopMatcher are looked up here, so tests can inject a failing one.
        state = SequenceState(job.prompt_ids, params, self.tokenizer, self.context_length,
                              sampler=Sampler(params), stops=StopMatcher(params.stop))
        return ActiveSequence(job, slot, state, drafting=self._drafting(job))

    def _drafting(self, job: Job) -> Drafting | None:
        """How `job` drafts: prompt lookup, a draft model's cache of its own (none free: it decodes
        plainly), or not at all."""
        draft = job.draft
        if draft is None or not draft.enabled:
            return None
        if not draft.uses_model:
            lookup = PromptLookup(job.prompt_ids)
            return Drafting(lookup, DraftPolicy(draft.tokens, self.pass_costs.setdefault("lookup", {})))
        if not self._draft_models and self._draft_twins > 0:
            self._draft_twins -= 1
            self._draft_models.append(self.draft_model.twin())
        if not self._draft_models:
            return None
        model = self._draft_models.pop()
        policy = DraftPolicy(draft.tokens, self.pass_costs.setdefault("model", {}))
        return Drafting(model.drafts_for(job.prompt_ids), policy, model)

    def _contained(self, seq: ActiveSequence, work: Callable, *args):
        """`work(seq, *args)`; an exception ends `seq` alone with an error, never the batch, unless
        a pipeline stage failed under it: that is every sequence's, and reaches the caller (whose
        restart ends them all with the reason)."""
        try:
            return work(seq, *args)
        except (StageFailed, StageUnreachable):
            raise
        except Exception as err:  # noqa: BLE001 - whatever broke, it broke for this sequence only
            _fail_job(seq.job, err)
            seq.intact = False
            self._release(seq)
            return None

    def _prefill_chunk(self, seq: ActiveSequence) -> int:
        chunk = seq.prefill_ids[seq.prefilled : seq.prefilled + PREFILL_CHUNK]
        ids = torch.tensor([chunk], dtype=torch.long, device=self.loaded.device)
        self._select([seq.variant])
        logits = self.model.forward(ids, self.cache.slot(seq.slot), logits="last")
        seq.prefilled += len(chunk)
        if not seq.prefilling and seq.resume is not None:  # back where it was preempted
            seq.pending, seq.resume, seq.resume_token = seq.resume_token, None, None
        elif not seq.prefilling:
            self._accept(seq, logits[0, -1])
        return len(chunk)

    # -- pages -----------------------------------------------------------------------------

    def _ready(self) -> list[ActiveSequence]:
        """The sequences with a token to feed whose next page is there: oldest first, each one's
        room made from idle slots and younger sequences (preempted); one that finds none is
        preempted itself."""
        for seq in sorted(self.active, key=lambda s: s.admitted):
            if seq.pending is not None and seq in self.active:
                needed = self.cache.pages_needed(seq.slot, self.cache.lengths[seq.slot] + 1)
                if not self._room(needed, seq):
                    self._preempt(seq)
        return [s for s in self.active if s.pending is not None]

    def _room(self, pages: int, seq: ActiveSequence | None = None, keep: set[int] = frozenset()) -> bool:
        """Whether `pages` pages are free, after taking the pages of idle slots (but `keep`),
        least recently used first, and then (for `seq`) preempting sequences younger than it,
        youngest first. Nothing is taken when all of that would still not be enough."""
        pool, tables = self.cache.pool, self.cache.tables
        idle = sorted((s for s in self._free if s not in keep and tables[s]), key=lambda s: self._held[s].used_at)
        younger = [o for o in sorted(self.active, key=lambda o: -o.admitted)
                   if seq is not None and o.admitted > seq.admitted and tables[o.slot]]  # fmt: skip
        held = [*idle, *(o.slot for o in younger)]
        if pool.free + sum(self._own_pages(s) for s in held) < pages:
            return pool.free >= pages
        for slot in idle:
            if pool.free >= pages:
                return True
            self._spill_out(slot, 0)
            self.cache.free(slot)
            self._held[slot] = HeldRows(used_at=self._held[slot].used_at)
            self.counts.reclaimed += 1
        for other in younger:
            if pool.free >= pages:
                break
            self._preempt(other)
        return pool.free >= pages

    def _own_pages(self, slot: int) -> int:
        """Pages freeing `slot` gives back (those no other table holds)."""
        return sum(1 for page in self.cache.tables[slot] if not self.cache.pool.shared(page))

    def _preempt(self, seq: ActiveSequence) -> None:
        """Free `seq`'s pages; it computes every id fed so far again when there is room, then goes
        on with the token it was about to feed (its state is untouched). Its prompt then counts
        as computed, not reused."""
        if seq.pending is not None:
            seq.resume, seq.resume_token = [*seq.job.prompt_ids, *seq.token_ids[:-1]], seq.pending
            seq.pending = None
        seq.prefilled = seq.job.cached_tokens = 0
        self.cache.free(seq.slot)
        self.counts.preempted += 1

    def _decode_groups(self, ready: list[ActiveSequence]) -> list[list[ActiveSequence]]:
        """`ready` as the decode steps to run: one, where the step reads the pages in place (the
        fused CPU step); else (an eager or graphed step gathers every row's keys and values over
        the longest row's span) groups of rows of similar length whose span, summed over rows,
        stays within the pool's positions: the read-back the plan charges a step for."""
        if self._reads_in_place():
            return [ready]
        budget = self.contexts * self.cache.max_len
        groups: list[list[ActiveSequence]] = [[]]
        for seq in sorted(ready, key=lambda s: self.cache.lengths[s.slot]):
            if groups[-1] and (len(groups[-1]) + 1) * (self.cache.lengths[seq.slot] + 1) > budget:
                groups.append([])
            groups[-1].append(seq)
        return groups

    def _reads_in_place(self) -> bool:
        """Whether a decode step reads the cache's pages where they are (models/fused_decode.py)."""
        from tierlm.device.cpu import fused_decode_enabled
        from tierlm.models.fused_decode import native_library

        loaded = self.loaded
        cpu = loaded.device.type == "cpu" and loaded.dtype == torch.float32
        return cpu and fused_decode_enabled() and native_library() is not None

    def _decode(self, ready: list[ActiveSequence]) -> None:
        ids = torch.tensor([[s.pending] for s in ready], dtype=torch.long, device=self.loaded.device)
        self._select([s.variant for s in ready])
        logits = self.model.forward_batch(ids, self.cache.batch([s.slot for s in ready]))
        for seq, row in zip(ready, logits):
            self._contained(seq, self._accept, row)

    def _drafts(self, seq: ActiveSequence) -> list[int]:
        """The tokens `seq` drafts after its pending one: as many as its policy allows, its context
        and token budget leave room for, and free pages hold (drafts never take pages from others)."""
        length = self.cache.lengths[seq.slot]
        limit = draft_limit(seq.drafting.policy.allowed(), self.context_length - length,
                            seq.state.params.max_new_tokens - len(seq.token_ids))
        drafts = seq.drafting.drafter.draft(limit) if limit > 0 else []
        if drafts and self.cache.pages_needed(seq.slot, length + 1 + len(drafts)) > self.cache.pool.free:
            return []
        return drafts

    def _verify(self, seq: ActiveSequence, drafts: list[int], drafting_s: float = 0.0) -> tuple[int, int]:
        """Feed `seq`'s pending token and `drafts` in one forward over its slot, take tokens row by
        row while the drafts stand (the rejection rule: SequenceState.verify), then cut the slot
        back to the positions kept; (drafted, accepted). `drafting_s`: what drafting them took,
        part of the pass's cost."""
        base = self.cache.lengths[seq.slot]
        ids = torch.tensor([[seq.pending, *drafts]], dtype=torch.long, device=self.loaded.device)
        self._select([seq.variant])
        started = time.perf_counter()
        rows = self.model.forward(ids, self.cache.slot(seq.slot), logits="all", as_steps=True)[0]
        verification = Verification(rows, drafts, base)
        while self._take(seq, verification.next_token(seq.state)) and verification.standing:
            pass
        self.cache.slot(seq.slot).trim(verification.kept)
        seq.drafting.policy.verified(len(drafts), verification.accepted, time.perf_counter() - started + drafting_s)
        return len(drafts), verification.accepted

    def _select(self, rows: list[str | None]) -> None:
        """Name each row's variant for the next forward (a store without variants needs nothing)."""
        select = getattr(self.model.store, "select", None)
        if select is not None:
            select(rows)

    def _accept(self, seq: ActiveSequence, logits: torch.Tensor) -> None:
        """Sample the next token from logits [V]; the sequence's state decides whether it goes on."""
        seq.pending = None
        self._take(seq, seq.state.sample(logits))

    def _take(self, seq: ActiveSequence, token: int) -> bool:
        """Record `seq`'s next token and emit its text; False when the sequence ended with it."""
        seq.pending = None
        self._sampled += 1
        if seq.job.first_token_at is None:
            seq.job.first_token_at = time.monotonic()
        text, reason = seq.state.accept(token)
        # Counted live: a request ended from the handler's side (client gone, deadline) keeps its count.
        if not seq.job.closed:
            seq.job.completion_tokens = len(seq.token_ids)
        seq.job.emit_text(text)
        if reason is not None:
            seq.job.finish(reason, len(seq.token_ids))
            self._release(seq)
            return False
        seq.pending = token
        if seq.drafting is not None:
            seq.drafting.drafter.extend([token])
        return True

    def _flush(self, seq: ActiveSequence) -> None:
        """Emit text still held back: an incomplete character, a possible stop-string prefix."""
        seq.job.emit_text(seq.state.flush())

    def _release(self, seq: ActiveSequence) -> None:
        if seq in self.active:
            self.active.remove(seq)
            if seq.drafting is not None and seq.drafting.draft_model is not None:
                self._draft_models.append(seq.drafting.draft_model)  # its cache keeps the conversation
            self._held[seq.slot] = self._history(seq)
            self._free.append(seq.slot)
            self._free.sort()

    def _history(self, seq: ActiveSequence, keep: bool = False) -> HeldRows:
        """What `seq`'s slot holds once it ends (or, `keep`, holds now, running): its prompt and
        the tokens fed back, as far as the slot's length (the last sampled token was never fed);
        nothing after a failure."""
        held = self.cache.lengths[seq.slot]
        if keep:
            return HeldRows([*seq.job.prompt_ids, *seq.token_ids][:held], seq.variant,
                               _weak(self._overlay(seq.variant)), time.monotonic())  # fmt: skip
        if not seq.intact:
            self.cache.free(seq.slot)
            return HeldRows(used_at=time.monotonic())
        overlay = self._overlay(seq.variant)
        return HeldRows([*seq.job.prompt_ids, *seq.token_ids][:held], seq.variant,
                           weakref.ref(overlay) if overlay is not None else None, time.monotonic())  # fmt: skip


# Fewer rows than this are computed rather than copied from another slot (a chat template's
# first tokens, which every prompt shares, are not worth a copy of every layer's rows).
MIN_COPIED_ROWS = 16
# Sequences run at once per context the pool holds: most replies use a fraction of the context.
PARALLEL_PER_CONTEXT = 4


def sequences_at_once(contexts: int, parallel: int | None) -> int:
    """The most sequences a runner decodes together: `parallel`, else PARALLEL_PER_CONTEXT per context."""
    return parallel or PARALLEL_PER_CONTEXT * contexts


@dataclass
class PageCounts:
    """What the runner did with pages, for /stats and /metrics."""

    reclaimed: int = 0  # idle slots whose pages were taken for another sequence
    preempted: int = 0  # running sequences whose pages were taken (computed again later)


def _weak(overlay):
    return weakref.ref(overlay) if overlay is not None else None


class VariantGone(Exception):
    pass


def _fail_job(job: Job, err: Exception) -> None:
    # A bug or an input nothing validated: logged in full for the operator; the client gets a 500.
    logging.getLogger("tierlm.server").exception("request %d failed", job.number)
    job.fail(f"generating this reply failed: {type(err).__name__}: {err}", status=500, code="internal_error")
