"""Hot-parameter cache for skewed accesses: embedding rows now, MoE experts later.

Token frequency is Zipfian, so a small device-side cache of the most used rows serves most
lookups of an embedding that lives on host RAM or disk. Admission is by access count (LFU):
a row enters when there is room or when it is used more often than the coldest cached row.
Counts persist beside the artifact, so the next start pre-loads the hot set.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Callable

import torch

COUNTS_NAME = "hot_rows.json"


class HotRowCache:
    """Up to `capacity` decoded rows [capacity, width] on `device`, keyed by row id."""

    def __init__(self, capacity: int, width: int, *, device, dtype, counts_path: Path | None = None):
        self.capacity = capacity
        self.table = torch.empty((capacity, width), device=device, dtype=dtype)
        self.slot_of: dict[int, int] = {}
        self.counts: Counter[int] = Counter()
        self.counts_path = counts_path
        if counts_path is not None and counts_path.is_file():
            try:
                self.counts.update({int(k): int(v) for k, v in json.loads(counts_path.read_text()).items()})
            except (ValueError, TypeError, AttributeError, OSError):
                pass  # a damaged statistics file (bad JSON, a list, odd values) only costs a cold start

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def warm(self, fetch: Callable[[list[int]], torch.Tensor]) -> None:
        """Pre-load the rows that were hottest in earlier runs."""
        hottest = [row for row, _ in self.counts.most_common(self.capacity)]
        if hottest:
            self._insert(hottest, fetch(hottest))

    def lookup(self, ids: torch.Tensor, fetch: Callable[[list[int]], torch.Tensor]) -> tuple[torch.Tensor, int, int]:
        """Rows for ids (any shape) -> ([*ids.shape, width], hits, misses); misses come from `fetch`."""
        flat = ids.reshape(-1).tolist()
        self.counts.update(flat)
        missing = sorted({row for row in flat if row not in self.slot_of})
        fetched = {}
        if missing:
            rows = fetch(missing)
            fetched = {row: rows[i] for i, row in enumerate(missing)}
            self._admit(missing, rows)
        out = torch.empty((len(flat), self.table.shape[1]), device=self.table.device, dtype=self.table.dtype)
        for i, row in enumerate(flat):
            slot = self.slot_of.get(row)
            out[i] = self.table[slot] if slot is not None else fetched[row]
        hits = sum(1 for row in flat if row not in fetched)
        return out.view(*ids.shape, -1), hits, len(flat) - hits

    def save(self) -> None:
        """Persist access counts beside the artifact (atomic replace)."""
        if self.counts_path is None:
            return
        tmp = self.counts_path.with_suffix(f".tmp{os.getpid()}")
        top = dict(self.counts.most_common(max(self.capacity * 4, 1)))
        try:
            tmp.write_text(json.dumps({str(k): v for k, v in top.items()}))
            os.replace(tmp, self.counts_path)
        except OSError:  # a read-only cache directory loses only the warm start
            with contextlib.suppress(OSError):  # and a full disk keeps no half-written file
                tmp.unlink(missing_ok=True)

    def _admit(self, rows: list[int], values: torch.Tensor) -> None:
        chosen, chosen_values = [], []
        for i, row in enumerate(rows):
            if len(self.slot_of) + len(chosen) < self.capacity:
                chosen.append(row)
                chosen_values.append(values[i])
                continue
            coldest = min(self.slot_of, key=self.counts.__getitem__, default=None)
            if coldest is not None and self.counts[row] > self.counts[coldest]:
                slot = self.slot_of.pop(coldest)
                self.slot_of[row] = slot
                self.table[slot] = values[i]
        if chosen:
            self._insert(chosen, torch.stack(chosen_values))

    def _insert(self, rows: list[int], values: torch.Tensor) -> None:
        free = self.capacity - len(self.slot_of)
        for i, row in enumerate(rows[:free]):
            slot = len(self.slot_of)
            self.slot_of[row] = slot
            self.table[slot] = values[i]
