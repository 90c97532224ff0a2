"""The charge against a cgroup's limit, measured (issue 24, item 6's planner point).

Under a 4gb profile in a cgroup, smollm2 was refused below ~450 MiB ("needs at least 447 MiB")
while its run peaked at ~300-340 MiB of the cgroup's memory. Compared with measurements, the
charges hold in RSS (a full-context run's peak RSS was within 7% of the least limit); the gap was
the baseline's ~85 MiB of file-backed pages (the shared libraries, torch's mostly), counted in
RSS, which a cgroup reclaims under pressure and reads again when touched. Against a cgroup's limit
only the share of them a run keeps resident is charged (probe/baseline.py FILE_KEPT_SHARE); an
address-space limit and profile budgets charge them all.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from tests.test_real_limits import memory_cgroup, needs_cgroup, tierlm_in
from tierlm.device.memory import MemoryLimits
from tierlm.probe.baseline import FILE_KEPT_SHARE, Baseline, measured_baseline, record_path, recorded_baseline
from tierlm.profile import load_profile
from tierlm.runtime import source

MiB = 2**20
CPU = SimpleNamespace(type="cpu")
# The least limit must also hold a cold start, whose libraries' pages are charged to the cgroup
# itself: a warm run (those pages charged to the parent, which read them first) peaks 1.1-1.2x
# lower than what a cold one needs. Measured here: 413-416 MiB against warm peaks of 320-338 MiB
# (1.24-1.30x; 1.35-1.43x before, when the 457 MiB asked charged every library page).
FACTOR = 1.35


def budget_under(monkeypatch, limits: MemoryLimits, baseline: Baseline):
    monkeypatch.setattr(source, "process_limits", lambda device=None: limits)
    return source.charged_budget(None, load_profile("4gb"), CPU, baseline)


def test_a_cgroup_limit_charges_only_the_file_backed_pages_a_run_keeps(monkeypatch):
    baseline = Baseline(measured=256 * MiB, charged=260 * MiB, file_backed=85 * MiB)
    capped = budget_under(monkeypatch, MemoryLimits(395 * MiB, "cgroup memory limit"), baseline).baseline
    reclaimed = int(85 * MiB * (1 - FILE_KEPT_SHARE)) // MiB * MiB
    assert 0 < reclaimed < 85 * MiB and capped.reclaimed == reclaimed
    assert capped.charged == 260 * MiB - reclaimed and capped.measured == baseline.measured
    # An address-space limit counts mapped files; a cgroup limit above the profile caps nothing.
    rlimit = MemoryLimits(395 * MiB, "address-space limit (RLIMIT_AS)")
    assert budget_under(monkeypatch, rlimit, baseline).baseline == baseline
    assert budget_under(monkeypatch, MemoryLimits(64 << 30, "cgroup memory limit"), baseline).baseline == baseline


def test_the_baseline_record_keeps_its_file_backed_part(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path))
    first = measured_baseline("cpu", "int8", None, 1)
    assert 0 < first.file_backed < first.measured <= first.charged  # this process maps torch's libraries
    assert recorded_baseline("cpu", "int8", None, 1) == Baseline(first.measured, first.charged, first.file_backed)
    # A record from before the part was kept is completed by the next measurement in its band.
    path = record_path("cpu", "int8", None, 1)
    old = {k: v for k, v in json.loads(path.read_text()).items() if k != "file_backed"}
    path.write_text(json.dumps(old))
    again = measured_baseline("cpu", "int8", None, 1)
    assert again.charged == first.charged and again.file_backed > 0
    assert recorded_baseline("cpu", "int8", None, 1).file_backed == again.file_backed


@pytest.mark.slow
@pytest.mark.e2e
@needs_cgroup
def test_smollm2_runs_in_the_least_cgroup_limit_plan_names_and_that_limit_is_near_its_peak():
    """The real thing: `plan` in a small cgroup names the least limit; a full-context bench (two
    runs: the peak of either) in a cgroup of exactly that runs, streaming from disk, and the
    limit is within FACTOR of the cgroup's measured peak."""
    # First use (import, conversion, probe, baseline record) outside any cgroup: not what is measured.
    warm = tierlm_in(None, "bench", "--profile", "4gb", "--prompt-tokens", "8", "--tokens", "2", "--runs", "1")
    assert warm.returncode == 0, warm.stderr[-2000:]
    with memory_cgroup(330 * MiB) as group:
        refused = tierlm_in(group, "plan", "--profile", "4gb")
    found = re.search(r"needs at least (\d+) MiB of RAM", refused.stderr)
    assert refused.returncode == 1 and found, refused.stderr[-2000:]
    least = int(found.group(1)) * MiB
    with memory_cgroup(least) as group:
        done = tierlm_in(group, "bench", "--profile", "4gb", "--prompt-tokens", "1008", "--tokens", "16",
                         "--runs", "2", "--json")  # fmt: skip
        peak = int((group / "memory.max_usage_in_bytes").read_text())
    assert done.returncode == 0, f"rc {done.returncode} (-9 or 137 = OOM-killed): {done.stderr[-2000:]}"
    measured = json.loads(done.stdout)
    assert "disk" in measured["placement_bytes"], "the least limit holds the smallest placement: streamed"
    assert least <= FACTOR * peak, f"the planner asks {least / MiB:.0f} MiB for a run peaking at {peak / MiB:.0f} MiB"
