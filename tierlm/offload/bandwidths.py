"""The machine's measured speeds, as the planner's cost model reads them (tierlm/probe/ measures
and caches them; tests pass fixed figures)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

MATRIX = 4096  # the int8 bandwidth probe's weight: 4096 x 4096 (16 MiB), as a 7B layer's wo


@dataclass(frozen=True)
class Bandwidths:
    """Effective speeds of this machine (bytes/s, FLOP/s, seconds).

    device_bytes_per_s    int8 weight bytes/s of a batch-1 matmul on the compute device
    host_bytes_per_s      the same computed by the CPU on host RAM (= device on CPU-only)
    link_bytes_per_s      host -> device copy (pinned H2D on CUDA; a RAM-to-RAM copy_ on CPU)
    disk_bytes_per_s      sequential read of a file whose pages were dropped from the cache
    device_flops          GEMM throughput on the compute device (prefill), compute dtype
    host_flops            fp32 GEMM throughput of the CPU (= device_flops on CPU-only)
    per_block_overhead_s  fixed cost of one decoder layer's decode step (dispatch, small ops,
                          kernel calls), besides its weight bytes
    per_token_overhead_s  fixed cost of a decode step besides its layers (embedding, final
                          norm, head call, sampling, the engine's bookkeeping)
    per_row_s             extra cost of a weight row at batch 1 on the compute device, per
                          row of 1/K of the 4096-wide probe's: a [N, K] matmul takes
                          bytes / device_bytes_per_s + N x (1 - K / 4096) x per_row_s
    """

    device_bytes_per_s: float
    host_bytes_per_s: float
    link_bytes_per_s: float
    disk_bytes_per_s: float
    device_flops: float
    host_flops: float
    per_block_overhead_s: float
    per_token_overhead_s: float = 0.0
    per_row_s: float = 0.0
    device: str = "cpu"
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {**asdict(self), "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, raw: dict) -> "Bandwidths":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        values["notes"] = tuple(values.get("notes", ()))
        return cls(**values)
