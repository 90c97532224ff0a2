"""Which adapters POST /v1/adapters may load: the `path` a client sends is either a directory
under `serve --adapter-dir DIR` (relative to DIR, or absolute) or, when DIR holds no such path, the
name of an adapter the cache already knows. Nothing else is read for a client: the server's files are not the API's to name.

"Under DIR" is decided after following every symlink (Path.resolve), for the adapter directory and
for the two files the loader reads from it, so neither `..` nor a link placed inside DIR leads
out of it. An adapter "the cache knows" is one an artifact in the cache was built with, by the
name `tierlm list` shows in that artifact's name (`smollm2:int8+my-lora`: `my-lora`, its
directory's name); it was loaded once already, by the operator or from DIR. Without
--adapter-dir only such names are accepted. Adapters given to `serve --lora` are the operator's
and never pass through here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tierlm.cache.entries import cache_entries
from tierlm.cache.manifest import MANIFEST_NAME
from tierlm.lora.adapter import CONFIG_NAME, WEIGHTS_NAME
from tierlm.server.schemas import ApiError
from tierlm.weights.embedded import slug

REFUSED = "this server only loads adapters under --adapter-dir, or adapters the cache knows by name"


@dataclass(frozen=True)
class AdapterSources:
    """Where a client's adapter may come from; `root` is --adapter-dir resolved (None: not given)."""

    root: Path | None = None

    @classmethod
    def of(cls, adapter_dir: Path | str | None) -> "AdapterSources":
        """For `serve --adapter-dir` (ServerOptions has checked it is a directory)."""
        return cls(Path(adapter_dir).expanduser().resolve() if adapter_dir is not None else None)

    def locate(self, spec: str) -> Path:
        """The adapter directory the request's `path` names: a path under the root, else an
        adapter the cache knows by that name; an ApiError 403 (param `path`) for anything else."""
        inside = self._inside(spec) if self.root is not None else None
        if inside is not None and inside.exists():
            return inside
        known = cached_adapters()
        paths = known.get(spec.lower(), ())
        if len(paths) > 1:
            raise ApiError(400, f"`{spec}` names {len(paths)} adapters in the cache ({', '.join(map(str, paths))}); "
                                "give the path of one under --adapter-dir", param="path", code="ambiguous_adapter")
        if paths:
            return paths[0]
        if inside is not None:
            return inside  # a missing directory under the root: the adapter check says so (400)
        where = "is not under it (symlinks followed)" if self.root is not None else "cannot be loaded: it was not given"
        names = ", ".join(f"`{name}`" for name in sorted(known)) or "none"
        raise ApiError(403, f"{REFUSED}; `{spec}` {where}, and the cache knows no adapter of that name "
                            f"(it knows {names})", param="path", code="adapter_path_refused")  # fmt: skip

    def _inside(self, spec: str) -> Path | None:
        """`spec` resolved against the root when it, and the adapter files in it, stay inside."""
        try:
            path = (self.root / Path(spec).expanduser()).resolve()  # an absolute `spec` stays itself
            targets = [path] + [(path / name).resolve() for name in (CONFIG_NAME, WEIGHTS_NAME)]
        except (OSError, RuntimeError, ValueError):  # an unknown ~user, a symlink loop, a NUL byte
            return None
        return path if all(target.is_relative_to(self.root) for target in targets) else None


def cached_adapters() -> dict[str, tuple[Path, ...]]:
    """name -> the adapter directories (still there) the cache's artifacts were built with."""
    found: dict[str, set[Path]] = {}
    for entry in cache_entries():
        if entry.kind != "artifact":
            continue
        try:
            manifest = json.loads((entry.path / MANIFEST_NAME).read_text())
            adapters = [Path(path) for path, _weight in manifest.get("adapters") or ()]
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # an unreadable manifest names no adapter; `tierlm cache verify` reports it
        for path in adapters:
            if path.is_dir():
                found.setdefault(slug(path.name), set()).add(path)
    return {name: tuple(sorted(paths)) for name, paths in found.items()}
