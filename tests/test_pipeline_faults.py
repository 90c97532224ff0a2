"""Faults in a pipeline: a stage that dies or stops answering is noticed within the heartbeat
timeout, no wait on it hangs, no worker outlives rank 0, and a server over the pipeline answers 503
with the reason, restarts it and serves the same text again (distributed/health.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tierlm.distributed.health import ORPHANED, PipelineHealth, StageFailed, beat_interval

TIMEOUT = 1.5  # the stage timeout these tests run with
MARGIN = 2.0  # on top of it: a loaded 2-core machine's scheduling, process exit and reaping

WORKER = """
import sys, threading
from tierlm.distributed.health import Heartbeat
Heartbeat(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
print("ready", flush=True)
threading.Event().wait()
"""

RANK0 = """
import sys, threading
from tierlm.distributed.health import PipelineHealth
health = PipelineHealth(2, float(sys.argv[1]))
print(health.address, flush=True)
threading.Event().wait()
"""

GLOO_WORKER = """
import sys, threading
from datetime import timedelta
import torch.distributed as dist
from tierlm.distributed.health import Heartbeat
address, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
Heartbeat(address, 1, timeout)
store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=60))
group = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=600))
print("ready", flush=True)
threading.Event().wait()  # never sends: rank 0's receive waits on it
"""


def spawn(code: str, *args) -> subprocess.Popen:
    """A python child in its own session, so `end` can kill it and whatever it started."""
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip


def end(*processes: subprocess.Popen) -> None:
    for proc in processes:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def ready(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline().strip()
    assert line, f"the child did not start: {proc.stderr.read() if proc.poll() is not None else ''}"
    return line


def until_failed(health: PipelineHealth, limit: float):
    """(failure, seconds it took) once `health` names a failure, waiting at most `limit`."""
    start = time.monotonic()
    while health.failure is None and time.monotonic() - start < limit:
        time.sleep(0.02)
    return health.failure, time.monotonic() - start


@pytest.fixture
def monitored():
    """(health, worker): a PipelineHealth of two ranks watching a spawned worker that beats."""
    health = PipelineHealth(2, TIMEOUT)
    worker = spawn(WORKER, health.address, 1, TIMEOUT)
    try:
        health.watch_process(1, worker)
        ready(worker)
        health.wait_connected(30)
        yield health, worker
    finally:
        end(worker)
        health.close()


def test_a_beating_worker_is_healthy_and_a_killed_one_is_named(monitored):
    health, worker = monitored
    time.sleep(2 * TIMEOUT)  # longer than the timeout: only its beats keep it healthy
    assert health.failure is None
    health.check()
    assert health.status()["stages"][0]["connected"]
    os.kill(worker.pid, signal.SIGKILL)
    failure, took = until_failed(health, TIMEOUT + MARGIN)
    assert failure is not None and took < TIMEOUT + MARGIN
    assert (failure.rank, failure.pid) == (1, worker.pid)
    assert failure.describe() == f"pipeline stage 1 (pid {worker.pid}) exited with code -9 (SIGKILL)"
    with pytest.raises(StageFailed, match="exited with code -9"):
        health.check()


def test_a_stopped_worker_is_noticed_within_the_timeout(monitored):
    health, worker = monitored
    os.kill(worker.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    failure, _ = until_failed(health, TIMEOUT + MARGIN)
    took = time.monotonic() - stopped
    assert failure is not None, "a stopped worker was never noticed"
    assert TIMEOUT <= took < TIMEOUT + MARGIN
    assert failure.rank == 1 and "sent no heartbeat" in failure.reason and "stopped or hung" in failure.reason


def test_failure_runs_the_abort_hooks_and_ends_other_workers(monitored):
    health, worker = monitored
    killed = []
    health.on_failure(lambda failure: killed.append(failure.rank))
    health.fail(1, "broke the link: test")
    assert killed == [1]
    # Its heartbeat connection is closed on failure: the worker exits on its own, as ORPHANED.
    assert worker.wait(TIMEOUT + MARGIN) == ORPHANED
    assert "rank 0 closed the connection; exiting" in worker.stderr.read()
    late = []
    health.on_failure(lambda failure: late.append(failure.describe()))  # after the fact: at once
    assert late == [f"pipeline stage 1 (pid {worker.pid}) broke the link: test"]


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_worker_exits_when_rank_0_goes_away(how):
    rank0 = spawn(RANK0, TIMEOUT)
    worker = None
    try:
        address = ready(rank0)
        worker = spawn(WORKER, address, 1, TIMEOUT)
        ready(worker)
        time.sleep(TIMEOUT)  # beats flowing both ways: it stays
        assert worker.poll() is None
        os.kill(rank0.pid, how)
        gone = time.monotonic()
        assert worker.wait(TIMEOUT + MARGIN) == ORPHANED
        # A killed rank 0 closes the connection at once; a stopped one only goes silent (its
        # last beat came up to one interval before it stopped).
        assert time.monotonic() - gone >= (TIMEOUT - beat_interval(TIMEOUT) if how == signal.SIGSTOP else 0)
        why = "sent no heartbeat" if how == signal.SIGSTOP else "closed the connection"
        assert f"rank 0 {why}" in worker.stderr.read()
    finally:
        end(*(p for p in (worker, rank0) if p is not None))


def test_a_wait_on_a_stopped_stage_is_aborted():
    """A gloo receive from a stage that stops answering ends with StageFailed within the timeout,
    and the abort hook (killing the stage) also ends the blocked helper wait."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    health = PipelineHealth(2, TIMEOUT)
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=60), wait_for_workers=False)
    worker = spawn(GLOO_WORKER, health.address, store.port, TIMEOUT)
    try:
        health.watch_process(1, worker)
        health.on_failure(lambda _failure: os.killpg(worker.pid, signal.SIGKILL))
        group = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=600))
        ready(worker)
        health.wait_connected(30)
        received = torch.zeros(4)
        work = group.recv([received], 1, 0)
        outcome = []

        def receive():
            try:
                health.wait(work, 1)
                outcome.append("returned")
            except StageFailed as err:
                outcome.append(err)

        waiting = threading.Thread(target=receive, daemon=True)
        waiting.start()
        time.sleep(0.5)
        assert not outcome, "the receive returned without a message"
        os.kill(worker.pid, signal.SIGSTOP)
        waiting.join(TIMEOUT + MARGIN + 1)
        assert not waiting.is_alive(), "the wait on a stopped stage hung"
        assert isinstance(outcome[0], StageFailed) and "sent no heartbeat" in str(outcome[0])
        assert worker.wait(MARGIN) == -signal.SIGKILL  # the abort hook ended it
    finally:
        end(worker)
        health.close()
