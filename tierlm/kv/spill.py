"""Idle conversations' keys and values kept in host RAM once their KV slot is taken.

A server has a few slots and often more conversations: a chat app's second chat, or the title it
asks for after the first turn, takes the slot the first conversation's rows were in. Those rows
are copied out here before the slot is overwritten, and copied back when the conversation
returns, so its next turn prefills only the new message instead of the whole history again.

Entries are evicted least recently used first to stay within `capacity` bytes: the room the
memory plan leaves free (server/worker.py), so the process's peak stays within its budget. An
entry is keyed by the ids its rows hold and the variant (and its overlay's identity) that
computed them, as a slot's history is: rows of another variant never match.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class HeldRows:
    """Keys and values of `ids` computed under `variant` (a weak reference to the variant's
    overlay, so one removed or replaced under the same name never matches), last used at
    `used_at`: what a slot holds, or a spilled copy of it."""

    ids: list[int] = field(default_factory=list)
    variant: str | None = None
    overlay: object = None  # weakref.ref to the variant's Overlay (None for the base)
    used_at: float = 0.0

    def shared_prefix(self, prompt: list[int], variant: str | None, overlay) -> int:
        if variant != self.variant or (variant is not None and (self.overlay is None or self.overlay() is not overlay)):
            return 0
        n = 0
        for held, wanted in zip(self.ids, prompt):
            if held != wanted:
                break
            n += 1
        return n


@dataclass(eq=False)
class Spilled(HeldRows):
    parts: list[torch.Tensor] = field(default_factory=list)  # copies of a slot's `rows_of`
    nbytes: int = 0


@dataclass
class SpillStore:
    capacity: int  # bytes; 0 keeps nothing
    entries: list[Spilled] = field(default_factory=list)
    spilled: int = 0  # entries put, ever
    restored: int = 0  # entries taken back into a slot, ever
    dropped: int = 0  # entries evicted for room, ever

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def put(self, ids: list[int], variant: str | None, overlay, rows: list[torch.Tensor]) -> bool:
        """Keep a copy of `rows` (views of a slot: every layer's codes and scales over `ids`,
        computed under `variant`, `overlay` a weakref.ref to its overlay or None) unless they
        cannot fit at all; older entries make room. Whether they are kept."""
        nbytes = sum(r.numel() * r.element_size() for r in rows)
        if not ids or nbytes > self.capacity:
            return False
        source = overlay() if overlay is not None else None
        same = [e for e in self.entries
                if e.variant == variant and (e.overlay() if e.overlay is not None else None) is source]  # fmt: skip
        if any(e.ids[: len(ids)] == ids for e in same):  # an entry holds these rows and more
            return True
        # Entries these rows continue are superseded by them.
        self.entries = [e for e in self.entries if e not in same or ids[: len(e.ids)] != e.ids]
        while self.entries and self.nbytes + nbytes > self.capacity:
            self.entries.remove(min(self.entries, key=lambda e: e.used_at))
            self.dropped += 1
        self.entries.append(Spilled(list(ids), variant, overlay, time.monotonic(), [r.clone() for r in rows], nbytes))
        self.spilled += 1
        return True

    def best(self, prompt: list[int], variant: str | None, overlay) -> tuple[Spilled | None, int]:
        """The entry sharing the longest prefix with `prompt`, and how long; (None, 0) for none."""
        found, longest = None, 0
        for entry in self.entries:
            shared = entry.shared_prefix(prompt, variant, overlay)
            if shared > longest:
                found, longest = entry, shared
        return found, longest

    def take(self, entry: Spilled, rows: list[torch.Tensor], length: int) -> None:
        """Copy `entry`'s first `length` positions into `rows` (a slot's `rows_of(slot, length)`)
        and forget it: the slot holds it now, and spills it again when it is taken."""
        for held, saved in zip(rows, entry.parts, strict=True):
            held.copy_(saved[:, :, :length])
        self.entries.remove(entry)
        self.restored += 1
