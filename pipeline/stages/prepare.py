"""prepare: check the model, infer shapes, run graph passes, record what changed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.backends.reference import reference_runner
from pipeline.core.errors import GateFailed, InputError
from pipeline.core.io import atomic_write_bytes, atomic_write_json, sha256_bytes
from pipeline.core.progress import Progress
from pipeline.model.graph import (
    infer_shapes,
    load_model,
    mark_batch_axes,
    op_counts,
    output_batch_axes,
    rename_axes,
    run_passes,
    signature,
    source_sha256,
)
from pipeline.project.artifacts import RESULT, layout, log
from pipeline.project.config import DatasetSource, GenerateSpec, ModelSpec, Registry
from pipeline.project.data import generate, iter_batches
from pipeline.results.reports import PrepareReport

if TYPE_CHECKING:
    import onnx

SELF_CHECK_SAMPLES = 4


def load_source(registry: Registry, model: str) -> onnx.ModelProto:
    """The source model, checked against the spec, dynamic axes named as in params.yaml."""
    path = registry.model_file(model)
    proto = load_model(path, root=registry.path(registry.model(model).dir))
    rename_axes(proto, registry.model(model).inputs, path, registry.model(model).batch_axis)
    return infer_shapes(proto, path)


def batch_axes(model: str, spec: ModelSpec, pins: dict[str, int], prepared: onnx.ModelProto) -> dict[str, int | None]:
    """Each output's batch axis (None: it has none). Shape inference from the spec's axis names
    decides where it can; an output it leaves open (an unnamed or unknown dim) is probed: the
    model runs at batch 1 and 2 and the one axis whose size follows the batch is it."""
    axes = {a for i in spec.inputs for a in i.axes}
    if spec.batch_axis not in axes:  # a fixed batch: nothing to split
        return {o.name: None for o in prepared.graph.output}
    found = output_batch_axes(prepared, spec.batch_axis, axes)
    open_ = [o.name for o in prepared.graph.output if o.name not in found]
    if open_:
        found.update(probe_batch_axes(model, spec, pins, prepared.SerializeToString(), open_))
    return found


def probe_batch_axes(
    model: str, spec: ModelSpec, pins: dict[str, int], model_bytes: bytes, outputs: list[str]
) -> dict[str, int | None]:
    """The axis of each of ``outputs`` whose size is 1 at batch 1 and 2 at batch 2, all other dims
    unchanged; None where no single axis does, or the model does not run at batch 2 (then only
    batch 1 works, which needs no batch axis)."""
    import numpy as np

    feeds = generate(spec, pins, DatasetSource(generate=GenerateSpec(count=1, seed=4321)))
    bidx = {i.name: (i.shape.index(spec.batch_axis) if spec.batch_axis in i.shape else None) for i in spec.inputs}
    shapes = []
    with reference_runner(model_bytes) as runner:
        for batch in (1, 2):
            _, batched = next(iter_batches(feeds, bidx, batch))
            try:
                got = runner.infer(batched)
            except Exception as exc:  # ORT raises its own classes; a model fixed to batch 1 fails here
                log(model).warning(
                    "batch-axis probe: the model does not run at batch %d (%s); outputs %s are taken "
                    "to have no batch axis, so only batch 1 works",
                    batch,
                    str(exc).strip()[:200],
                    outputs,
                )
                return dict.fromkeys(outputs)
            shapes.append({k: np.shape(got[k]) for k in outputs})
    found: dict[str, int | None] = {}
    for name in outputs:
        one, two = shapes[0][name], shapes[1][name]
        follows = [
            i
            for i in range(len(one))
            if len(one) == len(two)
            and one[i] == 1
            and two[i] == 2
            and all(a == b for j, (a, b) in enumerate(zip(one, two, strict=True)) if j != i)
        ]
        found[name] = follows[0] if len(follows) == 1 else None
    return found


def prepare(registry: Registry, model: str, progress: Progress | None = None) -> PrepareReport:
    import copy

    import numpy as np

    spec = registry.model(model)
    path = registry.model_file(model)
    source = load_source(registry, model)
    sig = signature(source)
    names = [o.name for o in sig.outputs]
    post = [] if isinstance(spec.postprocess, str) else spec.postprocess.outputs()
    for wanted in [*(spec.outputs or []), *([spec.metric.output] if spec.metric else []), *post]:
        if wanted not in names:
            raise InputError(
                f"{path}: params.yaml names output {wanted!r} but the model's outputs are {names}",
                hint="fix models.<name>.outputs / metric.output / postprocess",
            )
    work = copy.deepcopy(source)
    records = run_passes(work)
    prepared = infer_shapes(work, path)
    pins = registry.pins(model)
    found = batch_axes(model, spec, pins, prepared)
    if spec.batch_axis is not None:
        mark_batch_axes(prepared, spec.batch_axis, found)
    data = prepared.SerializeToString()

    # The passes must not change the function: compare both on a few seeded inputs.
    feeds_all = generate(spec, pins, DatasetSource(generate=GenerateSpec(count=SELF_CHECK_SAMPLES, seed=1234)))
    bidx = {t.name: t.batch_index(spec.batch_axis) for t in sig.inputs}
    worst = 0.0
    with reference_runner(source.SerializeToString()) as ref, reference_runner(data) as new:
        for _, feeds in iter_batches(feeds_all, bidx, pins.get(spec.batch_axis or "", 1)):
            a, b = ref.infer(feeds), new.infer(feeds)
            for name in a:
                if not np.issubdtype(a[name].dtype, np.floating):
                    worst = max(worst, 0.0 if np.array_equal(a[name], b[name]) else np.inf)
                    continue
                same_nonfinite = np.array_equal(~np.isfinite(a[name]), ~np.isfinite(b[name]))
                diff = np.abs(np.nan_to_num(a[name] - b[name], nan=0.0, posinf=0.0, neginf=0.0))
                scale = max(1.0, float(np.max(np.abs(np.nan_to_num(a[name])), initial=0.0)))
                worst = max(worst, float(np.max(diff, initial=0.0)) / scale if same_nonfinite else np.inf)
    if not worst <= 1e-4:
        raise GateFailed(
            f"{model}: graph passes changed the model's outputs (relative error {worst:.3g})",
            hint="this is a skuforge bug in a graph pass: report it with the model",
        )
    worst = float(worst)

    report = PrepareReport(
        model=model,
        source_sha256=source_sha256(path, registry.path(spec.dir)),
        prepared_sha256=sha256_bytes(data),
        opset={o.domain or "ai.onnx": o.version for o in prepared.opset_import},
        producer=f"{source.producer_name} {source.producer_version}".strip(),
        signature=signature(prepared),
        passes=records,
        op_counts_before=op_counts(source),
        op_counts_after=op_counts(prepared),
        self_check_max_abs_error=worst,
    )
    out = layout(registry)
    atomic_write_bytes(out.prepared_model(model), data)
    atomic_write_json(out.report(model, None, "prepare"), report.to_json())
    log(model).info("prepared: %d -> %d nodes", len(source.graph.node), len(prepared.graph.node), extra=RESULT)
    return report
