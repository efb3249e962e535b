"""config: the registry resolved into one small JSON file per example, model and (model, SKU).

DVC tracks these files instead of params.yaml keys: it then parses params.yaml once per run (in
this stage) rather than once per stage, which keeps a no-op `dvc repro` fast as SKUs multiply,
and a stage re-runs exactly when the settings it reads change.
"""

from __future__ import annotations

from typing import Any

from pipeline.core.io import atomic_write_bytes, to_json
from pipeline.core.progress import Progress
from pipeline.project.artifacts import layout
from pipeline.project.config import Registry


def resolved(registry: Registry) -> dict[str, dict[str, Any]]:
    """File name -> the settings a stage of that example, model or pair reads."""
    out = layout(registry)
    files: dict[str, dict[str, Any]] = {}
    for name, example in registry.examples.items():
        files[out.config_file(name, example=True).name] = {"example": name, **example.model_dump(mode="json")}
    for model, spec in registry.models.items():
        # per-SKU overrides are read by the pair's stages only: editing them reruns no model stage
        files[out.config_file(model).name] = {
            "model": model,
            "spec": spec.model_dump(mode="json", exclude={"higher_precision"}),
            "pins": registry.pins(model),
        }
        for _, sku in registry.pairs(models=[model]):
            files[out.config_file(model, sku).name] = registry.pair(model, sku).settings()
    return files


def write_config(registry: Registry, progress: Progress | None = None) -> dict[str, Any]:
    """Write the resolved files; unchanged ones are left alone, stale ones removed."""
    folder = layout(registry).config_dir()
    folder.mkdir(parents=True, exist_ok=True)
    files = resolved(registry)
    changed = []
    for name, content in files.items():
        data = to_json(content).encode()
        path = folder / name
        if not path.is_file() or path.read_bytes() != data:
            atomic_write_bytes(path, data)
            changed.append(name)
    stale = [p.name for p in folder.glob("*.json") if p.name not in files]
    for name in stale:
        (folder / name).unlink()
    return {"files": len(files), "changed": sorted(changed), "removed": sorted(stale)}
