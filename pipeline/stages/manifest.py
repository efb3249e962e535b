"""manifest: every report of one (model, SKU) in one schema-valid document."""

from __future__ import annotations

from pipeline.core.io import atomic_write_json, read_json
from pipeline.core.progress import Progress
from pipeline.project.artifacts import RESULT, layout, log, read_report
from pipeline.project.config import Pair
from pipeline.results.dvcmetrics import write_metrics
from pipeline.results.manifest import Manifest, provenance, settle, validate_document
from pipeline.results.reports import BenchReport
from pipeline.tracking.evidence import assemble


def write_manifest(pair: Pair, progress: Progress | None = None) -> Manifest:
    registry, model, sku = pair.registry, pair.model, pair.sku
    path = layout(registry).manifest(model, sku)
    old = _previous(path)
    doc = settle(assemble(pair), old)
    prov = old.get("provenance") if old.get("digest") == doc["digest"] else None  # a no-op rebuild leaves no diff
    doc["provenance"] = prov or provenance(registry.root).to_json()
    manifest = Manifest.model_validate(doc)
    doc = manifest.to_json()
    validate_document(doc, str(path))
    atomic_write_json(path, doc)
    out = layout(registry)
    bench = read_report(out.report(model, sku, "bench"), BenchReport, "bench")
    write_metrics(registry.root, doc, out.latency_csv(model, sku), out.timeline_csv(model, sku), bench.sweep)
    log(model, sku).info("manifest %s (digest %s)", path, doc["digest"][:12], extra=RESULT)
    return manifest


def _previous(path) -> dict:
    """The manifest already there (for its provenance), or {} when absent or unreadable."""
    try:
        old = read_json(path)
    except (OSError, ValueError):
        return {}
    return old if isinstance(old, dict) else {}
