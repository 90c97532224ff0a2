"""Models by name on the command line: `tierlm list`, `tierlm show`, `cache list|rm`, and chat's
positional MODEL. Naming and resolution live in tierlm.cache.catalog; this module only renders."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tierlm.errors import TierlmError

# GGUF: the file an import reads; SIZE: what the model takes in the cache (import and artifacts).
LIST_COLUMNS = ("NAME", "FAMILY", "PARAMETERS", "SOURCE", "GGUF", "VARIANTS", "SIZE", "LAST USED")


def pick_model(positional: str | None, option: str | None) -> str | None:
    """The model a command was given, as `chat NAME` or `chat --model NAME`, but not both."""
    if positional is not None and option is not None:
        raise TierlmError(
            f"the model is given twice: {positional!r} and --model {option!r}",
            "name it once, either as the first argument or with --model",
        )
    return positional if positional is not None else option


def version_text() -> str:
    from tierlm import __version__

    return f"tierlm {__version__}"


# ----------------------------------------------------------------------------- tierlm list


def render_list() -> str:
    """The `tierlm list` table: one row per base model, then a total line."""
    from tierlm.cache.catalog import list_models
    from tierlm.paths import cache_root
    from tierlm.profile import format_size

    rows = list_models()
    if not rows:
        return "\n".join([
            f"no models in {cache_root()} yet: `tierlm chat` imports the embedded smollm2 on first use, "
            "`tierlm import-gguf FILE` adds a GGUF",
            *stale_builds_lines(),
        ])  # fmt: skip
    now = time.time()
    table = [LIST_COLUMNS] + [
        (
            row.name,
            row.family or "-",
            format_parameters(row.parameters),
            row.source,
            format_size(row.gguf_bytes) if row.gguf_bytes is not None else "-",
            ", ".join(row.variants) or "-",
            format_size(row.nbytes),
            age(now - row.last_used) if row.last_used is not None else "never",
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(LIST_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table]
    variants = sum(len(row.variants) for row in rows)
    total = sum(row.nbytes for row in rows)
    lines.append(
        f"{len(rows)} model{'s' * (len(rows) != 1)}, {variants} variant{'s' * (variants != 1)}, "
        f"{format_size(total)} in {cache_root()}"
    )
    for row in rows:
        if row.duplicate_of:
            lines.append(
                f"note: {row.path.name} holds the same GGUF as {row.duplicate_of} (an older tierlm imported "
                f"it twice); `tierlm cache rm {row.path.name}` frees {format_size(row.nbytes)}"
            )
    return "\n".join(lines + stale_builds_lines())


def render_cache_list() -> str:
    """`tierlm cache list`: kind, size, directory name (what `cache rm` takes), catalogue name.

    A variant's size is what it adds to the cache: the blocks its adapters change; it reads the
    rest from the base artifact named after it. A variant whose base is gone cannot load: it is
    not listed, a note says how to remove it."""
    from tierlm.cache.catalog import catalog, orphaned_variants
    from tierlm.profile import format_size

    entries = catalog()
    orphans = orphaned_variants(entries)
    lines = []
    for entry in entries:
        if entry in orphans:
            continue
        kind, name = entry.kind, entry.name
        if entry.shares is not None:
            kind, name = "variant", f"{name}; adds {format_size(entry.nbytes)} to base {entry.shares}"
        lines.append(f"{kind:9} {format_size(entry.nbytes):>10}  {entry.path.name}  ({name})")
    if orphans:
        names = " ".join(e.path.name for e in orphans)
        lines.append(f"{len(orphans)} variant artifact{'s' * (len(orphans) != 1)} whose base artifact is gone "
                     f"(not listed, {format_size(sum(e.nbytes for e in orphans))}); `tierlm cache rm {names}` removes them")  # fmt: skip
    return "\n".join(lines + stale_builds_lines())


def stale_builds_lines() -> list[str]:
    """The note on what killed builds left behind, for both listings (none when nothing is)."""
    from tierlm.cache.entries import stale_builds

    stale = stale_builds()
    if not stale.count:
        return []
    mib = stale.nbytes / (1 << 20)
    return [
        f"{stale.count} stale partial build{'s' * (stale.count != 1)}, {mib:.1f} MiB; "
        "`tierlm cache rm --all` or the next build removes them"
    ]


def format_parameters(count: int | None) -> str:
    if count is None:
        return "-"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def age(seconds_ago: float) -> str:
    """`3 minutes ago`-style text for a duration in seconds."""
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds_ago >= size:
            count = int(seconds_ago // size)
            return f"{count} {unit}{'s' * (count > 1)} ago"
    return "just now"


# ----------------------------------------------------------------------------- tierlm cache rm


def remove_from_cache(names: list[str], everything: bool, yes: bool) -> list[Path]:
    """`tierlm cache rm`: names are directory names or catalogue names; --all asks first unless --yes.
    Removing an import removes the artifacts built from it, and a base artifact the variants that
    read their blocks from it (without it they could not load); that, or removing an import (a
    source that is not rebuilt), asks first unless --yes."""
    import typer

    from tierlm.cache import catalog
    from tierlm.cache.entries import cache_entries, remove_entries, require_known
    from tierlm.cache.removal import removal_of
    from tierlm.profile import format_size

    if everything:
        entries = cache_entries()
        if entries and not yes:
            if not sys.stdin.isatty():
                raise TierlmError(
                    "`cache rm --all` asks before removing everything, and stdin is not a terminal",
                    "pass --yes to remove every entry without asking",
                )
            size = format_size(sum(e.nbytes for e in entries))
            if not typer.confirm(f"Remove all {len(entries)} cache entries ({size})?", default=False):
                raise typer.Abort()
        return remove_entries([], everything=True)
    entries = catalog.catalog()
    listed = {entry.path.name: entry for entry in entries}
    dir_names = list(dict.fromkeys(catalog.entry_dir_name(name, entries) for name in names or []))
    require_known(dir_names, listed)
    removal = removal_of([listed[name].path for name in dir_names], entries)
    if removal.derived or any(entry.kind == "model" for entry in removal.named):
        confirm_removal(", ".join(dir_names), removal, yes)
    return removal.remove()


def remove_models(names: list[str], yes: bool) -> list[str]:
    """`tierlm rm`: each named model's import and the artifacts built from it (an artifact's name:
    that artifact and its variants), after asking unless `yes`; the lines saying what was removed."""
    from tierlm.cache import catalog
    from tierlm.cache.removal import removal_of
    from tierlm.weights.embedded import EMBEDDED_NAME, EMBEDDED_PACKAGE

    entries = catalog.catalog()
    chosen = {}
    for name in dict.fromkeys(names):
        found = catalog.find_entry(name, entries)
        removal = removal_of([found], entries) if found is not None else None
        if removal is None or not removal.entries:
            if name.lower() == EMBEDDED_NAME:
                raise TierlmError(f"{EMBEDDED_NAME} has nothing in the cache to remove: it is the embedded model, "
                                  f"shipped in the Python package {EMBEDDED_PACKAGE}, which tierlm does not remove",
                                  f"`pip uninstall {EMBEDDED_PACKAGE.replace('_', '-')}` removes the package")  # fmt: skip
            raise TierlmError(f"no model named {name!r} in the cache", "`tierlm list` shows the models by name")
        chosen[name] = removal
    total = removal_of([e.path for removal in chosen.values() for e in removal.entries], entries)
    confirm_removal(", ".join(chosen), total, yes)
    total.remove()
    lines = [f"removed {name} ({removal.summary()})" for name, removal in chosen.items()]
    if any(e.name == EMBEDDED_NAME and e.kind == "model" for e in total.entries):
        lines.append(f"note: {EMBEDDED_NAME} is shipped in the package {EMBEDDED_PACKAGE}, which stays: its next "
                     "use imports it again")  # fmt: skip
    return lines


def confirm_removal(what: str, removal, yes: bool) -> None:
    """Ask on the terminal before `removal` (unless `yes`); refuse when stdin is not a terminal."""
    import typer

    if yes:
        return
    said = f"{what} ({removal.summary()})"
    if not sys.stdin.isatty():
        names = ", ".join(entry.path.name for entry in removal.entries)
        raise TierlmError(f"removing {said} asks first, and stdin is not a terminal; nothing was removed "
                          f"(it would remove {names})", "pass --yes to remove them without asking")  # fmt: skip
    if not typer.confirm(f"Remove {said}?", default=False):
        raise typer.Abort()


# ----------------------------------------------------------------------------- tierlm import-gguf


def import_gguf_command(path: Path, progress) -> tuple[Path, str, bool, str]:
    """Import `path` (or find its earlier import): (directory, name, whether it was already there,
    what it replaced: the import of the file's earlier content, said after a `;`, or "")."""
    from tierlm.cache.catalog import catalog, model_name
    from tierlm.cache.removal import removal_of, retire_replaced_imports
    from tierlm.weights.embedded import find_import, import_gguf_to_cache
    from tierlm.weights.gguf_import import gguf_content_key
    from tierlm.weights.import_record import read_import_record

    path = Path(path).expanduser()
    existed = path.is_file() and find_import(gguf_content_key(path)) is not None
    source = str(path.resolve())
    earlier = [] if existed else [e.path for e in catalog() if e.kind == "model"
                                  and (read_import_record(e.path) or {}).get("source_path") == source]  # fmt: skip
    replaced = removal_of(earlier)  # the import removes them once it is complete
    model_dir = import_gguf_to_cache(path, progress, on_fresh=retire_replaced_imports)
    kept = [entry.path.name for entry in replaced.named if entry.path.exists()]
    said = f"; replaced the import of its earlier content ({replaced.summary()})" if replaced.named else ""
    if kept:  # another process builds from it right now
        said = f"; the import of its earlier content stays while in use: `tierlm rm {' '.join(kept)}` removes it"
    return model_dir, model_name(model_dir), existed, said


# ----------------------------------------------------------------------------- tierlm show


def render_show(spec: str, profile_name: str, device: str | None) -> str:
    """`tierlm show NAME`: config summary, chat template, artifacts, and the plan under a profile."""
    from tierlm.cache import catalog
    from tierlm.models import read_config
    from tierlm.profile import format_size

    model_dir = catalog.resolve_model(spec)
    config = read_config(model_dir)
    entries = catalog.catalog()
    here = model_dir.resolve()
    this = next((e for e in entries if e.path.resolve() == here), None)
    base_dir = this.base_dir.resolve() if this is not None else here
    lines = [
        f"name        {catalog.model_name(model_dir)}",
        f"path        {model_dir}",
        f"source      {this.source if this is not None else 'dir (not in the cache)'}",
        f"family      {config.model_type}",
        f"parameters  {format_parameters(catalog.parameter_count(base_dir))}",
        f"layers      {config.num_hidden_layers}",
        f"hidden      {config.hidden_size} (intermediate {config.intermediate_size})",
        f"heads       {config.num_attention_heads} query, {config.num_key_value_heads} key/value, "
        f"head_dim {config.head_dim}",
        f"vocab       {config.vocab_size}",
        f"context     {config.max_position_embeddings}",
    ]
    lines += _gguf_lines(base_dir)
    lines += _template_lines(model_dir)
    lines += _sampling_lines(model_dir)
    variants = [e for e in entries if e.kind == "artifact" and e.base_dir.resolve() == base_dir]
    lines.append("artifacts   " + ("none yet (built on first use of a quant mode or --lora)" if not variants else ""))
    lines += [f"  {e.name:30} {format_size(e.nbytes):>10}  {e.path.name}" for e in variants]
    lines += ["", f"plan under the {profile_name} profile:", plan_text(model_dir, profile_name, device)]
    return "\n".join(line.rstrip() for line in lines)


def _gguf_lines(base_dir: Path) -> list[str]:
    """For a GGUF import: its tensor types, each with its count and bytes, and the file's size."""
    from tierlm.profile import format_size
    from tierlm.weights.import_record import read_import_record

    record = read_import_record(base_dir) or {}
    counts, stored = record.get("tensor_types") or {}, record.get("tensor_type_bytes") or {}
    if not counts:
        return []
    order = sorted(counts, key=lambda kind: (-stored.get(kind, 0), kind))
    types = ", ".join(f"{kind} x {counts[kind]}" + (f" ({format_size(stored[kind])})" if kind in stored else "")
                      for kind in order)  # fmt: skip
    size = record.get("source_bytes")
    return [f"gguf        {types}" + (f"; a {format_size(size)} file" if isinstance(size, int) else "")]


# GenerationDefaults field -> the flag that overrides it, as `tierlm show` names it.
_SAMPLING_FLAGS = (("temperature", "temperature"), ("top_p", "top-p"), ("top_k", "top-k"), ("min_p", "min-p"),
                   ("repetition_penalty", "repeat-penalty"), ("repeat_last_n", "repeat-last-n"))  # fmt: skip


def _sampling_lines(model_dir: Path) -> list[str]:
    """The sampling defaults in effect (where no flag or request field sets one), with where each comes from."""
    from tierlm.runtime.model_defaults import model_generation_defaults

    defaults = model_generation_defaults(model_dir)
    return ["sampling    defaults where no flag or request field sets one:"] + [
        f"  {flag:15} {getattr(defaults, name):<6g} {defaults.origin(name)}" for name, flag in _SAMPLING_FLAGS
    ]


def _template_lines(model_dir: Path, shown: int = 4) -> list[str]:
    import json

    from tierlm.runtime.tokenizer import select_chat_template

    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    template, why_not = select_chat_template(model_dir, config if isinstance(config, dict) else {})
    if template is None:
        return [f"template    none: {why_not}; use `generate --raw`"]
    body = template.strip().splitlines()
    more = f" ... ({len(body)} lines)" if len(body) > shown else ""
    return ["template    chat template present:"] + [f"  {line}" for line in body[:shown]] + ([f"  {more.strip()}"] if more else [])


def plan_text(model_dir: Path, profile_name: str, device: str | None) -> str:
    """The plan for `model_dir` under a profile, computed and shown as `tierlm plan` does."""
    from dataclasses import replace

    from tierlm.cli.plan_view import plan_for, render_plan
    from tierlm.device.cpu import resolve_threads
    from tierlm.profile import load_profile

    profile = load_profile(profile_name)
    # As `tierlm plan`: the thread count keys the probe, the baseline and the kernels' calibration.
    profile = replace(profile, threads=resolve_threads(profile.threads))
    return render_plan(*plan_for(model_dir, profile, None, device))
