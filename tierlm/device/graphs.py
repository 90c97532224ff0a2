"""Capture a step once and replay it: CUDA graphs, torch_npu's NPUGraph, and a CPU stand-in.

A `DecodeGraph` takes a `step()` that reads only static input tensors and writes only static
output tensors (preallocated, same addresses every call; new values are copied in, never
rebound) and replays its device work without re-running the Python that issued it, so a decode
token costs one launch instead of hundreds. The caller refreshes the inputs' contents and calls
`replay()`; after `capture` it must replay once too (a device capture only records).

- `AcceleratorGraph`: CUDA (`torch.cuda.CUDAGraph`) or the NPU (`torch.npu.NPUGraph` and
  `torch.npu.graph`, which torch_npu documents as mirroring the CUDA API); warm-up runs on a side
  stream before capture, and the graphs of one `graph_factory` share one memory pool.
- `RecordedGraph`: the CPU stand-in the tests use. Capture records the aten ops the step issues
  (through a TorchDispatchMode); replay re-issues that tape on the same tensors, so Python-side
  values are frozen at capture exactly as in a device graph, a host sync during capture is an
  error as it is under CUDA capture, and a static tensor that moved is caught at replay. Work
  done outside torch's dispatcher (ctypes kernels) is invisible to it, as it is to a graph.

`graph_kind(device)` says which one a device gets, or why none; `TIERLM_GRAPHS=0` turns graphs
off everywhere.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

WARMUP_RUNS = 2  # eager runs on a side stream before capture (cuBLAS handles, lazy inits)
# Ops that read a device value back to the host: forbidden inside a CUDA capture.
_HOST_SYNCS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
                         torch.ops.aten.item.default})  # fmt: skip


class GraphUnavailable(RuntimeError):
    """A step cannot be captured (a host sync, an unsupported device); the caller runs eager."""


def graphs_enabled() -> bool:
    return os.environ.get("TIERLM_GRAPHS", "1") != "0"


def graph_kind(device) -> tuple[str | None, str]:
    """("cuda" | "npu", "") when `device` can capture graphs, else (None, why not)."""
    if not graphs_enabled():
        return None, "TIERLM_GRAPHS=0"
    if device.type == "cuda":
        return "cuda", ""
    if device.type == "npu":
        npu = getattr(torch, "npu", None)
        if npu is not None and hasattr(npu, "NPUGraph") and hasattr(npu, "graph"):
            return "npu", ""
        return None, "this torch_npu has no NPUGraph (graph mode needs a newer torch_npu)"
    return None, f"no graph capture on {device.type}: its decode step runs eagerly"


class DecodeGraph:
    """Capture `step` once, then `replay()` it; subclasses say how."""

    def capture(self, step: Callable[[], None]) -> None:
        raise NotImplementedError

    def replay(self) -> None:
        raise NotImplementedError


def graph_factory(kind: str) -> Callable[[], DecodeGraph]:
    """New graphs of `kind` ("cuda" | "npu") sharing one memory pool: they never run at once, and
    whatever outlives a replay is in buffers allocated outside capture."""
    pool = (torch.cuda if kind == "cuda" else torch.npu).graph_pool_handle()
    return lambda: AcceleratorGraph(kind, pool)


class AcceleratorGraph(DecodeGraph):
    """A CUDA graph or an NPUGraph, allocating from `pool`."""

    def __init__(self, kind: str, pool):
        self.module = torch.cuda if kind == "cuda" else torch.npu
        self.kind = kind
        self.pool = pool
        self.graph = None

    def capture(self, step: Callable[[], None]) -> None:
        module = self.module
        side = module.Stream()
        side.wait_stream(module.current_stream())
        with module.stream(side):
            for _ in range(WARMUP_RUNS):
                step()
        module.current_stream().wait_stream(side)
        graph = module.CUDAGraph() if self.kind == "cuda" else module.NPUGraph()
        try:
            if self.kind == "cuda":
                # thread_local: the server's other threads may touch the device meanwhile.
                with module.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    step()
            else:
                with module.graph(graph, pool=self.pool):
                    step()
        except RuntimeError as err:
            raise GraphUnavailable(f"{self.kind} graph capture failed: {err}") from err
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


class RecordedGraph(DecodeGraph):
    """The CPU stand-in: replays the aten ops recorded at capture on the same static tensors."""

    def __init__(self):
        self.tape: list = []
        self.static: list = []  # (tensor, data_ptr) of every tensor the tape reads or writes from outside
        self.replays = 0

    def capture(self, step: Callable[[], None]) -> None:
        recorder = _Recorder()
        with recorder:
            step()
        self.tape = recorder.tape
        produced: set[int] = set()
        static: dict[int, object] = {}
        for func, args, kwargs, out in self.tape:
            for t in _tensors((args, kwargs)):
                if id(t) not in produced:  # read before the tape made it: it comes from outside
                    static.setdefault(id(t), t)
            produced.update(id(t) for t in _tensors(out) if id(t) not in static)
        self.static = [(t, t.data_ptr()) for t in static.values()]

    def replay(self) -> None:
        for tensor, address in self.static:
            if tensor.data_ptr() != address:
                raise GraphUnavailable(f"a static tensor {tuple(tensor.shape)} moved since capture")
        now: dict[int, object] = {}  # capture-time intermediate -> this replay's

        def current(value):
            return now.get(id(value), value)

        for func, args, kwargs, out in self.tape:
            result = func(*tree_map(current, args), **tree_map(current, kwargs))
            for old, new in zip(_tensors(out), _tensors(result)):
                now[id(old)] = new
        self.replays += 1


def _tensors(tree) -> list:
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


class _Recorder(TorchDispatchMode):
    """A dispatch mode that runs each aten op and keeps (op, args, kwargs, outputs)."""

    def __init__(self):
        super().__init__()
        self.tape: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_SYNCS:
            raise GraphUnavailable(f"{func} reads a device value on the host during capture")
        out = func(*args, **kwargs)
        self.tape.append((func, args, kwargs, out))
        return out
