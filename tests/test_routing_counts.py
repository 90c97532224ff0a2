"""Routing counts: aging halves a pick's weight every half-life, counts survive a save and load, and a
damaged, foreign or other-shaped file costs only a cold start (uniform expectations)."""

from __future__ import annotations

import json
import math

import pytest

from tierlm.offload.routing_counts import COUNTS_NAME, RoutingCounts


def test_a_pick_halves_in_weight_after_a_half_life_of_later_picks():
    counts = RoutingCounts([3], 4, half_life=8)
    counts.record(3, {0: 1})
    first = counts.count(3, 0)
    assert first == pytest.approx(1.0, rel=0.1)
    counts.record(3, {1: 8})  # eight later picks of the same layer
    assert counts.count(3, 0) == pytest.approx(first / 2)
    assert counts.count(3, 1) == pytest.approx(8 / 2)  # one step's picks share one weight
    counts.record(3, {2: 4, 1: 4})
    assert counts.count(3, 0) == pytest.approx(first / 4)


def test_recent_use_overtakes_old_frequency():
    """Plain LFU would keep expert 0 forever; aged counts follow the new workload."""
    counts = RoutingCounts([0], 4, half_life=16)
    for _ in range(64):
        counts.record(0, {0: 1})
    assert counts.ranked(0)[0] == 0
    for _ in range(64):
        counts.record(0, {1: 1})
    assert counts.ranked(0)[:2] == [1, 0]
    assert counts.share(0)[1] > 0.9


def test_layers_age_apart_and_counts_compare_across_layers():
    counts = RoutingCounts([0, 5], 2, half_life=4)
    counts.record(0, {1: 4})
    counts.record(5, {0: 2})
    counts.record(5, {1: 2})  # layer 5's own picks age layer 5's counts only
    assert counts.count(0, 1) == pytest.approx(4 / 2)
    assert counts.count(5, 0) == pytest.approx(2 / 2)
    assert counts.count(5, 1) == pytest.approx(2 * 2**-0.5)
    assert counts.ranked(5) == [1, 0] and counts.count(0, 1) > counts.count(5, 1)


def test_no_data_means_uniform_shares_and_hit_rate_by_share():
    counts = RoutingCounts([0, 1], 4)
    assert counts.share(0) == [0.25] * 4
    assert counts.hit_rate(0, [0, 1]) == pytest.approx(0.5)
    counts.record(1, {2: 3, 3: 1})
    assert counts.hit_rate(1, [2, 2]) == pytest.approx(0.75)
    assert counts.ranked(1) == [2, 3, 0, 1]


def test_rescaling_keeps_counts_finite_and_comparable():
    counts = RoutingCounts([0], 2, half_life=0.5)  # weights grow 4x per pick: rescaled often
    for _ in range(400):
        counts.record(0, {0: 1})
    counts.record(0, {1: 1})
    assert all(math.isfinite(counts.count(0, e)) for e in range(2))
    assert counts.count(0, 1) == pytest.approx(0.25)
    assert counts.count(0, 0) == pytest.approx(sum(4.0**-k for k in range(2, 402)), rel=1e-6)


def test_saved_counts_load_as_they_were(tmp_path):
    path = tmp_path / COUNTS_NAME
    counts = RoutingCounts([1, 3], 4, half_life=8)
    counts.record(1, {0: 5, 2: 1})
    counts.record(3, {3: 2})
    counts.save(path)
    loaded = RoutingCounts.load(path, [1, 3], 4)
    for layer in (1, 3):
        for e in range(4):
            assert loaded.count(layer, e) == pytest.approx(counts.count(layer, e))
    assert loaded.ranked(1) == counts.ranked(1)
    assert not list(tmp_path.glob("*.tmp*")), "the temporary file was renamed into place"


def test_loading_other_layers_keeps_the_matching_ones(tmp_path):
    path = tmp_path / COUNTS_NAME
    counts = RoutingCounts([0, 1], 4)
    counts.record(1, {2: 3})
    counts.save(path)
    loaded = RoutingCounts.load(path, [1, 2], 4)  # layer 0 gone, layer 2 new
    assert loaded.layers == [1, 2]
    assert loaded.count(1, 2) == pytest.approx(counts.count(1, 2)) and loaded.count(1, 2) > 2.9
    assert loaded.share(2) == [0.25] * 4


@pytest.mark.parametrize(
    "damage",
    ["not json", "[1, 2]", '{"experts": 4}', '{"experts": 4, "layers": [1]}', '{"experts": 4, "layers": {"x": [1, 1, 1, 1]}}',
     '{"experts": 4, "layers": {"0": "abcd"}}', '{"experts": 4, "layers": {"0": [1, null, 1, 1]}}'],
)  # fmt: skip
def test_a_damaged_file_costs_only_a_cold_start(tmp_path, damage):
    path = tmp_path / COUNTS_NAME
    path.write_text(damage)
    loaded = RoutingCounts.load(path, [0], 4)
    assert loaded.share(0) == [0.25] * 4 and loaded.count(0, 1) == 0


@pytest.mark.parametrize("values", [[1, -1, 0, 0], [1, float("nan"), 0, 0], [1, float("inf"), 0, 0], [1, 2, 3]])
def test_negative_infinite_or_short_rows_are_dropped(tmp_path, values):
    path = tmp_path / COUNTS_NAME
    path.write_text(json.dumps({"version": 1, "experts": 4, "layers": {"0": values, "1": [0, 0, 5, 0]}}))
    loaded = RoutingCounts.load(path, [0, 1], 4)
    assert loaded.share(0) == [0.25] * 4
    assert loaded.ranked(1)[0] == 2


def test_a_file_for_another_expert_count_is_ignored(tmp_path):
    path = tmp_path / COUNTS_NAME
    counts = RoutingCounts([0], 8)
    counts.record(0, {7: 3})
    counts.save(path)
    assert RoutingCounts.load(path, [0], 4).share(0) == [0.25] * 4
    assert RoutingCounts.load(path, [0], 8).ranked(0)[0] == 7


def test_a_missing_file_or_an_unwritable_directory_is_no_error(tmp_path):
    assert RoutingCounts.load(tmp_path / "absent.json", [0], 2).share(0) == [0.5, 0.5]
    counts = RoutingCounts([0], 2)
    counts.record(0, {1: 1})
    counts.save(tmp_path / "no-such-dir" / COUNTS_NAME)  # the next start is merely cold
    assert not (tmp_path / "no-such-dir").exists()
