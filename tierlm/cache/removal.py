"""What removing a model takes from the cache: its import and every artifact built from it.

An artifact's manifest records its source (`source`: the model directory it was built from) and,
for a LoRA variant, the base artifact whose blocks it reads (`base`). Removing a model without its
artifacts would leave entries no name reaches; removing a base artifact without its variants,
entries that cannot load. `tierlm rm`, `tierlm cache rm` and an import that replaces the import of
a GGUF edited in place all remove through `removal_of`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tierlm.cache.catalog import Entry, catalog
from tierlm.cache.entries import remove_entries
from tierlm.errors import TierlmError
from tierlm.units import format_size
from tierlm.weights.import_record import read_import_record


@dataclass(frozen=True)
class Removal:
    """The cache entries a removal takes: those named, and those that go with them."""

    named: tuple[Entry, ...]
    derived: tuple[Entry, ...]  # artifacts built from a named model, variants reading a named artifact

    @property
    def entries(self) -> tuple[Entry, ...]:
        return self.named + self.derived

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)

    def summary(self) -> str:
        """`516.0 MiB import + 5 artifacts, 1.2 GiB`: what goes, and the space it frees."""
        imports = [e for e in self.entries if e.kind == "model"]
        artifacts = len(self.entries) - len(imports)
        parts = [f"{format_size(imports[0].nbytes)} import"] if len(imports) == 1 else []
        parts += [f"{len(imports)} imports"] if len(imports) > 1 else []
        parts += [f"{artifacts} artifact{'s' * (artifacts != 1)}"] if artifacts else []
        if len(imports) == 1 and not artifacts:
            return parts[0]
        return f"{' + '.join(parts)}, {format_size(self.nbytes)}"

    def remove(self) -> list[Path]:
        """Remove every entry (none if one is being built: TierlmError); the paths removed."""
        return remove_entries([entry.path.name for entry in self.entries]) if self.entries else []


def removal_of(directories: Iterable[Path], entries: list[Entry] | None = None) -> Removal:
    """The removal of the cache entries at `directories` with what derives from them. A directory
    outside the cache (a checkpoint artifacts were built from) is a source only: its artifacts go,
    it stays."""
    entries = catalog() if entries is None else entries
    wanted = {Path(directory).resolve() for directory in directories}
    named = [e for e in entries if e.path.resolve() in wanted]
    derived = [e for e in entries if e.kind == "artifact" and e not in named and e.base_dir.resolve() in wanted]
    gone = {e.path.name for e in named + derived if e.kind == "artifact"}
    derived += [e for e in entries if e.shares in gone and e not in named and e not in derived]
    return Removal(tuple(named), tuple(derived))


def retire_replaced_imports(model_dir: Path) -> list[Path]:
    """After a fresh import into `model_dir`: remove the older imports of the same GGUF file (its
    path; other content: the file was edited in place) with their artifacts, so its name means the
    new import alone. An older import another process is building from stays (the paths removed)."""
    source = (read_import_record(model_dir) or {}).get("source_path")
    if not source:
        return []
    entries = catalog()
    here = Path(model_dir).resolve()
    older = [e.path for e in entries if e.kind == "model" and e.path.resolve() != here
             and (read_import_record(e.path) or {}).get("source_path") == source]  # fmt: skip
    try:
        return removal_of(older, entries).remove()
    except (TierlmError, OSError):  # being built from right now, or unwritable: the new import stands
        return []
