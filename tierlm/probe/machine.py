"""This machine's probe record: read from the cache, or measured once in a child process.

The measurements themselves run in `tierlm.runtime.measure_machine` (started as a child by
name, so this module, which the loader uses, never imports the loader back). Reading a cached
record loads no torch.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tierlm.device.cpu import torch_threads
from tierlm.device.resolve import plan_device
from tierlm.errors import TierlmError
from tierlm.offload.bandwidths import Bandwidths
from tierlm.probe.record import ProbeRecord, bandwidths_path, read_probe


def load_bandwidths(device=None, *, refresh: bool = False, threads: int | None = None) -> Bandwidths:
    """This machine's Bandwidths for `device`, from the cache or probed (then cached) once."""
    return load_probe(device, refresh=refresh, threads=threads).bandwidths


def load_probe(device=None, *, refresh: bool = False, threads: int | None = None) -> ProbeRecord:
    """The cached ProbeRecord for `device` at `threads` compute threads (default: torch's count,
    device/cpu.py `torch_threads`); probed first (in a child) when missing, damaged or `refresh`."""
    device = plan_device(device)
    threads = torch_threads() if threads is None else threads
    path = bandwidths_path(device, threads)
    if not refresh:
        cached = read_probe(path)
        if cached is not None:
            return cached
    _probe_in_child(device, threads)
    return ProbeRecord.from_dict(json.loads(path.read_text()))


def _probe_in_child(device, threads: int) -> None:
    """Run `probe` in a child process with `threads` compute threads; it saves the cache file."""
    done = subprocess.run(
        [sys.executable, "-m", "tierlm.runtime.measure_machine", str(device), str(threads)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise TierlmError(
            f"measuring this machine's bandwidths failed: {' | '.join(tail)}",
            f"run `python -m tierlm.runtime.measure_machine {device}` to see the whole error",
        )
