"""validate: the engine against the reference (per output, with the SKU's tolerances), the task
metric on the evaluation and hard-tail sets, and the placement gate. The report is written
before a failing gate exits 1."""

from __future__ import annotations

from collections import Counter

from pipeline.backends import get_backend
from pipeline.core.budget import Budget
from pipeline.core.errors import GateFailed, InputError, SkuforgeError
from pipeline.core.io import atomic_savez, atomic_write_json, sha256_arrays
from pipeline.core.progress import Progress
from pipeline.engine.build import require_emulation, require_host
from pipeline.engine.matrix import EMULATE_STAGE
from pipeline.project.artifacts import check_engine, layout, log, read_report
from pipeline.project.config import Pair
from pipeline.results.reports import (
    BuildReport,
    PlacementResult,
    PrecisionResult,
    PreprocessingDrift,
    ValidationReport,
)
from pipeline.verify.bisect import Bisection, bisect
from pipeline.verify.check import (
    Judgement,
    correctness,
    correctness_failures,
    diagnostics,
    input_failures,
    placement_gate,
    precision_gate,
    task_warnings,
)
from pipeline.verify.compare import (
    metric_warnings,
    output_warnings,
)
from pipeline.verify.drift import drift_line, preprocessing_drift
from pipeline.verify.task import task_text


def _bisect(pair: Pair):
    """The first divergent node of a failing engine (skus.<sku>.bisect.on_failure); a bisection that
    cannot run is recorded as inconclusive with the reason, never raised over the gate's own failure."""

    try:
        return bisect(pair)
    except SkuforgeError as exc:
        spec = pair.sku_spec
        return Bisection(
            model=pair.model,
            sku=pair.sku,
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


def _gate_lines(
    pair: Pair,
    judgement: Judgement,
    drift: list[PreprocessingDrift],
    placement: PlacementResult,
    precision: PrecisionResult,
    failures: list[str],
) -> list[str]:
    """The placement and precision gates' lines (failures appended to ``failures``) and the warnings."""
    model, sku, sku_spec = pair.model, pair.sku, pair.sku_spec
    errors, metrics = judgement.errors, judgement.metrics
    if not placement.passed:
        nodes = ", ".join(f"{layer.name} ({layer.op_type}) on {layer.device}" for layer in placement.offending)
        failures.append(
            f"placement: {len(placement.offending)} nodes ran outside {placement.allowed} "
            f"(allowed {placement.max_fallback_nodes}): {nodes}"
        )
    warnings = (
        [line for e in errors if e.gating for line in output_warnings(e)]
        + [line for m in metrics for line in metric_warnings(m)]
        + task_warnings(judgement)
    )
    gate = sku_spec.preprocessing
    if not drift and (
        gate.device is not None
        or gate.max_metric_drop is not None
        or gate.max_input_diff is not None
        or gate.max_agreement_drop is not None
    ):
        warnings.append(
            f"skus.{sku}.preprocessing: {model} has no input made from raw files (preprocess.<input>.decode "
            "with files datasets), so no drift check ran for it"
        )
    if precision.mismatched:
        kinds = Counter(layer.precision for layer in precision.mismatched)
        line = (
            f"precision: {sku_spec.precision} was asked for but {len(precision.mismatched)} layers ran in "
            f"{', '.join(f'{k} ({n})' for k, n in sorted(kinds.items()))}: "
            + ", ".join(f"{layer.name} ({layer.op_type}, {layer.precision})" for layer in precision.mismatched[:20])
            + (" …" if len(precision.mismatched) > 20 else "")
        )
        (warnings if precision.passed else failures).append(line)
    return warnings


def _log_report(pair: Pair, report: ValidationReport, judgement: Judgement) -> None:
    """What validate found, in the log: warnings, top-1 agreement, task verdicts, drift, metrics."""
    model, sku, spec = pair.model, pair.sku, pair.spec
    warnings, errors, drift, metrics = report.warnings, report.outputs, report.preprocessing, report.metrics
    lg = log(model, sku)
    if report.emulation:
        lg.info(
            "ran under emulation (%s, %s; not benchmarked): %s",
            report.emulation.get("emulator"),
            report.emulation.get("cpu"),
            ", ".join(f"{k} {v}" for k, v in report.emulation.get("runtime", {}).items()),
        )
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
    for t in judgement.task:
        lg.info("%s", task_text(t))
    for line in report.diagnostics:
        lg.info("%s", line)
    for d in drift:
        lg.info("%s", drift_line(d))
    for m in metrics:
        assert spec.metric is not None  # correctness() measures metrics only for a model that declares one
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


def _raise_on_failures(
    pair: Pair, failures: list[str], unjudged: list[str], bisection: Bisection | None, stage: str = "validate"
) -> None:
    """InputError when only the data could not judge the engine; GateFailed with the bisection's
    finding and the remedy's command otherwise."""
    model, sku, sku_spec = pair.model, pair.sku, pair.sku_spec
    report = layout(pair.registry).report(model, sku, stage)
    if failures and len(failures) == len(unjudged):
        raise InputError(
            f"{model}/{sku}: the datasets cannot judge the engine:\n" + "\n".join(f"  - {f}" for f in failures),
            hint=f"see {report} and docs/correctness.md (sample sizes)",
        )
    if failures:
        hint = f"see {report}; loosen the SKU's tolerance only if the error is understood"
        lines = failures + ([f"bisection ({bisection.builds} builds): {bisection.summary}"] if bisection else [])
        if bisection is not None and bisection.suspects and sku_spec.precision != "fp32":
            what = (
                "keep the suspects in higher precision"
                if any(s.keep for s in bisection.suspects)
                else "the suspect cannot be kept precise itself: keep what feeds it"
            )
            hint = (
                f"{what} and re-validate: skuforge bisect --model {model} --sku {sku} "
                f"--fix (--apply writes params.yaml); {hint}"
            )
        under = " under emulation" if stage == EMULATE_STAGE else ""
        raise GateFailed(f"{model}/{sku} failed validation{under}:\n" + "\n".join(f"  - {f}" for f in lines), hint=hint)


def validate(pair: Pair, progress: Progress | None = None) -> ValidationReport:
    """The engine on this host, which runs the SKU's target (or reaches its device bench)."""
    require_host(pair.sku, pair.sku_spec)
    return _validate(pair, progress, "validate")


def emulate(pair: Pair, progress: Progress | None = None) -> ValidationReport:
    """validate under QEMU user-mode emulation: an aarch64 SKU's engine on this x86-64 host, run by
    the SKU's runtime built for its CPU (pipeline/backends/emulated), judged by the same gates;
    written to emulate.json and emulate_outputs.npz (the device's own validate.json is never this;
    the consistency matrix takes them where the device's are absent, marked emulated). No bisection:
    its rebuilt candidates would run natively here."""
    require_emulation(pair.sku, pair.sku_spec)
    return _validate(pair, progress, EMULATE_STAGE)


def _validate(pair: Pair, progress: Progress | None, stage: str) -> ValidationReport:
    model, sku, sku_spec = pair.model, pair.sku, pair.sku_spec
    emulated = stage == EMULATE_STAGE
    out = layout(pair.registry)
    build = read_report(out.report(model, sku, "build"), BuildReport, "build")
    outputs_sha = None
    # the budget covers loading and the engine calls; what follows them is bounded by the data's size
    budget = Budget(sku_spec.max_seconds, stage, f"skus.{sku}.max_seconds", log(model, sku))
    backend = get_backend(sku_spec.backend)
    load = backend.load_emulated if emulated else backend.load
    with budget.watch(), load(out.engine_dir(model, sku), sku_spec) as runner:
        engine_sha = check_engine(runner, build, out.engine_dir(model, sku), model, sku)
        judgement = correctness(pair, runner, progress, budget)
        errors, metrics, golden = judgement.errors, judgement.metrics, judgement.golden
        # the device's preprocessing against the training side's, through this engine (docs/preprocessing.md)
        drift = preprocessing_drift(pair, runner, {m.split: m.engine for m in metrics}, progress, budget)
    if golden:
        atomic_savez(out.engine_outputs(model, sku, stage), **golden)
        outputs_sha = sha256_arrays(golden)
    placement = placement_gate(build, sku_spec.placement.allowed, sku_spec.placement.max_fallback_nodes)
    precision = precision_gate(build, sku_spec.precision_gate.policy, sku_spec.precision_gate.max_mismatched_layers)
    gate_failures = correctness_failures(pair.spec, judgement)
    unjudged = input_failures(judgement) + [d.failure for d in drift if d.failure and not d.judgeable]
    failures = gate_failures + [d.failure for d in drift if d.failure and d.judgeable] + unjudged
    warnings = _gate_lines(pair, judgement, drift, placement, precision, failures)
    bisection = None
    if gate_failures and sku_spec.bisect.on_failure and not emulated:
        bisection = _bisect(pair)
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
        samples=judgement.samples,
        engine_sha256=engine_sha,
        build_config_sha256=build.build_config_sha256,
        outputs_sha256=outputs_sha,
        bisection=bisection,
        task=judgement.task,
        diagnostics=diagnostics(judgement),
        preprocessing=drift,
        emulation=runner.emulation,
    )
    atomic_write_json(out.report(model, sku, stage), report.to_json())
    _log_report(pair, report, judgement)
    _raise_on_failures(pair, failures, unjudged, bisection, stage)
    return report
