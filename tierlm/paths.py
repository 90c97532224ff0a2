"""Where tierlm keeps what it builds: one cache root, overridable by $TIERLM_CACHE, and the
compiled kernels, under it unless $TIERLM_KERNELS names their own directory."""

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


def kernels_root() -> Path:
    """The compiled native kernels' directory: $TIERLM_KERNELS, else `cache_root()/kernels`.

    Each library's file name is keyed on everything its bytes depend on (sources, flags,
    compiler, CPU), so one directory can serve every cache, session and checkout of a machine.
    """
    explicit = os.environ.get("TIERLM_KERNELS")
    if explicit:
        return Path(explicit).expanduser()
    return cache_root() / "kernels"
