"""What this host is and what state it is in: recorded with every build and benchmark.

The one place that asks the host about its CPU and GPU: backends resolve "host" targets and judge
whether an engine runs here through these functions, never by a CPU or GPU model name.

Testing hooks (read on every call, so ``monkeypatch.setenv`` works and subprocesses such as the
CLI inherit them): ``SKUFORGE_FAKE_CPU_FLAGS`` replaces the CPU flags of ``/proc/cpuinfo``
(space- or comma-separated, in the kernel's names: ``avx2 fma avx512_vnni amx_tile``) and
``SKUFORGE_FAKE_CPU_MODEL`` its model name. A faked GPU is an ``nvidia-smi`` script on ``PATH``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.env import PATH, SKUFORGE_FAKE_CPU_FLAGS, SKUFORGE_FAKE_CPU_MODEL

ARCH_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64", "armv8": "aarch64"}
ENV_FAKE_CPU_FLAGS = SKUFORGE_FAKE_CPU_FLAGS.name  # testing hook: the CPU flags this host reports
ENV_FAKE_CPU_MODEL = SKUFORGE_FAKE_CPU_MODEL.name  # testing hook: the CPU model name this host reports


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
    """The CPU's model name, core count and flags (``/proc/cpuinfo`` names), as this host reports
    them or as the testing hooks fake them (``faked``)."""
    model: str | None = None
    flags: list[str] = []
    text = _read("/proc/cpuinfo") or ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "Hardware") and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = value.split()
    fake_flags, fake_model = SKUFORGE_FAKE_CPU_FLAGS.get(), SKUFORGE_FAKE_CPU_MODEL.get()
    if fake_flags is not None:
        flags = fake_flags.replace(",", " ").split()
    if fake_model is not None:
        model = fake_model
    return {
        "model": model or platform.processor() or None,
        "cores": os.cpu_count(),
        "flags": sorted(set(flags)),
        "faked": fake_flags is not None or fake_model is not None,
    }


def cpu_max_mhz() -> float | None:
    """The CPU's highest clock: cpufreq's maximum, else the highest ``cpu MHz`` of /proc/cpuinfo
    (a VM's nominal clock); None where neither is reported."""
    freq = _read("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    if freq and freq.isdigit():
        return int(freq) / 1000
    found = re.findall(r"^cpu MHz\s*:\s*([\d.]+)", _read("/proc/cpuinfo") or "", re.MULTILINE)
    return max(map(float, found)) if found else None


def llc_bytes() -> int | None:
    """Size of cpu0's last-level (L3) cache as the kernel reports it; None where it does not."""
    text = _read("/sys/devices/system/cpu/cpu0/cache/index3/size") or ""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[:-1].isdigit() and text[-1:] in units:
        return int(text[:-1]) * units[text[-1]]
    return None


def cpu_features() -> frozenset[str]:
    """The CPU flags this host reports (``/proc/cpuinfo`` names, e.g. ``avx512_vnni``): what
    every "host" target and every engine-compatibility check is decided from."""
    return frozenset(cpu_info()["flags"])


# --- LLVM targets from the reported flags -----------------------------------------------------------
# A CPU name implies features: LLVM names a KVM guest whose hypervisor hides AMX "emeraldrapids",
# which implies AMX, and the engine then dies with an illegal instruction on the very host that
# built it. So a host target is a generic CPU plus exactly the features the kernel reports.

LLVM_GENERIC_CPU = {"x86_64": "x86-64", "aarch64": "generic"}
# /proc/cpuinfo flag -> LLVM feature, per architecture; features not listed here are not judged
LLVM_FEATURES = {
    "x86_64": {
        "sse": "sse",
        "sse2": "sse2",
        "pni": "sse3",
        "ssse3": "ssse3",
        "sse4_1": "sse4.1",
        "sse4_2": "sse4.2",
        "sse4a": "sse4a",
        "cx16": "cx16",
        "lahf_lm": "sahf",
        "popcnt": "popcnt",
        "abm": "lzcnt",
        "movbe": "movbe",
        "avx": "avx",
        "avx2": "avx2",
        "fma": "fma",
        "fma4": "fma4",
        "f16c": "f16c",
        "bmi1": "bmi",
        "bmi2": "bmi2",
        "adx": "adx",
        "aes": "aes",
        "pclmulqdq": "pclmul",
        "sha_ni": "sha",
        "rdrand": "rdrnd",
        "rdseed": "rdseed",
        "xsave": "xsave",
        "xsaveopt": "xsaveopt",
        "xsavec": "xsavec",
        "xsaves": "xsaves",
        "fsgsbase": "fsgsbase",
        "gfni": "gfni",
        "vaes": "vaes",
        "vpclmulqdq": "vpclmulqdq",
        "avx_vnni": "avxvnni",
        "avx512f": "avx512f",
        "avx512bw": "avx512bw",
        "avx512cd": "avx512cd",
        "avx512dq": "avx512dq",
        "avx512vl": "avx512vl",
        "avx512ifma": "avx512ifma",
        "avx512vbmi": "avx512vbmi",
        "avx512_vbmi2": "avx512vbmi2",
        "avx512_vnni": "avx512vnni",
        "avx512_bitalg": "avx512bitalg",
        "avx512_vpopcntdq": "avx512vpopcntdq",
        "avx512_bf16": "avx512bf16",
        "avx512_fp16": "avx512fp16",
        "avx512_vp2intersect": "avx512vp2intersect",
        "amx_tile": "amx-tile",
        "amx_int8": "amx-int8",
        "amx_bf16": "amx-bf16",
        "amx_fp16": "amx-fp16",
    },
    "aarch64": {
        "fp": "fp-armv8",
        "asimd": "neon",
        "aes": "aes",
        "sha2": "sha2",
        "sha3": "sha3",
        "sm4": "sm4",
        "crc32": "crc",
        "atomics": "lse",
        "fphp": "fullfp16",
        "asimdhp": "fullfp16",
        "asimdrdm": "rdm",
        "lrcpc": "rcpc",
        "asimddp": "dotprod",
        "asimdfhm": "fp16fml",
        "jscvt": "jsconv",
        "fcma": "complxnum",
        "dcpop": "ccpp",
        "sve": "sve",
        "sve2": "sve2",
        "i8mm": "i8mm",
        "bf16": "bf16",
    },
}


def llvm_features(flags: Iterable[str] | None = None, arch: str | None = None) -> frozenset[str]:
    """LLVM feature names (``avx512vnni``, ``amx-tile``, ``dotprod``) of the reported flags
    (default: this host's)."""
    table = LLVM_FEATURES.get(arch or host_arch(), {})
    return frozenset(table[f] for f in (cpu_features() if flags is None else flags) if f in table)


def llvm_cpu_target(flags: Iterable[str] | None = None, arch: str | None = None) -> dict[str, Any]:
    """The LLVM target a "host" build compiles for: the architecture's generic CPU and the
    features the host reports (``+avx2`` …), never the CPU's name."""
    arch = arch or host_arch()
    if arch not in LLVM_GENERIC_CPU:
        raise ValueError(f"no LLVM host target for architecture {arch} (known: {', '.join(sorted(LLVM_GENERIC_CPU))})")
    return {"cpu": LLVM_GENERIC_CPU[arch], "cpu_features": sorted(f"+{f}" for f in llvm_features(flags, arch))}


def resolve_llvm_target(cpu: str, features: Iterable[str], arch: str | None = None) -> tuple[str, list[str]]:
    """An LLVM CPU and features as a SKU names them: features as ``+name`` (a bare name is
    ``+name``); CPU ``host`` becomes the architecture's generic CPU with the features this host
    reports, refined by the given ones (``-name`` drops one, ``+name`` adds one)."""
    features = [f if f[:1] in "+-" else f"+{f}" for f in features]
    if cpu != "host":
        return cpu, features
    host = llvm_cpu_target(arch=arch)
    dropped = {f[1:] for f in features}
    return host["cpu"], [f for f in host["cpu_features"] if f[1:] not in dropped] + features


def missing_llvm_features(
    required: Iterable[str], flags: Iterable[str] | None = None, arch: str | None = None
) -> list[str]:
    """Enabled LLVM features (``+name``) an engine was compiled for that the host does not report.
    Only features with a /proc/cpuinfo flag are judged (``+crc32``, ``+evex512`` and the like are
    implied by others), and nothing where the host reports no flags (no ``/proc/cpuinfo``)."""
    flags = cpu_features() if flags is None else frozenset(flags)
    if not flags:
        return []
    known = set(LLVM_FEATURES.get(arch or host_arch(), {}).values())
    have = llvm_features(flags, arch)
    return sorted({f[1:] for f in required if f.startswith("+") and f[1:] in known and f[1:] not in have})


def host() -> dict[str, Any]:
    """The host's identity-free hardware description (deterministic on one machine)."""
    cpu = cpu_info()
    interesting = {
        "avx",
        "avx2",
        "avx512f",
        "avx512_vnni",
        "avx_vnni",
        "fma",
        "f16c",
        "amx_tile",
        "amx_int8",
        "amx_bf16",
        "neon",
        "asimd",
        "asimdhp",
        "asimddp",
        "sve",
        "i8mm",
        "bf16",
    }
    return {
        "arch": host_arch(),
        "os": host_os(),
        "cpu_model": cpu["model"],
        "cpu_cores": cpu["cores"],
        "cpu_features": [f for f in cpu["flags"] if f in interesting],
        "python": platform.python_version(),
    }


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask; a container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cpu_record(flags: Iterable[str] | None = None, arch: str | None = None) -> dict[str, Any]:
    """What a CPU engine's build records about the host CPU that decided it: the architecture,
    the model name (for people; nothing is decided by it) and the reported flags that name an
    instruction-set feature."""
    arch = arch or host_arch()
    info = cpu_info()
    table = LLVM_FEATURES.get(arch, {})
    return {
        "arch": arch,
        "model": info["model"],
        "features": sorted(f for f in (info["flags"] if flags is None else flags) if f in table),
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


def cpu_mhz_lowest() -> float | None:
    """The lowest current clock across CPUs (cpufreq ``scaling_cur_freq``): a throttled core shows
    here when cpu0 alone would not. None where cpufreq is not exposed (most VMs)."""
    found = [_read(str(p)) for p in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_cur_freq")]
    mhz = [int(f) / 1000 for f in found if f and f.isdigit()]
    return min(mhz) if mhz else None


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


@dataclass(frozen=True)
class GpuInfo:
    name: str
    compute_capability: str | None = None  # "8.7"
    driver: str | None = None  # NVIDIA driver release, e.g. "550.54.15"
    memory_mb: str | None = None

    @property
    def cc(self) -> float | None:
        return float(self.compute_capability) if self.compute_capability else None

    def to_json(self) -> dict[str, str | None]:
        return {
            "name": self.name,
            "driver": self.driver,
            "compute_capability": self.compute_capability,
            "memory_mb": self.memory_mb,
        }


NVIDIA_SMI_QUERY = (
    "nvidia-smi",
    "--query-gpu=name,compute_cap,driver_version,memory.total",
    "--format=csv,noheader,nounits",
)


def parse_nvidia_smi_all(text: str) -> list[GpuInfo]:
    """Every GPU in the output of ``nvidia-smi --query-gpu=name,compute_cap,driver_version[,memory.total]
    --format=csv,noheader[,nounits]``; a field the GPU does not report ("[N/A]") is None."""
    gpus = []
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if fields and fields[0]:
            known = [f.removesuffix(" MiB") if re.fullmatch(r"[\d.]+( MiB)?", f) else None for f in fields[1:4]]
            cc, driver, memory = known + [None] * (3 - len(known))
            gpus.append(GpuInfo(name=fields[0], compute_capability=cc, driver=driver, memory_mb=memory))
    return gpus


def parse_nvidia_smi(text: str) -> GpuInfo | None:
    """The first GPU of ``nvidia-smi --query-gpu=...`` output (see parse_nvidia_smi_all)."""
    return next(iter(parse_nvidia_smi_all(text)), None)


def cuda_runtime_api() -> Any | None:
    """cuda-python's runtime API (``cuda.bindings.runtime`` since 12.6, ``cuda.cudart`` before), or None."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError:
            return None
    return runtime


def _gpus_from_nvml() -> list[GpuInfo]:
    try:
        import pynvml
    except ImportError:
        return []
    as_str = lambda v: v.decode() if isinstance(v, bytes) else str(v)  # noqa: E731 (older bindings return bytes)
    try:
        pynvml.nvmlInit()
        try:
            driver, gpus = as_str(pynvml.nvmlSystemGetDriverVersion()), []
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total // 2**20
                gpus.append(
                    GpuInfo(
                        name=as_str(pynvml.nvmlDeviceGetName(handle)),
                        compute_capability=f"{major}.{minor}",
                        driver=driver,
                        memory_mb=str(memory),
                    )
                )
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVMLError_*: no driver, no device (Jetson has no NVML)
        return []
    return gpus


def _gpus_from_nvidia_smi() -> list[GpuInfo]:
    return parse_nvidia_smi_all(_command(*NVIDIA_SMI_QUERY, timeout=20) or "")


def _gpu_from_cudart() -> GpuInfo | None:
    cudart = cuda_runtime_api()
    if cudart is None:
        return None
    try:
        err, count = cudart.cudaGetDeviceCount()
        if getattr(err, "value", err) != 0 or count < 1:
            return None
        err, prop = cudart.cudaGetDeviceProperties(0)
        if getattr(err, "value", err) != 0:
            return None
    except Exception:  # a broken CUDA install: the probe never raises
        return None
    name = prop.name.split(b"\0")[0].decode() if isinstance(prop.name, bytes) else str(prop.name)
    return GpuInfo(name=name, compute_capability=f"{prop.major}.{prop.minor}")


# Jetson modules by the name in /proc/device-tree/model, and their GPU's compute capability.
_JETSON_CC = {"Orin": "8.7", "Xavier": "7.2", "TX2": "6.2", "Nano": "5.3"}


def jetson_gpu(model: str) -> GpuInfo | None:
    """The integrated GPU of a Jetson from its device-tree model ("NVIDIA Jetson AGX Orin Developer Kit")."""
    model = model.strip("\0 \n")
    if "Jetson" not in model:
        return None
    cc = next((cc for family, cc in _JETSON_CC.items() if family in model), None)
    return GpuInfo(name=model, compute_capability=cc)


def _gpu_from_device_tree() -> GpuInfo | None:
    model = _read("/proc/device-tree/model") or ""
    found = jetson_gpu(model)
    if found is None and _read("/etc/nv_tegra_release") is not None:  # an L4T board under another name
        found = GpuInfo(name=model.strip("\0 \n") or "NVIDIA Tegra")
    return found


def nvidia_gpus() -> list[GpuInfo]:
    """This host's NVIDIA GPUs: NVML, else nvidia-smi, else the CUDA runtime, else a Jetson's
    device tree (Jetson has no NVML and a partial nvidia-smi). A missing compute capability is
    filled in from the CUDA runtime or the Jetson table. Cached per ``PATH`` (a faked
    ``nvidia-smi`` earlier on ``PATH`` is a new probe)."""
    return list(_nvidia_gpus(PATH.get() or ""))


@functools.lru_cache(maxsize=8)
def _nvidia_gpus(path: str) -> tuple[GpuInfo, ...]:
    gpus = _gpus_from_nvml() or _gpus_from_nvidia_smi()
    if gpus and all(g.compute_capability for g in gpus):
        return tuple(gpus)
    for fallback in (_gpu_from_cudart, _gpu_from_device_tree):
        found = fallback()
        if found is None:
            continue
        if not gpus:
            return (found,)
        gpus = [
            g if g.compute_capability else dataclasses.replace(g, compute_capability=found.compute_capability)
            for g in gpus
        ]
        if all(g.compute_capability for g in gpus):
            break
    return tuple(gpus)


NO_GPU = (
    "no NVIDIA GPU is visible on this host (NVML, nvidia-smi, the CUDA runtime and a Jetson device tree found none)"
)


def gpu_info() -> GpuInfo | None:
    """GPU 0 of this host (see nvidia_gpus), or None."""
    return next(iter(nvidia_gpus()), None)


def jetson() -> dict[str, Any] | None:
    release = _read("/etc/nv_tegra_release")
    if release is None:
        return None
    # nvpmodel -q prints "NV Power Mode: MAXN" then the mode number
    mode = _command("nvpmodel", "-q")
    return {"l4t_release": release.splitlines()[0], "power_mode": mode.splitlines() if mode else None}


def gpu() -> dict[str, Any]:
    """The GPUs as recorded in reports: ``nvidia`` (nvidia_gpus) and the Jetson's L4T release."""
    return {"nvidia": [g.to_json() for g in nvidia_gpus()], "jetson": jetson()}
