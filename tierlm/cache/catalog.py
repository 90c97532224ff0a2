"""The model catalogue: what tierlm can run by name, how names are made, and resolving them.

Names are short, stable and lowercase, as ollama users expect:

    smollm2                    the embedded SmolLM2-135M-Instruct, however its GGUF reached the cache
    llama-3.2-1b.q8_0          an imported GGUF: its file stem, lowercased (Llama-3.2-1B.Q8_0.gguf);
                               the same bytes imported again from another path keep the first name
    qwen2.5-0.5b-instruct      a Hugging Face directory outside the cache that artifacts were built
                               from: its directory name, lowercased
    smollm2:int8               a compiled artifact: BASE:QUANT, then `+ADAPTER` for each merged LoRA;
    smollm2:mixed:80MiB        QUANT as the user writes it (mixed-83886080 is the same artifact)
    smollm2:int8+my-lora@0.5   adapter (its directory name, `@WEIGHT` unless the weight is 1)

A variant artifact (tierlm.cache.artifact: only the tensors its adapters change, over a base
artifact) has the name the full artifact of those adapters would have; its size is what it adds.

Every cache entry also answers to its directory name as `tierlm cache list` prints it, which is
unique: that is how to pick one of several entries sharing a name. Names match case-insensitively.
A name that fits several models is an error listing them; an unknown name is an error listing
the known names and how to add a model. Artifacts of one base and variant rebuilt by a newer
tierlm count once (the newest, as `plan` picks), and so do copies of one GGUF imported by older
versions under several names (the one imports reuse).

`--model` takes a name, a directory (HF checkpoint or artifact) or a `.gguf` file; a word that is
both a name and a path in the current directory is ambiguous and refused.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tierlm.cache.manifest import FORMAT_VERSION, MANIFEST_NAME
from tierlm.cache.entries import cache_entries, usage_stamp
from tierlm.errors import TierlmError
from tierlm.paths import cache_root
from tierlm.progress import ProgressFactory
from tierlm.quant.modes import quant_text
from tierlm.weights import embedded
from tierlm.weights.embedded import FreshImport
from tierlm.weights.import_record import IMPORT_FORMAT_VERSION, read_import_record, weights_in_gguf
from tierlm.weights.safetensors_index import checkpoint_entries

# Older import directories end in `-<12 hex digits of the content key>`; names drop it.
_KEY_SUFFIX = re.compile(r"-[0-9a-f]{12}$")
IMPORT_HINT = (
    "`tierlm list` shows the models in the cache; add a GGUF with `tierlm import-gguf FILE`, "
    "or pass a Hugging Face directory or .gguf path (models are never downloaded)"
)


@dataclass(frozen=True)
class Entry:
    """One model or artifact in the cache, with its catalogue name."""

    name: str
    kind: str  # "model" (an imported GGUF) or "artifact"
    path: Path
    base: str  # the base model's name; equals `name` for a model
    base_dir: Path  # a model's own directory; an artifact's source directory
    variant: str | None  # artifacts: QUANT[+ADAPTER...]
    source: str  # "embedded", "gguf FILE" or "dir PATH"
    family: str | None
    nbytes: int
    mtime: float
    content_key: str | None = None  # imports: the GGUF content key, shared by duplicate copies
    loadable: bool = True  # artifacts: written in the artifact format this tierlm reads
    # False for what a rebuild supersedes: an import in another import format (tierlm imports
    # the GGUF afresh), an artifact of such an import or of a base that is gone.
    current: bool = True
    shares: str | None = None  # a variant artifact: the base artifact directory whose blocks it reads


@dataclass(frozen=True)
class ModelRow:
    """One line of `tierlm list`: a base model and the variants built from it."""

    name: str
    family: str | None
    parameters: int | None
    source: str
    variants: tuple[str, ...]
    nbytes: int
    last_used: float | None
    path: Path
    duplicate_of: str | None = None  # another directory holding the same GGUF content
    gguf_bytes: int | None = None  # the GGUF file an import reads its weights from


# ----------------------------------------------------------------------------- names


def model_name(model_dir: Path) -> str:
    """The name `tierlm list` shows for the model in `model_dir` (see the module docstring).

    Works for imports, artifacts, and any other directory (its name, lowercased).
    """
    model_dir = Path(model_dir)
    manifest = _read_json(model_dir / MANIFEST_NAME)
    if manifest is not None:
        source = manifest.get("source")
        base = _base_name(Path(source)) if source else embedded.slug(model_dir.name)
        return f"{base}:{_variant(manifest)}"
    record = read_import_record(model_dir)
    if record is not None:
        return _import_name(record)
    return embedded.slug(model_dir.name)


def _import_name(record: dict) -> str:
    return embedded.import_name(
        str(record.get("source_name", "model")), record.get("source_key"), record.get("source_bytes")
    )


def _base_name(base_dir: Path) -> str:
    """An artifact's source: an import, a checkpoint directory, or one that is gone."""
    record = read_import_record(base_dir)
    if record is not None:
        return _import_name(record)
    # A checkpoint is named by its directory; of a removed import, the key suffix is dropped.
    return embedded.slug(base_dir.name if base_dir.is_dir() else _KEY_SUFFIX.sub("", base_dir.name))


def _variant(manifest: dict) -> str:
    variant = quant_text(str(manifest.get("quant", "unknown")))
    for path, weight in manifest.get("adapters") or ():
        variant += f"+{embedded.slug(Path(path).name)}"
        if float(weight) != 1.0:
            variant += f"@{float(weight):g}"
    return variant


def _canonical(spec: str) -> str:
    """`spec` lowercased with its QUANT part (BASE:QUANT+ADAPTER...) as `quant_text` writes it, so
    smollm2:mixed:80MiB, smollm2:mixed:80mib and smollm2:mixed-83886080 are one name."""
    base, colon, rest = spec.partition(":")
    quant, plus, adapters = rest.partition("+")
    return f"{base}{colon}{quant_text(quant) if colon else ''}{plus}{adapters}".lower()


# ----------------------------------------------------------------------------- what the cache holds


def catalog() -> list[Entry]:
    """Every finished model and artifact in the cache, named."""
    entries = []
    for item in cache_entries():
        if item.kind == "artifact":
            entries.append(_artifact_entry(item.path, item.nbytes))
        else:
            entries.append(_model_entry(item.path, item.nbytes))
    return entries


def _model_entry(path: Path, nbytes: int) -> Entry:
    record = read_import_record(path)
    config = _read_json(path / "config.json") or {}
    if record is None:  # not an import: a directory placed here by hand
        name, source, key = embedded.slug(path.name), f"dir {path}", None
    else:
        name, key = _import_name(record), record.get("source_key")
        source = "embedded" if name == embedded.EMBEDDED_NAME else f"gguf {record.get('source_name')}"
    current = _is_current_base(path)
    if not current:
        source += " (other import format; import its GGUF again)"
    return Entry(name, "model", path, name, path, None, source, config.get("model_type"), nbytes,
                 path.stat().st_mtime, content_key=key, current=current)  # fmt: skip


def _is_current_base(model_dir: Path) -> bool:
    """An existing directory that is not an import in an older import format."""
    if not model_dir.is_dir():
        return False
    record = read_import_record(model_dir)
    return record is None or record.get("format") == IMPORT_FORMAT_VERSION


def _artifact_entry(path: Path, nbytes: int) -> Entry:
    manifest = _read_json(path / MANIFEST_NAME) or {}
    base_dir = Path(manifest.get("source") or path)
    base = _base_name(base_dir) if manifest.get("source") else embedded.slug(path.name)
    variant = _variant(manifest)
    loadable = manifest.get("format_version") == FORMAT_VERSION
    shares = manifest.get("base") if isinstance(manifest.get("base"), str) else None
    if shares is not None:  # what the variant adds: not the model files it links from its base
        nbytes = _unlinked_bytes(path, path.parent / shares)
    # A variant whose base artifact is gone is superseded: building it again rebuilds the base.
    current = loadable and _is_current_base(base_dir) and (shares is None or (path.parent / shares).is_dir())
    return Entry(f"{base}:{variant}", "artifact", path, base, base_dir, variant, f"dir {base_dir}",
                 manifest.get("model_type"), nbytes, path.stat().st_mtime, loadable=loadable,
                 current=current, shares=shares)  # fmt: skip


def _unlinked_bytes(directory: Path, other: Path) -> int:
    """Bytes of the files under `directory` that are not hard links to files in `other`."""
    try:
        theirs = {(f.stat().st_dev, f.stat().st_ino) for f in other.iterdir() if f.is_file()}
    except OSError:
        theirs = set()
    total = 0
    for file in directory.rglob("*"):
        try:
            stat = file.stat()
        except OSError:
            continue
        if file.is_file() and (stat.st_dev, stat.st_ino) not in theirs:
            total += stat.st_size
    return total


def variants_of(base_dirs, entries: list[Entry] | None = None) -> list[Entry]:
    """The variant artifacts that read their blocks from one of the artifact directories named
    `base_dirs` (directory names): removing a base without them would leave them dangling."""
    entries = catalog() if entries is None else entries
    wanted = set(base_dirs)
    return [e for e in entries if e.shares is not None and e.shares in wanted]


def orphaned_variants(entries: list[Entry] | None = None) -> list[Entry]:
    """Variant artifacts whose base artifact is gone (removed by an older tierlm, or by hand)."""
    entries = catalog() if entries is None else entries
    return [e for e in entries if e.shares is not None and not (e.path.parent / e.shares).is_dir()]


def known_names(entries: list[Entry] | None = None) -> list[str]:
    """Every name that resolves: the embedded model, the cache's entries, their external bases."""
    entries = catalog() if entries is None else entries
    names = {embedded.EMBEDDED_NAME}
    for entry in entries:
        if entry.loadable:
            names.add(entry.name)
            if entry.kind == "artifact" and entry.base_dir.is_dir():
                names.add(entry.base)
    return sorted(names)


# ----------------------------------------------------------------------------- resolving


def resolve_model(spec: str | None, progress: ProgressFactory | None = None,
                  on_fresh: FreshImport | None = None) -> Path:  # fmt: skip
    """The model directory `spec` (a `--model` value) stands for, importing a GGUF on first use
    (`on_fresh` is told of an import made: cache/removal.py retires the one it replaces).

    None is the embedded default; see the module docstring for names. Errors are TierlmErrors
    that say what would work.
    """
    if spec is None:
        return embedded.ensure_embedded_model(_label(progress, "importing embedded model"), on_fresh)
    path = Path(spec).expanduser()
    as_name = not _looks_like_path(spec)
    if as_name:
        entries = catalog()
        found = find_entry(spec, entries)
        is_embedded = spec.lower() == embedded.EMBEDDED_NAME
        if (found is not None or is_embedded) and path.exists():
            raise TierlmError(
                f"{spec!r} is both a model name and a path in this directory",
                f"pass ./{spec} for the path, or run from elsewhere for the model",
            )
        if is_embedded and (found is None or not _is_current_base(found)):
            # Not imported yet, or by an older tierlm: import it now, as the default does.
            return embedded.ensure_embedded_model(_label(progress, "importing embedded model"), on_fresh)
        if found is not None:
            return found
    if path.is_file() and path.suffix.lower() == ".gguf":
        return embedded.import_gguf_to_cache(path, _label(progress, "importing GGUF"), on_fresh)
    if path.is_dir():
        return path
    if path.exists():
        raise TierlmError(f"model {spec!r} is neither a directory nor a .gguf file")
    if as_name:
        raise TierlmError(f"no model named {spec!r}; known: {', '.join(known_names(entries))}", IMPORT_HINT)
    raise TierlmError(
        f"model {spec!r} not found",
        "pass a model name (`tierlm list`), a Hugging Face model directory or a .gguf file "
        "(models are never downloaded)",
    )


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or os.sep in spec or spec.startswith(("~", ".")) or spec.lower().endswith(".gguf")


def find_entry(spec: str, entries: list[Entry] | None = None) -> Path | None:
    """The one directory the name `spec` stands for, None if none; TierlmError listing them if several.

    What a newer build supersedes (`Entry.current`) answers only when nothing current does.
    """
    entries = catalog() if entries is None else entries
    wanted = _canonical(spec)
    by_dir = [e for e in entries if e.path.name == spec]
    if by_dir:  # directory names are unique
        return by_dir[0].path
    found: dict[str, tuple[Path, str, bool]] = {}  # identity -> (directory, description, current)
    # Models in name order (the first copy wins), artifacts newest first (the newest build wins).
    for entry in sorted(entries, key=lambda e: (-e.mtime if e.kind == "artifact" else 0.0, e.path.name)):
        if not entry.loadable:
            continue
        if entry.name.lower() == wanted:
            if entry.kind == "model":  # copies of one GGUF: the first, as imports reuse it
                identity = f"gguf:{entry.content_key or entry.path}"
            else:
                identity = f"artifact:{entry.base_dir.resolve()}:{entry.variant}"
            found.setdefault(identity, (entry.path, f"{entry.path.name} ({entry.source})", entry.current))
        if entry.kind == "artifact" and entry.base == wanted and entry.base_dir.is_dir():
            resolved = entry.base_dir.resolve()
            if resolved.parent != (cache_root() / "models").resolve():  # an import is matched itself
                found.setdefault(f"dir:{resolved}", (entry.base_dir, str(entry.base_dir), True))
    candidates = [c for c in found.values() if c[2]] or list(found.values())
    if len(candidates) > 1:
        listed = ", ".join(sorted(description for _, description, _ in candidates))
        raise TierlmError(
            f"the name {spec!r} fits {len(candidates)} models: {listed}",
            "pass the cache directory name (`tierlm cache list`) or a path instead",
        )
    return candidates[0][0] if candidates else None


def entry_dir_name(spec: str, entries: list[Entry] | None = None) -> str:
    """The cache directory `spec` names: a directory name or a catalogue name, as `cache list`
    prints either. `spec` as typed when it names no cache entry, for the caller to call unknown."""
    entries = catalog() if entries is None else entries
    found = find_entry(spec, entries)
    if found is None:  # an artifact in a format no longer read: listed, but no name loads it
        unread = [e.path for e in entries if e.name.lower() == _canonical(spec)]
        found = unread[0] if len(unread) == 1 else None
    by_path = {entry.path.resolve(): entry.path.name for entry in entries}
    return by_path.get(found.resolve(), spec) if found is not None else spec


def _label(progress: ProgressFactory | None, what: str):
    return progress(what) if progress else None


# ----------------------------------------------------------------------------- last use


def mark_used(model_dir: Path) -> None:
    """Record that `model_dir` is being used now (one empty file's mtime; failures are ignored)."""
    stamp = usage_stamp(model_dir)
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
        os.utime(stamp)
    except OSError:  # a read-only cache must not stop a chat
        pass


def last_used(model_dir: Path) -> float | None:
    try:
        return usage_stamp(model_dir).stat().st_mtime
    except OSError:
        return None


# ----------------------------------------------------------------------------- the listing


def list_models(entries: list[Entry] | None = None) -> list[ModelRow]:
    """One row per base model: imports, and the external directories artifacts were built from."""
    entries = catalog() if entries is None else entries
    rows: dict[Path, dict] = {}
    first_copy: dict[str, str] = {}
    for entry in sorted((e for e in entries if e.kind == "model"), key=lambda e: e.path.name):
        duplicate = first_copy.setdefault(entry.content_key, entry.path.name) if entry.content_key else None
        rows[entry.path.resolve()] = dict(
            name=entry.name, family=entry.family, source=entry.source, variants=[], nbytes=entry.nbytes,
            used=[last_used(entry.path)], path=entry.path,
            duplicate_of=duplicate if duplicate != entry.path.name else None,
        )  # fmt: skip
    for entry in sorted((e for e in entries if e.kind == "artifact"), key=lambda e: e.name):
        key = entry.base_dir.resolve()
        row = rows.get(key)
        if row is None:
            gone = "" if entry.base_dir.is_dir() else " (gone)"
            row = rows[key] = dict(
                name=entry.base, family=entry.family, source=f"dir {_home(entry.base_dir)}{gone}", variants=[],
                nbytes=0, used=[last_used(entry.base_dir)], path=entry.base_dir, duplicate_of=None,
            )  # fmt: skip
        row["variants"].append(entry.variant if entry.loadable else f"{entry.variant} (other format)")
        row["nbytes"] += entry.nbytes
        row["used"].append(last_used(entry.path))
    result = []
    for row in rows.values():
        used = [u for u in row.pop("used") if u is not None]
        result.append(
            ModelRow(
                parameters=parameter_count(row["path"]), last_used=max(used) if used else None,
                gguf_bytes=_gguf_bytes(row["path"]),
                **{**row, "variants": tuple(dict.fromkeys(row["variants"]))},
            )
        )  # fmt: skip
    return sorted(result, key=lambda r: (r.name, str(r.path)))


def _gguf_bytes(model_dir: Path) -> int | None:
    size = (read_import_record(model_dir) or {}).get("source_bytes")
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def parameter_count(model_dir: Path) -> int | None:
    """Parameters of the checkpoint in `model_dir`, from its safetensors headers (no weights read);
    a GGUF import's receipt counts them."""
    record = read_import_record(model_dir)
    if weights_in_gguf(record):
        return record.get("parameters") if isinstance(record.get("parameters"), int) else None
    try:
        return sum(math.prod(e.shape) for e in checkpoint_entries(Path(model_dir)).values())
    except (TierlmError, OSError):
        return None


def _home(path: Path) -> str:
    home = str(Path.home())
    text = str(path)
    return "~" + text[len(home):] if text.startswith(home + os.sep) else text


def _read_json(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
