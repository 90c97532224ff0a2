"""Keeping a served pipeline up: what the server reports while a stage is down, and the restart.

The server's watchdog (server/worker.py) asks `failure()` each turn. When a stage failed it ends
the requests in flight, and `recover` restarts the pipeline's workers: the failed group is closed
(its processes are already killed by the health monitor's abort hook), fresh workers are spawned
on a new port under the same stage loads (spans, profiles), and rank 0's own stage stays loaded.
Restarts back off (backoff_s, doubling, at most max_backoff_s); after `max_failures` failures
within `window_s` the pipeline stays down and every request is told why, until the server is
restarted. Meanwhile requests get a 503 with `down_reason()` and Retry-After.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass

from tierlm.distributed.launch import start_group
from tierlm.distributed.wire import LOAD, RELEASE, control
from tierlm.errors import TierlmError


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 1.0  # wait before the first restart; doubles with each failure in the window
    max_backoff_s: float = 30.0
    max_failures: int = 5  # failures within window_s after which the pipeline stays down
    window_s: float = 600.0

    def delay(self, recent: int) -> float:
        """The wait before restarting after the `recent`-th failure in the window."""
        return min(self.backoff_s * 2 ** max(recent - 1, 0), self.max_backoff_s)


class PipelineSupervisor:
    """Rank 0's view of a served pipeline (`model`, a PipelineModel) and its restarts."""

    def __init__(self, model, policy: RestartPolicy | None = None):
        self.model = model
        self.policy = policy or RestartPolicy()
        self.restarts = 0
        self._lock = threading.Lock()
        self._failures: deque[float] = deque()  # when each failure in the window happened
        self._last_failure: str | None = None
        self._recovering = False
        self._gave_up: str | None = None
        self._resume_at = 0.0  # when the restart under way is expected to be serving
        self._restart_s = 5.0  # how long the latest restart took (a first guess until one ran)

    @property
    def gave_up(self) -> bool:
        return self._gave_up is not None

    def failure(self) -> str | None:
        """The stage failure the health monitor names (None while every stage beats)."""
        health = getattr(self.model.group, "health", None)
        failure = health.failure if health is not None else None
        return failure.describe() if failure is not None else None

    def down_reason(self) -> str | None:
        """Why requests cannot be served now, for the 503's message; None while serving."""
        with self._lock:
            if self._gave_up is not None:
                return self._gave_up
            recovering, last = self._recovering, self._last_failure
        failure = self.failure()
        if failure is not None or recovering:
            return f"{failure or last}; restarting the pipeline"
        return None

    def retry_after(self) -> int:
        """Seconds a refused client should wait: until the restart under way should be done."""
        with self._lock:
            left = self._resume_at - time.monotonic() if self._recovering else self.policy.backoff_s + self._restart_s
        return max(1, math.ceil(left))

    def status(self) -> dict:
        with self._lock:
            state = "down" if self._gave_up else "restarting" if self._recovering else "up"
            report = {"state": state, "stages": self.model.world, "restarts": self.restarts,
                      "last_failure": self._last_failure}  # fmt: skip
        if state == "up" and self.failure() is not None:
            report["state"] = "failed"
        health = getattr(self.model.group, "health", None)
        if health is not None:
            report["heartbeats"] = health.status()
        return report

    def recover(self, problem: str, stop: threading.Event) -> bool:
        """Restart the pipeline after `problem`, retrying with back-off; True once it serves again,
        False when the policy gives up (it then stays down) or `stop` is set."""
        while True:
            now = time.monotonic()
            with self._lock:
                self._last_failure = problem
                self._failures.append(now)
                while self._failures and now - self._failures[0] > self.policy.window_s:
                    self._failures.popleft()
                recent = len(self._failures)
                if recent >= self.policy.max_failures:
                    self._recovering = False
                    times = "once" if recent == 1 else f"{recent} times"
                    self._gave_up = (f"{problem}; the pipeline failed {times} in {self.policy.window_s:g} s and is "
                                     f"not restarted again (fix the cause and restart the server)")  # fmt: skip
                    return False
                delay = self.policy.delay(recent)
                self._recovering = True
                self._resume_at = now + delay + self._restart_s
            if stop.wait(delay):
                return False
            started = time.monotonic()
            try:
                restart_workers(self.model)
            except Exception as err:  # noqa: BLE001 - any failed restart is retried under the policy
                problem = f"restarting the pipeline failed: {err}"
                continue
            with self._lock:
                self.restarts += 1
                self._restart_s = time.monotonic() - started
                self._recovering = False
            return True


def supervise(loaded, policy: RestartPolicy | None = None) -> PipelineSupervisor | None:
    """The supervisor of `loaded` (a LoadedModel) when its model is a pipeline this process can
    restart: one whose workers it spawned, with their heartbeat. None for a single process, and
    under torchrun (which owns the workers: a failed rank there fails its requests, and the
    launcher restarts the job)."""
    group = getattr(loaded.model, "group", None)
    if group is None or not getattr(loaded.model, "owns_group", False) or not group.workers or group.health is None:
        return None
    return PipelineSupervisor(loaded.model, policy)


def restart_workers(model) -> None:
    """Fresh workers for `model` (a PipelineModel whose workers failed): close the failed group,
    start a new one under the failed one's settings (new port; same world, device and timeouts)
    and load every worker's stage again, as before.
    Rank 0's stage stays loaded; the new workers make their cache twins on first use, so
    only sequences started after the restart run on it (the server's fresh batch runner)."""
    model.group.close(grace_s=0.0)  # its processes are dead or are killed now
    group = start_group(model.group.settings)
    try:
        link = group.link()
        link.send(control(LOAD, link.device), 1)
        link.send_object(model.loads, 1)
        reports = [link.recv_object(rank) for rank in range(1, group.world)]
        failed = next((r for r in reports if not r["ok"]), None)
        if failed is not None:
            link.send(control(RELEASE, link.device), 1)
            raise TierlmError(f"pipeline stage {failed['rank']} failed to load again: {failed['error']}", failed.get("hint"))
    except BaseException:
        group.close(grace_s=0.0)
        raise
    model.group, model.link, model.reports = group, link, reports
