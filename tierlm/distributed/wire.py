"""What the ranks of a pipeline say to each other over torch.distributed point-to-point sends.

Every message starts with a fixed header (HEADER_FIELDS int64). Messages travel down the chain
0 -> 1 -> ... -> last, so each worker only ever receives from the rank before it, in order; only
the last stage's logits (and a worker's load report) go straight back to rank 0.

A forward step is: header, then for a slot batch or dropped caches one int64 `extra` tensor,
then the hidden states [rows, T, H]. The header carries what a stage needs to run the step on
its own KV cache: which of rank 0's caches (an id; each worker keeps a twin), its kind, where
the new tokens go (each row's length BEFORE the step), T and whether every position's logits are
wanted. Batch-1 decode sends the header and the activation, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tierlm.errors import TierlmError

# Ops
STEP, LOAD, RELEASE, SHUTDOWN = 1, 2, 3, 4
# The kind of rank 0's cache a step runs on (kv/cache.py).
CONTIGUOUS, SLOT_VIEW, SLOT_BATCH = 0, 1, 2
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# op, cache_id, kind, rows, length, all_logits, dtype, cache_rows, max_len, slot, offset, n_slots, n_dropped,
# n_shrunk
HEADER_FIELDS = 14


@dataclass(frozen=True)
class StepHeader:
    """One forward step as a stage sees it. `slots`/`lengths`: a slot batch's rows; `slot`,
    `offset`: a single sequence's slot (SLOT_VIEW) and its length before the step (else the
    contiguous cache's offset). `dropped`: ids of rank 0's caches gone since the last step;
    `shrunk`: (slot, length) pairs of slots rank 0 cut shorter since (their twins free those
    pages too, so a stage holds no more pages than rank 0's pool)."""

    cache_id: int
    kind: int
    rows: int
    length: int
    all_logits: bool
    dtype: torch.dtype
    cache_rows: int  # a KVCache's batch, a PagedKVCache's slots (page tables)
    max_len: int
    slot: int = 0
    offset: int = 0
    slots: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    shrunk: tuple[tuple[int, int], ...] = ()

    def encode(self, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(header, extra or None) as the tensors that go on the wire."""
        fields = [STEP, self.cache_id, self.kind, self.rows, self.length, int(self.all_logits),
                  DTYPES.index(self.dtype), self.cache_rows, self.max_len, self.slot, self.offset,
                  len(self.slots), len(self.dropped), len(self.shrunk)]  # fmt: skip
        extra = [*self.slots, *self.lengths, *self.dropped, *(n for pair in self.shrunk for n in pair)]
        header = torch.tensor(fields, dtype=torch.long, device=device)
        return header, (torch.tensor(extra, dtype=torch.long, device=device) if extra else None)

    @staticmethod
    def decode(header: list[int], extra: list[int]) -> "StepHeader":
        n_slots, n_dropped = header[11], header[12]
        shrunk = extra[2 * n_slots + n_dropped :]
        return StepHeader(
            cache_id=header[1], kind=header[2], rows=header[3], length=header[4], all_logits=bool(header[5]),
            dtype=DTYPES[header[6]], cache_rows=header[7], max_len=header[8], slot=header[9], offset=header[10],
            slots=tuple(extra[:n_slots]), lengths=tuple(extra[n_slots : 2 * n_slots]),
            dropped=tuple(extra[2 * n_slots : 2 * n_slots + n_dropped]), shrunk=tuple(zip(shrunk[::2], shrunk[1::2])),
        )  # fmt: skip

    @staticmethod
    def extra_count(header: list[int]) -> int:
        return 2 * header[11] + header[12] + 2 * header[13]


def control(op: int, device) -> torch.Tensor:
    """The header of a message that is not a step (LOAD, RELEASE, SHUTDOWN)."""
    fields = [0] * HEADER_FIELDS
    fields[0] = op
    return torch.tensor(fields, dtype=torch.long, device=device)


class Link:
    """This rank's sends and receives; a failed one raises a TierlmError naming the stage at the
    other end (the place a fault handler hooks in)."""

    def __init__(self, rank: int, world: int, device=None, health=None):
        self.rank = rank
        self.world = world
        self.device = torch.device(device or "cpu")
        # Rank 0's PipelineHealth (health.py): its waits end with StageFailed when a stage fails.
        self.health = health

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self._finish(self.isend(tensor, peer), peer, "send to")

    def isend(self, tensor: torch.Tensor, peer: int):
        """Start sending `tensor` (keep it alive until the returned Work is waited on)."""
        return self._guard(peer, "send to", lambda: dist.isend(tensor, peer))

    def recv(self, shape, dtype: torch.dtype, peer: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        self._finish(self._guard(peer, "receive from", lambda: dist.irecv(tensor, peer)), peer, "receive from")
        return tensor

    def wait(self, works, peer: int) -> None:
        for work in works:
            self._finish(work, peer, "send to")

    def _finish(self, work, peer: int, what: str) -> None:
        if self.health is not None:
            self.health.wait(work, peer)
        else:
            self._guard(peer, what, work.wait)

    def recv_header(self, peer: int) -> list[int]:
        return self.recv((HEADER_FIELDS,), torch.long, peer).tolist()

    def send_object(self, obj, peer: int) -> None:
        self._guard(peer, "send to", lambda: dist.send_object_list([obj], peer, device=self.device))

    def recv_object(self, peer: int):
        holder = [None]
        self._guard(peer, "receive from", lambda: dist.recv_object_list(holder, peer, device=self.device))
        return holder[0]

    def _guard(self, peer: int, what: str, call):
        try:
            return call()
        except TierlmError:
            raise
        except Exception as err:  # noqa: BLE001 - gloo/nccl raise RuntimeError subclasses of many kinds
            if self.health is not None:  # rank 0: the heartbeat monitor names the failed stage
                raise self.health.broken(peer, err) from err
            raise StageUnreachable(peer, f"pipeline stage {peer}: could not {what} it: {err}") from err


class StageUnreachable(TierlmError):
    """A send to or receive from pipeline stage `stage` failed (it exited, or the link broke)."""

    def __init__(self, stage: int, message: str):
        self.stage = stage
        super().__init__(message, "the pipeline has to be restarted; see that stage's log for why it stopped")
