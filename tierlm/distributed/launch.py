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

from tierlm.distributed.health import Heartbeat, PipelineHealth, check_timeout, stage_timeout_s
from tierlm.distributed.ranks import BACKEND_ENV, PARENT_ENV, TIMEOUT_ENV, RankEnv, backend_for, rank_env, timeout_s
from tierlm.distributed.wire import SHUTDOWN, Link, control
from tierlm.errors import TierlmError

# A spawned worker's program. `python -m` (and -c) put the working directory first on sys.path,
# where a `tierlm/` folder (a checkout) would shadow the installed package; the worker drops that
# entry before importing tierlm. (3.11's -P does the same; tierlm also runs on 3.10.)
WORKER_PROGRAM = "import sys\nif sys.path[:1] == ['']: del sys.path[0]\nfrom tierlm.distributed.worker import main\nmain()"


@dataclass(frozen=True)
class GroupSettings:
    """Everything a pipeline's group starts under, kept on the group: a restart (supervisor.py)
    starts its successor from this same object, so no setting falls back to a default."""

    stages: int
    device: object  # the compute device (torch.device)
    timeout: float  # seconds a rank waits in a collective (ranks.timeout_s)
    stage_timeout: float  # seconds a stage may send no heartbeat (health.py)

    @classmethod
    def of(cls, stages: int, device, *, timeout: float | None = None, stage_timeout: float | None = None):
        """Settings with each timeout not given taken from the environment, else its default."""
        stage_timeout = check_timeout(stage_timeout) if stage_timeout is not None else stage_timeout_s()
        return cls(stages, torch.device(device), timeout or timeout_s(), stage_timeout)


@dataclass
class PipelineGroup:
    """Rank 0's handle on a process group of `world` ranks; `workers` are the processes it spawned
    (none under torchrun, which owns them). `close()` ends the workers and the group."""

    settings: GroupSettings  # what it was started under
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


def start_group(settings: GroupSettings) -> PipelineGroup:
    """Rank 0 of a pipeline of `settings.stages` ranks: under torchrun (RANK/WORLD_SIZE set) the
    group its processes form, else the other ranks as local worker processes spawned here
    (127.0.0.1, a free port)."""
    stages, device = settings.stages, settings.device
    comm_device = device if backend_for(device.type) != "gloo" else torch.device("cpu")
    env = rank_env()
    if env is not None:
        if env.rank != 0:
            raise TierlmError(f"rank {env.rank} cannot drive a pipeline", "only RANK=0 runs the command")
        if stages not in (1, env.world):
            raise TierlmError(f"--stages {stages} under torchrun with WORLD_SIZE={env.world}",
                              f"drop --stages, or launch {stages} processes")  # fmt: skip
        join_group(env, backend_for(device.type), settings.timeout)
        health = announce_health(env.world, settings.stage_timeout, comm_device)
        return PipelineGroup(settings, env.world, comm_device, health=health)
    if stages < 2:
        raise TierlmError(f"a pipeline needs at least 2 stages, not {stages}")
    return spawn_group(settings, comm_device)


def spawn_group(settings: GroupSettings, comm_device) -> PipelineGroup:
    """Spawn ranks 1..stages-1 (WORKER_PROGRAM: tierlm/distributed/worker.py) and form the group;
    a heartbeat (health.py) watches them: a worker silent for `settings.stage_timeout` s or exited
    fails the pipeline and is killed."""
    if dist.is_initialized():
        raise TierlmError("this process already belongs to a torch.distributed group",
                          "close the other pipeline first")  # fmt: skip
    stages, device, timeout = settings.stages, settings.device, settings.timeout
    # A store on port 0 picks a free port without a race; the workers are told which it got.
    store = dist.TCPStore("127.0.0.1", 0, stages, True, timedelta(seconds=timeout), wait_for_workers=False)
    health = PipelineHealth(stages, settings.stage_timeout)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(stages),
               **{PARENT_ENV: str(os.getpid()), TIMEOUT_ENV: str(timeout), BACKEND_ENV: backend_for(device.type)},
               **health.worker_env())  # fmt: skip
    group = PipelineGroup(settings, stages, comm_device, health=health)
    for rank in range(1, stages):
        group.workers.append(subprocess.Popen([sys.executable, "-c", WORKER_PROGRAM],
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


def announce_health(world: int, timeout: float, device) -> PipelineHealth:
    """Rank 0 of a torchrun group: a PipelineHealth listening on every interface, whose port and
    timeout every rank learns from one broadcast (matched by `join_health` on each worker)."""
    health = PipelineHealth(world, timeout, host="0.0.0.0")
    dist.broadcast_object_list([health.port, health.timeout], src=0, device=device)
    return health


def join_health(env: RankEnv, device) -> Heartbeat:
    """A torchrun worker's heartbeat to rank 0 (at MASTER_ADDR), after `announce_health`'s broadcast."""
    announced = [None, None]
    dist.broadcast_object_list(announced, src=0, device=device)
    port, timeout = announced
    return Heartbeat(f"{env.master_addr}:{port}", env.rank, timeout)
