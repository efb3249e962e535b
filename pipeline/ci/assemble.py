"""Assemble dvc.lock from the locks the per-SKU build jobs uploaded, and the cross-SKU consistency
reports from the golden outputs they uploaded.

Each matrix job runs its SKU's stages in its own checkout and uploads its dvc.lock; parallel jobs
never share one lock file. This merges them: from the lock of SKU S it takes only the stages of
(model, S) pairs, plus the SKU-independent stages (config, prepare, data, ...) from the first SKU
in registry order that has them. ``dvc repro --pull`` cannot do this job: the build and publish
stages have ``persist`` outputs, which DVC keeps out of the run cache, so they would re-run on the
assembling host, which is not the SKU's hardware.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError
from pipeline.core.io import atomic_write_bytes
from pipeline.project.config import Registry
from pipeline.results.dvcmetrics import write_comparison
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


def assemble(registry: Registry, locks_dir: Path, lock: Path | None = None) -> dict[str, Any]:
    """Merge ``locks_dir/<sku>/dvc.lock`` into ``lock`` (default: the project's dvc.lock), then
    refresh ``reports/consistency/`` from the SKUs' outputs in ``build/`` (``consistency``: model ->
    the files written, or why not)."""
    import yaml

    lock = Path(lock) if lock is not None else registry.root / "dvc.lock"
    merged: dict[str, Any] = _load(lock) if lock.is_file() else {"schema": "2.0", "stages": {}}
    stages: dict[str, Any] = dict(merged["stages"])
    found, shared_from = [], {}
    pairs = {sku: {f"{m}-{sku}" for m in registry.models} for sku in registry.skus}
    all_pairs = set().union(*pairs.values()) if pairs else set()
    for sku in registry.skus:  # registry order: deterministic
        path = Path(locks_dir) / sku / "dvc.lock"
        if not path.is_file():
            continue
        found.append(sku)
        for name, entry in _load(path)["stages"].items():
            item = name.partition("@")[2]
            if item in pairs[sku]:
                stages[name] = entry
            elif item not in all_pairs and name not in shared_from:
                shared_from[name] = sku
                stages[name] = entry
    if not found:
        raise InputError(
            f"no <sku>/dvc.lock under {locks_dir}",
            hint="the build jobs upload build/ci/<sku>/dvc.lock in their artifacts; did any succeed?",
        )
    merged["stages"] = dict(sorted(stages.items()))
    text = yaml.safe_dump(merged, sort_keys=False)
    changed = not lock.is_file() or lock.read_text() != text
    if changed:
        atomic_write_bytes(lock, text.encode())

    # each SKU job wrote its own metrics/bench files; the per-model comparison spans them all
    compared = [str(written) for model in registry.models if (written := write_comparison(registry.root, model))]
    return {
        "lock": str(lock),
        "skus": found,
        "changed": changed,
        "consistency": refresh_reports(registry),
        "metrics": compared,
    }
