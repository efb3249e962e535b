"""Energy meters (pipeline/host/energy.py) against recorded sysfs trees, NVML without its package, and
the real host's meter where it has one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from pipeline.host.energy import (
    RAPL_PERMISSION_FIX,
    EnergyMeter,
    Ina3221Meter,
    RaplMeter,
    open_ina3221,
    open_meter,
    open_nvml,
    open_rapl,
    unavailable,
)

WRAP_UJ = 262143328850


def write(path: Path, text: str) -> None:
    """Replace the file whole, as a sysfs attribute changes (a reader never sees it half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(text + "\n")
    os.replace(staged, path)


def rapl_tree(root: Path) -> Path:
    """Package 0 with core and dram subzones, as /sys/class/powercap lists them (flat, by id)."""
    base = root / "sys/class/powercap"
    for zone, name, uj in (
        ("intel-rapl:0", "package-0", 1_000_000),
        ("intel-rapl:0:0", "core", 500_000),
        ("intel-rapl:0:1", "dram", WRAP_UJ - 1_000_000),  # about to wrap
    ):
        write(base / zone / "name", name)
        write(base / zone / "energy_uj", str(uj))
        write(base / zone / "max_energy_range_uj", str(WRAP_UJ))
    write(base / "intel-rapl" / "enabled", "1")  # the control type folder: not a zone
    return base


def test_rapl_zones_wraparound_and_no_double_counting(tmp_path):
    base = rapl_tree(tmp_path)
    meter = open_rapl(tmp_path)
    assert isinstance(meter, RaplMeter)
    meter.start()
    write(base / "intel-rapl:0/energy_uj", str(13_000_000))  # +12 J
    write(base / "intel-rapl:0:0/energy_uj", str(8_500_000))  # +8 J, part of the package
    write(base / "intel-rapl:0:1/energy_uj", str(2_000_000))  # wrapped: +1 J to the top, +2 J after
    result = meter.stop(inferences=6, phase="engine-only steady state")
    assert result.available and result.source == "rapl"
    assert result.domains == pytest.approx({"package-0": 12.0, "package-0/core": 8.0, "package-0/dram": 3.0})
    assert result.summed == ["package-0", "package-0/dram"]
    assert result.joules == pytest.approx(15.0)
    assert result.joules_per_inference == pytest.approx(2.5)
    assert result.mean_power_w == pytest.approx(15.0 / result.window_seconds)


def test_rapl_psys_counts_only_without_a_package(tmp_path):
    base = tmp_path / "sys/class/powercap"
    for zone, name in (("intel-rapl:0", "package-0"), ("intel-rapl:1", "psys")):
        write(base / zone / "name", name)
        write(base / zone / "energy_uj", "0")
        write(base / zone / "max_energy_range_uj", str(WRAP_UJ))
    meter = open_rapl(tmp_path)
    assert isinstance(meter, RaplMeter)
    assert meter.total({"package-0": 5.0, "psys": 9.0}) == (5.0, ["package-0"])
    assert meter.total({"psys": 9.0}) == (9.0, ["psys"])


def test_a_dead_counter_is_unavailable_never_zero(tmp_path):
    rapl_tree(tmp_path)
    meter = open_rapl(tmp_path)
    assert isinstance(meter, RaplMeter)
    meter.start()
    short = meter.stop(inferences=3, phase="p")  # nothing moved, well under a second
    assert not short.available and short.joules is None
    assert short.reason is not None and short.reason.startswith("unavailable: rapl counter did not advance")
    long = meter.result({"package-0": 0.0, "package-0/dram": 0.0}, 2.5, 10, "p")
    assert not long.available and long.joules is None and long.mean_power_w is None
    assert long.reason is not None and "did not advance over 2.5 s" in long.reason and "dead" in long.reason


def test_rapl_energy_readable_by_root_only_says_so_with_the_fix(tmp_path):
    base = rapl_tree(tmp_path)
    for energy in base.glob("*/energy_uj"):
        energy.chmod(0o000)  # unreadable to this user, as 0400 root files are to others since Linux 5.10
    code = (
        "import sys; from pathlib import Path; from pipeline.host.energy import open_rapl; "
        "print(open_rapl(Path(sys.argv[1])))"
    )
    argv = [sys.executable, "-c", code, str(tmp_path)]
    if os.geteuid() == 0:  # root reads any file: run without the capabilities that let it
        if not shutil.which("setpriv"):
            pytest.skip("running as root and setpriv (util-linux) is absent: cannot make a file unreadable")
        argv = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *argv]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    reason = done.stdout.strip()
    assert reason.startswith("rapl: intel-rapl:0, intel-rapl:0:0, intel-rapl:0:1:")
    assert "root only since Linux 5.10" in reason and "CVE-2020-8694" in reason
    assert "chmod o+r" in reason and "udev" in reason
    assert RAPL_PERMISSION_FIX in reason


def test_no_meter_in_an_empty_tree_names_each_source(tmp_path):
    reason = open_meter(tmp_path, sources=("rapl", "ina3221"))
    assert isinstance(reason, str)
    assert reason.startswith("unavailable: rapl: no /sys/class/powercap")
    assert "; ina3221: no INA3221 power monitor" in reason
    (tmp_path / "sys/class/powercap").mkdir(parents=True)
    assert "has no intel-rapl zones" in str(open_rapl(tmp_path))


def hwmon_tree(root: Path) -> Path:
    """An Orin's ina3221 under hwmon: VDD_IN feeds the other rails; an NC channel; the shunt sum."""
    folder = root / "sys/class/hwmon/hwmon1"
    write(folder / "name", "ina3221")
    for n, label, mv, ma in ((1, "VDD_IN", 5000, 1000), (2, "VDD_CPU_GPU_CV", 5000, 400), (3, "NC", 0, 0)):
        write(folder / f"in{n}_label", label)
        write(folder / f"in{n}_input", str(mv))
        write(folder / f"curr{n}_input", str(ma))
        write(folder / f"in{n}_enable", "1")
    write(folder / "in7_label", "sum of shunt voltages")
    write(folder / "in7_input", "120")
    write(root / "sys/class/hwmon/hwmon0/name", "cpu_thermal")  # another hwmon: not a power monitor
    return folder


def test_hwmon_ina3221_rails_integrate_to_the_input_rail(tmp_path):
    hwmon_tree(tmp_path)
    meter = open_ina3221(tmp_path, period=0.005)
    assert isinstance(meter, Ina3221Meter)
    assert sorted(meter.rails) == ["VDD_CPU_GPU_CV", "VDD_IN"]
    with meter:
        time.sleep(0.1)
        result = meter.stop(inferences=4, phase="engine-only steady state")
    assert result.available and result.source == "ina3221"
    assert result.summed == ["VDD_IN"]  # the CPU/GPU rail is inside VDD_IN
    assert result.mean_power_w == pytest.approx(5.0)  # 5 V * 1 A held constant
    assert result.domains["VDD_CPU_GPU_CV"] / result.window_seconds == pytest.approx(2.0, rel=1e-3)
    assert result.sampling is not None and "every 5 ms" in result.sampling and "trapezoid" in result.sampling


def test_ina3221_integrates_a_power_step(tmp_path):
    folder = hwmon_tree(tmp_path)
    meter = open_ina3221(tmp_path, period=0.002)
    assert isinstance(meter, Ina3221Meter)
    with meter:
        time.sleep(0.1)
        low, t_low = meter.read()
        write(folder / "curr1_input", "3000")  # 5 W -> 15 W
        time.sleep(0.2)
        high, t_high = meter.read()
    step = (high["VDD_IN"] - low["VDD_IN"]) / (t_high - t_low)
    assert 10.0 < step < 15.5  # most of the window at 15 W; one sampling period around the step
    assert low["VDD_IN"] / t_low == pytest.approx(5.0)


def test_old_l4t_iio_rails(tmp_path):
    folder = tmp_path / "sys/bus/i2c/drivers/ina3221x/0-0041/iio:device1"
    for n, rail, mw in ((0, "VDD_SYS_GPU", 1500), (1, "VDD_IN", 4000), (2, "VDD_SYS_CPU", 900)):
        write(folder / f"rail_name_{n}", rail)
        write(folder / f"in_power{n}_input", str(mw))
    meter = open_meter(tmp_path, sources=("rapl", "ina3221"))
    assert isinstance(meter, Ina3221Meter)
    assert sorted(meter.rails) == ["VDD_IN", "VDD_SYS_CPU", "VDD_SYS_GPU"]
    assert meter.rails["VDD_SYS_GPU"]() == pytest.approx(1.5)
    assert meter.total({"VDD_IN": 4.0, "VDD_SYS_GPU": 1.5}) == (4.0, ["VDD_IN"])
    meter.close()


def test_rails_without_an_input_rail_are_summed(tmp_path):
    folder = tmp_path / "sys/bus/i2c/drivers/ina3221x/1-0040/iio:device0"
    for n, rail in enumerate(("GPU", "CPU", "SOC")):
        write(folder / f"rail_name_{n}", rail)
        write(folder / f"in_power{n}_input", "1000")
    meter = open_ina3221(tmp_path)
    assert isinstance(meter, Ina3221Meter)
    assert meter.total({"GPU": 1.0, "CPU": 2.0, "SOC": 3.0}) == (6.0, ["CPU", "GPU", "SOC"])


def test_nvml_without_its_package_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml now raises ImportError
    reason = open_nvml()
    assert isinstance(reason, str)
    assert "nvidia-ml-py" in reason and "pip install" in reason


def test_nvml_on_this_host():
    """Where NVML gives no meter, the reason names the package, the driver or the GPU."""
    meter = open_nvml()
    if isinstance(meter, EnergyMeter):
        meter.close()
        pytest.skip("NVML gives a meter here: see test_real_counter_on_this_host")
    assert meter.startswith("nvml: ")
    assert any(word in meter for word in ("nvidia-ml-py", "driver", "GPU"))


def test_unavailable_is_never_a_zero_figure():
    result = unavailable("no meter", "engine-only steady state", window_seconds=3.0, inferences=9)
    assert result.reason == "unavailable: no meter"
    assert not result.available and result.joules is None and result.joules_per_inference is None
    assert unavailable("unavailable: x", "p").reason == "unavailable: x"


def test_real_counter_on_this_host():
    meter = open_meter()
    if isinstance(meter, str):
        pytest.skip(meter)
    with meter:
        end, n = time.perf_counter() + 1.5, 0
        while time.perf_counter() < end:
            sum(i * i for i in range(1000))
            n += 1
        result = meter.stop(inferences=n, phase="busy loop")
    assert result.available, result.reason
    assert result.joules is not None and result.joules > 0
    assert result.mean_power_w is not None and 0 < result.mean_power_w < 5000


class FakeNvml(types.ModuleType):
    """nvidia-ml-py's calls as the module names them, for hosts without an NVIDIA driver: two GPUs whose
    counters (mJ) advance 1500 and 250 mJ per read; ``old`` makes GPU 1 a pre-Volta board without one."""

    class NVMLError(Exception):
        pass

    def __init__(self, old: bool = False):
        super().__init__("pynvml")
        self.old, self.mj, self.shut = old, [10_000, 20_000], False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, i: int) -> str:
        return "Tesla P4" if i else "H100"

    def nvmlDeviceGetTotalEnergyConsumption(self, i: int) -> int:
        if self.old and i == 1:
            raise self.NVMLError("Not Supported")
        self.mj[i] += (1500, 250)[i]
        return self.mj[i]


def test_nvml_counters_in_joules_per_gpu_summed(monkeypatch):
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    meter = open_nvml()
    assert isinstance(meter, EnergyMeter) and meter.source == "nvml"
    with meter:
        result = meter.stop(inferences=7, phase="engine-only steady state")
    assert fake.shut
    assert result.domains == {"gpu0": 1.5, "gpu1": 0.25}
    assert result.joules == pytest.approx(1.75) and result.summed == ["gpu0", "gpu1"]
    assert result.joules_per_inference == pytest.approx(0.25)


def test_nvml_gpu_without_an_energy_counter_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(old=True))
    reason = open_nvml()
    assert reason == "nvml: GPU 1 (Tesla P4) has no energy counter (Not Supported; needs Volta or newer)"
