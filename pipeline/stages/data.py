"""data: golden, calibration, evaluation and hard-tail sets as model inputs, each hashed."""

from __future__ import annotations

from pipeline.core.errors import InputError
from pipeline.core.io import atomic_savez, atomic_write_json, sha256_arrays
from pipeline.core.paths import SPLITS
from pipeline.core.progress import Progress
from pipeline.project.artifacts import layout, log
from pipeline.project.config import Registry
from pipeline.project.data import LABELS, check_dataset, check_finite, check_range, generate, load_file, preprocess
from pipeline.results.reports import DataReport, DatasetRecord


def make_data(registry: Registry, model: str, progress: Progress | None = None) -> DataReport:
    spec = registry.model(model)
    pins = registry.pins(model)
    out = layout(registry)
    staged = {}
    for split in SPLITS:
        source = getattr(spec.datasets, split)
        if source is None:
            continue
        # everything is checked before anything is written: a refused set leaves no file behind
        if source.generate is not None:
            origin = f"generated (seed {source.generate.seed}, {source.generate.count} samples)"
            inputs = generate(spec, pins, source)
            check_dataset(spec, inputs, pins, split, raw=False)
            raw = {k: _unprocess(spec, k, v) for k, v in inputs.items()}
        else:
            origin = f"{spec.dir}/{source.path}"
            raw = load_file(spec, registry.root, source, split)
            check_dataset(spec, raw, pins, split, raw=True)
            check_finite(raw, split, origin, source.allow_non_finite)
            inputs = preprocess(spec, raw)
            check_dataset(spec, inputs, pins, split, raw=False)
        # preprocessing or a narrow dtype (float16) can overflow to Inf
        where = f"{origin} after preprocessing" if spec.preprocess and source.path else origin
        check_finite(inputs, split, where, source.allow_non_finite)
        if split == "calibration" and source.path is not None:  # generated sets stay in range by construction
            check_range(spec, inputs, split, where)
        staged[split] = (inputs, raw, origin)
    if spec.metric is not None:
        for split in ("evaluation", "hard_tail"):
            if split in staged and LABELS not in staged[split][0]:
                raise InputError(
                    f"dataset {split} of {model} has no labels, but the model declares a metric",
                    hint=f"add a '{LABELS}' array to the .npz (or set datasets.{split}.labels to its key)",
                )
    records = {}
    for split, (inputs, raw, origin) in staged.items():
        atomic_savez(out.split(model, split), **inputs)
        if split == "golden":
            atomic_savez(out.split(model, split, raw=True), **raw)
        records[split] = DatasetRecord(
            split=split,
            samples=len(next(iter(inputs.values()))),
            sha256=sha256_arrays(inputs),
            source=origin,
            has_labels=LABELS in inputs,
            synthetic=getattr(spec.datasets, split).generate is not None,
        )
    report = DataReport(model=model, splits=records)
    atomic_write_json(out.report(model, None, "data"), report.to_json())
    log(model).info("data: %s", ", ".join(f"{k} {v.samples}" for k, v in records.items()))
    return report


def _unprocess(spec, name, arr):
    """Raw values whose preprocessing gives ``arr`` (for end-to-end benchmarks)."""
    affine = spec.preprocess.get(name)
    if affine is None or name == LABELS:
        return arr
    return ((arr.astype("float64") - affine.offset) / affine.scale).astype("float32")
