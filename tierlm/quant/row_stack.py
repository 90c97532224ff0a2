"""A weight fused from rows of several formats: each run of rows kept in its own (GGUF Q4_K_M puts a
Q6_K v under Q4_K q and k; a Q3_K_M file mixes Q4_0 and Q8_0 rows), so a fused wqkv costs the
file's bytes instead of one wider form that holds every run exactly (int8-g16-asym: ~10 bits a
weight where Q4_K is 4.5).

`RowStack` stands where any weight does: `linear` runs each run's own kernel into its slice of the
output, `dequantize` stacks each run's values, and the fused decode step reads the runs as stored
(csrc/weight.h kStack). An artifact stores it as one `stack` record (cache/encodings.py).
"""

from __future__ import annotations

import torch


class RowStack:
    """`runs`: weights of one input width, rows [0, r0) the first's, [r0, r0 + r1) the next's, ..."""

    def __init__(self, runs, *, dtype: torch.dtype | None = None):
        runs = list(runs)
        if len(runs) < 2:
            raise ValueError(f"a row stack needs at least two runs, got {len(runs)}")
        widths = {run.shape[1] for run in runs}
        if len(widths) != 1:
            raise ValueError(f"every run of a row stack must have one input width, got {sorted(widths)}")
        self.runs = runs
        self.dtype = dtype or runs[0].dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(run.shape[0] for run in self.runs), self.runs[0].shape[1]))

    @property
    def device(self) -> torch.device:
        return self.runs[0].device

    @property
    def nbytes(self) -> int:
        return sum(run.nbytes for run in self.runs)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ W.T (+ bias [out]) -> [..., out] in x's dtype: each run into its columns."""
        outs, start = [], 0
        for run in self.runs:
            stop = start + run.shape[0]
            outs.append(run.linear(x, None if bias is None else bias[start:stop]))
            start = stop
        return torch.cat(outs, dim=-1)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Embedding lookup: ids (any shape) -> dequantized rows [*ids.shape, in] in `dtype`."""
        flat = ids.reshape(-1)
        out = torch.empty(flat.numel(), self.shape[1], dtype=dtype or self.dtype, device=flat.device)
        start = 0
        for run in self.runs:
            inside = (flat >= start) & (flat < start + run.shape[0])
            if bool(inside.any()):
                out[inside] = run.rows(flat[inside] - start, out.dtype)
            start += run.shape[0]
        return out.view(*ids.shape, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float weight as fp32 [out, in]: each run's own values, in order."""
        return torch.cat([run.dequantize() for run in self.runs])

    def to(self, device, dtype: torch.dtype | None = None) -> RowStack:
        return RowStack([run.to(device, dtype) for run in self.runs], dtype=dtype or self.dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every run's parts, named "i.<part>" after run i."""
        return {f"{i}.{name}": part for i, run in enumerate(self.runs) for name, part in run.tensors().items()}

    def __repr__(self) -> str:
        inner = " + ".join(f"{type(run).__name__}{list(run.shape)}" for run in self.runs)
        return f"RowStack({inner})"
