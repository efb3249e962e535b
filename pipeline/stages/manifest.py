"""manifest: every report of one (model, SKU) in one schema-valid document."""

from __future__ import annotations

from ..config import Registry
from ..io import atomic_write_json, read_json
from ..manifest import digest, provenance, validate_document
from ..results import (BenchReport, BuildReport, CalibrationReport, DataReport, Manifest, PrepareReport,
                       ValidationReport)
from ..runner.probe import host
from . import Progress
from .common import layout, log, read_report


def write_manifest(registry: Registry, model: str, sku: str, progress: Progress | None = None) -> Manifest:
    out = layout(registry)
    sku_spec = registry.sku(sku)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    data = read_report(out.report(model, None, "data"), DataReport, "data")
    build = read_report(out.report(model, sku, "build"), BuildReport, "build")
    val = read_report(out.report(model, sku, "validate"), ValidationReport, "validate")
    bench = read_report(out.report(model, sku, "bench"), BenchReport, "bench")
    calibration = None
    if build.calibration is not None:
        cal = read_report(out.report(model, None, "calibrate"), CalibrationReport, "calibrate")
        calibration = {**build.calibration, "calibration_set_sha256": cal.calibration_set_sha256, "samples": cal.samples}
    body = {
        "schema_version": 1,
        "model": model,
        "sku": sku,
        "source": {"path": f"{registry.model(model).dir}/{registry.model(model).source}", "sha256": prep.source_sha256,
                   "prepared_sha256": prep.prepared_sha256, "opset": prep.opset, "producer": prep.producer,
                   "passes": [p.to_json() for p in prep.passes]},
        "target": sku_spec.target.model_dump(mode="json") | {"runner_labels": sku_spec.runner_labels},
        "backend": build.backend,
        "precision": build.precision,
        "toolchain": build.versions,
        "build_config_sha256": build.config_sha256,
        "shapes": build.shapes,
        "profiles": build.profiles,
        "signature": prep.signature.to_json(),
        "engine": [f.to_json() for f in build.engine_files],
        "build": {"seconds": build.build_seconds, "warnings": build.warnings, "options": build.options},
        "hardware_specific": build.hardware_specific,
        "calibration": calibration,
        "timing_cache_sha256": build.timing_cache.sha256 if build.timing_cache else None,
        "datasets": {k: v.sha256 for k, v in data.splits.items()},
        "layers": [layer.to_json() for layer in build.layers],
        "placement": build.placement,
        "precision_counts": build.precision_counts,
        "correctness": {"passed": val.passed, "failures": val.failures,
                        "outputs": [e.to_json() for e in val.outputs], "metrics": [m.to_json() for m in val.metrics],
                        "placement": {"passed": val.placement.passed, "allowed": val.placement.allowed,
                                      "offending": len(val.placement.offending),
                                      "partition_boundaries": val.placement.partition_boundaries},
                        "precision": {"passed": val.precision_gate.passed, "requested": val.precision_gate.requested,
                                      "policy": val.precision_gate.policy,
                                      "mismatched_layers": len(val.precision_gate.mismatched)},
                        "warnings": val.warnings},
        "benchmark": {"batch": bench.batch, "concurrency": bench.concurrency, "engine_only": bench.engine_only.to_json(),
                      "end_to_end": bench.end_to_end.to_json(), "throughput_per_s": bench.throughput_per_s,
                      "first_inference_ms": bench.first_inference_ms, "load_seconds": bench.load_seconds,
                      "memory_mb": bench.memory_mb, "device_state": bench.device_state},
        "host": host(),
    }
    body["digest"] = digest(body)
    path = out.manifest(model, sku)
    if path.is_file():  # unchanged content keeps its provenance: a no-op rebuild leaves no diff
        old = read_json(path)
        prov = old.get("provenance") if old.get("digest") == body["digest"] else None
    else:
        prov = None
    body["provenance"] = prov or provenance(registry.root).to_json()
    manifest = Manifest.model_validate(body)
    doc = manifest.to_json()
    validate_document(doc, str(path))
    atomic_write_json(path, doc)
    log(model, sku).info("manifest %s (digest %s)", path, body["digest"][:12])
    return manifest
