"""A 2-stage pipeline launched torchrun-style (RANK/WORLD_SIZE/MASTER_*: both ranks run the same
`generate`) with each rank in its own cgroup v1 memory group capped at its profile's budget:
the run succeeds, prints the single-process text, and each rank's measured peak (the group's
max_usage_in_bytes and the process's own peak RSS) stays within its budget, never OOM-limited.
Each rank holds only its layers, so each peaks below the single process that holds them all.

The cgroup helpers are those of tests/test_real_limits.py (a child of this process's own group).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_real_limits import memory_cgroup, needs_cgroup, own_memory_cgroup
from tests.tiny import make_model

pytestmark = pytest.mark.e2e  # ranks are processes in cgroups

MiB = 2**20
BUDGET = 512 * MiB  # each rank's profile budget and its cgroup's cap
CONTEXT = 64
# Runs `argv` in the cgroup whose cgroup.procs is argv[1] (joined before exec, so every byte is
# charged) and writes the child's peak RSS (ru_maxrss, KiB) to argv[2]; it stays outside the group.
IN_GROUP = """
import os, resource, subprocess, sys
procs, peak_file, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
def join():
    fd = os.open(procs, os.O_WRONLY)
    os.write(fd, b"0")  # "0": the writing process itself
    os.close(fd)
rc = subprocess.call(argv, preexec_fn=join)
with open(peak_file, "w") as out:
    out.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
sys.exit(rc)
"""


def write_budget_profile(path: Path, budget: int) -> Path:
    """A CPU profile of `budget` bytes, weights as stored, nothing streamed to disk."""
    path.write_text(
        'description = "tests: one pipeline rank under a cgroup cap"\n'
        f"device_memory = {budget}\nhost_memory = {budget}\ndisk_offload = false\nheadroom = \"32MiB\"\n"
        'quant = "none"\nkv_cache = "auto"\nprefetch_depth = 0\n'
        f"context_length = {CONTEXT}\nbatch_size = 1\n"
    )
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_in(group: Path, peak_file: Path, argv: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", IN_GROUP, str(group / "cgroup.procs"), str(peak_file), *argv],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)  # fmt: skip


def kill_members(group: Path) -> None:
    """End whatever this test started that is still in `group` (each by its pid)."""
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def group_peak(group: Path) -> dict:
    read = lambda name: int((group / name).read_text())  # noqa: E731
    return {"max_usage": read("memory.max_usage_in_bytes"), "failcnt": read("memory.failcnt"),
            "oom_kills": oom_kills(group)}  # fmt: skip


def oom_kills(group: Path) -> int:
    control = (group / "memory.oom_control").read_text().split()
    return int(control[control.index("oom_kill") + 1]) if "oom_kill" in control else 0


@needs_cgroup
def test_each_rank_stays_within_its_capped_profile(tmp_path):
    if own_memory_cgroup() is None:
        pytest.skip("this process cannot make a child group under the cgroup v1 memory controller")
    model_dir = tmp_path / "model"
    # 8 layers of 512 wide, fp32 (~100 MiB of layers): each rank's half is a difference the peaks show.
    make_model(model_dir, "llama", hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536, vocab=320)
    profiles = [write_budget_profile(tmp_path / f"rank{rank}.toml", BUDGET) for rank in range(2)]
    command = [sys.executable, "-m", "tierlm", "generate", "hello world", "--model", str(model_dir),
               "--temperature", "0", "-n", "8", "--threads", "1"]  # fmt: skip
    env = dict(os.environ, TIERLM_PIPELINE_TIMEOUT="120", TIERLM_STAGE_TIMEOUT="60")  # a loaded machine
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)

    # First use builds the native kernels and probes the machine into the test cache: a one-off
    # peak (the compiler's) that is not what the ranks are measured for.
    warm = subprocess.run(command + ["--profile", str(profiles[0])], env=env, capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert warm.returncode == 0, warm.stderr[-3000:]

    # The single process (in a group of its own, uncapped but measured) and both ranks run at once.
    port = free_port()
    procs, outputs = [], []
    with memory_cgroup(4 * BUDGET) as alone, memory_cgroup(BUDGET) as group0, memory_cgroup(BUDGET) as group1:
        groups = (alone, group0, group1)
        try:
            procs.append(start_in(alone, tmp_path / "peak-one", command + ["--profile", str(profiles[0])], env))
            for rank, group in enumerate((group0, group1)):
                rank_env = dict(env, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                procs.append(start_in(group, tmp_path / f"peak-{rank}",
                                      command + ["--profile", ",".join(map(str, profiles))], rank_env))  # fmt: skip
            outputs = [proc.communicate(timeout=150) for proc in procs]
        finally:
            for group in groups:
                kill_members(group)
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        single, *peaks = [group_peak(group) for group in groups]
    (one, *ranks), ((one_out, one_err), *outputs) = procs, outputs
    assert one.returncode == 0 and one_out == warm.stdout, one_err[-3000:]
    single["rss"] = int((tmp_path / "peak-one").read_text())
    for rank, (proc, (out, err)) in enumerate(zip(ranks, outputs)):
        assert proc.returncode == 0, f"rank {rank}: rc {proc.returncode} (-9 = OOM-killed): {err[-3000:]}"
        peaks[rank]["rss"] = int((tmp_path / f"peak-{rank}").read_text())
    print("single", single, "ranks", peaks)

    assert outputs[0][0] == one_out and one_out.strip()  # rank 0 prints the single-process text
    for rank, peak in enumerate(peaks):
        assert peak["failcnt"] == 0 and peak["oom_kills"] == 0, f"rank {rank} hit its cap: {peak}"
        assert peak["max_usage"] <= BUDGET and peak["rss"] <= BUDGET, f"rank {rank}: {peak}"
        # Half the layers each (~50 MiB less): a rank that loaded them all would not be below.
        assert peak["rss"] < single["rss"] and peak["max_usage"] < single["max_usage"], \
            f"rank {rank} peaks at {peak} vs one process {single}"
