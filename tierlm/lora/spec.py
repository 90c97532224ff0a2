"""Parsing the CLI's `--lora PATH[:WEIGHT]` and `serve --lora NAME=PATH[:WEIGHT]` (no torch here:
the CLI imports it)."""

from __future__ import annotations

import math
import re
from pathlib import Path

from tierlm.errors import TierlmError

USAGE = "use --lora DIR[:WEIGHT], DIR a PEFT adapter directory and WEIGHT a number (default 1.0)"
# A variant's name on the API (`model` in a request): what /v1/models lists beside the base.
VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NAME_RULE = "a variant name is 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"


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


def parse_variant_spec(spec: str) -> tuple[str | None, Path, float]:
    """`serve --lora`: "chat=adapters/chat:0.5" -> ("chat", Path("adapters/chat"), 0.5), a variant
    served under its own name; a spec without NAME= -> (None, path, weight), merged into the base.

    The text before the first '=' is a name only if it reads as one and the whole spec is not an
    existing path (a directory may be named `a=b`)."""
    text = spec.strip()
    name, eq, rest = text.partition("=")
    if not eq or Path(text).expanduser().exists() or not VARIANT_NAME.fullmatch(name):
        return (None, *parse_lora_spec(spec))
    return (name, *parse_lora_spec(rest))


def split_variant_specs(specs) -> tuple[tuple[str, ...], dict[str, tuple[tuple[Path, float], ...]]]:
    """`serve --lora` values -> (the specs merged into the base, {variant: its (path, weight)s});
    the same NAME twice puts both adapters in that variant, in the order given."""
    merged: list[str] = []
    variants: dict[str, list[tuple[Path, float]]] = {}
    for spec in specs:
        name, path, weight = parse_variant_spec(spec)
        if name is None:
            merged.append(spec)
        else:
            variants.setdefault(name, []).append((path, weight))
    return tuple(merged), {name: tuple(adapters) for name, adapters in variants.items()}


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
