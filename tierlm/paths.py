"""Where tierlm keeps what it builds: one cache root, overridable by $TIERLM_CACHE."""

import os
from pathlib import Path


def cache_root() -> Path:
    """The cache directory: $TIERLM_CACHE, else $XDG_CACHE_HOME/tierlm, else ~/.cache/tierlm."""
    explicit = os.environ.get("TIERLM_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tierlm"
