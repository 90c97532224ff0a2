"""Idle conversations' keys and values kept in host RAM once their KV slot is taken.

A server has a few slots and often more conversations: a chat app's second chat, or the title it
asks for after the first turn, takes the slot the first conversation's rows were in. Those rows
are copied out here before the slot is overwritten, and copied back when the conversation
returns, so its next turn prefills only the new message instead of the whole history again.

Entries are evicted least recently used first to stay within `capacity` bytes: the room the
memory plan leaves free (server/worker.py), so the process's peak stays within its budget. An
entry is keyed by the ids its rows hold and the variant (and its overlay's identity) that
computed them, as a slot's history is: rows of another variant never match.

An entry evicted for room goes on to disk (`DiskSpill`) when the server has one: a prompt-cache
file (kv/prompt_cache.py: checksummed, written atomically, tied to the model that computed it)
in a folder of this process's own, within its own byte budget, least recently used deleted
first. A file that reads back damaged is not used (the conversation is computed again). The
folder is deleted when the process ends; one whose process is gone (killed) is deleted by the
next server that starts, so no later run trusts what a killed write left.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from tierlm.kv.prompt_cache import PromptCacheRejected, read_prompt_cache, save_prompt_cache


@dataclass
class HeldRows:
    """Keys and values of `ids` computed under `variant` (a weak reference to the variant's
    overlay, so one removed or replaced under the same name never matches), last used at
    `used_at`: what a slot holds, or a spilled copy of it."""

    ids: list[int] = field(default_factory=list)
    variant: str | None = None
    overlay: object = None  # weakref.ref to the variant's Overlay (None for the base)
    used_at: float = 0.0

    def computed_by(self, variant: str | None, overlay) -> bool:
        """Whether these rows are what `variant` computes under its overlay `overlay` (the live
        object; None for the base)."""
        return variant == self.variant and (variant is None or (self.overlay is not None and self.overlay() is overlay))

    def shared_prefix(self, prompt: list[int], variant: str | None, overlay) -> int:
        if not self.computed_by(variant, overlay):
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


@dataclass(eq=False)
class OnDisk(HeldRows):
    path: Path | None = None
    nbytes: int = 0


class DiskSpill:
    """Spilled rows in prompt-cache files under `root/<pid>-<start time>/`, within `capacity` bytes."""

    def __init__(self, root: Path, capacity: int, identity):
        """`identity`: what the rows depend on (runtime/saved_chat.py `model_identity`), or a
        function giving it, called at the first write (it may hash a checkpoint)."""
        process = psutil.Process()
        self.folder = Path(root) / f"{process.pid}-{int(process.create_time())}"
        self.capacity, self._identity = capacity, identity
        self.entries: list[OnDisk] = []
        self.rejected = 0  # files that read back damaged, ever
        remove_orphans(Path(root))

    @property
    def identity(self) -> dict:
        if callable(self._identity):
            self._identity = self._identity()
        return self._identity

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def put(self, entry: Spilled) -> bool:
        if entry.nbytes > self.capacity:
            return False
        while self.entries and self.nbytes + entry.nbytes > self.capacity:
            self._forget(min(self.entries, key=lambda e: e.used_at))
        name = hashlib.sha256(repr((entry.variant, entry.ids)).encode()).hexdigest()[:32]
        path = self.folder / f"{name}.tlmkv"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            save_prompt_cache(path, self.identity, {}, entry.ids, entry.parts)
        except OSError as err:  # a full or read-only disk loses the copy, never the request
            logging.getLogger("tierlm.server").warning("KV spill to %s failed: %s", path, err)
            return False
        self.entries.append(OnDisk(entry.ids, entry.variant, entry.overlay, entry.used_at, path, entry.nbytes))
        return True

    def take(self, entry: OnDisk, rows: list[torch.Tensor], length: int) -> bool:
        """Copy the file's first `length` positions into `rows` and delete it; False (rows
        untouched, the entry gone) when it reads back damaged or not at all."""
        self.entries.remove(entry)
        try:
            saved = read_prompt_cache(entry.path, self.identity)
            if len(saved.parts) != len(rows) or saved.token_ids[:length] != entry.ids[:length]:
                raise PromptCacheRejected("it holds other rows")
        except (PromptCacheRejected, OSError) as err:
            logging.getLogger("tierlm.server").warning("KV spill file %s not used: %s", entry.path, err)
            self.rejected += 1
            entry.path.unlink(missing_ok=True)
            return False
        for held, part in zip(rows, saved.parts):
            held.copy_(part[:, :, :length])
        entry.path.unlink(missing_ok=True)
        return True

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.entries.clear()

    def _forget(self, entry: OnDisk) -> None:
        self.entries.remove(entry)
        entry.path.unlink(missing_ok=True)


def remove_orphans(root: Path) -> None:
    """Delete the spill folders under `root` whose process is gone (or whose pid now names
    another process): what a killed server left."""
    if not root.is_dir():
        return
    for folder in root.iterdir():
        pid, _, started = folder.name.partition("-")
        if not (pid.isdigit() and started.isdigit()):
            continue
        try:
            alive = int(psutil.Process(int(pid)).create_time()) == int(started)
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            alive = False
        if not alive:
            shutil.rmtree(folder, ignore_errors=True)


@dataclass
class SpillStore:
    capacity: int  # bytes of host RAM; 0 keeps nothing there
    disk: DiskSpill | None = None  # where entries evicted for room go on to (None: they are dropped)
    entries: list[Spilled] = field(default_factory=list)
    spilled: int = 0  # entries put, ever
    restored: int = 0  # entries taken back into a slot, ever
    dropped: int = 0  # entries evicted from host RAM for room, ever (to disk when there is one)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def put(self, ids: list[int], variant: str | None, overlay, rows: list[torch.Tensor]) -> bool:
        """Keep a copy of `rows` (views of a slot: every layer's codes and scales over `ids`,
        computed under `variant`, `overlay` a weakref.ref to its overlay or None) unless they
        cannot fit at all; older entries make room. Whether they are kept."""
        nbytes = sum(r.numel() * r.element_size() for r in rows)
        if not ids:
            return False
        if nbytes > self.capacity:  # past host RAM's room: straight to disk (a layer at a time), if any
            kept = self.disk is not None and self.disk.put(Spilled(list(ids), variant, overlay, time.monotonic(), rows, nbytes))
            self.spilled += kept
            return kept
        same = [e for e in self.entries if e.computed_by(variant, overlay() if overlay is not None else None)]
        if any(e.ids[: len(ids)] == ids for e in same):  # an entry holds these rows and more
            return True
        # Entries these rows continue are superseded by them.
        self.entries = [e for e in self.entries if e not in same or ids[: len(e.ids)] != e.ids]
        # Rows of a variant since removed or replaced can never match again: their room is free.
        self.entries = [e for e in self.entries if e.variant is None or (e.overlay is not None and e.overlay() is not None)]
        entry = Spilled(list(ids), variant, overlay, time.monotonic(), [r.clone() for r in rows], nbytes)
        self.entries.append(entry)
        while self.entries and self.nbytes > self.capacity:
            oldest = min(self.entries, key=lambda e: e.used_at)
            self.entries.remove(oldest)
            self.dropped += 1
            if self.disk is not None:
                self.disk.put(oldest)
        self.spilled += 1
        return True

    def stats(self) -> dict:
        """What it holds and has done, in host RAM and on disk (the server's /stats)."""
        disk = self.disk
        return {"capacity_bytes": self.capacity, "bytes": self.nbytes, "conversations": len(self.entries),
                "spilled": self.spilled, "restored": self.restored, "dropped": self.dropped,
                "disk": None if disk is None else {"capacity_bytes": disk.capacity, "bytes": disk.nbytes,
                                                   "conversations": len(disk.entries), "rejected": disk.rejected,
                                                   "folder": str(disk.folder)}}  # fmt: skip

    def best(self, prompt: list[int], variant: str | None, overlay) -> tuple[HeldRows | None, int]:
        """The entry (in RAM or on disk) sharing the longest prefix with `prompt`, and how long;
        (None, 0) for none."""
        found, longest = None, 0
        for entry in [*self.entries, *(self.disk.entries if self.disk else ())]:
            shared = entry.shared_prefix(prompt, variant, overlay)
            if shared > longest:
                found, longest = entry, shared
        return found, longest

    def take(self, entry: HeldRows, rows: list[torch.Tensor], length: int) -> bool:
        """Copy `entry`'s first `length` positions into `rows` (a slot's `rows_of(slot, length)`)
        and forget it: the slot holds it now, and spills it again when it is taken. False when
        a file on disk read back damaged (nothing copied: the caller computes the rows)."""
        if isinstance(entry, OnDisk):
            if not self.disk.take(entry, rows, length):
                return False
        else:
            for held, saved in zip(rows, entry.parts, strict=True):
                held.copy_(saved[:, :, :length])
            self.entries.remove(entry)
        self.restored += 1
        return True
