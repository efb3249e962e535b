"""Does this host match a SKU? Architecture, OS, device, CPU features, pinned toolchain, backend."""

from __future__ import annotations

from importlib import metadata

from ..backends import get_backend
from ..config import Registry
from . import probe


def toolchain_problems(pins: dict[str, str]) -> list[str]:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    problems = []
    for package, spec in sorted(pins.items()):
        try:
            wanted = SpecifierSet(spec)
        except InvalidSpecifier:
            problems.append(f"toolchain.{package}: {spec!r} is not a version specifier (e.g. '==1.20.1' or '>=1.20,<2')")
            continue
        try:
            have = metadata.version(package)
        except metadata.PackageNotFoundError:
            problems.append(f"{package} is not installed (the SKU pins {spec})")
            continue
        if have not in wanted:
            problems.append(f"{package} {have} is installed, the SKU pins {spec}")
    return problems


def host_problems(registry: Registry, sku: str) -> list[str]:
    """Why this host cannot build ``sku``; empty when it can."""
    spec = registry.sku(sku)
    problems = []
    if spec.target.arch != probe.host_arch():
        problems.append(f"needs arch {spec.target.arch}, this host is {probe.host_arch()}")
    if spec.target.os != probe.host_os():
        problems.append(f"needs os {spec.target.os}, this host runs {probe.host_os()}")
    flags = set(probe.cpu_info()["flags"])
    missing = [f for f in spec.target.cpu_features if f not in flags]
    if missing:
        problems.append(f"needs CPU features {missing} this host lacks")
    if problems:  # wrong hardware: the SDK checks below would only add noise
        return problems
    problems += toolchain_problems(spec.toolchain)
    problems += get_backend(spec.backend).environment_problems(spec)
    return problems
