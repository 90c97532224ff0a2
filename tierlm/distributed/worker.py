"""A pipeline worker: rank r > 0 runs its stage for rank 0 until told to stop.

A process spawned by `--stages N` (launch.py's WORKER_PROGRAM runs `main`; rank and rendezvous in
the environment), or a torchrun process whose rank is not 0 (the CLI calls `serve_stage`). The loop
receives only from rank r - 1: LOAD (every rank's StageLoad: it passes them on, loads its own and
reports to rank 0), STEP (set its twin cache's lengths from the header, run its layers, send the
hidden states on, or the logits back to rank 0 from the last stage), RELEASE (drop the stage),
SHUTDOWN (pass it on and exit). A worker whose rank 0 is gone exits: its link breaks, and a
spawned one also watches its parent process.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from tierlm.distributed import wire
from tierlm.distributed.health import Heartbeat
from tierlm.distributed.launch import join_group, join_health
from tierlm.distributed.ranks import BACKEND_ENV, PARENT_ENV, rank_env, timeout_s
from tierlm.distributed.stage_load import load_stage, stage_cache
from tierlm.errors import TierlmError
from tierlm.profile import format_size

PARENT_POLL_S = 0.5


class StageWorker:
    """Rank `rank` of `world`: its loaded stage, its twins of rank 0's caches, its pending sends."""

    def __init__(self, rank: int, world: int, device=None):
        self.link = wire.Link(rank, world, device)
        self.rank, self.world = rank, world
        self.previous, self.next = rank - 1, rank + 1
        self.is_last = rank == world - 1
        self.loaded = None
        self.caches: dict[int, object] = {}
        self.sending: list[tuple] = []  # (work, tensors kept alive until it completes)

    def run(self) -> None:
        """Serve messages until SHUTDOWN."""
        while True:
            header = self.link.recv((wire.HEADER_FIELDS,), torch.long, self.previous)
            op = int(header[0])
            if op == wire.STEP:
                self.step(header)
            elif op == wire.LOAD:
                self.load(header)
            elif op == wire.RELEASE:
                self.pass_on(header)
                self.release()
            elif op == wire.SHUTDOWN:
                self.pass_on(header)
                self.finish_sends()
                self.release()
                return
            else:
                raise TierlmError(f"pipeline stage {self.rank} received unknown op {op}")

    def pass_on(self, *tensors) -> None:
        if not self.is_last:
            for tensor in tensors:
                self.sending.append((self.link.isend(tensor, self.next), tensor))

    def load(self, header) -> None:
        loads = self.link.recv_object(self.previous)
        self.pass_on(header)
        if not self.is_last:
            self.link.send_object(loads, self.next)  # before loading: the stages load at once
        self.release()
        report = {"rank": self.rank, "ok": False}
        try:
            self.loaded = load_stage(loads[self.rank])
            report.update(ok=True, max_len=self.loaded.max_len, dtype=str(self.loaded.dtype),
                          describe=self.describe())  # fmt: skip
        except TierlmError as err:
            report.update(error=err.message, hint=err.hint)
        except Exception as err:  # noqa: BLE001 - reported to rank 0, which fails the load with it
            traceback.print_exc()
            report.update(error=f"{type(err).__name__}: {err}")
        self.link.send_object(report, 0)

    def describe(self) -> str:
        text = self.loaded.span.describe()
        placement = self.loaded.placement
        if placement is not None:
            tiers = ", ".join(f"{tier} {format_size(n)}" for tier, n in placement.block_bytes_by_tier().items())
            text += f" ({tiers})"
        return text

    def step(self, header: torch.Tensor) -> None:
        fields = header.tolist()
        count = wire.StepHeader.extra_count(fields)
        extra = self.link.recv((count,), torch.long, self.previous) if count else None
        step = wire.StepHeader.decode(fields, extra.tolist() if extra is not None else [])
        for cache_id in step.dropped:
            self.caches.pop(cache_id, None)
        if self.loaded is None:
            raise TierlmError(f"pipeline stage {self.rank} received a step before its stage was loaded")
        hidden_size = self.loaded.config.hidden_size
        hidden = self.link.recv((step.rows, step.length, hidden_size), step.dtype, self.previous)
        out = self.loaded.model.forward(hidden, self.position(step), "all" if step.all_logits else "last")
        self.prune_sends()
        if self.is_last:
            self.sending.append((self.link.isend(out, 0), out))
        else:
            self.pass_on(header, *([extra] if extra is not None else []), out.contiguous())

    def position(self, step: wire.StepHeader):
        """This stage's twin of rank 0's cache, set to the lengths the step starts from."""
        slots = step.kind != wire.CONTIGUOUS
        cache = self.caches.get(step.cache_id)
        rows = cache.slots if slots and cache is not None else (cache.keys.shape[1] if cache is not None else None)
        if cache is None or rows != step.cache_rows or cache.max_len != step.max_len or slots != hasattr(cache, "lengths"):
            cache = self.caches[step.cache_id] = stage_cache(self.loaded, slots, step.cache_rows, step.max_len)
        if step.kind == wire.CONTIGUOUS:
            cache.offset = step.offset
            return cache
        for slot, length in step.shrunk:  # rank 0 gave these pages back: so does its twin
            cache.set_length(slot, min(length, cache.lengths[slot]))
        if step.kind == wire.SLOT_VIEW:
            cache.set_length(step.slot, step.offset)
            return cache.slot(step.slot)
        for slot, length in zip(step.slots, step.lengths):
            cache.set_length(slot, length)
        return cache.batch(list(step.slots))

    def prune_sends(self) -> None:
        self.sending = [(work, kept) for work, kept in self.sending if not work.is_completed()]

    def finish_sends(self) -> None:
        for work, _ in self.sending:
            work.wait()
        self.sending = []

    def release(self) -> None:
        self.caches.clear()
        if self.loaded is not None:
            self.loaded.close()
            self.loaded = None


def serve_stage(env, backend: str, heartbeat=None) -> None:
    """Join the group described by `env` (a ranks.RankEnv) and serve as its rank until SHUTDOWN
    (`heartbeat`: this worker's health.Heartbeat, told when SHUTDOWN came)."""
    join_group(env, backend, timeout_s())
    device = {"nccl": "cuda", "hccl": "npu"}.get(backend, "cpu")  # where the link's tensors live
    if PARENT_ENV not in os.environ:  # torchrun's rank: rank 0 names its heartbeat now (health.py)
        heartbeat = join_health(env, device)  # beats until this process exits
    try:
        StageWorker(env.rank, env.world, device).run()
        if heartbeat is not None:
            heartbeat.finished()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_when_orphaned(parent: int) -> None:
    """Exit this process as soon as `parent` (rank 0) is gone: a worker never outlives it."""
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(PARENT_POLL_S)


def main() -> None:
    parent = os.environ.get(PARENT_ENV)
    if parent:
        threading.Thread(target=exit_when_orphaned, args=(int(parent),), daemon=True, name="orphan-watch").start()
    env = rank_env()
    if env is None or env.rank == 0:
        print("error: a pipeline worker needs RANK >= 1 and WORLD_SIZE in its environment", file=sys.stderr)
        sys.exit(2)
    try:
        heartbeat = Heartbeat.from_env(env.rank)  # beats until this process exits
        serve_stage(env, os.environ.get(BACKEND_ENV, "gloo"), heartbeat)
    except TierlmError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
