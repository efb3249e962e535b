"""Assemble the DVC locks from the ones the per-SKU build jobs uploaded, and the cross-SKU
consistency reports from the golden outputs they uploaded.

Each matrix job runs its SKU's stages in its own checkout and uploads its locks; parallel jobs
never share one lock file. The (model, SKU) stages live in the SKU's own files
(pipelines/<sku>/dvc.yaml and run/dvc.yaml, each with its dvc.lock): the SKU's job owns those
locks, so they are taken as it wrote them. The root dvc.lock holds the SKU-independent stages
(config, prepare, data, ...): each is taken from the first SKU in registry order that has it.
``dvc repro --pull`` cannot do this job: the build and publish stages have ``persist`` outputs,
which DVC keeps out of the run cache, so they would re-run on the assembling host, which is not
the SKU's hardware.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from pipeline.core.errors import InputError
from pipeline.core.io import atomic_write_bytes
from pipeline.engine.matrix import EXAMPLE_STAGES, GLOBAL_STAGES, MODEL_STAGES, pipeline_file
from pipeline.project.config import Registry
from pipeline.results.dvcmetrics import write_model_tables
from pipeline.verify.consistency import refresh_reports


def _load(path: Path) -> dict[str, Any]:
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InputError(
            f"cannot read the DVC lock file {path}: {exc}", hint="download the build jobs' artifacts again"
        ) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("stages"), dict):
        raise InputError(
            f"{path} is not a DVC lock file (no 'stages' mapping)",
            hint="pass the folder the build jobs' <sku>/dvc.lock files were downloaded to",
        )
    return doc


def _root_stage(name: str) -> bool:
    """A stage of the root dvc.yaml (an older lock also holds ``build@<model>-<sku>`` entries)."""
    return name.partition("@")[0] in (*GLOBAL_STAGES, *EXAMPLE_STAGES, *MODEL_STAGES)


def assemble(registry: Registry, locks_dir: Path, lock: Path | None = None) -> dict[str, Any]:
    """Merge ``locks_dir/<sku>/dvc.lock`` into ``lock`` (default: the project's dvc.lock) and take
    each SKU's own locks (``locks_dir/<sku>/pipelines/<sku>/dvc.lock`` and ``.../run/dvc.lock``) as
    they are, then refresh ``reports/consistency/`` from the SKUs' outputs in ``build/``
    (``consistency``: model -> the files written, or why not; ``written``: the lock files changed)."""
    import yaml

    lock = Path(lock) if lock is not None else registry.root / "dvc.lock"
    merged: dict[str, Any] = _load(lock) if lock.is_file() else {"schema": "2.0", "stages": {}}
    stages = {name: entry for name, entry in merged["stages"].items() if _root_stage(name)}
    found, taken, locks = [], set(), []
    for sku in registry.skus:  # registry order: deterministic
        job = Path(locks_dir) / sku
        own = [PurePosixPath(pipeline_file(sku, run)).with_name("dvc.lock").as_posix() for run in (False, True)]
        if not any((job / name).is_file() for name in ("dvc.lock", *own)):
            continue
        found.append(sku)
        if (job / "dvc.lock").is_file():
            for name, entry in _load(job / "dvc.lock")["stages"].items():
                if _root_stage(name) and name not in taken:
                    taken.add(name)
                    stages[name] = entry
        for name in own:
            if (job / name).is_file():
                _load(job / name)  # a lock file at all, before it replaces the project's
                if _write(registry.root / name, (job / name).read_text()):
                    locks.append(name)
    if not found:
        raise InputError(
            f"no <sku>/dvc.lock under {locks_dir}",
            hint="the build jobs upload build/ci/<sku>/dvc.lock and build/ci/<sku>/pipelines/ in their "
            "artifacts; did any succeed?",
        )
    merged["stages"] = dict(sorted(stages.items()))
    changed = _write(lock, yaml.safe_dump(merged, sort_keys=False))
    if changed:
        locks.insert(0, _shown(lock, registry.root))

    # each SKU job wrote its own metrics files; the per-model comparison and the grouped plot
    # tables (metrics/by_sku/) span them all
    compared = [str(path) for model in registry.models for path in write_model_tables(registry.root, model)]
    return {
        "lock": str(lock),
        "skus": found,
        "changed": bool(locks),
        "written": locks,
        "consistency": refresh_reports(registry),
        "metrics": compared,
    }


def _write(path: Path, text: str) -> bool:
    """Write ``text`` unless ``path`` holds it already; whether it wrote."""
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, text.encode())
    return True


def _shown(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)
