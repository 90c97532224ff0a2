"""Parsing the CLI's `--lora PATH[:WEIGHT]` (no torch here: the CLI imports it)."""

from __future__ import annotations

import math
from pathlib import Path

from tierlm.errors import TierlmError

USAGE = "use --lora DIR[:WEIGHT], DIR a PEFT adapter directory and WEIGHT a number (default 1.0)"


def parse_lora_spec(spec: str) -> tuple[Path, float]:
    """("adapters/chat:0.5") -> (Path("adapters/chat"), 0.5); the weight defaults to 1.0.

    The text after the last colon is a weight only if it reads as a number, so Windows paths
    (C:\\adapters\\chat) and directory names with colons stay paths. The directory must exist.
    """
    text = spec.strip()
    if not text:
        raise TierlmError("--lora was given an empty value", USAGE)
    path_text, weight = text, 1.0
    head, colon, tail = text.rpartition(":")
    if colon and head:
        parsed = _number(tail)
        if parsed is not None:
            if not math.isfinite(parsed):
                raise TierlmError(f"LoRA weight {tail!r} in {spec!r} is not a finite number", USAGE)
            path_text, weight = head, parsed
    path = Path(path_text).expanduser()
    if not path.exists():
        hint = USAGE
        if colon and head and _number(tail) is None:
            hint = (
                f"{tail!r} after the last ':' is not a number, so it was read as part of the path; "
                + USAGE
            )
        raise TierlmError(f"LoRA adapter {path} does not exist", hint)
    if not path.is_dir():
        raise TierlmError(
            f"LoRA adapter {path} is not a directory",
            "pass the directory that holds adapter_config.json and adapter_model.safetensors",
        )
    return path, weight


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
