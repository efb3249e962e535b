"""Sustained runs: call an engine in windows until it reaches thermal equilibrium.

A benchmark that stops once its latency is steady measures a cool device; a fanless box or a Jetson
throttles minutes later. ``sustained_run`` keeps calling, and after each window records its latency,
the hottest temperature, the lowest CPU clock and (with a meter) the power. It stops once, after
``min_seconds``, the least-squares trends of the last ``trend_windows`` windows are flat: the p50
changes less than ``max_latency_slope`` of its mean per window (either way: a falling latency is not
settled either), and the temperature rises less than ``max_temperature_slope`` degrees per window.
Without a temperature sensor it judges the latency alone and says so. Otherwise it stops at
``max_seconds`` (the cap) or at the caller's deadline, and the reason gives the slopes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pipeline.core.progress import Progress
from pipeline.host.energy import EnergyMeter, joules_between
from pipeline.host.probe import cpu_mhz_lowest, device_state
from pipeline.results.power import EnergyResult, SustainedResult, SustainedStop, SustainedWindow, Throttling

if TYPE_CHECKING:
    from pipeline.project.config import SustainedSpec

Sensors = Callable[[], tuple[float | None, float | None]]  # (hottest temperature C, lowest CPU MHz)


def host_sensors() -> tuple[float | None, float | None]:
    """This host's hottest thermal zone (C) and lowest current CPU clock (MHz); None where unreadable."""
    temperatures = device_state()["temperatures_c"]
    return (max(temperatures.values()) if temperatures else None), cpu_mhz_lowest()


def slope(values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` against their index (change per window)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    return num / sum((i - mean_x) ** 2 for i in range(n))


def _percentiles(samples: Sequence[float]) -> tuple[float, float]:
    import numpy as np

    p50, p99 = np.percentile(np.asarray(samples, dtype=np.float64), [50, 99])
    return float(p50), float(p99)


class _Trend:
    """The flatness of the last windows: slopes, what they were judged on, and a sentence."""

    def __init__(self, windows: Sequence[SustainedWindow], spec: SustainedSpec):
        p50 = [w.p50_ms for w in windows]
        temps = [w.temperature_c for w in windows]
        self.latency = slope(p50) / (sum(p50) / len(p50)) if len(p50) > 1 else None
        known = [t for t in temps if t is not None]
        self.temperature = slope(known) if len(known) == len(temps) and len(known) > 1 else None
        self.judged_on = ["latency", "temperature"] if self.temperature is not None else ["latency"]
        self.flat = (
            len(windows) >= spec.trend_windows
            and self.latency is not None
            and abs(self.latency) < spec.max_latency_slope
            and (self.temperature is None or self.temperature < spec.max_temperature_slope)
        )
        parts = [
            f"p50 {self.latency:+.2%} per window (limit ±{spec.max_latency_slope:.2%})"
            if self.latency is not None
            else "too few windows for a latency trend"
        ]
        if self.temperature is not None:
            parts.append(f"temperature {self.temperature:+.3g} C per window (limit {spec.max_temperature_slope:g})")
        elif not known:
            parts.append("no temperature sensor: judged on latency alone")
        else:
            parts.append("temperature not read in every window: judged on latency alone")
        self.text = f"over the last {len(windows)} windows " + ", ".join(parts)


def _throttling(windows: Sequence[SustainedWindow], eq: Sequence[SustainedWindow], p50: float) -> Throttling:
    first, later = windows[0], windows[1:]
    clocks = [w.cpu_mhz for w in later if w.cpu_mhz is not None]
    drop: float | None = None
    why: str | None = None
    if first.cpu_mhz is None or not first.cpu_mhz:
        why = "no CPU clock readable (cpufreq scaling_cur_freq not exposed)"
    elif not clocks:
        why = "one window only, or no later clock reading: nothing to compare"
    else:
        drop = (first.cpu_mhz - min(clocks)) / first.cpu_mhz * 100
    eq_temps = [w.temperature_c for w in eq if w.temperature_c is not None]
    rise = sum(eq_temps) / len(eq_temps) - first.temperature_c if first.temperature_c is not None and eq_temps else None
    return Throttling(
        clock_drop_pct=drop,
        clock_reason=why,
        latency_drift_pct=(p50 - first.p50_ms) / first.p50_ms * 100 if first.p50_ms > 0 else 0.0,
        temperature_rise_c=rise,
    )


def _window(fn: Callable[[], object], until: float) -> tuple[list[float], float]:
    """Call ``fn`` until ``until`` (a ``time.perf_counter()`` time), at least once even past it (a
    window is never empty): the ms per call and when the last call ended."""
    samples: list[float] = []
    while True:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        samples.append((t1 - t0) * 1000.0)
        if t1 >= until:
            return samples, t1


def _stop(
    spec: SustainedSpec, trend: _Trend, elapsed: float, windows: int, past_deadline: bool
) -> tuple[SustainedStop | None, str]:
    """Whether the run stops after this window, and why: flat trends, the cap, the deadline."""
    if spec.until_thermal_steady and elapsed >= spec.min_seconds and trend.flat:
        return "flat", f"flat after {elapsed:.3g} s ({windows} windows): {trend.text}"
    if elapsed >= spec.max_seconds:
        why = (
            "until_thermal_steady is false: ran"
            if not spec.until_thermal_steady
            else "the trends did not flatten: stopped"
        )
        return "cap", f"{why} at max_seconds ({spec.max_seconds:g} s): {trend.text}"
    if past_deadline:
        return "stopped", f"the deadline came after {elapsed:.3g} s, before a verdict: {trend.text}"
    return None, ""


def sustained_run(
    fn: Callable[[], object],
    spec: SustainedSpec,
    batch: int,
    *,
    progress: Progress | None = None,
    sensors: Sensors | None = None,
    meter: EnergyMeter | None = None,
    deadline: float | None = None,
) -> SustainedResult:
    """Call ``fn`` (one call infers ``batch`` samples) in windows of ``spec.window_seconds`` until the
    trends flatten, ``spec.max_seconds`` or ``deadline`` (a ``time.perf_counter()`` time).

    ``sensors`` gives (hottest temperature C, lowest CPU MHz) after each window (default: this
    host's). ``meter`` is started here and read after each window (power per window, energy over
    the equilibrium windows); the caller closes it. The equilibrium figures are those of the last
    ``trend_windows`` windows (fewer where the run stopped earlier).
    """
    read_sensors = sensors or host_sensors
    clock = time.perf_counter
    k = spec.trend_windows
    windows: list[SustainedWindow] = []
    recent: deque[tuple[list[float], float]] = deque(maxlen=k)  # (ms per call, window seconds)
    marks: deque[tuple[dict[str, float], float]] = deque(maxlen=k + 1)  # meter reads at window ends
    if meter is not None:
        meter.start()
        marks.append(({}, 0.0))
    start = clock()
    end_at = start + spec.max_seconds if deadline is None else min(start + spec.max_seconds, deadline)
    while True:
        w0 = clock()
        samples, t1 = _window(fn, min(w0 + spec.window_seconds, end_at))
        temperature, mhz = read_sensors()
        power: float | None = None
        if meter is not None:
            joules, t_read = meter.read()
            before, t_before = marks[-1]
            gained = meter.total(joules)[0] - meter.total(before)[0]
            power = gained / (t_read - t_before) if gained > 0 and t_read > t_before else None
            marks.append((joules, t_read))
        p50, p99 = _percentiles(samples)
        now = clock()
        windows.append(
            SustainedWindow(
                t_s=round(now - start, 4),
                calls=len(samples),
                p50_ms=p50,
                p99_ms=p99,
                temperature_c=temperature,
                cpu_mhz=mhz,
                power_w=power,
            )
        )
        recent.append((samples, t1 - w0))
        elapsed = now - start
        trend = _Trend(windows[-k:], spec)
        stopped, reason = _stop(spec, trend, elapsed, len(windows), deadline is not None and now >= deadline)
        if stopped is not None:
            break
        if progress is not None:
            progress("bench sustained", min(1.0, elapsed / spec.max_seconds))

    eq = windows[-len(recent) :]
    pooled = [x for s, _ in recent for x in s]
    eq_p50, eq_p99 = _percentiles(pooled)
    calls = sum(len(s) for s, _ in recent)
    busy = sum(seconds for _, seconds in recent)
    energy: EnergyResult | None = None
    if meter is not None:
        (before, t_before), (after, t_after) = marks[0], marks[-1]
        energy = meter.result(
            joules_between(before, after),
            t_after - t_before,
            calls * batch,
            f"sustained equilibrium (last {len(eq)} windows)",
        )
    return SustainedResult(
        seconds=round(elapsed, 4),
        batch=batch,
        windows=windows,
        stopped=stopped,
        reason=reason,
        judged_on=trend.judged_on,
        latency_slope=trend.latency,
        temperature_slope_c=trend.temperature,
        equilibrium_windows=len(eq),
        p50_ms=eq_p50,
        p99_ms=eq_p99,
        throughput_per_s=calls * batch / busy if busy > 0 else 0.0,
        throttling=_throttling(windows, eq, eq_p50),
        energy=energy,
    )
