"""The tiered weight store: each block where the placement says, streamed ones through a ring.

Implements the WeightStore contract (acquire/release), so model code is unchanged:
- device blocks are decoded once and handed out as they are;
- host blocks keep their raw bytes in host RAM (pinned where an accelerator exists) and are
  either copied into a device ring slot ahead of use, or computed where they lie;
- disk blocks are read from the artifact's contiguous byte range into a ring slot ahead of use
  (on an accelerator, into the slot's pinned staging buffer first);
- host -> device copies run on the ring's copy stream, ordered by per-slot events (prefetch.py);
- an embedding that is not resident serves rows on demand through the hot-row cache.
Every read goes through the Artifact, which checks each block's checksums on its first read
(an embedding's rows: the chunks holding them), so no unverified byte reaches the model.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Mapping

import torch

from tierlm.blocks import EMBED, HEAD
from tierlm.cache import codec
from tierlm.cache.artifact import Artifact
from tierlm.device import backend_for
from tierlm.errors import TierlmError
from tierlm.offload.hot_cache import COUNTS_NAME, HotRowCache
from tierlm.weights.ledger import Ledger
from tierlm.offload.placement import DEVICE, DISK, HOST, Placement
from tierlm.offload.prefetch import PrefetchRing
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
    ):
        """`backend`: streams, events and pinning for `device` (backend_for(device) unless a
        test injects one)."""
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
        if EMBED not in self.resident:
            self._embed_rows = EmbeddingRows(
                artifact.blocks[EMBED].tensors["embed"],
                self._read_embed_rows,
                ledger=self.ledger,
                device=self.device,
                dtype=self.dtype,
                cache_bytes=placement.hot_cache_bytes,
                counts_path=Path(artifact.directory) / COUNTS_NAME,
            )
        streamed = [b.name for b in placement.blocks if b.streamed and b.name != EMBED]
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

    # -- the WeightStore contract -------------------------------------------------------------

    def acquire(self, block: str) -> Mapping[str, object]:
        if block == EMBED and self._embed_rows is not None:
            return {"embed": self._embed_rows}
        found = self.resident.get(block)
        if found is not None:
            return found
        buffer = self.ring.acquire(block)
        return self._decode(block, self.artifact.views(self.artifact.source_block(block), buffer), self.device)

    def release(self, block: str) -> None:
        if self.ring is not None and block in self.ring.held:
            self.ring.release(block)

    def block_names(self) -> list[str]:
        return [b.name for b in self.placement.blocks]

    def nbytes(self) -> int:
        """Bytes this store holds in memory: resident blocks, host copies, ring slots, hot rows."""
        unique = {id(t): t for tensors in self.resident.values() for t in tensors.values()}
        total = sum(t.nbytes for t in unique.values()) + sum(b.nbytes for b in self.host_bytes.values())
        total += self.ring.nbytes if self.ring else 0
        total += self._embed_rows.nbytes if self._embed_rows else 0
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
        self.artifact.close()

    # -- reading and decoding -----------------------------------------------------------------

    def _read_raw(self, source: str) -> torch.Tensor:
        """Block `source`'s bytes in a host buffer (pinned where an accelerator copies from it)."""
        return self.artifact.read_bytes(source, into=self.backend.empty_host(self.artifact.blocks[source].nbytes))

    def _fill_slot(self, block: str, staging: torch.Tensor) -> torch.Tensor:
        """Worker thread: block's bytes in host memory (the ring's BlockReader; see PrefetchRing)."""
        try:
            return self._in_host_memory(block, staging)
        except OSError as err:
            raise TierlmError(
                f"reading block {block!r} from {self.artifact.weights_path} failed: {err}",
                f"the artifact may be damaged or its disk unavailable; `tierlm cache rm "
                f"{self.artifact.directory.name}` rebuilds it on next use",
            ) from None

    def _in_host_memory(self, block: str, staging: torch.Tensor) -> torch.Tensor:
        """Host-tier bytes as they lie, or a disk read into `staging` (the ring slot on the CPU)."""
        source = self.artifact.source_block(block)
        record = self.artifact.blocks[source]
        started = time.perf_counter()
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
        host = self.host_bytes.get(source)
        tier = HOST if host is not None else DISK
        if host is None:
            host = self.artifact.read_bytes(source, into=staging)  # checksums checked on the first read
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
        vocab, width = record.parts["qweight" if record.encoding == "int8" else "data"].shape
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
