"""The latency comparison of the performance gate: rank test, bootstrap interval, the three outcomes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.results.latency import (
    bootstrap_median_ratio,
    compare_latency,
    mann_whitney_greater,
    rankdata,
    read_latency_csv,
)


def test_ranks_average_ties():
    assert rankdata(np.array([10.0, 20.0, 10.0, 30.0, 20.0])).tolist() == [1.5, 3.5, 1.5, 5.0, 3.5]


def test_mann_whitney_by_hand():
    # x all above y: U = n1 * n2 = 6; z = (6 - 3 - 0.5) / sqrt(2 * 3 * 6 / 12) = 2.5 / sqrt(3)
    u, p = mann_whitney_greater([3.0, 4.0, 5.0], [1.0, 2.0])
    assert u == 6.0
    assert p == pytest.approx(0.5 * math.erfc(2.5 / math.sqrt(3) / math.sqrt(2)))
    u, p = mann_whitney_greater([1.0, 2.0], [3.0, 4.0, 5.0])
    assert u == 0.0 and p > 0.9
    assert mann_whitney_greater([1.0, 1.0], [1.0, 1.0]) == (2.0, 1.0)  # all equal: no evidence


def test_mann_whitney_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats", reason="scipy cross-check (the implementation itself needs only numpy)")
    rng = np.random.default_rng(3)
    for n1, n2, shift in ((12, 40, 0.0), (200, 150, 0.03), (60, 60, 0.5)):
        x = np.round(rng.lognormal(shift, 0.2, n1), 2)  # rounded: many ties
        y = np.round(rng.lognormal(0.0, 0.2, n2), 2)
        u, p = mann_whitney_greater(x, y)
        ref = stats.mannwhitneyu(x, y, alternative="greater", method="asymptotic", use_continuity=True)
        assert u == pytest.approx(ref.statistic) and p == pytest.approx(ref.pvalue, rel=1e-9, abs=1e-300)
        assert rankdata(x).tolist() == pytest.approx(stats.rankdata(x).tolist())


def test_bootstrap_interval_covers_the_ratio_and_is_reproducible():
    rng = np.random.default_rng(5)
    base = rng.lognormal(np.log(1.0), 0.1, 300)
    cand = rng.lognormal(np.log(1.2), 0.1, 300)
    low, high = bootstrap_median_ratio(cand, base, 1000, 0.95, seed=1)
    assert low < np.median(cand) / np.median(base) < high
    assert 1.1 < low < 1.2 < high < 1.3
    assert (low, high) == bootstrap_median_ratio(cand, base, 1000, 0.95, seed=1)
    wide = bootstrap_median_ratio(cand, base, 1000, 0.99, seed=1)
    assert wide[0] <= low and wide[1] >= high


def samples(median: float, sigma: float, n: int = 200, seed: int = 0) -> np.ndarray:
    z = np.random.default_rng(seed).normal(0.0, sigma, n)
    return median * np.exp(z - np.median(z))


@pytest.mark.parametrize(
    "candidate, outcome",
    [
        (samples(0.100, 0.05, seed=1), "not_regressed"),  # same engine, another run
        (samples(0.090, 0.05, seed=1), "not_regressed"),  # faster
        (samples(0.103, 0.05, seed=1), "not_regressed"),  # 3% slower: within the 5% allowed
        (samples(0.150, 0.05, seed=1), "regressed"),  # 50% slower, tight
        (samples(0.107, 1.00, seed=1), "too_noisy"),  # median 7% slower, spread too wide to say
        (samples(0.150, 0.05, n=10, seed=1), "too_noisy"),  # too few samples
    ],
)
def test_outcomes(candidate, outcome):
    base = samples(0.100, 0.05, seed=0)
    result = compare_latency(candidate, base, max_regression=0.05, min_samples=30)
    assert result.outcome == outcome, result.reason
    assert result.threshold == pytest.approx(1.05)
    if result.ratio is not None:
        assert result.ci_low <= result.ratio <= result.ci_high
        assert f"{result.ratio:.3f}" in result.reason and "Mann-Whitney" in result.reason


def test_slower_but_within_the_allowance_is_not_a_regression_even_when_significant():
    base = samples(0.100, 0.01, n=2000, seed=0)
    cand = samples(0.102, 0.01, n=2000, seed=1)
    result = compare_latency(cand, base, max_regression=0.05)
    assert result.p_value < 1e-6 and result.outcome == "not_regressed"


def test_bad_samples_are_not_compared():
    base = samples(0.1, 0.05)
    bad = base.copy()
    bad[3] = float("nan")
    result = compare_latency(bad, base)
    assert result.outcome == "too_noisy" and "candidate" in result.reason and result.ratio is None


def test_latency_csv():
    assert read_latency_csv("iteration,latency_ms\n0,0.1000\n1,0.2500\n") == [0.1, 0.25]
    with pytest.raises(ValueError, match="header"):
        read_latency_csv("0,0.1\n")
