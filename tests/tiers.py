"""Test tiers: `make test` runs everything; `make test-fast` skips tests marked `slow` or `e2e`.

A parametrized check keeps a few quick cases in the fast tier and marks the rest `slow`, so every
case still runs in `make test` and the fast tier still reaches every module.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def quick(values: Iterable, fast: Iterable, ids=None, unpack: bool = True) -> list:
    """`values` as pytest params, those not in `fast` marked slow. With `unpack`, a value that is a
    tuple is a row of several arguments (for parametrize); a fixture's params keep it whole (pass
    unpack=False). `ids` (a list, or a function of the value) names the params."""
    fast = list(fast)
    params = []
    for i, value in enumerate(values):
        name = ids(value) if callable(ids) else ids[i] if ids is not None else None
        row = value if unpack and isinstance(value, tuple) else (value,)
        params.append(pytest.param(*row, id=name, marks=() if value in fast else pytest.mark.slow))
    return params
