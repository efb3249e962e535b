"""The correctness check of a loaded engine: per-output errors against the reference, the task metric
paired with the reference's, and the placement and precision gates over the build's layers. The
validate stage and the remedy loop judge engines with it; the gates' statistics are in compare.py."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pipeline.core.budget import Budget
from pipeline.core.paths import REFERENCE_SPLITS
from pipeline.core.progress import Progress
from pipeline.project.artifacts import layout, load_arrays, read_report, run_plan
from pipeline.project.config import ModelSpec, Pair
from pipeline.project.data import run_dataset, targets
from pipeline.results.reports import (
    COMPUTE_PRECISIONS,
    BuildReport,
    MetricResult,
    OutputError,
    PlacementResult,
    PrecisionResult,
    PrepareReport,
    ReferenceReport,
    TaskAgreement,
)
from pipeline.verify.compare import (
    input_problems,
    metric_input_problems,
    metric_problems,
    metric_result,
    output_errors,
    output_problems,
    state_outputs,
    structural_problems,
)
from pipeline.verify.sequence import MAX_SEQUENCES, sequence_errors
from pipeline.verify.task import metric_correct, task_agreement, task_short


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


@dataclass(frozen=True)
class Judgement:
    """A loaded engine against the reference: per-output errors (golden), task metrics per labelled
    split, the task agreement after the declared postprocess, samples per split, and the engine's
    golden outputs (for the cross-SKU consistency matrix)."""

    errors: list[OutputError]
    metrics: list[MetricResult]
    task: list[TaskAgreement]
    samples: dict[str, int]
    golden: dict[str, Any]

    @property
    def task_decides(self) -> bool:
        """The task agreement is the verdict: a postprocess gates and its sets resolve its threshold."""
        gated = [t for t in self.task if t.threshold is not None]
        return bool(gated) and all(t.judgeable for t in gated)


def correctness(pair: Pair, runner, progress: Progress | None = None, budget: Budget | None = None) -> Judgement:
    """A loaded engine against the reference: per-output errors on the golden split (agreement
    joined by the other referenced splits where golden alone cannot resolve it), the task metric
    per labelled split paired with the reference's, the task agreement after the declared
    postprocess (golden first, joined by the other splits while it cannot resolve its threshold),
    samples per split, and the engine's golden outputs. When the task agreement can judge, the
    tensor gates become diagnostics (``OutputError.gating`` false) unless the SKU's tolerance sets
    ``enforce``. The remedy (pipeline/verify/remedy.py) judges its rebuilt engines with it too.
    ``budget``: checked before each engine call, which it counts and logs when slow."""
    model, spec = pair.model, pair.spec
    out = layout(pair.registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    ref = read_report(out.report(model, None, "reference"), ReferenceReport, "reference")
    tol, gate = pair.tolerance, pair.metric_gate
    in_idx, out_idx, batch = run_plan(pair, prep.signature)
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
        labels = targets(arrays)
        if spec.metric is not None and labels is not None:
            max_drop = gate.max_drop_hard_tail if split == "hard_tail" else gate.max_drop
            e_ok, e_figures = metric_correct(spec, got[split], labels)
            r_ok, r_figures = metric_correct(spec, expected[split], labels)
            figures = {f"engine_{k}": v for k, v in e_figures.items()} | {
                f"reference_{k}": v for k, v in r_figures.items()
            }
            metrics.append(metric_result(split, e_ok, r_ok, max_drop, gate.confidence, figures))
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
    task = task_agreement(spec, tol.task, got, expected) if tol.task is not None else []
    judgement = Judgement(errors=errors, metrics=metrics, task=task, samples=samples, golden=golden)
    if judgement.task_decides and not tol.enforce:
        judgement = replace(judgement, errors=[e.model_copy(update={"gating": False}) for e in errors])
    if spec.sequence is not None and "golden" in got:
        # the state fed back over a sequence has no task statistic: its tensor gates always decide
        infer = runner.infer
        if budget is not None:
            calls = spec.sequence.steps * min(samples["golden"] // spec.sequence.steps, MAX_SEQUENCES)
            infer = budget.calls(infer, "validate sequence", calls, "sample")
        golden_arrays = load_arrays(out.split(model, "golden"), "data")
        after = sequence_errors(
            spec, spec.sequence, golden_arrays, infer, out.prepared_model(model), in_idx, out_idx, batch, tol
        )
        judgement = replace(judgement, errors=[*judgement.errors, *after])
    return judgement


def correctness_failures(spec: ModelSpec, j: Judgement) -> list[str]:
    """One line per failed output, task agreement or metric, with its figures. An output whose
    tensor gates do not decide fails only on its shape, NaN/Inf or a degenerate value."""
    kind = spec.metric.kind if spec.metric else "metric"
    return (
        [line for e in j.errors for line in (output_problems(e) if e.gating else structural_problems(e))]
        + [t.failure for t in j.task if t.failure]
        + [line for m in j.metrics for line in metric_problems(m, kind)]
    )


def diagnostics(j: Judgement) -> list[str]:
    """The tensor-gate lines that did not decide (the task agreement did)."""
    return [
        f"{line} (diagnostic: the task agreement decides)"
        for e in j.errors
        if not e.gating
        for line in output_problems(e)
        if line not in structural_problems(e)
    ]


def input_failures(j: Judgement) -> list[str]:
    """What the datasets cannot judge: an output they do not exercise, a set too small for its threshold."""
    return [line for e in j.errors if e.gating for line in input_problems(e)] + [
        line for m in j.metrics for line in metric_input_problems(m)
    ]


def task_warnings(j: Judgement) -> list[str]:
    """A postprocess whose agreement cannot judge: the tensor gates decide in its place."""
    return [f"{short}; the tensor gates decide" for t in j.task if (short := task_short(t))]
