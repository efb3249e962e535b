"""calibrate: activation ranges of the prepared model over the calibration set (for INT8 SKUs)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from pipeline.backends.reference import calibrate as ort_calibrate
from pipeline.core.io import atomic_write_json, sha256_file
from pipeline.core.progress import Progress
from pipeline.model.graph import pin_axes
from pipeline.project.artifacts import RESULT, calibration_batches, calibration_table, layout, log, read_report
from pipeline.project.config import Registry
from pipeline.results.reports import CalibrationReport, DataReport, PrepareReport


def calibrate(registry: Registry, model: str, progress: Progress | None = None) -> CalibrationReport:
    import onnx

    spec = registry.model(model)
    out = layout(registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    data = read_report(out.report(model, None, "data"), DataReport, "data")
    pins = registry.pins(model)
    batches, samples = calibration_batches(registry, model, spec, pins, prep.signature)
    prepared = out.prepared_model(model)
    with tempfile.TemporaryDirectory(prefix="skuforge-cal-") as tmp:
        pinned = Path(tmp) / "pinned.onnx"
        onnx.save(pin_axes(onnx.load(str(prepared)), pins, prepared), str(pinned))
        tensors = ort_calibrate(pinned, batches, spec.calibration.method, calibration_table(registry, model))
    report = CalibrationReport(
        model=model,
        method=spec.calibration.method,
        samples=samples,
        calibration_set_sha256=data.splits["calibration"].sha256,
        tensors=tensors,
        table_sha256=sha256_file(calibration_table(registry, model)),
    )
    atomic_write_json(out.report(model, None, "calibrate"), report.to_json())
    log(model).info("calibrate: %s over %d samples, %d tensors", report.method, samples, tensors, extra=RESULT)
    return report
