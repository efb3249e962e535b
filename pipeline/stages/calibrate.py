"""calibrate: activation ranges of the prepared model over the calibration set (for INT8 SKUs)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from pipeline.backends.reference import calibrate as ort_calibrate
from pipeline.core.io import atomic_write_json, sha256_file
from pipeline.core.progress import Progress
from pipeline.model.graph import pin_axes
from pipeline.project.artifacts import batch_indices, calibration_table, layout, load_arrays, log, read_report
from pipeline.project.config import Registry
from pipeline.project.data import LABELS, check_finite, iter_batches
from pipeline.results.reports import CalibrationReport, DataReport, PrepareReport


def calibrate(registry: Registry, model: str, progress: Progress | None = None) -> CalibrationReport:
    import onnx

    spec = registry.model(model)
    out = layout(registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    data = read_report(out.report(model, None, "data"), DataReport, "data")
    arrays = load_arrays(out.split(model, "calibration"), "data")
    arrays.pop(LABELS, None)
    # NaN/Inf would give infinite ranges; the data stage refuses them, this catches data written before it did
    check_finite(arrays, "calibration", str(out.split(model, "calibration")))
    if spec.calibration.samples is not None:
        arrays = {k: v[: spec.calibration.samples] for k, v in arrays.items()}
    pins = registry.pins(model)
    in_idx, _ = batch_indices(registry, model, prep.signature)
    batches = [feeds for _, feeds in iter_batches(arrays, in_idx, pins.get(spec.batch_axis or "", 1))]
    samples = len(next(iter(arrays.values())))
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
    log(model).info("calibrate: %s over %d samples, %d tensors", report.method, samples, tensors)
    return report
