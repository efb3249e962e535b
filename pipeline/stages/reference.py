"""reference: ONNX Runtime CPU FP32 outputs of the source model on every split."""

from __future__ import annotations

from pipeline.backends.reference import reference_runner, runtime_version
from pipeline.core.errors import InputError
from pipeline.core.io import atomic_savez, atomic_write_json, sha256_arrays
from pipeline.core.paths import REFERENCE_SPLITS
from pipeline.core.progress import Progress
from pipeline.project.artifacts import RESULT, layout, load_arrays, log, model_run_plan, read_report
from pipeline.project.config import Registry
from pipeline.project.data import run_dataset, targets
from pipeline.results.reports import DataReport, PrepareReport, ReferenceReport
from pipeline.stages.prepare import load_source
from pipeline.verify.task import metric_correct


def reference(registry: Registry, model: str, progress: Progress | None = None) -> ReferenceReport:
    import numpy as np

    spec = registry.model(model)
    out = layout(registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    data = read_report(out.report(model, None, "data"), DataReport, "data")
    in_idx, out_idx, batch = model_run_plan(registry, model, prep.signature)  # the model's pin: no SKU's
    source = load_source(registry, model)
    outputs = spec.outputs or [o.name for o in prep.signature.outputs]
    metric, hashes, samples = {}, {}, {}
    with reference_runner(source.SerializeToString()) as runner:
        for split in REFERENCE_SPLITS:
            if split not in data.splits:
                continue
            arrays = load_arrays(out.split(model, split), "data")
            result = run_dataset(runner.infer, arrays, in_idx, out_idx, batch, progress, f"reference {split}")
            result = {k: result[k] for k in outputs}
            for name, value in result.items():
                if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
                    bad = int((~np.isfinite(value)).sum())
                    raise InputError(
                        f"reference run of {model} gives {bad} NaN/Inf values in output {name!r} on the {split} set",
                        hint="the model or its inputs are broken: "
                        "check the model, models.<name>.inputs[].range and preprocess",
                    )
            atomic_savez(out.reference_dir(model) / f"{split}.npz", **result)
            hashes[split] = sha256_arrays(result)
            samples[split] = len(arrays[spec.inputs[0].name])
            labels = targets(arrays)
            if spec.metric is not None and labels is not None:
                metric[split] = float(metric_correct(spec, result, labels)[0].mean())
    report = ReferenceReport(
        model=model,
        runtime="onnxruntime CPUExecutionProvider fp32, optimisations off",
        runtime_version=runtime_version(),
        outputs=outputs,
        samples=samples,
        metric=metric,
        output_sha256=hashes,
    )
    atomic_write_json(out.report(model, None, "reference"), report.to_json())
    log(model).info("reference: %s", ", ".join(f"{k} {v:.4f}" for k, v in metric.items()) or "no metric", extra=RESULT)
    return report
