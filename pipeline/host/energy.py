"""Energy meters this host exposes: RAPL (powercap sysfs), NVML (NVIDIA GPUs), INA3221 (Jetson rails).

``open_meter`` tries them in that order and gives the first that reads, or one "unavailable: ..."
sentence naming why each is absent, so a report says what to do instead of showing 0 J.

- RAPL: ``/sys/class/powercap/intel-rapl:N`` (and ``:N:M`` subzones; AMD hosts expose the same
  names), ``energy_uj`` counters that wrap at ``max_energy_range_uj``. A wrap is seen as a counter
  that went down; one wrap between two reads is handled, so read at least once per wrap period
  (minutes at full power; ``sustained_run`` reads every window).
- NVML: ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since the driver loaded, Volta and newer).
- INA3221: power rails without an energy counter; a thread samples them every ``period`` and
  integrates (trapezoid), which the result states in ``sampling``.

``root`` lets tests point the sysfs readers at a recorded tree. Nothing here raises for a missing
or unreadable meter: that is a reason, not an error.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from pipeline.results.power import ENERGY_SOURCES, UNAVAILABLE, EnergyResult, EnergySource

log = logging.getLogger(__name__)

POWERCAP = "sys/class/powercap"
HWMON = "sys/class/hwmon"
INA3221X = "sys/bus/i2c/drivers/ina3221x"
# a Jetson module's input rail: it feeds the others, so it alone is the module's energy
INPUT_RAILS = ("VDD_IN", "POM_5V_IN")
SAMPLE_PERIOD_S = 0.01
MAX_MISSED_SAMPLES = 20
DEAD_COUNTER_S = 1.0  # a counter still at zero after this long is dead, not slow
RAPL_PERMISSION_FIX = (
    "energy_uj is readable by root only since Linux 5.10 (CVE-2020-8694); as root run "
    "`chmod o+r /sys/class/powercap/intel-rapl:*/energy_uj` (until reboot) or add a udev rule "
    '(SUBSYSTEM=="powercap", ACTION=="add", RUN+="/bin/chmod o+r /sys%p/energy_uj")'
)


def unavailable(reason: str, phase: str, *, window_seconds: float = 0.0, inferences: int = 0) -> EnergyResult:
    """No figure, with the reason (always starting ``unavailable: ``)."""
    text = reason if reason.startswith(UNAVAILABLE) else UNAVAILABLE + reason
    return EnergyResult(available=False, reason=text, window_seconds=window_seconds, inferences=inferences, phase=phase)


class EnergyMeter(ABC):
    """One host meter: ``start()`` zeroes it, ``read()`` gives joules per domain since then,
    ``stop()`` the result over the window. A context manager: ``with`` starts it and closes it."""

    source: EnergySource

    def __init__(self) -> None:
        self._t0: float | None = None
        self._error: str | None = None

    # --- what a source implements -----------------------------------------------------------------
    @abstractmethod
    def _zero(self) -> float:
        """Take the starting readings; the time (perf_counter) they stand for."""

    @abstractmethod
    def _joules(self) -> tuple[dict[str, float], float]:
        """Joules per domain since ``_zero``, and the time they stand for."""

    @property
    def sampling(self) -> str | None:
        """How power was sampled, for meters without an energy counter."""
        return None

    def total(self, domains: dict[str, float]) -> tuple[float, list[str]]:
        """The total of ``domains`` and the names summed into it (no domain that contains another)."""
        return sum(domains.values()), sorted(domains)

    # --- the contract ---------------------------------------------------------------------------
    def start(self) -> None:
        self._error = None
        try:
            self._t0 = self._zero()
        except OSError as exc:
            self._error = f"reading the {self.source} meter failed: {exc}"
            self._t0 = time.perf_counter()

    def read(self) -> tuple[dict[str, float], float]:
        """(joules per domain since ``start()``, seconds since ``start()``). A failed read is kept
        and reported by ``result`` as unavailable; the joules are then empty."""
        if self._t0 is None:
            raise RuntimeError("EnergyMeter.read() before start()")
        if self._error is None:
            try:
                joules, t = self._joules()
                return joules, t - self._t0
            except OSError as exc:
                self._error = f"reading the {self.source} meter failed: {exc}"
        return {}, time.perf_counter() - self._t0

    def stop(self, inferences: int, phase: str) -> EnergyResult:
        """The result from ``start()`` to now."""
        joules, seconds = self.read()
        return self.result(joules, seconds, inferences, phase)

    def result(self, domains: dict[str, float], seconds: float, inferences: int, phase: str) -> EnergyResult:
        """The result of ``domains`` joules over ``seconds`` (a difference of two ``read()``s)."""
        if self._error is not None:
            return unavailable(self._error, phase, window_seconds=seconds, inferences=inferences)
        total, summed = self.total(domains)
        if not domains or total <= 0:
            why = (
                f"{self.source} counter did not advance over {seconds:.3g} s (a dead counter: some VMs expose "
                "zones that never move)"
                if seconds > DEAD_COUNTER_S
                else f"{self.source} counter did not advance over {seconds:.3g} s (shorter than its update interval)"
            )
            return unavailable(why, phase, window_seconds=seconds, inferences=inferences)
        return EnergyResult(
            available=True,
            source=self.source,
            domains={k: round(v, 6) for k, v in sorted(domains.items())},
            summed=summed,
            joules=total,
            joules_per_inference=total / inferences if inferences > 0 else None,
            mean_power_w=total / seconds if seconds > 0 else None,
            window_seconds=seconds,
            inferences=inferences,
            phase=phase,
            sampling=self.sampling,
        )

    def close(self) -> None:  # noqa: B027 (a counter read from sysfs holds nothing to release)
        """Release the meter (a sampling thread, an NVML session)."""

    def __enter__(self) -> EnergyMeter:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# --- RAPL ------------------------------------------------------------------------------------------


@dataclass
class _Zone:
    key: str  # "package-0", "package-0/core", "psys"
    name: str  # the zone's own name file
    top: bool
    energy: Path
    wrap_uj: int
    last_uj: int = 0
    acc_uj: int = 0


_RAPL_ID = re.compile(r"^intel-rapl:(\d+)(?::(\d+))?$")


class RaplMeter(EnergyMeter):
    source: EnergySource = "rapl"

    def __init__(self, zones: list[_Zone]):
        super().__init__()
        self.zones = zones

    def _zero(self) -> float:
        for z in self.zones:
            z.last_uj, z.acc_uj = int(z.energy.read_text()), 0
        return time.perf_counter()

    def _joules(self) -> tuple[dict[str, float], float]:
        for z in self.zones:
            now = int(z.energy.read_text())
            step = now - z.last_uj
            z.acc_uj += step + z.wrap_uj if step < 0 else step
            z.last_uj = now
        return {z.key: z.acc_uj / 1e6 for z in self.zones}, time.perf_counter()

    def total(self, domains: dict[str, float]) -> tuple[float, list[str]]:
        tops = {z.key: z for z in self.zones if z.top and z.key in domains}
        summed = [k for k, z in tops.items() if z.name.startswith("package")]
        if not summed:  # psys contains the package: only where there is none
            summed = [k for k, z in tops.items() if z.name == "psys"] or [k for k in tops if k != "psys"]
        summed += [z.key for z in self.zones if z.name == "dram" and z.key in domains]
        return sum(domains[k] for k in summed), sorted(summed)


def open_rapl(root: Path = Path("/")) -> RaplMeter | str:
    """The RAPL zones of ``root``'s powercap tree, or why there are none readable."""
    base = root / POWERCAP
    if not base.is_dir():
        return f"rapl: no /{POWERCAP} (not Linux, or no powercap driver: intel_rapl_msr / amd energy)"
    found: list[tuple[tuple[int, int], Path]] = []
    for entry in base.iterdir():
        m = _RAPL_ID.match(entry.name)
        if m:
            found.append(((int(m.group(1)), int(m.group(2) or -1)), entry))
    if not found:
        return f"rapl: /{POWERCAP} has no intel-rapl zones (this CPU or VM exposes no RAPL)"
    names: dict[int, str] = {}
    zones: list[_Zone] = []
    denied: list[str] = []
    problems: list[str] = []
    for (top, sub), path in sorted(found):
        try:
            name = (path / "name").read_text().strip()
            wrap = int((path / "max_energy_range_uj").read_text())
            int((path / "energy_uj").read_text())
        except PermissionError:
            denied.append(path.name)
            continue
        except (OSError, ValueError) as exc:
            problems.append(f"{path.name}: {exc}")
            continue
        if sub < 0:
            names[top] = name
        key = name if sub < 0 else f"{names.get(top, f'intel-rapl:{top}')}/{name}"
        zones.append(_Zone(key=key, name=name, top=sub < 0, energy=path / "energy_uj", wrap_uj=wrap))
    if zones:
        if denied or problems:
            log.warning("RAPL zones skipped: %s", ", ".join(denied + problems))
        return RaplMeter(zones)
    if denied:
        return f"rapl: {', '.join(denied)}: {RAPL_PERMISSION_FIX}"
    return f"rapl: no readable zone ({'; '.join(problems)})"


# --- NVML ------------------------------------------------------------------------------------------


class NvmlMeter(EnergyMeter):
    source: EnergySource = "nvml"

    def __init__(self, nvml: Any, handles: dict[str, Any]):
        super().__init__()
        self._nvml, self._handles = nvml, handles
        self._start_mj: dict[str, int] = {}

    def _mj(self) -> dict[str, int]:
        try:
            return {k: int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h)) for k, h in self._handles.items()}
        except self._nvml.NVMLError as exc:
            raise OSError(f"nvmlDeviceGetTotalEnergyConsumption: {exc}") from exc

    def _zero(self) -> float:
        self._start_mj = self._mj()
        return time.perf_counter()

    def _joules(self) -> tuple[dict[str, float], float]:
        now = self._mj()
        return {k: (v - self._start_mj[k]) / 1000 for k, v in now.items()}, time.perf_counter()

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            log.debug("nvmlShutdown: %s", exc)


def open_nvml() -> NvmlMeter | str:
    """Every NVIDIA GPU's energy counter, or why NVML gives none (package, driver, GPU too old)."""
    try:
        import pynvml
    except ImportError:
        return "nvml: the Python package nvidia-ml-py (module pynvml) is not installed: pip install nvidia-ml-py"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"nvml: the NVIDIA driver's NVML library did not load ({exc}): no NVIDIA driver on this host"
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles: dict[str, Any] = {}
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            except pynvml.NVMLError as exc:
                name = pynvml.nvmlDeviceGetName(handle)
                pynvml.nvmlShutdown()
                return f"nvml: GPU {i} ({name}) has no energy counter ({exc}; needs Volta or newer)"
            handles[f"gpu{i}"] = handle
    except pynvml.NVMLError as exc:
        pynvml.nvmlShutdown()
        return f"nvml: {exc}"
    if not handles:
        pynvml.nvmlShutdown()
        return "nvml: the driver reports no NVIDIA GPU"
    return NvmlMeter(pynvml, handles)


# --- INA3221 ---------------------------------------------------------------------------------------

Reader = Callable[[], float]  # one rail's power now, in watts


def _hwmon_rail(folder: Path, n: int) -> Reader:
    volts, amps = folder / f"in{n}_input", folder / f"curr{n}_input"
    return lambda: int(volts.read_text()) * int(amps.read_text()) / 1e6  # mV * mA -> W


def _iio_rail(folder: Path, n: int) -> Reader:
    power = folder / f"in_power{n}_input"
    return lambda: int(power.read_text()) / 1e3  # mW -> W


def _ina3221_rails(root: Path) -> dict[str, Reader]:
    """Rail label -> reader, from the hwmon driver (L4T 32.5+/mainline) and the older ina3221x iio one."""
    rails: dict[str, Reader] = {}

    def add(label: str, where: str, reader: Reader) -> None:
        rails[label if label not in rails else f"{label}@{where}"] = reader

    for folder in sorted((root / HWMON).glob("hwmon*")):
        if _text(folder / "name") != "ina3221":
            continue
        for label_file in sorted(folder.glob("in[1-3]_label")):
            n = int(label_file.name[2])
            label = _text(label_file)
            # unconnected channels are labelled NC (Orin); a disabled one reads enable 0
            if not label or label == "NC" or _text(folder / f"in{n}_enable") == "0":
                continue
            if (folder / f"in{n}_input").exists() and (folder / f"curr{n}_input").exists():
                add(label, folder.name, _hwmon_rail(folder, n))
    for folder in sorted((root / INA3221X).glob("*/iio:device*")):
        for name_file in sorted(folder.glob("rail_name_*")):
            n = int(name_file.name.rsplit("_", 1)[1])
            label = _text(name_file)
            if label and (folder / f"in_power{n}_input").exists():
                add(label, folder.parent.name, _iio_rail(folder, n))
    return rails


def _text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


class Ina3221Meter(EnergyMeter):
    """Rails sampled by a thread every ``period`` s, power integrated with the trapezoid rule; a
    read adds the last sample held to now, so a constant power integrates exactly."""

    source: EnergySource = "ina3221"

    def __init__(self, rails: dict[str, Reader], period: float = SAMPLE_PERIOD_S):
        super().__init__()
        self.rails, self.period = rails, period
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._acc: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._t_last = 0.0
        self._t_first = 0.0
        self._samples = 0

    @property
    def sampling(self) -> str:
        with self._lock:
            n, span = self._samples, self._t_last - self._t_first
        achieved = f", {span / (n - 1) * 1000:.3g} ms achieved" if n > 1 else ""
        return f"power sampled every {self.period * 1000:g} ms{achieved} ({n} samples), trapezoid-integrated"

    def _sample(self) -> None:
        power = {k: read() for k, read in self.rails.items()}
        t = time.perf_counter()
        with self._lock:
            dt = t - self._t_last
            if dt <= 0:  # start() re-zeroed while this sample was read
                return
            for k, p in power.items():
                self._acc[k] += (p + self._last[k]) / 2 * dt
            self._last, self._t_last = power, t
            self._samples += 1

    def _run(self) -> None:
        missed = 0
        while not self._stop.wait(self.period):
            try:
                self._sample()
                missed = 0
            except (OSError, ValueError) as exc:
                # one bad read spans two periods with the trapezoid; a rail gone for good ends the meter
                missed += 1
                if missed >= MAX_MISSED_SAMPLES:
                    self._error = f"reading the INA3221 rails failed {missed} times in a row: {exc}"
                    return

    def _zero(self) -> float:
        power = {k: read() for k, read in self.rails.items()}
        with self._lock:
            self._acc = dict.fromkeys(power, 0.0)
            self._last, self._t_last = power, time.perf_counter()
            self._t_first, self._samples = self._t_last, 1
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="ina3221-sampler", daemon=True)
            self._thread.start()
        return self._t_first

    def _joules(self) -> tuple[dict[str, float], float]:
        with self._lock:
            t = time.perf_counter()
            return {k: v + self._last[k] * (t - self._t_last) for k, v in self._acc.items()}, t

    def total(self, domains: dict[str, float]) -> tuple[float, list[str]]:
        inputs = [k for k in domains if k.split("@")[0] in INPUT_RAILS]
        summed = inputs or sorted(domains)
        return sum(domains[k] for k in summed), sorted(summed)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
            self._thread = None


def open_ina3221(root: Path = Path("/"), period: float = SAMPLE_PERIOD_S) -> Ina3221Meter | str:
    """The Jetson's INA3221 rails, or why there are none."""
    rails = _ina3221_rails(root)
    if not rails:
        return (
            f"ina3221: no INA3221 power monitor (no hwmon named ina3221 under /{HWMON}, no /{INA3221X}): "
            "not a Jetson, or its power monitor driver is not loaded"
        )
    try:
        for read in rails.values():
            read()
    except (OSError, ValueError) as exc:
        return f"ina3221: the rails do not read: {exc}"
    return Ina3221Meter(rails, period)


# --- the one entry ---------------------------------------------------------------------------------


def open_meter(root: Path = Path("/"), sources: Sequence[EnergySource] = ENERGY_SOURCES) -> EnergyMeter | str:
    """The first of ``sources`` (default: rapl, nvml, ina3221) this host can read, or
    ``"unavailable: <source>: <why>; ..."`` for each. NVML asks the driver, not ``root``."""
    reasons: list[str] = []
    openers: dict[EnergySource, Callable[[], EnergyMeter | str]] = {
        "rapl": lambda: open_rapl(root),
        "nvml": open_nvml,
        "ina3221": lambda: open_ina3221(root),
    }
    for source in sources:
        meter = openers[source]()
        if isinstance(meter, EnergyMeter):
            return meter
        reasons.append(meter)
    return UNAVAILABLE + "; ".join(reasons)


def joules_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-domain joules between two ``read()``s of one meter."""
    return {k: after[k] - before.get(k, 0.0) for k in after}
