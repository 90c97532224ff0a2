"""Where this process sits in a pipeline (torchrun's or tierlm's RANK/WORLD_SIZE/MASTER_*), the
torch.distributed backend a device uses, and the timeouts ranks wait under.

Torch-free: the CLI asks whether it runs as a pipeline rank before it loads anything;
tierlm/distributed/launch.py forms the group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tierlm.errors import TierlmError

# Loading a stage may convert a checkpoint first (minutes for a large model), and every
# collective a rank waits in is bounded by this; TIERLM_PIPELINE_TIMEOUT overrides it.
DEFAULT_TIMEOUT_S = 1800.0
# Set in a locally spawned worker: the pid of rank 0, which the worker outlives by at most a poll.
PARENT_ENV = "TIERLM_PIPELINE_PARENT"
TIMEOUT_ENV = "TIERLM_PIPELINE_TIMEOUT"
BACKEND_ENV = "TIERLM_PIPELINE_BACKEND"  # a spawned worker's, from rank 0's device


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in a pipeline, as torchrun (or tierlm's spawner) tells it."""

    rank: int
    world: int
    master_addr: str
    master_port: int


def rank_env(environ=None) -> RankEnv | None:
    """This process's rank from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; None outside a pipeline
    (unset, or a world of one)."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        port = int(env.get("MASTER_PORT", "29500"))
    except ValueError:
        raise TierlmError(f"RANK={env['RANK']!r}, WORLD_SIZE={env['WORLD_SIZE']!r} are not integers",
                          "launch with torchrun, or unset RANK and WORLD_SIZE") from None  # fmt: skip
    if world <= 1:
        return None
    if not 0 <= rank < world:
        raise TierlmError(f"RANK={rank} is outside WORLD_SIZE={world}", "launch with torchrun")
    return RankEnv(rank, world, env.get("MASTER_ADDR", "127.0.0.1"), port)


def timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise TierlmError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds", f"unset {TIMEOUT_ENV}") from None


def backend_for(device_type: str) -> str:
    """The torch.distributed backend for a compute device: gloo on CPUs, nccl on CUDA, hccl on
    Ascend (torch_npu registers it)."""
    return {"cuda": "nccl", "npu": "hccl"}.get(device_type, "gloo")
