"""Faults in a pipeline: a stage that dies or stops answering is noticed within the heartbeat
timeout, no wait on it hangs, no worker outlives rank 0, and a server over the pipeline answers 503
with the reason, restarts it and serves the same text again (distributed/health.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.tiny import make_model, write_profile
from tierlm.distributed.health import (DEFAULT_STAGE_TIMEOUT_S, ORPHANED, STAGE_TIMEOUT_ENV, PipelineHealth, StageFailed,
                                      beat_interval)

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


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_a_stopped_worker_is_noticed_within_the_timeout(monitored):
    health, worker = monitored
    os.kill(worker.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    failure, _ = until_failed(health, TIMEOUT + MARGIN)
    took = time.monotonic() - stopped
    assert failure is not None, "a stopped worker was never noticed"
    assert TIMEOUT <= took < TIMEOUT + MARGIN
    assert failure.rank == 1 and "sent no heartbeat" in failure.reason and "stopped or hung" in failure.reason


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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



def test_restarts_back_off_and_stop_after_too_many_failures():
    """The supervisor's policy alone (a pipeline whose stage 1 failed; no restart is attempted)."""
    from types import SimpleNamespace

    from tierlm.distributed.supervisor import PipelineSupervisor, RestartPolicy

    assert [RestartPolicy(1.0, 4.0).delay(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 4.0]
    health = PipelineHealth(2, TIMEOUT)
    try:
        pipeline = SimpleNamespace(group=SimpleNamespace(health=health), world=2)  # what the supervisor reads
        stopping = threading.Event()
        stopping.set()
        patient = PipelineSupervisor(pipeline, RestartPolicy(max_failures=3))
        impatient = PipelineSupervisor(pipeline, RestartPolicy(max_failures=1))
        assert patient.down_reason() is None and patient.status()["state"] == "up"
        health.fail(1, "exited with code 1")
        assert patient.status()["state"] == "failed"
        assert patient.down_reason() == "pipeline stage 1 exited with code 1; restarting the pipeline"
        # A server shutting down does not restart; one within its policy is still restarting.
        assert not patient.recover(patient.failure(), stopping) and not patient.gave_up
        assert patient.status()["state"] == "restarting" and patient.retry_after() >= 1
        # Past max_failures in the window: down for good, saying why.
        assert not impatient.recover(impatient.failure(), threading.Event())
        assert impatient.gave_up and impatient.status()["state"] == "down" and impatient.restarts == 0
        assert impatient.down_reason() == (
            "pipeline stage 1 exited with code 1; the pipeline failed once in 600 s and is not restarted again "
            "(fix the cause and restart the server)")
    finally:
        health.close()

# -- end to end: `tierlm serve --stages 2` loses a stage mid-request ------------------------------

SERVE_TIMEOUT = 2.0  # --stage-timeout of the served pipeline


@contextmanager
def serve_pipeline(root: Path):
    """`tierlm serve --stages 2` on a tiny model, test hooks on, in its own session; yields
    (url, stderr lines). Its whole process group is killed at the end, whatever happened."""
    make_model(root / "tiny", layers=4)
    profile = write_profile(root / "serve.toml", context_length=256, batch_size=2)
    process = subprocess.Popen(
        [sys.executable, "-m", "tierlm", "serve", "--port", "0", "--model", str(root / "tiny"), "--profile",
         str(profile), "--device", "cpu", "--dtype", "fp32", "--stages", "2", "--stage-timeout", str(SERVE_TIMEOUT)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TIERLM_SERVE_DEBUG_HOOKS": "1"}, start_new_session=True)  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not any("listening on" in line for line in lines):
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        yield re.search(r"listening on (http://127\.0\.0\.1:\d+)", "".join(lines)).group(1), lines
        process.terminate()
        assert process.wait(30) in (0, -signal.SIGTERM), "".join(lines)
    finally:
        end(process)


def greedy_text(http) -> str:
    reply = http.post("/v1/completions", json={"prompt": "the pipeline", "max_tokens": 12, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.mark.e2e
def test_serve_answers_503_while_a_killed_stage_restarts_then_serves_the_same_text(tmp_path):
    import httpx
    import psutil

    with serve_pipeline(tmp_path) as (url, lines), httpx.Client(base_url=url, timeout=60) as http:
        before = greedy_text(http)
        report = http.get("/health").json()
        assert report["status"] == "ok" and report["pipeline"]["state"] == "up"
        (stage,) = report["pipeline"]["heartbeats"]["stages"]
        old_pid = stage["pid"]
        assert psutil.Process(old_pid).is_running()

        # A long stream (each step slowed down), and stage 1 killed once its first tokens came.
        assert http.post("/debug/worker", json={"action": "delay", "seconds": 0.05}).status_code == 200
        events, killed_at = [], None
        payload = {"prompt": "a long answer", "max_tokens": 200, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=payload) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                if len(events) == 3 and killed_at is None:
                    os.kill(old_pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        ended = time.monotonic() - killed_at
        assert killed_at is not None and ended < SERVE_TIMEOUT + MARGIN, ended
        error = json.loads(events[-1])["error"]
        assert error["code"] == "pipeline_failed", error
        assert f"pipeline stage 1 (pid {old_pid}) exited with code -9 (SIGKILL)" in error["message"]
        assert "[DONE]" not in events

        # Until the restart is done: 503 with the reason and Retry-After; /health says so too.
        refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "pipeline_unavailable"
        assert f"pipeline stage 1 (pid {old_pid}) exited with code -9" in refused.json()["error"]["message"]
        assert int(refused.headers["Retry-After"]) >= 1
        down = http.get("/health")
        assert down.status_code == 503 and down.json()["pipeline"]["state"] in ("restarting", "failed")

        deadline = time.monotonic() + 60
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the pipeline was not restarted:\n" + "".join(lines)
            time.sleep(0.2)
        assert http.post("/debug/worker", json={"action": "delay", "seconds": 0}).status_code == 200
        assert greedy_text(http) == before
        report = http.get("/health").json()
        assert report["pipeline"]["restarts"] == 1 and report["pipeline"]["heartbeats"]["stages"][0]["pid"] != old_pid
        assert re.search(r"^tierlm_pipeline_restarts_total 1\.0$", http.get("/metrics").text, re.M)
        assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE
    assert "Traceback" not in "".join(lines), "".join(lines)


def serving(http, restarts: int, lines) -> dict:
    """/health's pipeline report once it serves again after `restarts` restarts."""
    deadline = time.monotonic() + 60
    while True:
        reply = http.get("/health")
        if reply.status_code == 200 and reply.json()["pipeline"]["restarts"] == restarts:
            return reply.json()["pipeline"]
        assert time.monotonic() < deadline, f"no restart {restarts}: {reply.text}\n" + "".join(lines)
        time.sleep(0.2)


@pytest.mark.e2e
def test_stage_timeout_holds_after_a_restart_and_a_stage_stalled_then_is_noticed(tmp_path, monkeypatch):
    """`serve --stage-timeout` outlives a restart: the new stage and rank 0's monitor of it run
    under the flag's timeout, not the default, and a stage stopped after the restart is declared
    silent by that monitor and restarted in turn."""
    import httpx
    import psutil

    monkeypatch.delenv(STAGE_TIMEOUT_ENV, raising=False)  # only the flag sets it
    assert SERVE_TIMEOUT != DEFAULT_STAGE_TIMEOUT_S  # so a default taken instead is told apart

    def stage(pipeline: dict) -> int:
        """The pid of stage 1, checked to run under SERVE_TIMEOUT at both ends of its heartbeat."""
        heartbeats = pipeline["heartbeats"]
        assert heartbeats["stage_timeout_s"] == SERVE_TIMEOUT, heartbeats
        (worker,) = heartbeats["stages"]
        assert float(psutil.Process(worker["pid"]).environ()[STAGE_TIMEOUT_ENV]) == SERVE_TIMEOUT
        return worker["pid"]

    with serve_pipeline(tmp_path) as (url, lines), httpx.Client(base_url=url, timeout=60) as http:
        first = stage(serving(http, 0, lines))
        os.kill(first, signal.SIGKILL)
        second = stage(serving(http, 1, lines))
        assert second != first
        os.kill(second, signal.SIGSTOP)  # the stall: alive, its sockets open, silent
        after = serving(http, 2, lines)
        assert after["last_failure"].startswith(f"pipeline stage 1 (pid {second}) sent no heartbeat for"), after
        assert "stopped or hung" in after["last_failure"]
        assert stage(after) not in (first, second)
        assert greedy_text(http)
    assert "Traceback" not in "".join(lines), "".join(lines)
