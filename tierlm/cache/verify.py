"""`tierlm cache verify`: every block of every artifact read back and checked against its checksums.

An artifact of an older format version is reported as outdated, not corrupt: no current tierlm
reads it (its key differs, so it is rebuilt beside it), and `cache rm` frees its space.

Models carry no checksums of their own: a directory of safetensors gets the whole header of every
file validated and config.json read, which catches truncation and malformed headers but not
flipped bits inside a tensor; a GGUF import is checked against its GGUF, which must still be where
it was imported from with the same content (sha256) and header.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Iterator

from tierlm.cache.artifact import FORMAT_VERSION, MANIFEST_NAME, Artifact
from tierlm.cache.catalog import catalog, entry_dir_name
from tierlm.cache.entries import CacheEntry, cache_entries
from tierlm.errors import TierlmError
from tierlm.models import read_config
from tierlm.weights.import_record import read_import_record, weights_in_gguf
from tierlm.weights.safetensors_index import checkpoint_entries


@dataclass(frozen=True)
class Verdict:
    """One entry's outcome: status "ok", "outdated" or "corrupt", and what was found."""

    entry: CacheEntry
    status: str
    detail: str = ""

    def line(self) -> str:
        return f"{self.status:8} {self.entry.kind:9} {self.entry.path.name}{self.detail}"


def verify_cache(names: list[str], emit: Callable[[str], None]) -> None:
    """Verify the named entries (all when none are named), emitting one line each as it is
    checked; TierlmError afterwards when any is corrupt, with the command that removes them."""
    verdicts = []
    for verdict in verify_entries(names):
        emit(verdict.line())
        verdicts.append(verdict)
    bad = [v.entry.path.name for v in verdicts if v.status == "corrupt"]
    if bad:
        raise TierlmError(
            f"{len(bad)} of {len(verdicts)} cache entries failed verification",
            f"remove them with `tierlm cache rm {' '.join(bad)}`; they are rebuilt on next use",
        )


def verify_entries(names: list[str]) -> Iterator[Verdict]:
    """A Verdict per named entry (every entry when `names` is empty): directory or catalogue names,
    as `cache list` prints either. Unknown names are an error raised before anything is read."""
    entries = {e.path.name: e for e in cache_entries()}
    if names:
        listed = catalog()
        names = [entry_dir_name(name, listed) for name in names]
    unknown = [n for n in names if n not in entries]
    if unknown:
        raise TierlmError(f"no cache entry named {unknown[0]!r}", "see `tierlm cache list`")
    for name in dict.fromkeys(names) if names else entries:
        yield _verdict(entries[name])


def _verdict(entry: CacheEntry) -> Verdict:
    try:
        if entry.kind != "artifact":
            _verify_model(entry)
            return Verdict(entry, "ok", " (headers; no checksums)")
        version = _format_version(entry)
        if version is not None:
            return Verdict(entry, "outdated", f": format version {version}, no longer read (remove it to free its space)")
        _verify_artifact(entry)
    except TierlmError as err:
        return Verdict(entry, "corrupt", ": " + err.message.removeprefix(f"artifact {entry.path} "))
    except OSError as err:
        return Verdict(entry, "corrupt", f": unreadable ({err})")
    return Verdict(entry, "ok")


def _format_version(entry: CacheEntry) -> int | None:
    """An older format version the manifest declares, or None (current, or left to Artifact.open)."""
    try:
        version = json.loads((entry.path / MANIFEST_NAME).read_bytes()).get("format_version")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return version if isinstance(version, int) and not isinstance(version, bool) and version < FORMAT_VERSION else None


def _verify_artifact(entry: CacheEntry) -> None:
    artifact = Artifact.open(entry.path)
    try:
        artifact.verify()
    finally:
        artifact.close()


def _verify_model(entry: CacheEntry) -> None:
    read_config(entry.path)
    record = read_import_record(entry.path)
    if weights_in_gguf(record):  # its weights are the GGUF's: still there, the same content, readable
        from tierlm.weights.gguf_checkpoint import GgufCheckpoint

        GgufCheckpoint(entry.path, record)
    else:
        checkpoint_entries(entry.path)
