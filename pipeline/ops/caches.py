"""``skuforge cache status`` and ``cache refresh``: the checked-in compiler caches of a project
(the cache policy a build follows is pipeline/backends/caches.py)."""

from __future__ import annotations

from typing import Any

from pipeline.backends import backend_class
from pipeline.backends.caches import CacheStatus, inspect
from pipeline.core.errors import ConfigError
from pipeline.core.io import read_json
from pipeline.project.artifacts import layout
from pipeline.project.config import Registry
from pipeline.results.reports import BuildReport
from pipeline.stages.build import build


def status(registry: Registry, skus: list[str] | None = None, models: list[str] | None = None) -> list[CacheStatus]:
    """``skuforge cache status``: each (SKU, model) of a backend that keeps a cache."""
    out = layout(registry)
    rows = []
    for sku in skus or sorted(registry.skus):
        spec = registry.sku(sku)
        backend = backend_class(spec.backend)()
        if backend.capabilities.cache is None:
            continue
        try:
            want = backend.cache_key(spec)
        except Exception:  # the SDK is missing here: the index is still shown
            want = None
        for model in models or sorted(registry.models):
            row = inspect(backend, sku, model, out.cache_dir(model, sku), want)
            report = out.report(model, sku, "build")
            if report.is_file():
                try:
                    cache = BuildReport.model_validate(read_json(report)).cache
                    row.last_build = cache.model_dump(mode="json") if cache else None
                except Exception:  # an unreadable report is shown as none
                    row.last_build = None
            rows.append(row)
    return rows


def refresh(
    registry: Registry, sku: str, models: list[str] | None = None, trials: int | None = None, progress: Any = None
) -> list[dict[str, Any]]:
    """``skuforge cache refresh``: build again ignoring the SKU's caches, so the backend rebuilds
    them (TVM tunes from scratch with ``trials`` or the SKU's budget; TensorRT times every
    tactic). A cache is replaced only when its build succeeds. Returns each build's cache record."""
    spec = registry.sku(sku)
    backend = backend_class(spec.backend)
    if backend.capabilities.cache is None:
        raise ConfigError(
            f"SKU {sku} uses the {backend.name} backend, which keeps no cache: nothing to refresh",
            hint="skuforge backends lists the backends with a cache",
        )
    records = []
    for model in models or sorted(registry.models):
        report = build(registry.pair(model, sku), progress=progress, cache_refresh=True, tuning_trials=trials)
        records.append({"model": model, "sku": sku, **(report.cache.model_dump(mode="json") if report.cache else {})})
    return records
