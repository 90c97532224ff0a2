"""Liveness of a pipeline's ranks, on a side channel that does not depend on the data path.

A rank blocked in a gloo receive cannot be interrupted, and a stopped rank (SIGSTOP, a hung
driver) keeps its sockets open, so the data path alone would wait forever. Instead every worker
holds one small TCP connection to rank 0 and both ends send a byte every `interval`:

- rank 0's `PipelineHealth` marks the pipeline failed, naming the stage and why, when a worker's
  process exits ("exited with code -9 (SIGKILL)"), its connection closes, or no beat came for
  `timeout` seconds ("sent no heartbeat for 5.1 s": stopped or hung). It then closes every
  connection (so the other workers exit too) and runs its abort hooks (the launcher kills the
  processes it spawned, which also breaks any gloo wait still pending on them). Rank 0's blocking
  waits go through `PipelineHealth.wait`, which returns the moment either the operation completes
  or the pipeline fails, so a forward in flight raises `StageFailed` instead of hanging.
- a worker's `Heartbeat` exits its process (status ORPHANED) when rank 0's connection closes or
  rank 0 sent nothing for `timeout` seconds, so no worker outlives rank 0 by more than that.

The timeout is `--stage-timeout` (TIERLM_STAGE_TIMEOUT in a worker's environment); it bounds how
long a stopped rank goes unnoticed, not how long a stage may compute: a busy stage still beats.
Spawned workers find rank 0's listener in their environment (`worker_env`); under torchrun rank 0
broadcasts its port once the group is formed (launch.py `announce_health` / `join_health`) and the workers
connect to MASTER_ADDR.
"""

from __future__ import annotations

import os
import queue
import select
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from tierlm.errors import TierlmError

DEFAULT_STAGE_TIMEOUT_S = 5.0
HEALTH_ENV = "TIERLM_PIPELINE_HEALTH"  # host:port of rank 0's heartbeat listener, for a worker
STAGE_TIMEOUT_ENV = "TIERLM_STAGE_TIMEOUT"
SHUTDOWN_GRACE_S = 2.0  # how long a closed heartbeat waits for the SHUTDOWN the data path carries
ORPHANED = 75  # a worker's exit status when rank 0 went away (EX_TEMPFAIL: the launcher may retry)
BEAT = b"."
EXIT_NAME_WAIT_S = 1.0  # after a worker's connection closes, how long to wait to learn its exit status


def beat_interval(timeout: float) -> float:
    """Beats every half second, or four per timeout when that is shorter."""
    return min(0.5, timeout / 4)


def stage_timeout_s(environ=None) -> float:
    """The stage timeout the environment sets (TIERLM_STAGE_TIMEOUT), else the default."""
    env = os.environ if environ is None else environ
    raw = env.get(STAGE_TIMEOUT_ENV, "").strip()
    try:
        return check_timeout(float(raw)) if raw else DEFAULT_STAGE_TIMEOUT_S
    except ValueError:
        raise TierlmError(f"{STAGE_TIMEOUT_ENV}={raw!r} is not a number of seconds", f"unset {STAGE_TIMEOUT_ENV}") from None


def check_timeout(timeout: float) -> float:
    if not timeout > 0:
        raise TierlmError(f"--stage-timeout must be positive, not {timeout}",
                          f"give the seconds a silent stage is allowed, e.g. {DEFAULT_STAGE_TIMEOUT_S:g}")  # fmt: skip
    return float(timeout)


@dataclass(frozen=True)
class StageFailure:
    """Why pipeline stage `rank` (process `pid`, when known) counts as failed."""

    rank: int
    pid: int | None
    reason: str  # "exited with code -9 (SIGKILL)", "sent no heartbeat for 5.2 s", ...

    def describe(self) -> str:
        pid = f" (pid {self.pid})" if self.pid is not None else ""
        return f"pipeline stage {self.rank}{pid} {self.reason}"


class StageFailed(TierlmError):
    """A pipeline stage failed; `failure` says which and why."""

    def __init__(self, failure: StageFailure):
        self.failure = failure
        super().__init__(failure.describe(), "start the pipeline again; `tierlm serve` restarts it itself")


def exit_reason(code: int) -> str:
    """`exited with code X`, naming the signal of a negative code."""
    if code < 0:
        try:
            return f"exited with code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    if code == ORPHANED:
        return f"exited with code {code} (it lost rank 0)"
    return f"exited with code {code}"


class _Peer:
    """Rank 0's view of one worker."""

    def __init__(self, rank: int):
        self.rank = rank
        self.process = None  # subprocess.Popen when rank 0 spawned it
        self.pid: int | None = None
        self.sock: socket.socket | None = None
        self.last_beat = 0.0
        self.closed_at: float | None = None  # when its connection closed


class PipelineHealth:
    """Rank 0's heartbeat monitor over workers 1..world-1 (see the module docstring).

    `address` is what workers connect to (`worker_env()` for ones spawned here); `watch_process`
    gives the monitor a spawned worker's process so a failure names its exit status."""

    def __init__(self, world: int, timeout: float = DEFAULT_STAGE_TIMEOUT_S, *, host: str = "127.0.0.1",
                 connect_timeout: float = 120.0):  # fmt: skip
        self.world = world
        self.timeout = check_timeout(timeout)
        self.interval = beat_interval(self.timeout)
        self.connect_timeout = connect_timeout
        self._peers = {rank: _Peer(rank) for rank in range(1, world)}
        self._cond = threading.Condition()
        self._failure: StageFailure | None = None
        self._aborts: list[Callable[[StageFailure], None]] = []
        self._closed = threading.Event()
        self._closing = False  # stop_watching(): exits are expected
        self._started = time.monotonic()
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self.address = f"{host}:{self.port}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._waits: queue.SimpleQueue = queue.SimpleQueue()
        self._monitor = threading.Thread(target=self._watch, name="tierlm-stage-health", daemon=True)
        self._monitor.start()
        self._waiter = threading.Thread(target=self._wait_loop, name="tierlm-stage-wait", daemon=True)
        self._waiter.start()

    # -- set-up --------------------------------------------------------------------------------

    def worker_env(self) -> dict[str, str]:
        """The environment a spawned worker needs to beat to this monitor."""
        return {HEALTH_ENV: self.address, STAGE_TIMEOUT_ENV: repr(self.timeout)}

    def watch_process(self, rank: int, process) -> None:
        """`process` (subprocess.Popen) runs stage `rank`: its exit counts as that stage's failure."""
        with self._cond:
            self._peers[rank].process = process
            self._peers[rank].pid = process.pid

    def on_failure(self, abort: Callable[[StageFailure], None]) -> None:
        """Run `abort(failure)` (on the monitor thread) once a stage fails: kill what was spawned,
        so that gloo waits still pending on it end; at once if the pipeline failed already."""
        with self._cond:
            self._aborts.append(abort)
            failure = self._failure
        if failure is not None:
            abort(failure)

    def wait_connected(self, timeout: float) -> None:
        """Until every worker's heartbeat is connected (a TierlmError after `timeout` s, a
        StageFailed as soon as one fails)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_failure()
                missing = [r for r, p in self._peers.items() if p.sock is None and p.closed_at is None]
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TierlmError(f"pipeline stages {missing} did not connect their heartbeat within {timeout:g} s")
                self._cond.wait(min(left, self.interval))

    # -- state ---------------------------------------------------------------------------------

    @property
    def failure(self) -> StageFailure | None:
        return self._failure

    def check(self) -> None:
        """StageFailed if a stage has failed."""
        with self._cond:
            self._raise_failure()

    def fail(self, rank: int, reason: str) -> StageFailure:
        """Mark stage `rank` failed (the data path saw it break) unless the monitor already named
        a failure; returns the failure that stands."""
        return self._declare(rank, reason)

    def status(self) -> dict:
        """For /health: each worker's heartbeat age and the failure, if any."""
        now = time.monotonic()
        with self._cond:
            stages = [{"rank": p.rank, "pid": p.pid, "connected": p.sock is not None,
                       "heartbeat_age_s": round(now - p.last_beat, 3) if p.sock is not None else None}
                      for p in self._peers.values()]  # fmt: skip
            failure = self._failure
        return {"stage_timeout_s": self.timeout, "stages": stages,
                "failure": failure.describe() if failure else None}  # fmt: skip

    # -- abortable waits -------------------------------------------------------------------------

    def wait(self, work, peer: int) -> None:
        """Wait for a torch.distributed Work (an isend/irecv with stage `peer`) to complete, or
        raise StageFailed as soon as the pipeline fails: the blocking wait runs on a helper
        thread that only the completion (or the killed peer's closed socket) ends."""
        if work.is_completed() and self._failure is None:  # no hand-over (a send the reply proved done)
            try:
                work.wait()
                return
            except Exception as err:  # noqa: BLE001 - named as from the helper thread
                raise self.broken(peer, err) from None
        done = _Done()
        self._waits.put((work, done))
        with self._cond:
            while not done.finished and self._failure is None:
                self._cond.wait()
            if done.finished and done.error is None:
                return
            failure = self._failure
        if failure is None:  # the operation itself failed: give the monitor a moment to say why
            failure = self._name_failure(peer, done.error)
        raise StageFailed(failure)

    def broken(self, peer: int, error: BaseException) -> StageFailed:
        """The StageFailed for a data-path call with stage `peer` that raised `error`: the
        monitor's reason when it names one within a moment (the peer's exit), else this one."""
        return StageFailed(self._failure or self._name_failure(peer, error))

    def _name_failure(self, peer: int, error: BaseException) -> StageFailure:
        deadline = time.monotonic() + EXIT_NAME_WAIT_S + self.interval
        with self._cond:
            while self._failure is None and time.monotonic() < deadline:
                self._cond.wait(self.interval / 2)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return self._declare(peer, f"broke the link: {first_line}")

    def _wait_loop(self) -> None:
        while True:
            item = self._waits.get()
            if item is None:
                return
            work, done = item
            try:
                work.wait()
            except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
                done.error = err
            with self._cond:
                done.finished = True
                self._cond.notify_all()

    # -- the monitor ---------------------------------------------------------------------------

    def stop_watching(self) -> None:
        """The workers are being shut down: their exits from now on are no failure."""
        self._closing = True

    def close(self) -> None:
        """Stop watching and close every connection (workers still running then exit)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._monitor.join(5 * self.interval + 1)
        self._waits.put(None)

    def _watch(self) -> None:
        next_beat = 0.0
        try:
            while not self._closed.is_set():
                for key, _ in self._selector.select(self.interval / 2):
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._read(key.data)
                if self._failure is not None:
                    self._shut_connections()  # the other workers exit within a beat
                now = time.monotonic()
                if now >= next_beat:
                    self._beat()
                    next_beat = now + self.interval
                self._inspect(now)
        finally:
            self._shut_connections()
            self._selector.close()
            self._listener.close()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        sock.settimeout(self.timeout)  # the hello follows the connect at once
        try:
            hello = _read_line(sock)
            rank, pid = (int(field) for field in hello.split())
        except (OSError, ValueError):
            sock.close()
            return
        sock.setblocking(False)
        with self._cond:
            peer = self._peers.get(rank)
            if peer is None or peer.sock is not None or self._failure is not None:
                sock.close()  # not a rank of this pipeline, or too late: the worker exits
                return
            peer.sock, peer.pid, peer.last_beat = sock, pid, time.monotonic()
            self._selector.register(sock, selectors.EVENT_READ, peer)
            self._cond.notify_all()

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            peer.last_beat = time.monotonic()
            return
        self._selector.unregister(peer.sock)
        peer.sock.close()
        with self._cond:
            peer.sock, peer.closed_at = None, time.monotonic()

    def _beat(self) -> None:
        with self._cond:
            socks = [p.sock for p in self._peers.values() if p.sock is not None]
        for sock in socks:
            try:
                sock.send(BEAT)
            except (BlockingIOError, OSError):
                pass  # a stopped worker's buffer is full, or it is gone: the checks below tell

    def _inspect(self, now: float) -> None:
        if self._failure is not None or self._closing:
            return
        for peer in list(self._peers.values()):
            reason = self._trouble(peer, now)
            if reason is not None:
                self._declare(peer.rank, reason)
                return

    def _trouble(self, peer: _Peer, now: float) -> str | None:
        code = peer.process.poll() if peer.process is not None else None
        if code is not None:
            return exit_reason(code)
        if peer.closed_at is not None:
            if peer.process is not None and now - peer.closed_at < EXIT_NAME_WAIT_S:
                return None  # its exit status comes in a moment
            return "closed its heartbeat connection"
        if peer.sock is not None:
            silent = now - peer.last_beat
            return f"sent no heartbeat for {silent:.1f} s (stopped or hung)" if silent > self.timeout else None
        if now - self._started > self.connect_timeout:
            return f"never connected its heartbeat in {self.connect_timeout:g} s"
        return None

    def _declare(self, rank: int, reason: str) -> StageFailure:
        with self._cond:
            if self._failure is not None:
                return self._failure
            peer = self._peers.get(rank)
            self._failure = failure = StageFailure(rank, peer.pid if peer else None, reason)
            aborts = list(self._aborts)
            self._cond.notify_all()
        print(f"tierlm: {failure.describe()}; stopping the pipeline", file=sys.stderr, flush=True)
        for abort in aborts:
            try:
                abort(failure)
            except Exception as err:  # noqa: BLE001 - one failed hook must not keep the others from running
                print(f"tierlm: stopping the pipeline: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return failure

    def _shut_connections(self) -> None:
        """Close every worker's connection (monitor thread only: it owns the selector)."""
        for key in list(self._selector.get_map().values()):
            if key.fileobj is not self._listener:
                self._selector.unregister(key.fileobj)
                key.fileobj.close()
        now = time.monotonic()
        with self._cond:
            for peer in self._peers.values():
                if peer.sock is not None:
                    peer.sock, peer.closed_at = None, now

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise StageFailed(self._failure)


@dataclass
class _Done:
    finished: bool = False
    error: BaseException | None = None


def _read_line(sock: socket.socket, limit: int = 64) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk or len(data) > limit:
            raise OSError("no hello")
        data += chunk
    return data.decode("ascii")


class Heartbeat:
    """A worker's side: connects to rank 0's monitor, beats every interval, and ends this process
    (status ORPHANED) when rank 0's beats stop for `timeout` s or its connection closes."""

    def __init__(self, address: str, rank: int, timeout: float = DEFAULT_STAGE_TIMEOUT_S):
        self.rank = rank
        self.timeout = check_timeout(timeout)
        self.interval = beat_interval(self.timeout)
        host, _, port = address.rpartition(":")
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=self.timeout)
            self._sock.sendall(f"{rank} {os.getpid()}\n".encode("ascii"))
        except (OSError, ValueError) as err:
            raise TierlmError(f"pipeline stage {rank} cannot reach rank 0's heartbeat at {address}: {err}",
                              "rank 0 has gone; start the pipeline again") from None  # fmt: skip
        self._sock.setblocking(False)
        self._finished = threading.Event()  # SHUTDOWN came: rank 0 may now go first
        self._thread = threading.Thread(target=self._run, name="tierlm-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, rank: int, environ=None) -> "Heartbeat | None":
        """The heartbeat a spawned worker's environment asks for (None when it names no monitor)."""
        env = os.environ if environ is None else environ
        address = env.get(HEALTH_ENV)
        return cls(address, rank, stage_timeout_s(env)) if address else None

    def _run(self) -> None:
        last_heard = next_beat = time.monotonic()
        while True:
            readable, _, _ = select.select([self._sock], [], [], self.interval / 2)
            now = time.monotonic()
            if readable:
                try:
                    data = self._sock.recv(4096)
                except BlockingIOError:
                    data = BEAT
                except OSError:
                    data = b""
                if not data:
                    return self._lost("closed the connection")
                last_heard = now
            if now - last_heard > self.timeout:
                return self._lost(f"sent no heartbeat for {now - last_heard:.1f} s")
            if now >= next_beat:
                try:
                    self._sock.send(BEAT)
                except BlockingIOError:
                    pass  # rank 0 is not reading: its silence is what counts
                except OSError:
                    return self._lost("closed the connection")
                next_beat = now + self.interval

    def finished(self) -> None:
        """This stage was told to shut down: rank 0 closing its end now is no failure."""
        self._finished.set()

    def _lost(self, why: str) -> None:
        # Rank 0 exits right after sending SHUTDOWN, which this thread may see before the main
        # thread has read it: give the main thread a moment to say so.
        if self._finished.wait(min(self.timeout, SHUTDOWN_GRACE_S)):
            return
        print(f"tierlm stage {self.rank}: rank 0 {why}; exiting", file=sys.stderr, flush=True)
        os._exit(ORPHANED)  # not sys.exit: the main thread may sit in a gloo wait nothing else ends
