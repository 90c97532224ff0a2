"""The worker: one thread owns the model and runs the batching loop; a watchdog restarts it.

Handlers `submit` jobs to a bounded queue. Each turn of the loop beats the heartbeat, ends
jobs whose client left or whose deadline passed, admits queued jobs into free KV slots and
runs one `BatchRunner.step()`. The watchdog declares the worker dead when its thread has
ended or its heartbeat is older than `stall_timeout`; it then fails the jobs in flight with
a clear error, waits `restart_backoff` (health reports "unhealthy" meanwhile) and starts a
fresh worker on a fresh KV cache; queued jobs wait for it.
A LoRA variant being removed is retired here, between steps, once no queued or running job
uses it (`retire`): requests already accepted for it finish first. A superseded thread that wakes
up later finds its generation outdated and exits without touching anything shared.
Over a pipeline of stages (`pipeline`, a distributed.supervisor.PipelineSupervisor) the watchdog
also restarts the pipeline when a stage fails: requests in flight end with a 503 naming the stage,
new ones are refused with it (`down_reason`) until the restart is done, and restarts back off
and stop after too many failures (the supervisor's RestartPolicy).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from tierlm.distributed.health import StageFailed
from tierlm.server.batch import BatchRunner, StepReport, sequences_at_once
from tierlm.server.jobs import Job

IDLE_WAIT_S = 0.1  # an idle worker still beats this often
SHUTTING_DOWN = "the server is shutting down; retry the request once it is back"
DEBUG_ACTIONS = ("kill", "stall", "delay", "pause", "resume")
# A failed pipeline's waits end at once: its worker thread leaves its forward well within this.
PIPELINE_THREAD_EXIT_S = 5.0


def spill_room(loaded) -> int:
    """Host RAM the memory plan leaves free, for idle conversations' rows (kv/spill.py): the
    host tier's room beside an accelerator, the one RAM tier's on a CPU; none without a plan.
    At most half the RAM free now: a profile larger than the machine must not swap for it."""
    import psutil

    placement = loaded.placement
    if placement is None:
        return 0
    tier = "host" if "host" in placement.budgets and loaded.device.type != "cpu" else "device"
    budget = placement.budgets.get(tier)
    room = max(0, budget - placement.total(tier)) if budget is not None else 0
    return min(room, psutil.virtual_memory().available // 2)


class WorkerKilled(BaseException):
    """Raised in the worker thread by the `kill` debug hook: it ends the thread as a crash would."""


@dataclass(frozen=True)
class WorkerSettings:
    slots: int  # full contexts the KV pool holds (the profile's batch_size)
    max_queue: int  # jobs waiting for a slot; more are refused (429)
    stall_timeout: float = 60.0  # seconds without a heartbeat before the worker counts as dead
    restart_backoff: float = 1.0  # seconds between declaring it dead and starting a new one
    watchdog_interval: float = 0.25
    spill_disk_bytes: int = 0  # disk for idle conversations' rows past host RAM's room (0: none)
    parallel: int | None = None  # the most sequences decoded together (None: batch.py's default)


class Worker:
    """Owns `loaded` (a LoadedModel) and `tokenizer`; every model call happens in its thread."""

    def __init__(
        self,
        loaded,
        tokenizer,
        settings: WorkerSettings,
        *,
        on_step: Callable[[StepReport], None] | None = None,
        on_restart: Callable[[str], None] | None = None,
        pipeline=None,
        draft_model=None,
    ):
        """`draft_model`: the DraftModel (runtime/draft_model.py) of `serve --draft MODEL`, whose
        weights every drafting sequence's own cache drafts with; None: none loaded."""
        self.loaded = loaded
        self.draft_model = draft_model
        self.tokenizer = tokenizer
        self.settings = settings
        self._on_step = on_step
        self._on_restart = on_restart
        self.pipeline = pipeline  # a PipelineSupervisor when the model is a pipeline of stages
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._queue: deque[Job] = deque()
        self._generation = 0
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._runner: BatchRunner | None = None
        self._beat = time.monotonic()
        self._death: str | None = None
        self._restarting = False
        self._restarts = 0
        self._last_error: str | None = None
        self._hooks: deque[tuple[str, float]] = deque()
        self._paused = False
        self._step_delay = 0.0
        self._retiring: dict[str, Callable[[], None]] = {}
        self._spill_disk = None  # kv/spill.py DiskSpill, made by the first worker, kept across restarts
        self._spill_disk_failed = False
        self.peak_batch = 0

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._spawn()
        self._watchdog = threading.Thread(target=self._watch, name="tierlm-watchdog", daemon=True)
        self._watchdog.start()

    def drain(self) -> None:
        """Shutdown begins: refuse new jobs and end every queued or running one with a 503 now,
        so each handler answers before the HTTP server stops waiting for it. Does not block."""
        with self._cond:
            self._stop.set()
            self._cond.notify_all()
            queued, self._queue = list(self._queue), deque()
            runner = self._runner
        for job in queued + (runner.jobs() if runner else []):
            job.fail(SHUTTING_DOWN, code="server_shutting_down")

    def stop(self, timeout: float = 5.0) -> None:
        """`drain`, then wait for both threads (the worker ends after its current step)."""
        self.drain()
        for thread in (self._watchdog, self._thread):
            if thread is not None:
                thread.join(timeout)
        if self._spill_disk is not None:
            self._spill_disk.close()  # its files are this process's alone

    # -- handler side ----------------------------------------------------------------------

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full (or the server is stopping)."""
        with self._cond:
            if self._stop.is_set() or len(self._queue) >= self.settings.max_queue or self.down_reason():
                return False
            job.wake = self.wake
            self._queue.append(job)
            self._cond.notify_all()
        return True

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def down_reason(self) -> str | None:
        """Why requests are refused with a 503 while a pipeline stage is down; None otherwise."""
        return self.pipeline.down_reason() if self.pipeline is not None else None

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        runner = self._runner
        return len(runner.active) if runner else 0

    def kv_bytes(self) -> tuple[int, int] | None:
        """(reserved, used) bytes of the current worker's KV cache; None between workers."""
        runner = self._runner
        return (runner.cache.nbytes, runner.cache.used_bytes) if runner else None

    def page_stats(self) -> dict | None:
        """The paged KV pool's figures (server/batch.py page_stats); None between workers."""
        runner = self._runner
        return runner.page_stats() if runner is not None else None

    def spill_stats(self) -> dict | None:
        """The host-RAM store of idle conversations' rows (kv/spill.py); None between workers."""
        runner = self._runner
        if runner is None:
            return None
        return runner.spill.stats()

    def slots_held(self) -> list[dict] | None:
        """Per KV slot: the tokens it holds (its running sequence's, or what the last one left for a
        prompt continuing it) and whether a sequence runs in it; None between workers."""
        runner = self._runner
        if runner is None:
            return None
        running = {seq.slot for seq in list(runner.active)}
        return [{"tokens": n, "active": slot in running} for slot, n in enumerate(list(runner.cache.lengths))]

    def health(self) -> dict:
        with self._cond:
            thread = self._thread
            alive = thread is not None and thread.is_alive()
            age = time.monotonic() - self._beat
            healthy = alive and not self._restarting and age <= self.settings.stall_timeout
            healthy = healthy and self.down_reason() is None
            status = "shutting_down" if self.stopping else "ok" if healthy else "unhealthy"
            report = {
                "status": status,
                "worker": {
                    "alive": alive,
                    "heartbeat_age_s": round(age, 3),
                    "restarting": self._restarting,
                    "restarts": self._restarts,
                    "last_error": self._last_error,
                },
                "queue_depth": len(self._queue),
                "active": self.active,
                "slots": self.settings.slots,
                "parallel": sequences_at_once(self.settings.slots, self.settings.parallel),
                "peak_batch": self.peak_batch,
            }
        if self.pipeline is not None:
            report["pipeline"] = {**self.pipeline.status(), "down_reason": self.down_reason()}
        return report

    def retire(self, variant: str, remove: Callable[[], None]) -> None:
        """Call `remove` on the worker thread, between steps, once no queued or running job uses
        `variant` (so no forward has it selected)."""
        with self._cond:
            self._retiring[variant] = remove
            self._cond.notify_all()

    def debug(self, action: str, seconds: float = 0.0) -> None:
        """Test hooks (only reachable when the server enables them): kill or stall the worker
        thread, slow each step by `seconds` (delay), hold admission and decoding (pause/resume)."""
        with self._cond:
            if action in ("kill", "stall"):
                self._hooks.append((action, seconds))
            elif action == "delay":
                self._step_delay = seconds
            elif action in ("pause", "resume"):
                self._paused = action == "pause"
            else:
                raise ValueError(f"unknown debug action {action!r}")
            self._cond.notify_all()

    # -- the worker thread -----------------------------------------------------------------

    def _spawn(self) -> None:
        with self._cond:
            self._generation += 1
            self._beat = time.monotonic()
            self._death = None
            self._thread = threading.Thread(
                target=self._main, args=(self._generation,), name=f"tierlm-worker-{self._generation}", daemon=True
            )
            self._thread.start()

    def _main(self, generation: int) -> None:
        try:
            self._loop(generation)
        except BaseException as err:  # noqa: BLE001 - record why; the watchdog restarts it
            if generation == self._generation:
                self._death = f"{type(err).__name__}: {err}"
            if not isinstance(err, (WorkerKilled, StageFailed)):  # a stage's failure is logged as it is found
                logging.getLogger("tierlm.server").exception("the worker crashed")

    def _disk_for_spills(self):
        """The DiskSpill every worker of this server shares (None: no disk, a pipeline, or weights
        of no known source, whose files could not be tied to them)."""
        wanted = self.settings.spill_disk_bytes and self.pipeline is None and self.loaded.source is not None
        if self._spill_disk is None and wanted and not self._spill_disk_failed:
            from tierlm.kv.spill import DiskSpill
            from tierlm.paths import cache_root
            from tierlm.runtime.saved_chat import model_identity

            def identity():  # at the first write: it may hash a checkpoint loaded as stored
                return model_identity(self.loaded, self.loaded.new_cache())  # the layout and format

            try:
                self._spill_disk = DiskSpill(cache_root() / "kv-spill", self.settings.spill_disk_bytes, identity)
            except OSError as err:  # an unreadable cache folder costs the disk copies, not the server
                logging.getLogger("tierlm.server").warning("no disk for KV spills: %s", err)
                self._spill_disk_failed = True
        return self._spill_disk

    def _current(self, generation: int) -> bool:
        return generation == self._generation and not self._stop.is_set()

    def _loop(self, generation: int) -> None:
        runner = BatchRunner(self.loaded, self.tokenizer, self.settings.slots, spill_bytes=spill_room(self.loaded),
                             spill_disk=self._disk_for_spills(), parallel=self.settings.parallel,
                             draft_model=self.draft_model)  # fmt: skip
        with self._cond:
            if not self._current(generation):
                return
            self._runner = runner
        while True:
            with self._cond:
                if not self._current(generation):
                    return
                self._beat = time.monotonic()
                hook = self._hooks.popleft() if self._hooks else None
                paused, delay = self._paused, self._step_delay
            if hook is not None:
                self._apply(hook)
                continue
            self._end_gone(runner)
            with self._cond:
                if not self._current(generation):
                    return
                self._admit(runner, paused)
                self._retire_unused(runner)
                if paused or not runner.active:
                    self._cond.wait(IDLE_WAIT_S)
                    continue
            try:
                report = runner.step()
            except StageFailed:
                raise  # the whole pipeline is down: the watchdog fails every job and restarts it
            except Exception as err:  # noqa: BLE001 - a failed step fails its jobs, not the server
                if self.pipeline is not None and self.pipeline.failure() is not None:
                    raise  # an error of a pipeline that failed meanwhile: the same, for the watchdog  # noqa: BLE001 - a failed step fails its jobs, not the server
                logging.getLogger("tierlm.server").exception("a generation step failed")
                runner.fail_all(f"generation failed: {type(err).__name__}: {err}")
                continue
            self.peak_batch = max(self.peak_batch, report.batch)
            if self._on_step is not None:
                self._on_step(report)
            if delay:
                time.sleep(delay)

    def _apply(self, hook: tuple[str, float]) -> None:
        action, seconds = hook
        if action == "kill":
            raise WorkerKilled("killed by the debug hook")
        time.sleep(seconds)  # "stall": no heartbeat meanwhile

    def _end_gone(self, runner: BatchRunner) -> None:
        """End sequences whose client left (frees the slot) or whose deadline passed."""
        now = time.monotonic()
        for seq in list(runner.active):
            if seq.job.cancelled or seq.job.closed:
                runner.end(seq, "cancelled")
            elif seq.job.expired(now):
                runner.end(seq, "timeout")

    def _admit(self, runner: BatchRunner, paused: bool) -> None:
        """Drop queued jobs that ended or expired, then move queued jobs into free slots
        (under the lock, so the watchdog sees every job)."""
        now = time.monotonic()
        for job in [j for j in self._queue if j.closed or j.cancelled or j.expired(now)]:
            self._queue.remove(job)
            job.finish("timeout", 0)  # a no-op for a job that already ended
        while self._queue and runner.has_room and not paused:
            runner.admit(self._queue.popleft())

    def _retire_unused(self, runner: BatchRunner) -> None:
        if not self._retiring:
            return
        used = {s.variant for s in runner.active} | {job.variant for job in self._queue}
        for variant in [v for v in self._retiring if v not in used]:
            remove = self._retiring.pop(variant)
            try:
                remove()
            except Exception:  # noqa: BLE001 - a failed removal must not stop serving
                logging.getLogger("tierlm.server").exception("removing variant %s failed", variant)

    # -- the watchdog ----------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.settings.watchdog_interval):
            problem = self._problem()
            if problem is not None:
                self._restart(problem)

    def _problem(self) -> str | None:
        if self.pipeline is not None:
            if self.pipeline.gave_up:
                return None  # it stays down; requests are refused with the reason
            failure = self.pipeline.failure()
            if failure is not None:
                return failure
        thread = self._thread
        if thread is None or not thread.is_alive():
            return f"died ({self._death or 'its thread ended'})"
        age = time.monotonic() - self._beat
        if age > self.settings.stall_timeout:
            return f"stalled (no heartbeat for {age:.1f} s)"
        return None

    def _restart(self, problem: str) -> None:
        with self._cond:
            self._restarting = True
            self._restarts += 1
            self._last_error = problem
            self._generation += 1  # supersedes the old thread, should it ever wake up
            runner, self._runner = self._runner, None
        if self.pipeline is not None and self.pipeline.failure() is not None:
            self._restart_pipeline(problem, runner)
            return
        logging.getLogger("tierlm.server").error("the worker %s; restarting it", problem)
        message = f"the server's worker {problem} and was restarted; this request was aborted, retry it"
        for job in runner.jobs() if runner else []:
            job.fail(message)
        if self._on_restart is not None:
            self._on_restart(problem)
        if self._stop.wait(self.settings.restart_backoff):
            return
        self._spawn()
        with self._cond:
            self._restarting = False

    def _restart_pipeline(self, problem: str, runner: BatchRunner | None) -> None:
        """A stage failed: end every job in flight (queued ones too: the restart takes a while)
        with the reason, let the old thread leave its forward, restart the pipeline under the
        supervisor's back-off, then a fresh worker thread."""
        logging.getLogger("tierlm.server").error("%s; restarting the pipeline", problem)
        with self._cond:
            queued, self._queue = list(self._queue), deque()
        message = f"{problem}; the pipeline is restarting, retry the request in a few seconds"
        for job in queued + (runner.jobs() if runner else []):
            job.fail(message, code="pipeline_failed")
        thread = self._thread
        if thread is not None:
            thread.join(PIPELINE_THREAD_EXIT_S)  # its pending wait ended with StageFailed
        if self._on_restart is not None:
            self._on_restart(problem)
        if not self.pipeline.recover(problem, self._stop):
            return  # down for good (or shutting down): `down_reason` says so to every request
        self._spawn()
        with self._cond:
            self._restarting = False
