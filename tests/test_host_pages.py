"""Resident blocks' host buffers start on a 2 MiB boundary and are advised for transparent huge
pages (tierlm/device/host_pages.py); smaller ones are plain buffers."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tierlm.device.host_pages import HUGE_PAGE, block_buffer

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> str:
    """The /proc/self/smaps entry of the mapping that holds `address`."""
    text = Path("/proc/self/smaps").read_text()
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        start, end = (int(v, 16) for v in entry.split(" ", 1)[0].split("-"))
        if start <= address < end:
            return entry
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists(), reason="Linux transparent huge pages")
def test_a_block_of_huge_pages_is_aligned_and_advised():
    buffer = block_buffer(5 * HUGE_PAGE + 12345)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 5 * HUGE_PAGE + 12345
    assert buffer.data_ptr() % HUGE_PAGE == 0
    buffer.fill_(7)  # the whole buffer is usable memory
    assert int(buffer[-1]) == 7
    # The advised range is its own mapping, eligible unless THP is off for this system.
    entry = _mapping_of(buffer.data_ptr() + HUGE_PAGE)
    eligible = re.search(r"THPeligible:\s+(\d)", entry)
    assert eligible is not None
    assert eligible.group(1) == ("0" if "[never]" in THP.read_text() else "1"), entry


def test_a_small_block_is_a_plain_buffer():
    buffer = block_buffer(HUGE_PAGE - 1)
    assert buffer.dtype == torch.uint8 and buffer.numel() == HUGE_PAGE - 1
    assert buffer.untyped_storage().nbytes() == HUGE_PAGE - 1  # no slack kept for alignment
