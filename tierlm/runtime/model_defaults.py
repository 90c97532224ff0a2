"""The sampling defaults in effect for a model directory, and where each comes from.

Precedence, highest first (a user's flag or request field comes above all of these, at
`resolve_sampling`): the model's own generation_config.json, which for a GGUF import holds the
file's general.sampling.* keys; the settings tierlm ships for the model (only the embedded one
has any: tierlm.weights.embedded); the fallback (tierlm.config.GenerationDefaults). Torch-free:
`tierlm show` prints them.
"""

from __future__ import annotations

from pathlib import Path

from tierlm.cache.manifest import MANIFEST_NAME, read_manifest
from tierlm.config import GenerationDefaults
from tierlm.errors import TierlmError
from tierlm.weights.embedded import recommended_sampling
from tierlm.weights.import_record import read_import_record


def model_generation_defaults(model_dir: Path) -> GenerationDefaults:
    """The defaults for `model_dir`: an HF directory, an import, or an artifact built from one
    (which carries its base's generation_config.json; the base's receipt says what it is)."""
    model_dir = Path(model_dir)
    base_dir = _base_dir(model_dir)
    shipped = recommended_sampling(base_dir)
    base = GenerationDefaults().overridden(shipped[1], shipped[0]) if shipped else None
    gguf_keys = (read_import_record(base_dir) or {}).get("sampling_keys")
    labels = {field: f"the GGUF's {key}" for field, key in gguf_keys.items()} if isinstance(gguf_keys, dict) else {}
    return GenerationDefaults.from_dir(model_dir, base, labels)


def _base_dir(model_dir: Path) -> Path:
    """The model an artifact was built from (its manifest's `source`); any other directory itself."""
    if not (model_dir / MANIFEST_NAME).is_file():
        return model_dir
    try:
        source = read_manifest(model_dir).get("source")
    except TierlmError:  # an unusable artifact: its load says why; its own files still count
        return model_dir
    return Path(source) if isinstance(source, str) and source else model_dir
