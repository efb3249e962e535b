"""Noise-aware latency comparison of two engines from their steady-state samples.

Two single numbers (p50 of each run) cannot say whether a difference is real: benchmark runs on
shared CI machines are noisy. The samples can. Two views are combined:

- a one-sided Mann-Whitney U test (normal approximation with tie and continuity correction):
  is the candidate stochastically slower than the baseline?
- a bootstrap interval of the ratio of medians (candidate / baseline): by how much, and how sure?

Outcome: ``regressed`` when the whole interval lies above ``1 + max_regression`` and the test
is significant; ``not_regressed`` when the whole interval lies at or below ``1 + max_regression``;
otherwise (or with too few samples) ``too_noisy`` to decide. numpy only (scipy may be absent).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from pipeline.results.reports import Result

if TYPE_CHECKING:
    import numpy as np

Outcome = Literal["regressed", "not_regressed", "too_noisy"]


class LatencyComparison(Result):
    outcome: Outcome
    reason: str
    n_candidate: int
    n_baseline: int
    median_candidate_ms: float | None
    median_baseline_ms: float | None
    ratio: float | None = Field(description="median(candidate) / median(baseline)")
    ci_low: float | None
    ci_high: float | None
    confidence: float
    p_value: float | None = Field(description="one-sided Mann-Whitney U: candidate slower than baseline")
    prob_slower: float | None = Field(description="P(candidate sample > baseline sample), ties count half")
    threshold: float = Field(description="largest ratio still accepted: 1 + max_regression")
    alpha: float


def rankdata(a: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties get the mean of their ranks."""
    import numpy as np

    order = np.argsort(a, kind="mergesort")
    ranks = np.empty(len(a), dtype=np.float64)
    sorted_a = a[order]
    # start of each run of equal values
    starts = np.flatnonzero(np.r_[True, sorted_a[1:] != sorted_a[:-1]])
    ends = np.r_[starts[1:], len(a)]
    mean_rank = (starts + ends + 1) / 2.0  # mean of 1-based ranks start+1 .. end
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def mann_whitney_greater(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """U statistic of ``x`` and the one-sided p-value of H1: x tends to be larger than y."""
    import numpy as np

    xa, ya = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n1, n2 = len(xa), len(ya)
    if n1 == 0 or n2 == 0:
        raise ValueError("both samples need at least one value")
    ranks = rankdata(np.concatenate([xa, ya]))
    u1 = float(ranks[:n1].sum() - n1 * (n1 + 1) / 2.0)
    n = n1 + n2
    _, counts = np.unique(np.concatenate([xa, ya]), return_counts=True)
    tie_term = float((counts**3 - counts).sum()) / (n * (n - 1)) if n > 1 else 0.0
    var = n1 * n2 / 12.0 * ((n + 1) - tie_term)
    if var <= 0:  # every value equal: no evidence either way
        return u1, 1.0
    z = (u1 - n1 * n2 / 2.0 - 0.5) / math.sqrt(var)
    return u1, 0.5 * math.erfc(z / math.sqrt(2.0))


def bootstrap_median_ratio(
    x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray, resamples: int, confidence: float, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of median(x) / median(y), resampling each side on its own."""
    return bootstrap_quantile_ratio(x, y, 0.5, resamples, confidence, seed)


def bootstrap_quantile_ratio(
    x: Sequence[float] | np.ndarray,
    y: Sequence[float] | np.ndarray,
    q: float,
    resamples: int,
    confidence: float,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of quantile_q(x) / quantile_q(y) (q 0.5: the medians),
    resampling each side on its own."""
    import numpy as np

    def stat(a: np.ndarray) -> np.ndarray:
        return np.median(a, axis=1) if q == 0.5 else np.quantile(a, q, axis=1)

    xa, ya = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    rng = np.random.default_rng(seed)
    ratios = np.empty(resamples, dtype=np.float64)
    block = max(1, 2_000_000 // max(len(xa), len(ya)))  # bounded memory for long sample lists
    for start in range(0, resamples, block):
        k = min(block, resamples - start)
        mx = stat(xa[rng.integers(0, len(xa), (k, len(xa)))])
        my = stat(ya[rng.integers(0, len(ya), (k, len(ya)))])
        ratios[start : start + k] = mx / my
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return float(low), float(high)


def compare_latency(
    candidate: Sequence[float],
    baseline: Sequence[float],
    max_regression: float = 0.05,
    alpha: float = 0.05,
    confidence: float = 0.95,
    resamples: int = 2000,
    min_samples: int = 30,
    seed: int = 0,
) -> LatencyComparison:
    """Is ``candidate`` (latency samples, ms) slower than ``baseline`` by more than ``max_regression``?"""
    import numpy as np

    c = np.asarray(candidate, dtype=np.float64)
    b = np.asarray(baseline, dtype=np.float64)
    threshold = 1.0 + max_regression
    common = dict(n_candidate=len(c), n_baseline=len(b), confidence=confidence, threshold=threshold, alpha=alpha)
    bad = [name for name, a in (("candidate", c), ("baseline", b)) if not np.all(np.isfinite(a)) or np.any(a <= 0)]
    if len(c) < min_samples or len(b) < min_samples or bad:
        why = (
            f"samples not positive and finite: {', '.join(bad)}"
            if bad
            else f"too few samples to decide ({len(c)} candidate, {len(b)} baseline; need {min_samples} each)"
        )
        return LatencyComparison(
            outcome="too_noisy",
            reason=why,
            median_candidate_ms=float(np.median(c)) if len(c) else None,
            median_baseline_ms=float(np.median(b)) if len(b) else None,
            ratio=None,
            ci_low=None,
            ci_high=None,
            p_value=None,
            prob_slower=None,
            **common,
        )
    med_c, med_b = float(np.median(c)), float(np.median(b))
    ratio = med_c / med_b
    u1, p = mann_whitney_greater(c, b)
    low, high = bootstrap_median_ratio(c, b, resamples, confidence, seed)
    numbers = (
        f"median {med_c:.4g} ms vs {med_b:.4g} ms (ratio {ratio:.3f}, {confidence:.0%} interval "
        f"{low:.3f}..{high:.3f}), Mann-Whitney p={p:.3g}"
    )
    if high <= threshold:
        outcome: Outcome = "not_regressed"
        reason = f"not slower than allowed ({threshold:.3f}): {numbers}"
    elif low > threshold and p < alpha:
        outcome = "regressed"
        reason = f"slower than allowed ({threshold:.3f}): {numbers}"
    else:
        outcome = "too_noisy"
        reason = f"too noisy to decide against {threshold:.3f}: {numbers}"
    return LatencyComparison(
        outcome=outcome,
        reason=reason,
        median_candidate_ms=med_c,
        median_baseline_ms=med_b,
        ratio=ratio,
        ci_low=low,
        ci_high=high,
        p_value=p,
        prob_slower=u1 / (len(c) * len(b)),
        **common,
    )


def read_latency_csv(text: str) -> list[float]:
    """The bench stage's latency.csv: ``iteration,latency_ms`` rows."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines or lines[0].split(",")[:2] != ["iteration", "latency_ms"]:
        raise ValueError("expected a header 'iteration,latency_ms'")
    return [float(line.split(",")[1]) for line in lines[1:]]
