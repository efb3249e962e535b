"""What a host check's answer depends on, in milliseconds: installed packages, tools on ``PATH``,
drivers and device files, the CPU flags, the relevant environment variables and skuforge's own
backend code. Two equal fingerprints mean the same SDK imports and device probes would answer
the same, so their answers can be kept between commands (pipeline/engine/hostcheck.py caches
``skuforge skus``' and ``summary``'s "buildable here" this way: importing TVM, OpenVINO and the
IREE runtime to ask takes seconds, reading this takes a few milliseconds).

It is read, never probed: stat and listdir calls, a few small files, no import of an SDK and no
subprocess. What it misses (a package replaced in place with the same version and mtime, a driver
loaded without a device file or library change) keeps an old answer until the next reboot
(``boot_id`` is part of it) or until the cache folder is cleared.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipeline.core.env import process_environment
from pipeline.core.io import sha256_json
from pipeline.host import probe

# Environment variables a backend's availability or a device probe reads (the SDKs' own, the
# loader's, the testing hooks); SKUFORGE_* are all included.
ENV_NAMES = (
    "PATH",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "HOME",
    "XDG_CACHE_HOME",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "VK_ICD_FILENAMES",
    "VK_DRIVER_FILES",
    "OCL_ICD_VENDORS",
)
ENV_PREFIXES = ("SKUFORGE_", "OV_", "OPENVINO_", "IREE_", "ORT_", "TVM_", "TRT_")
# Folders whose entries are drivers or devices: a change in them (a driver installed, a GPU or
# NPU appearing) is a change of what the SDKs find.
DEVICE_DIRS = (
    "/dev",
    "/dev/dri",
    "/dev/accel",
    "/usr/share/vulkan/icd.d",
    "/usr/local/share/vulkan/icd.d",
    "/etc/vulkan/icd.d",
    "/etc/OpenCL/vendors",
)
DEVICE_FILES = (
    "/proc/driver/nvidia/version",
    "/proc/sys/kernel/random/boot_id",
    "/proc/device-tree/model",
    "/etc/nv_tegra_release",
    "/etc/ld.so.cache",
)
_DEV_PREFIXES = ("nvidia", "dri", "accel", "kfd", "nvhost", "nvmap")  # of /dev's entries, the devices that count
_PACKAGE_SUFFIXES = (".dist-info", ".egg-info", ".egg-link", ".pth")
_CODE = Path(__file__).resolve().parents[1]  # the pipeline package


def _stat(path: str | os.PathLike) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size]


def _entries(folder: str, keep: tuple[str, ...] | None = None, suffixes: bool = False) -> list[Any]:
    """(name, mtime) of a folder's entries, those starting (``suffixes``: ending) with ``keep``."""
    try:
        with os.scandir(folder) as it:
            found = [
                (e.name, e.stat(follow_symlinks=False).st_mtime_ns)
                for e in it
                if keep is None or (e.name.endswith(keep) if suffixes else e.name.startswith(keep))
            ]
    except OSError:
        return []
    return sorted(found)


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode(errors="replace")
    except OSError:
        return None


def packages() -> list[Any]:
    """The installed distributions of every import path (their metadata folders' names carry the
    version; the mtime changes on a reinstall)."""
    return [[p, _entries(p, _PACKAGE_SUFFIXES, suffixes=True)] for p in sys.path if p and os.path.isdir(p)]


def code_files() -> list[Any]:
    """skuforge's backend and host-probe code: a changed check is a new answer (an editable install)."""
    files = [*sorted((_CODE / "backends").rglob("*")), _CODE / "host" / "probe.py", _CODE / "engine" / "hostcheck.py"]
    return [[str(f.relative_to(_CODE)), _stat(f)] for f in files if "__pycache__" not in f.parts and f.is_file()]


def host_fingerprint(files: Iterable[str | os.PathLike] = ()) -> tuple[str, dict[str, Any]]:
    """The fingerprint's key (24 hex digits) and what it is made of; ``files``: further files whose
    state an answer depends on (stat only)."""
    environ = {k: v for k, v in process_environment().items() if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}
    basis: dict[str, Any] = {
        "python": [sys.prefix, os.path.realpath(sys.executable), sys.version],  # python and python3: one
        "arch": probe.host_arch(),
        "os": probe.host_os(),
        "cpu_flags": sha256_json(sorted(probe.cpu_features())),
        "environ": sorted(environ.items()),
        "path_dirs": [[d, _stat(d)] for d in environ.get("PATH", "").split(os.pathsep) if d],
        "devices": {d: _entries(d, _DEV_PREFIXES if d == "/dev" else None) for d in DEVICE_DIRS},
        "device_files": {f: _read(f) if f.startswith("/proc") else _stat(f) for f in DEVICE_FILES},
        "packages": packages(),
        "code": code_files(),
        "files": [[str(f), _stat(f)] for f in files],
    }
    return sha256_json(basis)[:24], basis
