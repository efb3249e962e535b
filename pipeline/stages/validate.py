"""validate: the engine against the reference (per output, with the SKU's tolerances), the task
metric on the evaluation and hard-tail sets, and the placement gate. The report is written
before a failing gate exits 1."""

from __future__ import annotations

from collections import Counter

from pipeline.backends import get_backend
from pipeline.compare import (
    input_problems,
    metric_input_problems,
    metric_problems,
    metric_result,
    metric_warnings,
    output_errors,
    output_problems,
    output_warnings,
    state_outputs,
)
from pipeline.config import Registry
from pipeline.data import LABELS, run_dataset
from pipeline.errors import GateFailed, InputError
from pipeline.io import atomic_savez, atomic_write_json, sha256_arrays
from pipeline.paths import REFERENCE_SPLITS
from pipeline.results import (
    BuildReport,
    PlacementResult,
    PrecisionResult,
    PrepareReport,
    ReferenceReport,
    ValidationReport,
)
from pipeline.stages import Progress
from pipeline.stages.build import require_host
from pipeline.stages.common import check_engine, layout, load_arrays, log, read_report, run_plan


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


# Precisions a layer computes in; "n/a" (data movement) and integer index ops are not judged.
COMPUTE_PRECISIONS = frozenset({"fp32", "fp16", "bf16", "int8", "fp8", "int4"})


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


def correctness(registry: Registry, model: str, sku: str, runner, progress: Progress | None = None):
    """A loaded engine against the reference: per-output errors on the golden split (agreement
    joined by the other referenced splits where golden alone cannot resolve it), the task metric
    per labelled split paired with the reference's, samples per split, and the engine's golden
    outputs. The remedy (pipeline/remedy.py) judges its rebuilt engines with it too."""
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
        got[split] = run_dataset(runner.infer, arrays, in_idx, out_idx, batch, progress, f"validate {split}")
        samples[split] = len(arrays[spec.inputs[0].name])
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


def _bisect(registry: Registry, model: str, sku: str):
    """The first divergent node of a failing engine (skus.<sku>.bisect.on_failure); a bisection that
    cannot run is recorded as inconclusive with the reason, never raised over the gate's own failure."""
    from pipeline.bisect import Bisection, bisect
    from pipeline.errors import SkuforgeError

    try:
        return bisect(registry, model, sku)
    except SkuforgeError as exc:
        spec = registry.sku(sku)
        return Bisection(
            model=model,
            sku=sku,
            backend=spec.backend,
            precision=spec.precision,
            verdict="inconclusive",
            summary=f"bisection could not run: {exc.message}",
            failing_outputs=[],
            candidates=0,
            builds=0,
            marks_per_build=spec.bisect.marks_per_build,
            samples=0,
        )


def validate(registry: Registry, model: str, sku: str, progress: Progress | None = None) -> ValidationReport:
    require_host(registry, sku)
    spec, sku_spec = registry.model(model), registry.sku(sku)
    out = layout(registry)
    build = read_report(out.report(model, sku, "build"), BuildReport, "build")
    outputs_sha = None
    with get_backend(sku_spec.backend).load(out.engine_dir(model, sku), sku_spec) as runner:
        engine_sha = check_engine(runner, build, out.engine_dir(model, sku), model, sku)
        errors, metrics, samples, golden = correctness(registry, model, sku, runner, progress)
    if golden:
        atomic_savez(out.engine_outputs(model, sku), **golden)
        outputs_sha = sha256_arrays(golden)
    placement = placement_gate(build, sku_spec.placement.allowed, sku_spec.placement.max_fallback_nodes)
    precision = precision_gate(build, sku_spec.precision_gate.policy, sku_spec.precision_gate.max_mismatched_layers)
    gate_failures = correctness_failures(registry, model, errors, metrics)
    unjudged = input_failures(errors, metrics)
    failures = gate_failures + unjudged
    if not placement.passed:
        nodes = ", ".join(f"{layer.name} ({layer.op_type}) on {layer.device}" for layer in placement.offending)
        failures.append(
            f"placement: {len(placement.offending)} nodes ran outside {placement.allowed} "
            f"(allowed {placement.max_fallback_nodes}): {nodes}"
        )
    warnings = [line for e in errors for line in output_warnings(e)] + [
        line for m in metrics for line in metric_warnings(m)
    ]
    if precision.mismatched:
        kinds = Counter(layer.precision for layer in precision.mismatched)
        line = (
            f"precision: {sku_spec.precision} was asked for but {len(precision.mismatched)} layers ran in "
            f"{', '.join(f'{k} ({n})' for k, n in sorted(kinds.items()))}: "
            + ", ".join(f"{layer.name} ({layer.op_type}, {layer.precision})" for layer in precision.mismatched[:20])
            + (" …" if len(precision.mismatched) > 20 else "")
        )
        (warnings if precision.passed else failures).append(line)
    bisection = None
    if gate_failures and sku_spec.bisect.on_failure:
        bisection = _bisect(registry, model, sku)
    report = ValidationReport(
        model=model,
        sku=sku,
        precision=sku_spec.precision,
        passed=not failures,
        failures=failures,
        outputs=errors,
        metrics=metrics,
        placement=placement,
        precision_gate=precision,
        warnings=warnings,
        samples=samples,
        engine_sha256=engine_sha,
        build_config_sha256=build.build_config_sha256,
        outputs_sha256=outputs_sha,
        bisection=bisection,
    )
    atomic_write_json(out.report(model, sku, "validate"), report.to_json())
    lg = log(model, sku)
    for w in warnings:
        lg.warning("%s", w)
    for e in errors:
        if e.top1_rows is not None:
            lg.info(
                "output %s: top-1 agreement %s/%s (%s ties) on %s, bounds %s",
                e.output,
                e.top1_agree,
                e.top1_rows,
                e.top1_ties,
                "+".join(e.top1_splits),
                e.top1_interval,
            )
    for m in metrics:
        lg.info(
            "%s %s: engine %.4f reference %.4f delta %+.4f on %d samples (%d worse, %d better, McNemar p=%.3g)",
            spec.metric.kind,
            m.split,
            m.engine,
            m.reference,
            m.delta,
            m.samples,
            m.worse,
            m.better,
            m.p_value,
        )
    if failures and len(failures) == len(unjudged):
        raise InputError(
            f"{model}/{sku}: the datasets cannot judge the engine:\n" + "\n".join(f"  - {f}" for f in failures),
            hint=f"see {out.report(model, sku, 'validate')} and docs/correctness.md (sample sizes)",
        )
    if failures:
        hint = f"see {out.report(model, sku, 'validate')}; loosen the SKU's tolerance only if the error is understood"
        lines = failures + ([f"bisection ({bisection.builds} builds): {bisection.summary}"] if bisection else [])
        if bisection is not None and bisection.suspects and sku_spec.precision != "fp32":
            hint = (
                f"keep the suspects in higher precision and re-validate: skuforge bisect --model {model} --sku {sku} "
                f"--fix (--apply writes params.yaml); {hint}"
            )
        raise GateFailed(f"{model}/{sku} failed validation:\n" + "\n".join(f"  - {f}" for f in lines), hint=hint)
    return report
