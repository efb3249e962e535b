"""Does this host match a SKU? Architecture, OS, device, CPU features, pinned toolchain, backend.

Two questions, because some backends cross-compile: can this host *build* the SKU's engine, and
can it *run* it (validate, bench)? For a backend that runs on the target only, both need the
target hardware; a cross-compiling backend (IREE) builds on any host with its compiler.

Asking imports the backends' SDKs and opens their devices (TVM, OpenVINO, the IREE runtime:
seconds). The read-only views (``skuforge skus``, ``summary``, the matrix) ask
``cached_host_problems``, which keeps the answers in this host's cache folder under a fingerprint
of what they depend on (pipeline/host/fingerprint.py: installed packages, tools on PATH, drivers
and device files, CPU flags, environment, skuforge's backend code): a change to any of them asks
again. A build, ``runner check`` and the reproducibility check ask ``host_problems``, uncached.
"""

from __future__ import annotations

import json
import logging
from importlib import metadata
from pathlib import Path
from typing import Literal

from pipeline.backends import backend_class, emulated, get_backend, litert_converter
from pipeline.core.io import atomic_write_json, sha256_json
from pipeline.core.paths import cache_dir
from pipeline.core.versions import UnreadableVersion, normalize, satisfies, specifier_problem
from pipeline.host import probe
from pipeline.host.fingerprint import host_fingerprint
from pipeline.project.config import Registry, SkuSpec

log = logging.getLogger(__name__)

Purpose = Literal["build", "run"]


def toolchain_problems(pins: dict[str, str], installed_only: bool = False) -> list[str]:
    """Pinned package versions this host does not satisfy. ``installed_only`` skips absent
    packages (a device that runs engines need not carry the compiler)."""
    problems = []
    for package, spec in sorted(pins.items()):
        bad_spec = specifier_problem(spec)
        if bad_spec:
            problems.append(f"toolchain.{package}: {bad_spec}")
            continue
        try:
            have = metadata.version(package)
        except metadata.PackageNotFoundError:
            if not installed_only:
                problems.append(f"{package} is not installed (the SKU pins {spec})")
            continue
        try:
            normalize(have)
        except UnreadableVersion as exc:  # fail closed, naming the string
            problems.append(f"{package}: the installed version {exc.message} (the SKU pins {spec})")
            continue
        if not satisfies(have, spec):
            problems.append(f"{package} {have} is installed, the SKU pins {spec}")
    return problems


def hardware_problems(spec: SkuSpec) -> list[str]:
    target = spec.target
    problems = []
    if target.arch != probe.host_arch():
        problems.append(f"needs arch {target.arch}, this host is {probe.host_arch()}")
    if target.os != probe.host_os():
        problems.append(f"needs os {target.os}, this host runs {probe.host_os()}")
    if target.device == "gpu" and probe.gpu_info() is None:
        problems.append(f"needs device gpu: {probe.NO_GPU}")
    flags = probe.cpu_features()
    missing = [f for f in target.cpu_features if f not in flags]
    if missing:
        problems.append(f"needs CPU features {missing} this host lacks")
    return problems


def can_emulate(spec: SkuSpec) -> bool:
    """True for a SKU whose engines an x86-64 host may validate under QEMU user-mode emulation: an
    aarch64 Linux CPU target and a backend with an emulated runner (pipeline/backends/emulated).
    Such a SKU has an emulate stage (pipelines/<sku>/emulated/dvc.yaml) whatever the host."""
    target = spec.target
    return (
        target.arch == "aarch64"
        and target.os == "linux"
        and target.device == "cpu"
        and backend_class(spec.backend).emulation
    )


def runs_emulated(spec: SkuSpec) -> bool:
    """True when this host would validate the SKU's engines under emulation (an x86-64 Linux host,
    no device bench that runs them instead): validated here, never benchmarked."""
    if not (can_emulate(spec) and probe.host_arch() == "x86_64" and probe.host_os() == "linux"):
        return False
    backend = get_backend(spec.backend)
    # an engine this host can build at all, and no device bench that runs it (TVM's tracker)
    return backend.cross_compiles(spec) and not backend.runs_remotely(spec)


def emulation_problems(spec: SkuSpec) -> list[str] | None:
    """None where this host would not emulate the SKU; else why it cannot now (empty: it can)."""
    return emulated.problems() if runs_emulated(spec) else None


def host_problems(registry: Registry, sku: str, purpose: Purpose = "run") -> list[str]:
    """Why this host cannot build (or run) ``sku``'s engines; empty when it can."""
    return sku_host_problems(registry.sku(sku), purpose)


def sku_host_problems(spec: SkuSpec, purpose: Purpose = "run") -> list[str]:
    """``host_problems`` of a SKU already resolved (a command's pair)."""
    backend = get_backend(spec.backend)
    # a cross build needs no target here; a remote run (a device on the bench) needs none either
    elsewhere = backend.cross_compiles(spec) if purpose == "build" else backend.runs_remotely(spec)
    if not elsewhere:
        problems = hardware_problems(spec)
        missing = emulation_problems(spec) if problems and purpose == "run" else None
        if missing is not None:  # validated here under emulation at most: said with the hardware
            how = (
                f"cannot emulate it: {'; '.join(missing)}"
                if missing
                else "its engines are validated under emulation here"
            )
            return [f"{'; '.join(problems)} ({how})"]
        if problems:  # wrong hardware: the SDK checks below would only add noise
            return problems
    return toolchain_problems(spec.toolchain, installed_only=purpose == "run") + backend.environment_problems(
        spec, purpose
    )


# --- the cached answers of the read-only views -------------------------------------------------------

CACHE_PREFIX = "hostcheck-"
KEEP_CACHES = 8  # fingerprints kept (a CI image, a developer's venvs): older ones are removed


def _state_files() -> list[Path]:
    """Files a backend's check reads besides packages and drivers: the LiteRT converter's stamp and
    the emulated aarch64 environment's."""
    return [litert_converter.env_dir() / litert_converter.STAMP, emulated.stamp()]


class HostCheckCache:
    """The answers of ``host_problems`` for one host fingerprint: ``<cache dir>/hostcheck-<key>.json``
    ({"key", "basis", "answers": {question: problems}}). A question is the backend's class, the
    SKU's spec and the purpose, so a changed SKU is a new question. An unreadable file is an empty
    cache; a file that cannot be written is left (the answers are still right, only slower)."""

    def __init__(self, folder: Path | None = None):
        self.key, self._basis = host_fingerprint(_state_files())
        self.path = (folder or cache_dir()) / f"{CACHE_PREFIX}{self.key}.json"
        self._answers: dict[str, list[str]] = {}
        self._dirty = False
        try:
            doc = json.loads(self.path.read_text())
            if doc.get("key") == self.key and isinstance(doc.get("answers"), dict):
                self._answers = {str(k): [str(p) for p in v] for k, v in doc["answers"].items()}
        except (OSError, ValueError, TypeError, AttributeError):
            pass

    def host_problems(self, registry: Registry, sku: str, purpose: Purpose = "run") -> list[str]:
        spec = registry.sku(sku)
        cls = backend_class(spec.backend)
        question = sha256_json(
            {"backend": f"{cls.__module__}:{cls.__qualname__}", "sku": spec.model_dump(mode="json"), "purpose": purpose}
        )
        if question not in self._answers:
            self._answers[question] = host_problems(registry, sku, purpose)
            self._dirty = True
        return list(self._answers[question])

    def save(self) -> None:
        if not self._dirty:
            return
        try:
            atomic_write_json(self.path, {"key": self.key, "basis": self._basis, "answers": self._answers})
            self._dirty = False
            old = sorted(self.path.parent.glob(f"{CACHE_PREFIX}*.json"), key=_mtime, reverse=True)[KEEP_CACHES:]
            for stale in old:
                stale.unlink(missing_ok=True)
        except OSError as exc:
            log.debug("host check cache %s not written: %s", self.path, exc)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def cached_host_problems(registry: Registry, skus: list[str] | None = None) -> dict[str, dict[str, list[str]]]:
    """``{sku: {"build": problems, "run": problems}}`` for ``skus`` (default: all), from this host's
    cache where the fingerprint matches, asked (and kept) otherwise."""
    cache = HostCheckCache()
    out = {
        sku: {purpose: cache.host_problems(registry, sku, purpose) for purpose in ("build", "run")}
        for sku in (skus if skus is not None else list(registry.skus))
    }
    cache.save()
    return out
