"""Does this host match a SKU? Architecture, OS, device, CPU features, pinned toolchain, backend.

Two questions, because some backends cross-compile: can this host *build* the SKU's engine, and
can it *run* it (validate, bench)? For a backend that runs on the target only, both need the
target hardware; a cross-compiling backend (IREE) builds on any host with its compiler.
"""

from __future__ import annotations

from importlib import metadata
from typing import Literal

from pipeline.backends import get_backend
from pipeline.core.versions import UnreadableVersion, normalize, satisfies, specifier_problem
from pipeline.host import probe
from pipeline.project.config import Registry

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


def hardware_problems(registry: Registry, sku: str) -> list[str]:
    target = registry.sku(sku).target
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


def host_problems(registry: Registry, sku: str, purpose: Purpose = "run") -> list[str]:
    """Why this host cannot build (or run) ``sku``'s engines; empty when it can."""
    spec = registry.sku(sku)
    backend = get_backend(spec.backend)
    cross = purpose == "build" and backend.cross_compiles(spec)
    if not cross:
        problems = hardware_problems(registry, sku)
        if problems:  # wrong hardware: the SDK checks below would only add noise
            return problems
    return toolchain_problems(spec.toolchain, installed_only=purpose == "run") + backend.environment_problems(
        spec, purpose
    )
