"""The machine's measured speeds, as the planner's cost model reads them (tierlm/probe/ measures
and caches them; tests pass fixed figures), with the corrections measured runs made to them.

A measured run corrects only the decode path it ran (`PATHS`): a run that streamed from disk says
how fast streaming was, not how fast resident weights are read, so its correction applies to
predictions of streamed placements alone (`Bandwidths.for_path`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from tierlm.offload.placement import DEVICE

MATRIX = 4096  # the int8 bandwidth probe's weight: 4096 x 4096 (16 MiB), as a 7B layer's wo

# A decode step's path: every block on the device tier; some dense block in host RAM or on disk
# (streamed, or computed by the CPU where it lies); a mixture-of-experts model's routed experts.
RESIDENT, STREAMED, MOE = "resident", "streamed", "moe"
PATHS = (RESIDENT, STREAMED, MOE)


def decode_path(tiers, moe: bool) -> str:
    """The path of a decode step over dense blocks on `tiers` (tier names); `moe`: routed experts."""
    if moe:
        return MOE
    return RESIDENT if all(tier == DEVICE for tier in tiers) else STREAMED


@dataclass(frozen=True)
class Correction:
    """A measured run's correction for one decode path: each corrected figure's factor over the
    probe's (`factors`: (figure, factor) pairs), from which run (`source`) and when (`at`)."""

    path: str
    factors: tuple[tuple[str, float], ...]
    source: str
    at: float

    def factor(self, figure: str) -> float | None:
        return dict(self.factors).get(figure)

    def to_dict(self) -> dict:
        return {"path": self.path, "factors": dict(self.factors), "source": self.source, "at": self.at}

    @classmethod
    def from_dict(cls, raw: dict) -> "Correction":
        factors = tuple((str(k), float(v)) for k, v in dict(raw["factors"]).items())
        return cls(str(raw["path"]), factors, str(raw["source"]), float(raw["at"]))


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
    format_factors        (mode, factor) per stored format the probe timed on a CPU: its weight
                          bytes/s over int8's (probe/bandwidth.py `format_factors`); a mode
                          not listed, and every mode on an accelerator, at int8's rate
    path_corrections      at most one Correction per path (PATHS); the figures above stay the
                          probe's, `for_path` applies a path's correction to them
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
    format_factors: tuple[tuple[str, float], ...] = ()
    device: str = "cpu"
    notes: tuple[str, ...] = ()
    path_corrections: tuple[Correction, ...] = ()

    def correction(self, path: str) -> Correction | None:
        return next((c for c in self.path_corrections if c.path == path), None)

    def for_path(self, path: str) -> "Bandwidths":
        """The figures a prediction for `path` uses: the probe's, times that path's correction."""
        found = self.correction(path)
        figures = replace(self, path_corrections=())
        if found is None:
            return figures
        return replace(figures, **{name: getattr(self, name) * factor for name, factor in found.factors})

    def corrected(self, path: str, fitted: "Bandwidths", source: str, at: float) -> "Bandwidths":
        """These bandwidths with `path`'s correction replaced by the one that turns the probe's
        figures into `fitted` (the path's figures a measured run implied)."""
        factors = tuple((name, getattr(fitted, name) / getattr(self, name)) for name in FIGURES
                        if getattr(self, name) > 0 and getattr(fitted, name) != getattr(self, name))  # fmt: skip
        others = tuple(c for c in self.path_corrections if c.path != path)
        return replace(self, path_corrections=(*others, Correction(path, factors, source, at)))

    def format_factor(self, mode: str) -> float:
        """Bytes/s of weights stored in `mode` over int8's (1 where the probe timed none)."""
        return dict(self.format_factors).get(mode, 1.0)

    def to_dict(self) -> dict:
        return {**asdict(self), "notes": list(self.notes), "format_factors": [list(f) for f in self.format_factors],
                "path_corrections": [c.to_dict() for c in self.path_corrections]}  # fmt: skip

    @classmethod
    def from_dict(cls, raw: dict) -> "Bandwidths":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        values["notes"] = tuple(values.get("notes", ()))
        values["format_factors"] = tuple((str(mode), float(factor)) for mode, factor in values.get("format_factors") or ())
        values["path_corrections"] = tuple(Correction.from_dict(c) for c in values.get("path_corrections") or ())
        return cls(**values)


# The figures a correction may scale: the measured speeds and times, not the device's name.
FIGURES = ("device_bytes_per_s", "host_bytes_per_s", "link_bytes_per_s", "disk_bytes_per_s", "device_flops",
           "host_flops", "per_block_overhead_s", "per_token_overhead_s", "per_row_s")
