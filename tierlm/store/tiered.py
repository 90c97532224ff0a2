"""The tiered weight store: each block where the placement says, streamed ones through a ring.

Implements the WeightStore contract (acquire/release), so model code is unchanged:
- device blocks are decoded once and handed out as they are;
- host blocks keep their raw bytes in host RAM (pinned where an accelerator exists) and are
  either copied into a device ring slot ahead of use, or computed where they lie;
- disk blocks are read from the artifact's contiguous byte range into a ring slot ahead of use
  (on an accelerator, into the slot's pinned staging buffer first);
- host -> device copies run on the ring's copy stream, ordered by per-slot events (prefetch.py);
- an embedding that is not resident serves rows on demand through the hot-row cache;
- routed experts (MoE) live in the expert cache's slots (expert_cache.py): the hottest cached on
  the device, the rest read when the router picks them, or computed on the host where they lie.
Every read goes through the Artifact, which checks each block's checksums on its first read
(an embedding's rows: the chunks holding them), so no unverified byte reaches the model.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch

from tierlm.blocks import EMBED, HEAD, expert_of, is_expert
from tierlm.cache import codec
from tierlm.cache.artifact import Artifact
from tierlm.cache.encodings import logical_shape
from tierlm.device.backend import backend_for
from tierlm.errors import TierlmError
from tierlm.offload.placement import DEVICE, DISK, HOST, Placement
from tierlm.offload.routing_counts import COUNTS_NAME as EXPERT_COUNTS_NAME
from tierlm.offload.routing_counts import RoutingCounts
from tierlm.store.expert_cache import ExpertCache
from tierlm.store.hot_rows import COUNTS_NAME, HotRowCache
from tierlm.store.prefetch import PrefetchRing
from tierlm.weights.ledger import Ledger
from tierlm.weights.store import WeightStore


class TieredStore(WeightStore):
    def __init__(
        self,
        artifact: Artifact,
        placement: Placement,
        *,
        device=None,
        dtype=None,
        ledger: Ledger | None = None,
        read_delay_s: float = 0.0,
        backend=None,
        expert_policy: str = "lfu",
        speculate: bool = True,
    ):
        """`backend`: streams, events and pinning for `device` (backend_for(device) unless a
        test injects one). `expert_policy`: the expert cache's (expert_cache.POLICIES);
        `speculate`: whether the model's guesses of the next layer's experts start reads."""
        self.artifact = artifact
        self.placement = placement
        self.device = torch.device(device or "cpu")
        self.backend = backend or backend_for(self.device)
        self.dtype = dtype or torch.float32
        self.ledger = ledger or Ledger()
        self.ledger.planned = {tier: dict(items) for tier, items in placement.charges.items()}
        self.read_delay_s = read_delay_s  # injected latency per streamed read (tests)
        self.resident: dict[str, dict] = {}
        self.host_bytes: dict[str, torch.Tensor] = {}
        self._embed_rows = None
        for placed in placement.blocks:
            source = artifact.source_block(placed.name)
            if is_expert(placed.name):
                if placed.tier == HOST:
                    self.host_bytes[source] = self._read_raw(source)
                continue  # the expert cache's, below
            if placed.name == EMBED and placed.tier != DEVICE:
                if placed.tier == HOST:
                    self.host_bytes[source] = self._read_raw(source)
                continue  # served row by row, below
            if placed.tier == DEVICE:
                if source in self.resident and source != placed.name:
                    self.resident[placed.name] = self._decode(placed.name, {}, self.device)
                else:
                    self.resident[placed.name] = self._decode(placed.name, artifact.read_block(source), self.device)
            elif placed.tier == HOST:
                if source not in self.host_bytes:
                    self.host_bytes[source] = self._read_raw(source)
                if placed.compute == HOST:
                    self.resident[placed.name] = self._decode(
                        placed.name, artifact.views(source, self.host_bytes[source]), torch.device("cpu")
                    )
        tied_head = artifact.source_block(HEAD) == EMBED and HEAD in self.resident
        if tied_head and EMBED not in self.resident:
            # A resident tied head is the embedding matrix: rows come from it for free.
            self.resident[EMBED] = {"embed": self.resident[HEAD]["head"]}
        if EMBED not in self.resident and any(placed.name == EMBED for placed in placement.blocks):
            # (A later pipeline stage has no embedding to read rows of: its placement lacks it.)
            self._embed_rows = EmbeddingRows(
                artifact.blocks[EMBED].tensors["embed"],
                self._read_embed_rows,
                ledger=self.ledger,
                device=self.device,
                dtype=self.dtype,
                cache_bytes=placement.hot_cache_bytes,
                counts_path=Path(artifact.directory) / COUNTS_NAME,
            )
        streamed = [b.name for b in placement.blocks if b.streamed and b.name != EMBED and not is_expert(b.name)]
        self.ring = None
        if streamed:
            sizes = {n: artifact.blocks[artifact.source_block(n)].nbytes for n in streamed}
            # Only disk reads need host staging; host-tier bytes are copied from where they lie.
            from_disk = [n for b, n in sizes.items() if artifact.source_block(b) not in self.host_bytes]
            self.ring = PrefetchRing(
                streamed,
                self._fill_slot,
                slots=max(placement.ring_slots, 1),
                slot_bytes=max(sizes.values()),
                staging_bytes=max(from_disk, default=0),
                backend=self.backend,
                on_stall=self.ledger.record_stall,
                on_upload=self._record_upload,
            )
        self.speculate = speculate
        self.expert_cache = self._expert_cache(expert_policy)

    # -- the WeightStore contract -------------------------------------------------------------

    def acquire(self, block: str) -> Mapping[str, object]:
        if block == EMBED and self._embed_rows is not None:
            return {"embed": self._embed_rows}
        found = self.resident.get(block)
        if found is not None:
            return found
        if is_expert(block):
            return self._expert_outside_cache(block)
        buffer = self.ring.acquire(block)
        return self._decode(block, self.artifact.views(self.artifact.source_block(block), buffer), self.device)

    def release(self, block: str) -> None:
        if self.ring is not None and block in self.ring.held:
            self.ring.release(block)

    @contextmanager
    def experts(self, layer: int, uses: Mapping[int, int]) -> Iterator[Mapping[int, Mapping[str, object]]]:
        """Layer's chosen experts ({expert: rows that chose it}) through the expert cache."""
        batch = self.expert_cache.open(layer, uses)
        try:
            yield batch
        finally:
            self.expert_cache.close(batch)

    def peek(self, block: str) -> Mapping | None:
        """Tensors on the compute device now (a host-computed block's live on the CPU: None)."""
        if is_expert(block):
            return self.expert_cache.peek(block) if self.expert_cache is not None else None
        return self.resident.get(block) if self.placement.block(block).tier == DEVICE else None

    def resident_block(self, block: str) -> Mapping | None:
        # acquire's first answer: an embedding read by rows is never among the resident blocks.
        return self.resident.get(block)

    def hint_experts(self, layer: int, experts: Sequence[int]) -> None:
        if self.speculates:
            self.expert_cache.hint(layer, experts)

    @property
    def speculates(self) -> bool:
        """Guesses pay only where some expert is streamed (and TIERLM_SPECULATE did not turn them off)."""
        return self.speculate and self.expert_cache is not None and self.expert_cache.streams

    def block_names(self) -> list[str]:
        return [b.name for b in self.placement.blocks]

    def nbytes(self) -> int:
        """Bytes this store holds in memory: resident blocks, host copies, ring slots, hot rows."""
        unique = {id(t): t for tensors in self.resident.values() for t in tensors.values()}
        total = sum(t.nbytes for t in unique.values()) + sum(b.nbytes for b in self.host_bytes.values())
        total += self.ring.nbytes if self.ring else 0
        total += self._embed_rows.nbytes if self._embed_rows else 0
        total += self.expert_cache.nbytes if self.expert_cache else 0
        return total

    def note_forward(self, tokens: int) -> None:
        self.ledger.record_forward(tokens)

    def stats(self) -> Ledger:
        """The live ledger: planned bytes per tier and what streaming has read, stalled and hit."""
        return self.ledger

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
        if self._embed_rows is not None:
            self._embed_rows.save()
        if self.expert_cache is not None:
            self.expert_cache.shutdown()
            self.expert_cache.counts.save(Path(self.artifact.directory) / EXPERT_COUNTS_NAME)
        self.artifact.close()

    # -- experts -------------------------------------------------------------------------------

    def _expert_cache(self, policy: str):
        """The cache over every routed expert of the artifact (None for a dense model)."""
        placed = [b for b in self.placement.blocks if is_expert(b.name)]
        if not placed:
            return None
        located = [expert_of(b.name) for b in placed]
        layers = sorted({layer for layer, _ in located})
        counts = RoutingCounts.load(Path(self.artifact.directory) / EXPERT_COUNTS_NAME, layers, 1 + max(e for _, e in located))
        sizes = {b.name: self.artifact.blocks[b.name].nbytes for b in placed}
        resident = [b.name for b in placed if b.tier == DEVICE]
        # An accelerator reads experts from disk through pinned staging, planned only where some
        # expert is placed on disk; without it, experts with no host copy are never demoted.
        from_disk = [b for b in sizes if b not in self.host_bytes]
        staging = any(b.tier == DISK for b in placed) and self.backend.accelerator
        host_computed = {
            b.name: (self._decode(b.name, self.artifact.views(b.name, self.host_bytes[b.name]), torch.device("cpu")),
                     self.host_bytes[b.name])
            for b in placed if b.tier == HOST and b.compute == HOST
        }  # fmt: skip
        return ExpertCache(
            counts=counts,
            reader=self._fill_slot,
            opening_reader=lambda block, staging: self._fill_slot(block, staging, counted=False),
            decode=lambda block, buffer: self._decode(block, self.artifact.views(block, buffer), self.device),
            slot_bytes=max(self.placement.expert_slot_bytes, max(sizes.values())),
            cache_slots=self.placement.expert_slots or len(resident),
            # All resident: none planned, none needed; a hand-made placement may name none: one.
            stream_slots=self.placement.expert_stream_slots or int(len(resident) < len(placed)),
            backend=self.backend,
            ledger=self.ledger,
            policy=policy,
            host_computed=host_computed,
            start=resident,
            staging_bytes=max((sizes[b] for b in from_disk), default=0) if staging else 0,
            kept=from_disk if self.backend.accelerator and not staging else (),
        )

    def _expert_outside_cache(self, block: str) -> dict:
        """An expert acquired by name (not through `experts`): cached or host-computed tensors,
        else one read into a fresh buffer (tools that walk every block, not the decode path)."""
        found = self.expert_cache.peek(block)
        if found is None and block in self.expert_cache.host_computed:
            found = self.expert_cache.host_computed[block][0]
        if found is None:
            found = self._decode(block, self.artifact.read_block(block), self.device)
        return found

    # -- reading and decoding -----------------------------------------------------------------

    def _read_raw(self, source: str) -> torch.Tensor:
        """Block `source`'s bytes in a host buffer (pinned where an accelerator copies from it)."""
        return self.artifact.read_bytes(source, into=self.backend.empty_host(self.artifact.blocks[source].nbytes))

    def _fill_slot(self, block: str, staging: torch.Tensor, *, counted: bool = True) -> torch.Tensor:
        """Worker thread: block's bytes in host memory (the ring's BlockReader; see PrefetchRing)."""
        try:
            return self._in_host_memory(block, staging, counted=counted)
        except OSError as err:
            raise TierlmError(
                f"reading block {block!r} from {self.artifact.weights_path} failed: {err}",
                f"the artifact may be damaged or its disk unavailable; `tierlm cache rm "
                f"{self.artifact.directory.name}` rebuilds it on next use",
            ) from None

    def _in_host_memory(self, block: str, staging: torch.Tensor, *, counted: bool = True) -> torch.Tensor:
        """Host-tier bytes as they lie, or a disk read into `staging` (the ring slot on the CPU).
        `counted`: traffic of the run (False: loading at open, which is no token's cost)."""
        source = self.artifact.source_block(block)
        record = self.artifact.blocks[source]
        started = time.perf_counter()
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
        host = self.host_bytes.get(source)
        tier = HOST if host is not None else DISK
        if host is None:
            host = self.artifact.read_bytes(source, into=staging)  # checksums checked on the first read
        if counted:
            self.ledger.record_read(tier, record.nbytes, time.perf_counter() - started)
        return host

    def _record_upload(self, block: str, nbytes: int, seconds: float) -> None:
        """Copy time (issue time, where the copy is asynchronous); its bytes counted at the read."""
        tier = HOST if self.artifact.source_block(block) in self.host_bytes else DISK
        self.ledger.record_read(tier, 0, seconds)

    def _read_embed_rows(self, rows: list[int]) -> dict:
        """{part: those rows} of the embedding, from its host copy or disk, counted as read."""
        host = self.host_bytes.get(EMBED)
        parts = self.artifact.read_rows(EMBED, "embed", rows, host=host)
        self.ledger.record_read(HOST if host is not None else DISK, sum(p.nbytes for p in parts.values()), 0.0)
        return parts

    def _decode(self, block: str, raw: dict, device) -> dict:
        tensors = {name: codec.decode(record, parts, device=device, dtype=self.dtype) for name, (record, parts) in raw.items()}
        for alias, (target_block, target_tensor) in self.artifact.blocks[block].alias_targets().items():
            if target_block in self.resident and target_tensor in self.resident[target_block]:
                tensors[alias] = self.resident[target_block][target_tensor]
            else:
                tensors[alias] = tensors[target_tensor]
        return tensors


class EmbeddingRows:
    """A non-resident embedding: `rows(ids)` reads only the needed rows, hot ones from the cache.

    `read_rows(rows) -> {part: rows of that part}` is the store's reader (host copy or disk,
    verified and counted there), so this class knows the embedding's record, not the store.
    """

    def __init__(self, record, read_rows: Callable[[list[int]], dict], *, ledger: Ledger, device, dtype,
                 cache_bytes: int, counts_path: Path | None = None):  # fmt: skip
        self.embed = record
        self.read_rows = read_rows
        self.ledger = ledger
        self.device, self.dtype = device, dtype
        vocab, width = logical_shape(record)
        row_bytes = width * torch.empty((), dtype=dtype).element_size()
        capacity = cache_bytes // row_bytes if cache_bytes else 0
        self.cache = (
            HotRowCache(capacity, width, device=device, dtype=dtype, counts_path=counts_path)
            if capacity else None
        )  # fmt: skip
        if self.cache is not None:
            # Saved statistics are bytes from disk too: rows the embedding lacks are dropped, not read.
            for row in [r for r in self.cache.counts if not 0 <= r < vocab]:
                del self.cache.counts[row]
            self.cache.warm(self._fetch)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes if self.cache is not None else 0

    def rows(self, ids: torch.Tensor, dtype=None) -> torch.Tensor:
        """ids [B, T] -> rows [B, T, H] on the store's device."""
        if self.cache is None:
            flat = ids.reshape(-1).tolist()
            self.ledger.record_rows(0, len(flat))
            return self._fetch(flat).view(*ids.shape, -1)
        out, hits, misses = self.cache.lookup(ids, self._fetch)
        self.ledger.record_rows(hits, misses)
        return out

    def save(self) -> None:
        if self.cache is not None:
            self.cache.save()

    def _fetch(self, rows: list[int]) -> torch.Tensor:
        """Decoded rows [len(rows), H] on the device."""
        weight = codec.decode(self.embed, self.read_rows(rows), device="cpu", dtype=self.dtype)
        dense = weight if isinstance(weight, torch.Tensor) else weight.dequantize()
        return dense.to(device=self.device, dtype=self.dtype)
