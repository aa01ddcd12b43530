"""The miss benchmark's interval for a ratio of pooled medians, resampled by engine pair."""

from __future__ import annotations

import pytest

from kvtier.bench.bootstrap import pair_bootstrap_interval, pooled_median_ratio


def test_the_pooled_ratio_takes_the_median_of_every_sample_of_every_pair() -> None:
    num = [[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]]  # pooled median 3.5
    den = [[1.0, 1.0, 2.0], [2.0, 2.0, 3.0]]  # pooled median 2.0
    assert pooled_median_ratio(num, den) == pytest.approx(1.75)


def test_pairs_that_agree_give_no_spread_and_pairs_that_differ_give_some() -> None:
    den = [[100.0, 101.0, 99.0], [150.0, 149.0, 151.0], [120.0, 121.0, 119.0]]
    alike = [[1.1 * x for x in pair] for pair in den]
    assert pair_bootstrap_interval(alike, den) == pytest.approx((1.1, 1.1))
    # Engine pairs whose with-kvtier engine happens to be fast or slow: the ratio depends on them.
    spread = [[0.9 * x for x in den[0]], [1.2 * x for x in den[1]], [1.0 * x for x in den[2]]]
    low, high = pair_bootstrap_interval(spread, den)
    assert low < pooled_median_ratio(spread, den) < high
    assert low < 1.0 < high  # a run like this cannot tell a 2% line apart


def test_the_same_samples_give_the_same_interval() -> None:
    den = [[100.0 + i + j for j in range(5)] for i in range(8)]
    num = [[x * (1 + 0.01 * (i % 3)) for x in pair] for i, pair in enumerate(den)]
    assert pair_bootstrap_interval(num, den) == pair_bootstrap_interval(num, den)


def test_strata_keep_each_resample_balanced_between_labels() -> None:
    # Two kinds of pair (kvtier's engine started first or second) with ratios 0.9 and 1.1: resampled
    # freely, a draw can hold only one kind; kept balanced, every draw pools both halves.
    den = [[100.0, 100.0], [100.0, 100.0], [100.0, 100.0], [100.0, 100.0]]
    num = [[90.0, 90.0], [110.0, 110.0], [90.0, 90.0], [110.0, 110.0]]
    free_low, free_high = pair_bootstrap_interval(num, den)
    low, high = pair_bootstrap_interval(num, den, strata=[0, 1, 0, 1])
    assert (free_low, free_high) == pytest.approx((0.9, 1.1))
    assert free_low < low <= 1.0 <= high < free_high
    with pytest.raises(ValueError, match="one stratum per pair"):
        pair_bootstrap_interval(num, den, strata=[0, 1])


def test_unmatched_pairs_or_a_bad_level_are_refused() -> None:
    with pytest.raises(ValueError, match="same number"):
        pair_bootstrap_interval([[1.0]], [[1.0], [2.0]])
    with pytest.raises(ValueError, match="same number"):
        pair_bootstrap_interval([], [])
    with pytest.raises(ValueError, match="level"):
        pair_bootstrap_interval([[1.0]], [[1.0]], level=1.5)
