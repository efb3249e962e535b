"""Sustained runs (pipeline/perf/sustained.py): when they stop and what they report, with an engine
that sleeps a chosen latency, scripted sensors and a recorded INA3221 tree as the meter.

The engine sleeps rather than spins: a sleeper wakes on time on a loaded host (other test runs),
where a spinning call's wall time doubles when it shares a core, and the trends would be noise."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pipeline.host.energy import Ina3221Meter, open_ina3221
from pipeline.perf.sustained import slope, sustained_run
from pipeline.project.config import SustainedSpec


class Engine:
    """A call that takes ``ms(seconds since creation)`` milliseconds."""

    def __init__(self, ms: Callable[[float], float]):
        self.ms, self.t0 = ms, time.perf_counter()

    def __call__(self) -> None:
        time.sleep(self.ms(time.perf_counter() - self.t0) / 1000)


def scripted(temperatures: Iterator[float | None], clocks: Iterator[float | None]):
    return lambda: (next(temperatures), next(clocks))


def spec(**kw: float) -> SustainedSpec:
    base = {
        "min_seconds": 0.1,
        "max_seconds": 2.0,
        "window_seconds": 0.04,
        "trend_windows": 4,
        "max_latency_slope": 0.05,
        "max_temperature_slope": 0.05,
    }
    return SustainedSpec(**{**base, **kw})


def test_a_latency_that_ramps_then_flattens_stops_flat_before_the_cap():
    engine = Engine(lambda t: 2.0 + 8.0 * min(1.0, t / 0.2))  # 2 ms -> 10 ms over 0.2 s, then flat
    seen: list[tuple[str, float]] = []
    result = sustained_run(
        engine,
        spec(),
        batch=2,
        sensors=scripted(itertools.repeat(45.0), itertools.repeat(2400.0)),
        progress=lambda label, fraction: seen.append((label, fraction)),
    )
    assert result.stopped == "flat", result.reason
    assert result.reason.startswith("flat after") and "limit ±5.00%" in result.reason
    assert result.judged_on == ["latency", "temperature"]
    assert result.latency_slope is not None and abs(result.latency_slope) < 0.05
    assert result.p50_ms == pytest.approx(10.0, rel=0.25)
    assert result.windows[0].p50_ms < 5.0  # the ramp was seen, and the run went on past it
    assert result.throttling.latency_drift_pct > 100
    assert result.throttling.clock_drop_pct == 0.0 and result.throttling.temperature_rise_c == 0.0
    assert result.equilibrium_windows == 4
    # samples per second of calls past the ramp's knee (>= 8 ms): at most 2 / 8 ms, and not ms per sample
    assert 0 < result.throughput_per_s <= 2 * 1000 / 8.0 and result.batch == 2
    assert seen and {label for label, _ in seen} == {"bench sustained"}
    assert all(0.0 <= fraction <= 1.0 for _, fraction in seen)
    assert result.energy is None


def test_a_rising_temperature_runs_to_the_cap():
    result = sustained_run(
        Engine(lambda t: 1.0),
        spec(max_seconds=0.4),
        batch=1,
        sensors=scripted(itertools.count(40.0), itertools.repeat(None)),  # +1 C every window
    )
    assert result.stopped == "cap", result.reason
    assert "did not flatten" in result.reason and "max_seconds (0.4 s)" in result.reason
    assert "temperature +1 C per window (limit 0.05)" in result.reason
    assert result.temperature_slope_c == pytest.approx(1.0)
    assert result.judged_on == ["latency", "temperature"]
    assert result.seconds >= 0.4
    assert result.throttling.temperature_rise_c is not None and result.throttling.temperature_rise_c > 5
    assert result.throttling.clock_drop_pct is None
    assert result.throttling.clock_reason is not None and "cpufreq" in result.throttling.clock_reason


def test_without_a_temperature_sensor_it_judges_latency_alone():
    result = sustained_run(
        Engine(lambda t: 1.0),
        spec(),
        batch=1,
        sensors=scripted(itertools.repeat(None), itertools.repeat(None)),
    )
    assert result.stopped == "flat", result.reason
    assert result.judged_on == ["latency"]
    assert "no temperature sensor: judged on latency alone" in result.reason
    assert result.temperature_slope_c is None and result.throttling.temperature_rise_c is None
    assert all(w.temperature_c is None for w in result.windows)


def test_a_clock_drop_is_measured_from_the_first_window_to_the_lowest():
    clocks = itertools.chain([3000.0, 2700.0, 2400.0], itertools.repeat(2550.0))
    result = sustained_run(Engine(lambda t: 1.0), spec(), batch=1, sensors=scripted(itertools.repeat(50.0), clocks))
    assert result.stopped == "flat", result.reason
    assert result.throttling.clock_drop_pct == pytest.approx(20.0)
    assert result.throttling.clock_reason is None


def test_the_deadline_stops_a_run_that_has_not_settled():
    result = sustained_run(
        Engine(lambda t: 1.0),
        spec(max_seconds=5.0),
        batch=1,
        sensors=scripted(itertools.count(40.0), itertools.repeat(None)),
        deadline=time.perf_counter() + 0.2,
    )
    assert result.stopped == "stopped", result.reason
    assert result.reason.startswith("the deadline came after")


def test_until_thermal_steady_false_runs_to_the_cap_though_flat():
    result = sustained_run(
        Engine(lambda t: 1.0),
        spec(max_seconds=0.3, until_thermal_steady=False),
        batch=1,
        sensors=scripted(itertools.repeat(45.0), itertools.repeat(None)),
    )
    assert result.stopped == "cap"
    assert result.reason.startswith("until_thermal_steady is false: ran at max_seconds")


def ina3221(root: Path) -> Ina3221Meter:
    folder = root / "sys/class/hwmon/hwmon2"
    folder.mkdir(parents=True)
    for name, text in {"name": "ina3221", "in1_label": "VDD_IN", "in1_input": "5000", "curr1_input": "1000"}.items():
        (folder / name).write_text(text + "\n")
    meter = open_ina3221(root, period=0.005)
    assert isinstance(meter, Ina3221Meter)
    return meter


def test_power_per_window_and_energy_over_the_equilibrium(tmp_path):
    meter = ina3221(tmp_path)
    try:
        result = sustained_run(
            Engine(lambda t: 1.0),
            spec(min_seconds=0.3),  # more windows than the equilibrium's 4
            batch=4,
            sensors=scripted(itertools.repeat(45.0), itertools.repeat(None)),
            meter=meter,
        )
    finally:
        meter.close()
    assert result.stopped == "flat", result.reason
    assert all(w.power_w == pytest.approx(5.0) for w in result.windows)  # 5 V * 1 A held
    energy = result.energy
    assert energy is not None and energy.available, energy
    assert energy.source == "ina3221" and energy.summed == ["VDD_IN"]
    assert energy.mean_power_w == pytest.approx(5.0)
    assert energy.inferences == sum(w.calls for w in result.windows[-4:]) * 4
    assert energy.joules_per_inference == pytest.approx(energy.joules / energy.inferences)
    assert energy.phase == "sustained equilibrium (last 4 windows)"
    # the equilibrium windows only, not the whole run
    assert energy.window_seconds < result.seconds


def test_slope():
    assert slope([1.0, 2.0, 3.0, 4.0]) == pytest.approx(1.0)
    assert slope([5.0, 5.0, 5.0]) == 0.0
    assert slope([3.0, 1.0, 2.0]) == pytest.approx(-0.5)
    assert slope([7.0]) == 0.0
