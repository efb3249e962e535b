"""Exact tests behind the correctness gates: a gated fraction is a statistical claim about n samples.

Three figures are judged, each from counts, never from a bare fraction (docs/correctness.md):

- **agreement** (top-1 of class scores): k of n decisive rows agree with the reference. The gate
  fails when the data show, at the stated confidence, that the engine agrees less often than
  ``min_top1_agreement``: the exact one-sided (Clopper-Pearson) upper bound of the agreement rate
  is below it, i.e. P(X <= k | n, min) < 1 - confidence.
- **mismatch** (elements beyond atol + rtol * |r|): k of n elements. The gate fails when the exact
  lower bound of the mismatch rate is above ``max_mismatch`` (with ``max_mismatch`` 0 any element
  beyond fails).
- **metric drop** (task accuracy on labelled samples, engine and reference paired on the same
  samples): an exact one-sided McNemar test on the discordant pairs (``worse``: the reference was
  right and the engine wrong; ``better``: the other way round). The gate fails when the observed
  drop exceeds ``max_drop`` *and* McNemar says the engine is worse at the stated confidence.

A set too small to fail an engine that errs at twice the allowed rate cannot resolve its
threshold: ``min_rows_for_agreement`` and ``min_samples_for_drop`` name the smallest set that can.
scipy.special is imported on first use: the binomial tail is the regularized incomplete beta
function (``betainc``, Boost's ``ibeta``: the figures scipy.stats.binom gives, within 1e-9 relative
up to n = 10 million) and the Clopper-Pearson bounds its inverse, at a third of scipy.stats' import
(0.33 s of CPU against 1.0 s), which every command loading a registry with class-score outputs pays.
(``bdtr`` is not used: its cephes code is 3e-4 off at n = 6.5 million, p = 0.5.)
"""

from __future__ import annotations

import math
from functools import lru_cache

# An engine erring at this multiple of the allowed rate must be failed by the observed figures alone.
RESOLUTION = 2.0
_MAX_SET = 200_000


def _special():
    import scipy.special

    return scipy.special


def bounds(k: int, n: int, confidence: float) -> tuple[float, float]:
    """Exact (Clopper-Pearson) one-sided bounds of a rate, each at ``confidence``: together the
    two-sided interval at 2 * confidence - 1 (quantiles of Beta(k, n - k + 1) and Beta(k + 1, n - k))."""
    if n <= 0:
        return 0.0, 1.0
    a = 1.0 - confidence
    low = 0.0 if k <= 0 else float(_special().betaincinv(k, n - k + 1, a))
    high = 1.0 if k >= n else float(_special().betaincinv(k + 1, n - k, confidence))
    return low, high


def p_at_most(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p): I_{1-p}(n - k, k + 1)."""
    return 0.0 if k < 0 else 1.0 if k >= n else float(_special().betainc(n - k, k + 1, 1.0 - p))


def p_at_least(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p): I_p(k, n - k + 1)."""
    return 1.0 if k <= 0 else 0.0 if k > n else float(_special().betainc(k, n - k + 1, p))


def _smallest_k_above(q: float, n: int, p: float) -> int:
    """The smallest k with P(X > k) <= q for X ~ Binomial(n, p) (the inverse survival function),
    by bisection: P(X > k) falls as k grows."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if p_at_least(mid + 1, n, p) <= q:
            hi = mid
        else:
            lo = mid + 1
    return lo


def agreement_fails(agree: int, n: int, minimum: float, confidence: float) -> bool:
    """Significantly below ``minimum`` (exact binomial, one-sided)."""
    return n > 0 and minimum > 0 and p_at_most(agree, n, minimum) < 1.0 - confidence


def mismatch_fails(beyond: int, n: int, maximum: float, confidence: float) -> bool:
    """Significantly above ``maximum`` (exact binomial, one-sided); with ``maximum`` 0 any element beyond."""
    if beyond <= 0 or n <= 0:
        return False
    return maximum <= 0 or p_at_least(beyond, n, maximum) < 1.0 - confidence


def max_mismatches(n: int, maximum: float, confidence: float) -> int:
    """The most elements of ``n`` that may be beyond without ``mismatch_fails``."""
    if n <= 0 or maximum <= 0:
        return 0
    k = _smallest_k_above(1.0 - confidence, n, maximum)
    while k > 0 and mismatch_fails(k, n, maximum, confidence):
        k -= 1
    while k < n and not mismatch_fails(k + 1, n, maximum, confidence):
        k += 1
    return k


def mcnemar_p(worse: int, better: int) -> float:
    """One-sided exact McNemar p-value for "the engine is worse than the reference": of the
    ``worse + better`` discordant pairs, at least ``worse`` went against the engine, under even odds."""
    m = worse + better
    return 1.0 if m == 0 else p_at_least(worse, m, 0.5)


def drop_interval(worse: int, better: int, n: int, confidence: float) -> tuple[float, float]:
    """Bounds of the accuracy drop (worse - better) / n, each one-sided at ``confidence``, conditional
    on the number of discordant pairs."""
    m = worse + better
    if n <= 0 or m == 0:
        return 0.0, 0.0
    lo, hi = bounds(worse, m, confidence)
    return m * (2 * lo - 1) / n, m * (2 * hi - 1) / n


def drop_fails(worse: int, better: int, n: int, max_drop: float, confidence: float) -> bool:
    """The observed drop exceeds ``max_drop`` and McNemar calls the engine worse."""
    return n > 0 and (worse - better) / n > max_drop + 1e-12 and mcnemar_p(worse, better) < 1.0 - confidence


@lru_cache(maxsize=256)
def min_rows_for_agreement(minimum: float, confidence: float) -> int:
    """The smallest n from which on an engine agreeing on a fraction 1 - RESOLUTION * (1 - minimum)
    of the rows always fails; 1 where any disagreement fails (minimum 1) or nothing is gated (0)."""
    import numpy as np

    if minimum <= 0 or minimum >= 1:
        return 1
    worst = 1.0 - RESOLUTION * (1.0 - minimum)
    if worst <= 0:
        return 1
    n = np.arange(1, _MAX_SET + 1)
    k = np.floor(n * worst + 1e-9)
    at_most = np.where(k >= n, 1.0, _special().betainc(np.maximum(n - k, 1), k + 1, 1.0 - minimum))  # P(X <= k)
    fails = at_most < 1.0 - confidence
    not_yet = np.flatnonzero(~fails)
    return 1 if not not_yet.size else int(not_yet[-1]) + 2


@lru_cache(maxsize=256)
def min_samples_for_drop(max_drop: float, confidence: float) -> int:
    """The smallest n in which a drop of RESOLUTION * max_drop with no compensating gains is significant."""
    need = 1
    while 0.5**need >= 1.0 - confidence:
        need += 1
    if max_drop <= 0:
        return need
    return max(need, math.floor((need - 1) / (RESOLUTION * max_drop)) + 1)


# the percentile bootstrap of a ratio over samples: seeded, so a gate recomputes the same bounds
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
_BOOTSTRAP_CELLS = 4_000_000  # indices drawn at once (memory: 8 bytes each)


def ratio_bounds(numerators, denominators, confidence: float) -> tuple[float, float] | None:
    """One-sided bounds, each at ``confidence``, of sum(numerators) / sum(denominators) over
    samples, by a percentile bootstrap that resamples whole samples (characters of one string, boxes
    of one image move together). None when the denominators sum to 0."""
    import numpy as np

    num, den = np.asarray(numerators, dtype=np.float64), np.asarray(denominators, dtype=np.float64)
    n = num.size
    if n == 0 or den.sum() <= 0:
        return None
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    chunk = max(1, _BOOTSTRAP_CELLS // n)
    values = []
    for start in range(0, BOOTSTRAP_RESAMPLES, chunk):
        idx = rng.integers(0, n, size=(min(chunk, BOOTSTRAP_RESAMPLES - start), n))
        d = den[idx].sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            values.append(np.where(d > 0, num[idx].sum(axis=1) / np.where(d > 0, d, 1.0), np.nan))
    ratios = np.concatenate(values)
    ratios = ratios[np.isfinite(ratios)]
    low, high = np.quantile(ratios, [1.0 - confidence, confidence])
    return float(low), float(high)


def units_for_rate(threshold: float, direction: str, confidence: float) -> int:
    """Units (samples, characters, boxes) a set needs to resolve a rate's threshold: as an agreement
    of ``threshold`` (min) or an error rate of ``threshold`` (max), judged as binomial units. A proxy
    for ratio statistics, whose units are not independent: it is a floor, not a guarantee."""
    return min_rows_for_agreement(threshold if direction == "min" else 1.0 - threshold, confidence)
