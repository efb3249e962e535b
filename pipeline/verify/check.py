"""The correctness check of a loaded engine: per-output errors against the reference, the task metric
paired with the reference's, and the placement and precision gates over the build's layers. The
validate stage and the remedy loop judge engines with it; the gates' statistics are in compare.py."""

from __future__ import annotations

from pipeline.core.budget import Budget
from pipeline.core.paths import REFERENCE_SPLITS
from pipeline.core.progress import Progress
from pipeline.project.artifacts import layout, load_arrays, read_report, run_plan
from pipeline.project.config import Registry
from pipeline.project.data import LABELS, run_dataset
from pipeline.results.reports import (
    COMPUTE_PRECISIONS,
    BuildReport,
    PlacementResult,
    PrecisionResult,
    PrepareReport,
    ReferenceReport,
)
from pipeline.verify.compare import (
    input_problems,
    metric_input_problems,
    metric_problems,
    metric_result,
    output_errors,
    output_problems,
    state_outputs,
)


def placement_gate(build: BuildReport, allowed: list[str] | None, max_fallback: int) -> PlacementResult:
    allowed = allowed if allowed is not None else build.requested_devices
    offending = [layer for layer in build.layers if layer.device is not None and layer.device not in allowed]
    return PlacementResult(
        allowed=allowed,
        offending=offending,
        max_fallback_nodes=max_fallback,
        partition_boundaries=build.partition_boundaries,
        passed=len(offending) <= max_fallback,
    )


def precision_gate(build: BuildReport, policy: str, max_mismatched: int) -> PrecisionResult:
    mismatched = [
        layer for layer in build.layers if layer.precision in COMPUTE_PRECISIONS and layer.precision != build.precision
    ]
    return PrecisionResult(
        requested=build.precision,
        mismatched=mismatched,
        policy=policy,
        max_mismatched_layers=max_mismatched,
        passed=policy == "warn" or len(mismatched) <= max_mismatched,
    )


def correctness(
    registry: Registry, model: str, sku: str, runner, progress: Progress | None = None, budget: Budget | None = None
):
    """A loaded engine against the reference: per-output errors on the golden split (agreement
    joined by the other referenced splits where golden alone cannot resolve it), the task metric
    per labelled split paired with the reference's, samples per split, and the engine's golden
    outputs. The remedy (pipeline/verify/remedy.py) judges its rebuilt engines with it too.
    ``budget``: checked before each engine call, which it counts and logs when slow."""
    spec = registry.model(model)
    out = layout(registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    ref = read_report(out.report(model, None, "reference"), ReferenceReport, "reference")
    tol = registry.tolerance(model, sku)
    gate = registry.metric_gate(model, sku)
    in_idx, out_idx, batch = run_plan(registry, model, prep.signature, sku)
    metrics, samples, got, expected = [], {}, {}, {}
    for split in REFERENCE_SPLITS:
        if split not in ref.samples:
            continue
        arrays = load_arrays(out.split(model, split), "data")
        expected[split] = load_arrays(out.reference_dir(model) / f"{split}.npz", "reference")
        samples[split] = len(arrays[spec.inputs[0].name])
        infer = runner.infer
        if budget is not None:
            step = batch if all(i is not None for i in in_idx.values()) else 1  # as run_dataset batches
            calls = -(-samples[split] // step)
            infer = budget.calls(infer, f"validate {split}", calls, "sample" if step == 1 else "batch")
        got[split] = run_dataset(infer, arrays, in_idx, out_idx, batch, progress, f"validate {split}")
        if spec.metric is not None and LABELS in arrays:
            max_drop = gate.max_drop_hard_tail if split == "hard_tail" else gate.max_drop
            metrics.append(
                metric_result(
                    split,
                    spec.metric.kind,
                    got[split][spec.metric.output],
                    expected[split][spec.metric.output],
                    arrays[LABELS],
                    max_drop,
                    gate.confidence,
                )
            )
    errors, golden = [], {}
    if "golden" in got:
        more = {
            name: [(split, got[split][name], expected[split][name]) for split in got if split != "golden"]
            for name in ref.outputs
        }
        errors = output_errors(
            got["golden"], expected["golden"], ref.outputs, tol, model, states=state_outputs(prep.signature), more=more
        )
        golden = {name: got["golden"][name] for name in ref.outputs}  # for the cross-SKU consistency matrix
    return errors, metrics, samples, golden


def correctness_failures(registry: Registry, model: str, errors: list, metrics: list) -> list[str]:
    """One line per failed output or metric, with its figures."""
    spec = registry.model(model)
    kind = spec.metric.kind if spec.metric else "metric"
    return [line for e in errors for line in output_problems(e)] + [
        line for m in metrics for line in metric_problems(m, kind)
    ]


def input_failures(errors: list, metrics: list) -> list[str]:
    """What the datasets cannot judge: an output they do not exercise, a set too small for its threshold."""
    return [line for e in errors for line in input_problems(e)] + [
        line for m in metrics for line in metric_input_problems(m)
    ]
