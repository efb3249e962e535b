"""Typed results of energy measurement and of sustained (thermal-equilibrium) runs.

An energy figure is either measured or absent with the reason: a host without a readable meter
gives ``available: false`` and ``reason: "unavailable: ..."``, never 0 J, so a report cannot
mistake "not measured" for "free".
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from pipeline.results.base import Result

EnergySource = Literal["rapl", "nvml", "ina3221"]
ENERGY_SOURCES: tuple[EnergySource, ...] = get_args(EnergySource)
SustainedStop = Literal["flat", "cap", "stopped"]
UNAVAILABLE = "unavailable: "


class EnergyResult(Result):
    """Energy over one measured window.

    ``joules`` sums only domains that do not contain one another, named in ``summed``:
    RAPL: the ``package-*`` zones (cores, caches, memory controller, integrated GPU of a socket;
    their ``core``/``uncore`` subzones are parts of them, so not added again) plus ``dram`` zones
    (the DIMMs, outside the package); ``psys`` (the whole platform, package included) only where
    there is no package zone. NVML: every GPU board (separate devices). INA3221: the module's input
    rail (``VDD_IN``, ``POM_5V_IN``), which feeds the others, or the sum of the rails where a board
    has no input rail.
    """

    available: bool = Field(description="a figure was measured; false: see reason")
    reason: str | None = Field(None, description='"unavailable: <why>" when not available')
    source: EnergySource | None = Field(None, description="the meter: rapl, nvml or ina3221")
    domains: dict[str, float] = Field(
        default_factory=dict, description="joules per RAPL zone, GPU or power rail over the window"
    )
    summed: list[str] = Field(
        default_factory=list, description="the domains added into joules (the others are parts of them)"
    )
    joules: float | None = Field(None, description="total over the window, of the summed domains")
    joules_per_inference: float | None = Field(None, description="joules / inferences (one sample of a batch)")
    mean_power_w: float | None = Field(None, description="joules / window_seconds")
    window_seconds: float = Field(0.0, description="length of the measured window")
    inferences: int = Field(0, description="samples inferred in the window (calls times batch)")
    phase: str = Field(description='what was running, e.g. "engine-only steady state"')
    sampling: str | None = Field(
        None, description="for rails without an energy counter: the sampling period and how power was integrated"
    )
    idle_power_w: float | None = Field(
        None,
        description="mean power of the same domains just before, the engine loaded and not called (the host's "
        "floor: other processes, idle cores)",
    )
    above_idle_joules_per_inference: float | None = Field(
        None,
        description="(joules - idle_power_w * window_seconds) / inferences: what the inferences added; noisy, "
        "and at or below 0 where the engine's draw is within the host's idle variation",
    )


class SustainedWindow(Result):
    """One point of a sustained run's trend."""

    t_s: float = Field(description="seconds from the run's start to the window's end")
    calls: int = Field(description="calls in the window")
    p50_ms: float
    p99_ms: float
    temperature_c: float | None = Field(None, description="hottest thermal zone at the window's end")
    cpu_mhz: float | None = Field(None, description="lowest CPU clock at the window's end")
    power_w: float | None = Field(None, description="mean power over the window, where a meter was read")


class Throttling(Result):
    """How the device changed from the first window to the equilibrium."""

    clock_drop_pct: float | None = Field(
        None, description="first window's CPU clock vs the lowest later one (percent); None: no clock readable"
    )
    clock_reason: str | None = Field(None, description="why clock_drop_pct is None")
    latency_drift_pct: float = Field(description="equilibrium p50 vs the first window's p50 (percent)")
    temperature_rise_c: float | None = Field(
        None, description="mean temperature of the equilibrium windows minus the first window's; None: no sensor"
    )


class SustainedResult(Result):
    """A run in windows until the latency and temperature trends flatten, or the cap, or the deadline."""

    seconds: float = Field(description="length of the run")
    batch: int = Field(description="samples per call")
    windows: list[SustainedWindow]
    stopped: SustainedStop = Field(
        description="flat: trends flat after min_seconds; cap: max_seconds reached; stopped: the deadline"
    )
    reason: str = Field(description="why it stopped, with the slopes")
    judged_on: list[str] = Field(description='what flatness was judged on: ["latency", "temperature"] or ["latency"]')
    latency_slope: float | None = Field(
        None, description="last trend_windows windows: least-squares p50 slope per window, as a fraction of their mean"
    )
    temperature_slope_c: float | None = Field(
        None, description="last trend_windows windows: least-squares temperature slope, degrees C per window"
    )
    equilibrium_windows: int = Field(description="windows the equilibrium figures are taken over")
    p50_ms: float = Field(description="equilibrium: p50 of the calls of the last trend_windows windows")
    p99_ms: float = Field(description="equilibrium: p99 of the calls of the last trend_windows windows")
    throughput_per_s: float = Field(description="equilibrium: samples per second over those windows")
    throttling: Throttling
    energy: EnergyResult | None = Field(None, description="over the equilibrium windows; None: no meter was given")
