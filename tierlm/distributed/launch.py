"""Starting the ranks of a pipeline: local worker processes spawned by tierlm, or the processes
torchrun started; then one torch.distributed process group over them, and (under torchrun) the
broadcast that tells every rank where rank 0's health monitor listens.

Which rank this process is, and the timeouts, are tierlm/distributed/ranks.py's (torch-free).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tierlm.distributed.health import Heartbeat, PipelineHealth, stage_timeout_s
from tierlm.distributed.ranks import BACKEND_ENV, PARENT_ENV, TIMEOUT_ENV, RankEnv, backend_for, rank_env, timeout_s
from tierlm.distributed.wire import SHUTDOWN, Link, control
from tierlm.errors import TierlmError

@dataclass
class PipelineGroup:
    """Rank 0's handle on a process group of `world` ranks; `workers` are the processes it spawned
    (none under torchrun, which owns them). `close()` ends the workers and the group."""

    world: int
    device: object  # torch.device the link's tensors live on
    workers: list = field(default_factory=list)  # subprocess.Popen, rank order from 1
    closed: bool = False
    health: object = None  # the PipelineHealth watching spawned workers (distributed/health.py)

    def link(self):
        return Link(0, self.world, self.device, self.health)

    def check_alive(self) -> None:
        """A TierlmError naming the first spawned stage whose process has exited."""
        for rank, proc in enumerate(self.workers, start=1):
            if proc.poll() is not None:
                raise TierlmError(f"pipeline stage {rank} exited with status {proc.returncode}",
                                  "its error is printed above; fix it and start again")  # fmt: skip

    def close(self, grace_s: float = 10.0) -> None:
        """Tell the workers to exit (they pass it down the chain), wait for them, kill stragglers,
        and leave the process group. A second call does nothing."""
        if self.closed:
            return
        self.closed = True
        if self.health is not None:
            self.health.stop_watching()  # the workers exit now: no failure

        try:
            self.link().send(control(SHUTDOWN, self.device), 1)
        except TierlmError:
            pass  # stage 1 is gone already; its successors exit when their link breaks
        end_processes(self.workers, grace_s)
        if self.health is not None:
            self.health.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def end_processes(processes, grace_s: float) -> None:
    """Wait up to `grace_s` for `processes` to exit, then kill the rest (never leave orphans)."""
    deadline = time.monotonic() + grace_s
    for proc in processes:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_group(stages: int, device, *, timeout: float | None = None, stage_timeout: float | None = None) -> PipelineGroup:
    """Rank 0 of a pipeline of `stages` ranks: under torchrun (RANK/WORLD_SIZE set) the group its
    processes form, else `stages - 1` local worker processes spawned here (127.0.0.1, a free port)."""
    device = torch.device(device)
    comm_device = device if backend_for(device.type) != "gloo" else torch.device("cpu")
    timeout = timeout or timeout_s()
    env = rank_env()
    if env is not None:
        if env.rank != 0:
            raise TierlmError(f"rank {env.rank} cannot drive a pipeline", "only RANK=0 runs the command")
        if stages not in (1, env.world):
            raise TierlmError(f"--stages {stages} under torchrun with WORLD_SIZE={env.world}",
                              f"drop --stages, or launch {stages} processes")  # fmt: skip
        join_group(env, backend_for(device.type), timeout)
        return PipelineGroup(env.world, comm_device, health=announce_health(env.world, stage_timeout, comm_device))
    if stages < 2:
        raise TierlmError(f"a pipeline needs at least 2 stages, not {stages}")
    return spawn_group(stages, device, comm_device, timeout, stage_timeout)


def spawn_group(stages: int, device, comm_device, timeout: float, stage_timeout: float | None = None) -> PipelineGroup:
    """Spawn ranks 1..stages-1 as `python -m tierlm.distributed.worker` and form the group; a
    heartbeat (health.py) watches them: a worker silent for `stage_timeout` s (default: the
    environment's TIERLM_STAGE_TIMEOUT, else 5) or exited fails the pipeline and is killed."""
    if dist.is_initialized():
        raise TierlmError("this process already belongs to a torch.distributed group",
                          "close the other pipeline first")  # fmt: skip
    # A store on port 0 picks a free port without a race; the workers are told which it got.
    store = dist.TCPStore("127.0.0.1", 0, stages, True, timedelta(seconds=timeout), wait_for_workers=False)
    health = PipelineHealth(stages, stage_timeout or stage_timeout_s())
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(stages),
               **{PARENT_ENV: str(os.getpid()), TIMEOUT_ENV: str(timeout), BACKEND_ENV: backend_for(device.type)},
               **health.worker_env())  # fmt: skip
    group = PipelineGroup(stages, comm_device, health=health)
    for rank in range(1, stages):
        group.workers.append(subprocess.Popen([sys.executable, "-m", "tierlm.distributed.worker"],
                                              env=dict(env, RANK=str(rank)), stdin=subprocess.DEVNULL))  # fmt: skip
        health.watch_process(rank, group.workers[-1])
    # A failed stage's peers are killed at once: that also ends any gloo wait still pending on them.
    health.on_failure(lambda _failure: [proc.kill() for proc in group.workers if proc.poll() is None])
    try:
        wait_for_workers(store, group, timeout)
        dist.init_process_group(backend_for(device.type), store=store, rank=0, world_size=stages,
                                timeout=timedelta(seconds=timeout))  # fmt: skip
    except BaseException:
        group.closed = True
        end_processes(group.workers, 0.0)
        health.close()
        raise
    return group


def wait_for_workers(store, group: PipelineGroup, timeout: float) -> None:
    """Until every spawned worker has reached the store; a worker that exits first (a bad
    install, an import error) fails the start at once instead of after the timeout."""
    deadline = time.monotonic() + timeout
    while store.add("joined", 0) < group.world - 1:
        group.check_alive()
        if time.monotonic() > deadline:
            raise TierlmError(f"pipeline workers did not start within {timeout:.0f} s")
        time.sleep(0.02)


def join_group(env: RankEnv, backend: str, timeout: float) -> None:
    """This process's place in the group of `env`: a worker tierlm spawned reaches rank 0's store
    (and counts itself in); under torchrun, the group its environment describes."""
    if PARENT_ENV not in os.environ:
        dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world,
                                timeout=timedelta(seconds=timeout))  # fmt: skip
        return
    store = dist.TCPStore(env.master_addr, env.master_port, env.world, False, timedelta(seconds=timeout))
    store.add("joined", 1)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world,
                            timeout=timedelta(seconds=timeout))  # fmt: skip


def announce_health(world: int, timeout: float | None, device) -> PipelineHealth:
    """Rank 0 of a torchrun group: a PipelineHealth listening on every interface, whose port and
    timeout every rank learns from one broadcast (matched by `join_health` on each worker)."""
    health = PipelineHealth(world, timeout or stage_timeout_s(), host="0.0.0.0")
    dist.broadcast_object_list([health.port, health.timeout], src=0, device=device)
    return health


def join_health(env: RankEnv, device) -> Heartbeat:
    """A torchrun worker's heartbeat to rank 0 (at MASTER_ADDR), after `announce_health`'s broadcast."""
    announced = [None, None]
    dist.broadcast_object_list(announced, src=0, device=device)
    port, timeout = announced
    return Heartbeat(f"{env.master_addr}:{port}", env.rank, timeout)
