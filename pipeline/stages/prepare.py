"""prepare: check the model, infer shapes, run graph passes, record what changed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import DatasetSource, GenerateSpec, Registry
from ..errors import GateFailed, InputError
from ..graph import infer_shapes, load_model, op_counts, rename_axes, run_passes, signature, source_sha256
from ..io import atomic_write_bytes, atomic_write_json, sha256_bytes
from ..results import PrepareReport
from . import Progress
from .common import layout, log

if TYPE_CHECKING:
    import onnx

SELF_CHECK_SAMPLES = 4


def load_source(registry: Registry, model: str) -> "onnx.ModelProto":
    """The source model, checked against the spec, dynamic axes named as in params.yaml."""
    path = registry.model_file(model)
    proto = load_model(path, root=registry.path(registry.model(model).dir))
    rename_axes(proto, registry.model(model).inputs, path)
    return infer_shapes(proto, path)


def prepare(registry: Registry, model: str, progress: Progress | None = None) -> PrepareReport:
    import copy

    import numpy as np

    from ..backends.onnxruntime import reference_runner
    from ..data import generate, iter_batches

    spec = registry.model(model)
    path = registry.model_file(model)
    source = load_source(registry, model)
    sig = signature(source)
    names = [o.name for o in sig.outputs]
    for wanted in [*(spec.outputs or []), *([spec.metric.output] if spec.metric else [])]:
        if wanted not in names:
            raise InputError(f"{path}: params.yaml names output {wanted!r} but the model's outputs are {names}",
                             hint="fix models.<name>.outputs / metric.output")
    work = copy.deepcopy(source)
    records = run_passes(work)
    prepared = infer_shapes(work, path)
    data = prepared.SerializeToString()

    # The passes must not change the function: compare both on a few seeded inputs.
    pins = registry.pins(model)
    feeds_all = generate(spec, pins, DatasetSource(generate=GenerateSpec(count=SELF_CHECK_SAMPLES, seed=1234, edge_cases=False)))
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
        raise GateFailed(f"{model}: graph passes changed the model's outputs (relative error {worst:.3g})",
                         hint="this is a skuforge bug in a graph pass: report it with the model")
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
    log(model).info("prepared: %d -> %d nodes", len(source.graph.node), len(prepared.graph.node))
    return report
