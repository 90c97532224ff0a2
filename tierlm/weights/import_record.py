"""The receipt a finished GGUF import leaves in its directory (tierlm-import.json), and the content
key an import is found by.

Written last by tierlm/weights/gguf_import.py; read by the catalogue and the planner, which need
what the import was made from but none of the converter (numpy, gguf).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tierlm.digests import file_digest
from tierlm.errors import TierlmError

# Bump when the written directory changes in a way that old imports should not be reused.
# 2: the receipt records the source tensor types (`--quant auto` keeps a quantized grid).
# 3: the content key is a sha256 of the whole file (it sampled regions, so an edit between them
#    returned the stale import). Older imports are listed as another format and imported afresh.
# 4: no float copy: the weights are read from the GGUF itself ("weights": WEIGHTS_IN_GGUF).
# 5: the receipt records each tensor's rows (mixed:source's row stacks are predicted from them).
IMPORT_FORMAT_VERSION = 5
RECORD_NAME = "tierlm-import.json"
WEIGHTS_IN_GGUF = "gguf"


def read_import_record(model_dir: Path) -> dict[str, Any] | None:
    """The receipt of a completed import in `model_dir`, or None if it holds none."""
    try:
        return json.loads((Path(model_dir) / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return None


def weights_in_gguf(record: dict[str, Any] | None) -> bool:
    """Whether an import's weights are read from its GGUF (no safetensors in the directory)."""
    return bool(record) and record.get("weights") == WEIGHTS_IN_GGUF


def source_tensor_types(model_dir: Path) -> dict[str, int]:
    """GGUF tensor type name -> tensor count an import's weights were stored in ({} when
    `model_dir` is not an import)."""
    record = read_import_record(model_dir) or {}
    return dict(record.get("tensor_types") or {})


def recorded_sources(model_dir: Path | None):
    """sources (HF tensor names fused by rows) -> (their GGUF types as an import in `model_dir`
    recorded them, "" where unknown; their rows, or None unless all are recorded): what
    modes.source_grid_mode takes."""
    record = (read_import_record(model_dir) if model_dir is not None else None) or {}
    types, rows = dict(record.get("tensor_type_of") or {}), dict(record.get("tensor_rows_of") or {})

    def describe(sources):
        counts = [rows[s] for s in sources] if all(s in rows for s in sources) else None
        return [types.get(s, "") for s in sources], counts

    return describe


def gguf_content_key(gguf_path: Path) -> str:
    """A short hex key for a GGUF file's whole content and this importer's version.

    Keyed by a sha256 of every byte, so an in-place edit anywhere (a chat template, one tensor)
    is a new import; the digest is remembered per file (tierlm.digests), so only the
    first run after a change reads the whole file.
    """
    gguf_path = Path(gguf_path)
    try:
        content = file_digest(gguf_path)
    except FileNotFoundError:
        raise TierlmError(f"GGUF file not found: {gguf_path}", hint="check the path") from None
    except OSError as err:
        raise TierlmError(f"cannot read GGUF file {gguf_path}: {err.strerror or err}") from None
    return hashlib.sha256(f"tierlm-gguf-import-v{IMPORT_FORMAT_VERSION}:sha256:{content}".encode()).hexdigest()[:16]
