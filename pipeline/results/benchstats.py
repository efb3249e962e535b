"""The statistics of one benchmark run: steady state, percentiles with confidence intervals, drift,
and the rounding that keeps a reviewed figure from changing when the engine did not.

Latency samples of consecutive calls are not independent (a neighbour process, a frequency step,
a garbage collection touch a run of calls), so the intervals come from a moving-block bootstrap:
resamples are made of blocks of consecutive calls, not of single calls, which keeps that
correlation and gives honest (wider) intervals. Seeded: the same samples give the same intervals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipeline.results.reports import Drift, LatencyStats

if TYPE_CHECKING:
    import numpy as np

    from pipeline.results.manifest import LatencySummary  # the manifest's module reads this one

RESAMPLES = 400
QUANTILES = (0.50, 0.95, 0.99)
MIN_CI_SAMPLES = 20  # fewer calls than this: no interval (it would say nothing)


def _block_length(n: int) -> int:
    return max(1, round(n ** (1 / 3)))


def block_bootstrap(
    samples: Sequence[float] | np.ndarray, confidence: float, resamples: int = RESAMPLES, seed: int = 0
) -> dict[str, tuple[float, float]]:
    """Intervals of p50, p95, p99 and the mean: {"p50": (low, high), ..., "mean": (...)}."""
    import numpy as np

    a = np.asarray(samples, dtype=np.float64)
    n = len(a)
    if n < MIN_CI_SAMPLES:
        return {}
    length = _block_length(n)
    blocks = math.ceil(n / length)
    rng = np.random.default_rng(seed)
    stats = np.empty((resamples, len(QUANTILES) + 1), dtype=np.float64)
    offsets = np.arange(length)
    chunk = max(1, 4_000_000 // n)  # bounded memory for long runs
    for start in range(0, resamples, chunk):
        k = min(chunk, resamples - start)
        starts = rng.integers(0, n - length + 1, (k, blocks))
        idx = (starts[:, :, None] + offsets).reshape(k, -1)[:, :n]
        drawn = a[idx]
        stats[start : start + k, : len(QUANTILES)] = np.quantile(drawn, QUANTILES, axis=1).T
        stats[start : start + k, -1] = drawn.mean(axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail], axis=0)
    names = [f"p{round(q * 100)}" for q in QUANTILES] + ["mean"]
    return {name: (float(lo), float(hi)) for name, lo, hi in zip(names, low, high, strict=True)}


def latency_stats(samples_ms: Sequence[float], confidence: float = 0.95) -> LatencyStats:
    import numpy as np

    a = np.asarray(samples_ms, dtype=np.float64)
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    ci = block_bootstrap(a, confidence)
    return LatencyStats(
        iterations=len(a),
        mean_ms=float(a.mean()),
        std_ms=float(a.std()),
        min_ms=float(a.min()),
        p50_ms=float(p50),
        p95_ms=float(p95),
        p99_ms=float(p99),
        max_ms=float(a.max()),
        p50_ci_ms=ci.get("p50"),
        p95_ci_ms=ci.get("p95"),
        p99_ci_ms=ci.get("p99"),
        mean_ci_ms=ci.get("mean"),
    )


def settled(medians: Sequence[float], tolerance: float) -> bool:
    """The last three window medians lie within ``tolerance`` (a fraction) of each other."""
    if len(medians) < 3:
        return False
    last = medians[-3:]
    return min(last) > 0 and (max(last) - min(last)) / min(last) <= tolerance


def drift(samples_ms: Sequence[float], window: int, threshold: float) -> Drift | None:
    """The median of the last ``window`` steady calls against the first's; flagged beyond ``threshold``."""
    import numpy as np

    if len(samples_ms) < 2 * window:
        return None
    first = float(np.median(samples_ms[:window]))
    last = float(np.median(samples_ms[-window:]))
    ratio = last / first if first > 0 else float("inf")
    return Drift(
        first_p50_ms=first,
        last_p50_ms=last,
        ratio=ratio,
        threshold=threshold,
        flagged=abs(ratio - 1.0) > threshold,
        window=window,
    )


# --- figures the manifest can hold without churning ------------------------------------------------


def round_to_ci(value: float, ci: tuple[float, float] | None, digits: int = 4) -> float:
    """``value`` rounded to the decade of its interval's half-width (what the run can tell apart);
    ``digits`` significant digits where there is no interval."""
    if value == 0 or not math.isfinite(value):
        return value
    if ci is None or not (ci[1] > ci[0]):
        return float(f"{value:.{digits}g}")
    step = min(_step(ci), 10 ** math.floor(math.log10(abs(value))))  # one significant digit at least
    return round(round(value / step) * step, 12)


def _step(ci: tuple[float, float]) -> float:
    return 10 ** math.floor(math.log10((ci[1] - ci[0]) / 2))


def round_ci(ci: tuple[float, float] | None) -> tuple[float, float] | None:
    """An interval widened outward to the decade its own half-width supports."""
    if ci is None or not (ci[1] > ci[0]):
        return ci
    step = _step(ci)
    return (round(math.floor(ci[0] / step) * step, 12), round(math.ceil(ci[1] / step) * step, 12))


def same_figure(
    old: float, old_ci: tuple[float, float] | None, new: float, new_ci: tuple[float, float] | None, rel: float = 0.05
) -> bool:
    """Is ``new`` the same measurement as ``old``? Their intervals overlap; without intervals, the two
    values lie within ``rel`` of each other."""
    if old_ci is not None and new_ci is not None:
        return old_ci[0] <= new_ci[1] and new_ci[0] <= old_ci[1]
    scale = max(abs(old), abs(new))
    return scale == 0 or abs(old - new) / scale <= rel


E2E_SLACK = 0.05  # without intervals, end to end must be this fraction below engine-only to be flagged


def e2e_below_engine(engine: LatencyStats | LatencySummary, e2e: LatencyStats | LatencySummary) -> bool:
    """End to end includes the engine call, so an end-to-end p50 below the engine-only p50 is a
    measurement error (the two phases ran under different conditions), never a faster pipeline.
    Flagged where the two p50 intervals lie apart, or without intervals by more than E2E_SLACK."""
    if engine.p50_ci_ms is not None and e2e.p50_ci_ms is not None:
        return e2e.p50_ci_ms[1] < engine.p50_ci_ms[0]
    return e2e.p50_ms < engine.p50_ms * (1 - E2E_SLACK)
