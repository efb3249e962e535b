"""What this host is and what state it is in: recorded with every build and benchmark."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

ARCH_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64", "armv8": "aarch64"}


def host_arch() -> str:
    machine = platform.machine().lower()
    return ARCH_ALIASES.get(machine, machine)


def host_os() -> str:
    return {"darwin": "macos"}.get(platform.system().lower(), platform.system().lower())


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def cpu_info() -> dict[str, Any]:
    model, flags = None, []
    text = _read("/proc/cpuinfo") or ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "Hardware") and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = value.split()
    return {"model": model or platform.processor() or None, "cores": os.cpu_count(), "flags": sorted(flags)}


def host() -> dict[str, Any]:
    """The host's identity-free hardware description (deterministic on one machine)."""
    cpu = cpu_info()
    interesting = {"avx", "avx2", "avx512f", "avx512_vnni", "avx_vnni", "fma", "f16c", "amx_tile", "amx_int8",
                   "amx_bf16", "neon", "asimd", "asimdhp", "asimddp", "sve", "i8mm", "bf16"}
    return {
        "arch": host_arch(),
        "os": host_os(),
        "cpu_model": cpu["model"],
        "cpu_cores": cpu["cores"],
        "cpu_features": [f for f in cpu["flags"] if f in interesting],
        "python": platform.python_version(),
    }


def device_state() -> dict[str, Any]:
    """The moment's state: governor, clocks, load, memory, temperatures (what skews a benchmark)."""
    state: dict[str, Any] = {
        "governor": _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
        "cpu_mhz": None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "memory_available_mb": None,
        "temperatures_c": {},
    }
    freq = _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq")
    if freq and freq.isdigit():
        state["cpu_mhz"] = int(freq) / 1000
    meminfo = _read("/proc/meminfo") or ""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            state["memory_available_mb"] = int(line.split()[1]) / 1024
    for zone in sorted(Path("/sys/class/thermal").glob("thermal_zone*")):
        kind, temp = _read(str(zone / "type")), _read(str(zone / "temp"))
        if kind and temp and temp.lstrip("-").isdigit():
            state["temperatures_c"][kind] = int(temp) / 1000
    nvpmodel = _read("/etc/nvpmodel.conf") and _read("/var/lib/nvpmodel/status")
    if nvpmodel:
        state["jetson_power_mode"] = nvpmodel
    return state


def rss_mb() -> dict[str, float]:
    """Resident and peak resident memory of this process, from /proc (MB)."""
    out = {}
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return {"rss": out.get("VmRSS", 0.0), "peak_rss": out.get("VmHWM", 0.0)}


def _command(*argv: str, timeout: float = 10.0) -> str | None:
    """stdout of a host tool, or None where it is absent or fails (a probe never raises)."""
    if not shutil.which(argv[0]):
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def nvidia_gpus() -> list[dict[str, str]]:
    out = _command("nvidia-smi", "--query-gpu=name,driver_version,compute_cap,memory.total",
                   "--format=csv,noheader,nounits")
    gpus = []
    for line in (out or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            gpus.append(dict(zip(("name", "driver", "compute_capability", "memory_mb"), parts)))
    return gpus


def jetson() -> dict[str, Any] | None:
    release = _read("/etc/nv_tegra_release")
    if release is None:
        return None
    # nvpmodel -q prints "NV Power Mode: MAXN" then the mode number
    mode = _command("nvpmodel", "-q")
    return {"l4t_release": release.splitlines()[0], "power_mode": mode.splitlines() if mode else None}


def gpu() -> dict[str, Any]:
    return {"nvidia": nvidia_gpus(), "jetson": jetson()}


def has_gpu(info: dict[str, Any]) -> bool:
    return bool(info["nvidia"] or info["jetson"])
