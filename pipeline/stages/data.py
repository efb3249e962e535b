"""data: golden, calibration, evaluation and hard-tail sets as model inputs, each hashed."""

from __future__ import annotations

import math

from pipeline.core.errors import InputError
from pipeline.core.io import atomic_savez, atomic_write_json, sha256_arrays
from pipeline.core.limits import DTYPE_BYTES, MAX_DATASET_BYTES, human_bytes
from pipeline.core.paths import SPLITS
from pipeline.core.progress import Progress
from pipeline.model.graph import infer_shapes, rename_axes, signature
from pipeline.project.artifacts import RESULT, layout, log
from pipeline.project.config import DatasetSource, ModelSpec, Registry
from pipeline.project.data import (
    LABELS,
    Classes,
    check_cast,
    check_classes,
    check_dataset,
    check_finite,
    check_range,
    generate,
    load_file,
    preprocess,
    targets,
)
from pipeline.project.files import NAMES, pack, read_files_dataset
from pipeline.project.processing import Preprocessor, describe
from pipeline.results.reports import DataReport, DatasetRecord


def make_data(registry: Registry, model: str, progress: Progress | None = None) -> DataReport:
    spec = registry.model(model)
    pins = registry.pins(model)
    out = layout(registry)
    classes = _classes(registry, model, spec)
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
        elif source.files is not None:
            inputs, raw, origin = _from_files(registry, spec, pins, source, split, classes)
            check_dataset(spec, inputs, pins, split, raw=False)
        else:
            origin = f"{spec.dir}/{source.path}"
            raw = load_file(spec, registry.root, source, split)
            check_dataset(spec, raw, pins, split, raw=True)
            check_finite(raw, split, origin, source.allow_non_finite)
            if classes is not None:
                check_classes(raw, classes, split, origin, source.labels)
            inputs = preprocess(spec, raw)
            check_cast(spec, raw, inputs, split, origin)
            check_dataset(spec, inputs, pins, split, raw=False)
        # preprocessing or a narrow dtype (float16) can overflow to Inf
        where = f"{origin} after preprocessing" if spec.preprocess and source.generate is None else origin
        check_finite(inputs, split, where, source.allow_non_finite)
        if split == "calibration" and source.generate is None:  # generated sets stay in range by construction
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
        source = getattr(spec.datasets, split)
        atomic_savez(out.split(model, split), **inputs)
        # the raw golden set feeds the end-to-end benchmark; raw files of every split, the drift check
        if split == "golden" or source.files is not None:
            atomic_savez(out.split(model, split, raw=True), **raw)
        records[split] = DatasetRecord(
            split=split,
            samples=len(next(iter(inputs.values()))),
            sha256=sha256_arrays(inputs),
            source=origin,
            has_labels=targets(inputs) is not None,
            synthetic=source.generate is not None,
            files=len(raw[NAMES]) if source.files is not None else None,
            raw_sha256=sha256_arrays(raw) if source.files is not None else None,
        )
    report = DataReport(
        model=model,
        splits=records,
        # the training-side implementation, as this host ran it: the manifest records it beside the device's
        preprocessing={name: describe(steps) for name, steps in spec.file_inputs.items()},
    )
    atomic_write_json(out.report(model, None, "data"), report.to_json())
    log(model).info("data: %s", ", ".join(f"{k} {v.samples}" for k, v in records.items()), extra=RESULT)
    return report


def _classes(registry: Registry, model: str, spec: ModelSpec) -> Classes | None:
    """The classes a top1_accuracy metric reads: the size per sample of its output in the source model
    (shapes inferred from the axes named in params.yaml; the weights stay unread). None without that
    metric, or where the model does not tell: a dynamic axis besides the batch, or a model prepare
    refuses (it says why); the reference stage then checks the labels against what the model outputs."""
    if spec.metric is None or spec.metric.kind != "top1_accuracy":
        return None
    import onnx  # here: a stage without that metric does not pay for its import

    try:
        path = registry.model_file(model)
        proto = onnx.load(str(path), load_external_data=False)
        rename_axes(proto, spec.inputs, path, spec.batch_axis)
        proto = infer_shapes(proto, path)
    except Exception:  # noqa: BLE001 - not readable, or not as params.yaml declares it: prepare says why
        return None
    output = next((o for o in signature(proto).outputs if o.name == spec.metric.output), None)
    if output is None:
        return None
    batch = output.batch_index(spec.batch_axis)
    dims = [d for i, d in enumerate(output.shape) if i != batch]
    if not all(isinstance(d, int) for d in dims):
        return None
    return Classes(output=output.name, count=math.prod(d for d in dims if isinstance(d, int)))


def _from_files(
    registry: Registry,
    spec: ModelSpec,
    pins: dict[str, int],
    source: DatasetSource,
    split: str,
    classes: Classes | None,
):
    """A folder of raw files through the model's declared (training-side) preprocessing: the model
    inputs, the packed files (for the drift check and the end-to-end benchmark) and the origin."""
    assert source.files is not None
    name, steps = next(iter(spec.file_inputs.items()))  # config: a files dataset feeds one decoded input
    inp = spec.input(name)
    shape = inp.shape_at(pins, drop=spec.batch_axis)
    # boxes.csv's boxes lie in the model input's pixels: (H, W) of a [C, H, W] or [H, W, C] sample
    extent = None
    if steps.decode == "image":
        extent = (shape[1], shape[2]) if steps.layout == "chw" else (shape[0], shape[1])
    found = read_files_dataset(
        registry.root,
        spec.dir,
        source.files,
        split,
        steps.decode,
        source.take,
        alphabet=spec.alphabet,
        extent=extent,
        classes=classes,
    )
    # decoded, the files are model inputs: the split's budget holds for them as for any array set
    sample = math.prod(shape)
    decoded = len(found.names) * sample * DTYPE_BYTES[inp.dtype]
    if decoded > MAX_DATASET_BYTES:
        raise InputError(
            f"dataset {split}: {len(found.names)} files decode to {human_bytes(decoded)} of model inputs, "
            f"over the {human_bytes(MAX_DATASET_BYTES)} a split may hold",
            hint=f"use fewer files (models.<name>.datasets.{split}.take) or a smaller input shape",
        )
    try:
        samples = Preprocessor(steps, inp.dtype)(found.blobs, found.names)
    except InputError as exc:  # it names the file: say which split and folder hold it
        raise InputError(f"dataset {split}: {found.folder}: {exc.message}", hint=exc.hint) from exc
    inputs = {name: samples, **found.targets}
    origin = f"{spec.dir}/{source.files} ({len(found.names)} files, {steps.library})"
    return inputs, pack(found.blobs, found.names, found.labels), origin


def _unprocess(spec, name, arr):
    """Raw values whose preprocessing gives ``arr`` (for end-to-end benchmarks)."""
    affine = spec.affine(name)
    if affine is None or name == LABELS:
        return arr
    return ((arr.astype("float64") - affine.offset) / affine.scale).astype("float32")
