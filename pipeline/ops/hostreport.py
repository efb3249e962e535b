"""`skuforge runner probe/check/labels`: the host's state and toolchain, host versus one SKU, and
the runner classes (runners/classes.yaml) that say which machine serves which SKU."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline.backends import emulated, get_backend
from pipeline.core.errors import ConfigError, InputError, SkuforgeError
from pipeline.core.versions import satisfies
from pipeline.engine.hostcheck import emulation_problems, host_problems
from pipeline.engine.matrix import sku_statuses
from pipeline.host import probe
from pipeline.host.peaks import host_peaks
from pipeline.project.config import Registry


def toolchain_versions(registry: Registry) -> dict[str, str | None]:
    """Installed version of every package some SKU pins (None: not installed)."""
    out: dict[str, str | None] = {}
    for package in sorted({p for s in registry.skus.values() for p in s.toolchain}):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def backend_versions(registry: Registry) -> dict[str, dict[str, str] | str]:
    """Each used backend's SDK versions, or why they cannot be read here."""

    out: dict[str, dict[str, str] | str] = {}
    for name in sorted({s.backend for s in registry.skus.values()}):
        try:
            out[name] = get_backend(name).versions()
        except (SkuforgeError, ImportError, OSError) as exc:  # SDK absent here: say so, keep probing
            out[name] = f"unavailable: {getattr(exc, 'message', None) or exc}"
    return out


def probe_report(registry: Registry, peaks: bool = False, refresh: bool = False) -> dict[str, Any]:
    """The host as a runner; with ``peaks``, its peak compute and bandwidth (pipeline.host.peaks:
    cached per host, ``refresh`` measures again)."""

    statuses = sku_statuses(registry)
    report = {
        "host": probe.host(),
        "device_state": probe.device_state(),
        "gpu": probe.gpu(),
        "toolchain": toolchain_versions(registry),
        "backends": backend_versions(registry),
        "skus": {
            "buildable": [s.sku for s in statuses if s.buildable],
            "runnable": [s.sku for s in statuses if s.runnable],
            "emulated": [s.sku for s in statuses if s.emulated],  # runnable under QEMU only: validated
        },
        "emulation": emulation_report(),
    }
    if peaks:
        report["peaks"] = host_peaks(refresh=refresh).to_json()
    return report


def emulation_report() -> dict[str, Any]:
    """Whether this host runs aarch64 engines under QEMU user-mode emulation, and with what."""
    problems = emulated.problems()
    return {"aarch64": "available" if not problems else "unavailable", "problems": problems, **emulated.describe()}


def check_report(registry: Registry, sku: str) -> dict[str, Any]:
    """Host versus SKU for building and running its engines: every difference, named. A host that
    runs the SKU's engines only under emulation validates them but is no runner for the SKU: its
    bench needs the device."""
    spec = registry.sku(sku)
    # an emulating host's run problem already says so ("... (its engines are validated under emulation here)")
    problems = list(dict.fromkeys(host_problems(registry, sku, "build") + host_problems(registry, sku, "run")))
    return {
        "sku": sku,
        "matches": not problems,
        "emulated": emulation_problems(spec) == [],
        "problems": problems,
        "target": spec.target.model_dump(),
        "toolchain": spec.toolchain,
        "runner_labels": spec.runner_labels,
    }


# --- runner classes --------------------------------------------------------------------------


def load_classes(path: str | Path) -> dict[str, dict[str, Any]]:
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise InputError(
            f"cannot read runner classes {path}: {exc.strerror}",
            hint="give --classes runners/classes.yaml (from the project root)",
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}", hint="fix the file") from exc
    classes = (data or {}).get("classes") if isinstance(data, dict) else None
    if not isinstance(classes, dict) or not classes:
        raise ConfigError(f"{path} has no 'classes' mapping", hint="see runners/classes.yaml in skuforge")
    for name, cls in classes.items():
        if not isinstance(cls, dict) or not isinstance(cls.get("labels"), list) or not cls["labels"]:
            raise ConfigError(f"runner class {name!r} in {path} has no 'labels' list", hint="add labels: [...]")
    return classes


def class_labels(classes: dict[str, dict[str, Any]], name: str) -> list[str]:
    if name not in classes:
        raise ConfigError(f"unknown runner class {name!r}", hint=f"known classes: {', '.join(sorted(classes))}")
    return [str(label) for label in classes[name]["labels"]]


def classes_problems(registry: Registry, classes: dict[str, dict[str, Any]]) -> list[str]:
    """Every SKU's labels served by a class whose hardware and pins agree with the SKU."""
    problems = []
    for sku, spec in sorted(registry.skus.items()):
        serving = [n for n, c in classes.items() if set(spec.runner_labels) <= set(c["labels"])]
        if not serving:
            problems.append(f"SKU {sku}: no runner class has all of its labels {spec.runner_labels}")
        for name in serving:
            cls = classes[name]
            hw = cls.get("hardware") or {}
            for key in ("arch", "os"):
                if hw.get(key) != getattr(spec.target, key):
                    problems.append(f"SKU {sku} / class {name}: {key} {hw.get(key)} != {getattr(spec.target, key)}")
            if spec.target.device == "gpu" and hw.get("device") != "gpu":
                problems.append(
                    f"SKU {sku} / class {name}: the SKU needs a GPU, the class has device {hw.get('device')}"
                )
            missing = set(spec.target.cpu_features) - set(hw.get("cpu_features") or [])
            if missing:
                problems.append(f"SKU {sku} / class {name}: class lacks CPU features {sorted(missing)}")
            pins = cls.get("toolchain") or {}
            for package, wanted in sorted(spec.toolchain.items()):
                have = pins.get(package)
                if have is None:
                    problems.append(
                        f"SKU {sku} / class {name}: the class does not pin {package} (the SKU wants {wanted})"
                    )
                elif not satisfies(have, wanted):
                    problems.append(f"SKU {sku} / class {name}: pins {package} {have}, the SKU wants {wanted}")
    return problems
