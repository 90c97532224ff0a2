"""Test-wide settings: offline transformers, and a private tierlm cache for the whole run."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def tierlm_cache(tmp_path_factory):
    """Every test (and subprocess it starts) shares one cache, so the embedded model imports once."""
    path = tmp_path_factory.mktemp("tierlm-cache")
    previous = os.environ.get("TIERLM_CACHE")
    os.environ["TIERLM_CACHE"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("TIERLM_CACHE", None)
    else:
        os.environ["TIERLM_CACHE"] = previous


@pytest.fixture(scope="module")
def decode_checkpoint(tmp_path_factory):
    """name -> folder of that tests.tiny.DECODE_CASES checkpoint, built once per test module."""
    from tests.tiny import DECODE_CASES, make_case

    made = {}

    def get(case):
        if case not in made:
            made[case] = tmp_path_factory.mktemp(case)
            make_case(made[case], DECODE_CASES[case])
        return made[case]

    return get
