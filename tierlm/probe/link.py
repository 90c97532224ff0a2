"""The link between pipeline ranks, measured once and cached beside the machine probe.

Two local processes joined by torch.distributed (gloo, the backend ranks on CPUs use) time what
a pipeline does between stages: tiny messages back and forth (the latency: half a round trip)
and 1-16 MiB tensors one way, acknowledged by a tiny one (the bandwidth: the slope of time over
bytes, so the latency drops out). The best of a few tries counts, as in the machine probe.

`load_link()` reads `<cache>/probe/link-gloo-local-v1.json`, measuring first when there is none
(in a child process: `python -m tierlm.probe.link`, which also re-probes by hand);
`load_link(refresh=True)` and `tierlm plan --stages N --reprobe-link` measure afresh. Ranks on
other machines are not measured from here: `tierlm plan --link-gbps G` gives their link.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tierlm.atomic import optional_write, replace_file
from tierlm.errors import TierlmError
from tierlm.offload.stage_planner import Link
from tierlm.paths import cache_root

LINK_VERSION = 1
TINY_ROUNDS = 50  # round trips of a one-element tensor
SIZES = (1 << 20, 4 << 20, 16 << 20)  # payloads sent one way (bytes)
TRIES = 5  # sends of each payload; the fastest counts
TIMEOUT_S = 120


def link_path() -> Path:
    return cache_root() / "probe" / f"link-gloo-local-v{LINK_VERSION}.json"


def gbps_link(gbps: float, latency_ms: float) -> Link:
    """A link given by hand (`--link-gbps`, `--link-latency-ms`): ranks on other machines."""
    if not gbps > 0 or latency_ms < 0:
        raise TierlmError(f"a link of {gbps} Gbit/s and {latency_ms} ms", "give --link-gbps > 0 and --link-latency-ms >= 0")
    return Link(gbps * 1e9 / 8, latency_ms / 1e3, f"--link-gbps {gbps:g}, latency {latency_ms:g} ms")


def load_link(*, refresh: bool = False) -> Link:
    """The cached local link, measured first (in a child) when missing, damaged or `refresh`."""
    if not refresh:
        cached = read_link(link_path())
        if cached is not None:
            return cached
    return _link_from(_measure_in_child())


def read_link(path: Path) -> Link | None:
    try:
        return _link_from(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _link_from(record: dict) -> Link | None:
    if record.get("version") != LINK_VERSION:
        return None
    return Link(float(record["bytes_per_s"]), float(record["latency_s"]),
                "measured between two local gloo processes", float(record["probed_at"]))  # fmt: skip


def link_record(bytes_per_s: float, latency_s: float) -> dict:
    return {"version": LINK_VERSION, "backend": "gloo", "bytes_per_s": bytes_per_s, "latency_s": latency_s,
            "probed_at": time.time()}  # fmt: skip


def save_link(record: dict, path: Path | None = None) -> Path:
    """Write a measured link's record (atomically; skipped on a read-only cache)."""
    path = link_path() if path is None else path
    with optional_write():
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, json.dumps(record, indent=1) + "\n")
    return path


def measure(port: int | None = None) -> tuple[float, float]:
    """(bytes per second, latency in seconds) between this process (rank 0) and a second local
    process it starts (rank 1), over gloo."""
    port = port or free_port()
    peer = subprocess.Popen([sys.executable, "-m", "tierlm.probe.link", "--rank", "1", "--port", str(port)])
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                                timeout=_timeout())  # fmt: skip
        try:
            return _time_rank0()
        finally:
            dist.destroy_process_group()
    finally:
        try:
            peer.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()


def _time_rank0() -> tuple[float, float]:
    tiny = torch.zeros(1)
    rounds = []
    for _ in range(TINY_ROUNDS):
        start = time.perf_counter()
        dist.send(tiny, 1)
        dist.recv(tiny, 1)
        rounds.append(time.perf_counter() - start)
    latency = min(rounds) / 2
    best = {}
    for size in SIZES:
        payload = torch.zeros(size // 4)
        best[size] = min(_one_way(payload, tiny) for _ in range(TRIES))
    # The slope between the smallest and largest payload: seconds per byte, the latency cancels.
    small, large = SIZES[0], SIZES[-1]
    per_byte = max(best[large] - best[small], 1e-9) / (large - small)
    return 1.0 / per_byte, latency


def _one_way(payload, ack) -> float:
    start = time.perf_counter()
    dist.send(payload, 1)
    dist.recv(ack, 1)
    return time.perf_counter() - start


def _serve_rank1(port: int) -> None:
    """Rank 1: answer rank 0's schedule (_time_rank0's) message for message."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2, timeout=_timeout())
    try:
        tiny = torch.zeros(1)
        for _ in range(TINY_ROUNDS):
            dist.recv(tiny, 0)
            dist.send(tiny, 0)
        for size in SIZES:
            payload = torch.zeros(size // 4)
            for _ in range(TRIES):
                dist.recv(payload, 0)
                dist.send(tiny, 0)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _timeout():
    return timedelta(seconds=TIMEOUT_S)


def _measure_in_child() -> dict:
    """Measure in a child process (it caches the result and prints its record as the last line),
    so the caller never joins a process group."""
    done = subprocess.run([sys.executable, "-m", "tierlm.probe.link"], capture_output=True, text=True,
                          timeout=TIMEOUT_S * 2)  # fmt: skip
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise TierlmError(f"measuring the link between local ranks failed: {' | '.join(tail)}",
                          "run `python -m tierlm.probe.link` to see the whole error, or give --link-gbps")  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    # `python -m tierlm.probe.link`: measure and cache (re-probes); `--rank 1 --port P`: the peer.
    if "--rank" in sys.argv:
        _serve_rank1(int(sys.argv[sys.argv.index("--port") + 1]))
    else:
        found = link_record(*measure())
        print(f"{save_link(found)}: {found['bytes_per_s'] / 1e9:.2f} GB/s, latency {found['latency_s'] * 1e6:.0f} us")
        print(json.dumps(found))
