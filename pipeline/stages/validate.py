"""validate: the engine against the reference (per output, with the SKU's tolerances), the task
metric on the evaluation and hard-tail sets, and the placement gate. The report is written
before a failing gate exits 1."""

from __future__ import annotations

from collections import Counter

from ..backends import get_backend
from ..compare import METRICS, output_error
from ..config import Registry
from ..data import LABELS, run_dataset
from ..errors import GateFailed
from ..io import atomic_write_json
from ..paths import REFERENCE_SPLITS
from ..results import (BuildReport, MetricResult, PlacementResult, PrecisionResult, PrepareReport, ReferenceReport,
                       ValidationReport)
from . import Progress
from .build import require_host
from .common import check_engine, layout, load_arrays, log, read_report, run_plan


def placement_gate(build: BuildReport, allowed: list[str] | None, max_fallback: int) -> PlacementResult:
    allowed = allowed if allowed is not None else build.requested_devices
    offending = [layer for layer in build.layers if layer.device is not None and layer.device not in allowed]
    return PlacementResult(allowed=allowed, offending=offending, max_fallback_nodes=max_fallback,
                           partition_boundaries=build.partition_boundaries, passed=len(offending) <= max_fallback)


# Precisions a layer computes in; "n/a" (data movement) and integer index ops are not judged.
COMPUTE_PRECISIONS = frozenset({"fp32", "fp16", "bf16", "int8", "fp8", "int4"})


def precision_gate(build: BuildReport, policy: str, max_mismatched: int) -> PrecisionResult:
    mismatched = [layer for layer in build.layers
                  if layer.precision in COMPUTE_PRECISIONS and layer.precision != build.precision]
    return PrecisionResult(requested=build.precision, mismatched=mismatched, policy=policy,
                           max_mismatched_layers=max_mismatched,
                           passed=policy == "warn" or len(mismatched) <= max_mismatched)


def validate(registry: Registry, model: str, sku: str, progress: Progress | None = None) -> ValidationReport:
    require_host(registry, sku)
    spec, sku_spec = registry.model(model), registry.sku(sku)
    out = layout(registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    ref = read_report(out.report(model, None, "reference"), ReferenceReport, "reference")
    build = read_report(out.report(model, sku, "build"), BuildReport, "build")
    tol = registry.tolerance(model, sku)
    gate = registry.metric_gate(model, sku)
    in_idx, out_idx, batch = run_plan(registry, model, prep.signature, sku)
    errors, metrics, samples = [], [], {}
    with get_backend(sku_spec.backend).load(out.engine_dir(model, sku), sku_spec) as runner:
        engine_sha = check_engine(runner, build, out.engine_dir(model, sku), model, sku)
        for split in REFERENCE_SPLITS:
            if split not in ref.samples:
                continue
            arrays = load_arrays(out.split(model, split), "data")
            expected = load_arrays(out.reference_dir(model) / f"{split}.npz", "reference")
            got = run_dataset(runner.infer, arrays, in_idx, out_idx, batch, progress, f"validate {split}")
            samples[split] = len(arrays[spec.inputs[0].name])
            if split == "golden":
                errors = [output_error(name, got[name], expected[name], tol) for name in ref.outputs]
            if spec.metric is not None and LABELS in arrays:
                engine_score = METRICS[spec.metric.kind](got[spec.metric.output], arrays[LABELS])
                max_drop = gate.max_drop_hard_tail if split == "hard_tail" else gate.max_drop
                delta = engine_score - ref.metric[split]
                metrics.append(MetricResult(split=split, reference=ref.metric[split], engine=engine_score,
                                            delta=delta, max_drop=max_drop, passed=-delta <= max_drop + 1e-12))
    placement = placement_gate(build, sku_spec.placement.allowed, sku_spec.placement.max_fallback_nodes)
    precision = precision_gate(build, sku_spec.precision_gate.policy, sku_spec.precision_gate.max_mismatched_layers)
    failures = [f"output {e.output}: {e.mismatch_fraction:.2%} of elements beyond atol={e.atol} rtol={e.rtol} "
                f"(allowed {e.max_mismatch:.2%}; max abs error {e.max_abs_error:.3g})" for e in errors if not e.passed]
    failures += [f"{spec.metric.kind if spec.metric else 'metric'} on {m.split}: {m.engine:.4f} vs reference {m.reference:.4f} "
                 f"(drop {-m.delta:.4f} > allowed {m.max_drop})" for m in metrics if not m.passed]
    if not placement.passed:
        nodes = ", ".join(f"{layer.name} ({layer.op_type}) on {layer.device}" for layer in placement.offending)
        failures.append(f"placement: {len(placement.offending)} nodes ran outside {placement.allowed} "
                        f"(allowed {placement.max_fallback_nodes}): {nodes}")
    warnings = []
    if precision.mismatched:
        kinds = Counter(layer.precision for layer in precision.mismatched)
        line = (f"precision: {sku_spec.precision} was asked for but {len(precision.mismatched)} layers ran in "
                f"{', '.join(f'{k} ({n})' for k, n in sorted(kinds.items()))}: "
                + ", ".join(f"{layer.name} ({layer.op_type}, {layer.precision})" for layer in precision.mismatched[:20])
                + (" …" if len(precision.mismatched) > 20 else ""))
        (warnings if precision.passed else failures).append(line)
    report = ValidationReport(model=model, sku=sku, precision=sku_spec.precision, passed=not failures, failures=failures,
                              outputs=errors, metrics=metrics, placement=placement, precision_gate=precision,
                              warnings=warnings, samples=samples, engine_sha256=engine_sha,
                              build_config_sha256=build.build_config_sha256)
    atomic_write_json(out.report(model, sku, "validate"), report.to_json())
    lg = log(model, sku)
    for w in warnings:
        lg.warning("%s", w)
    for m in metrics:
        lg.info("%s %s: engine %.4f reference %.4f delta %+.4f", spec.metric.kind, m.split, m.engine, m.reference, m.delta)
    if failures:
        raise GateFailed(f"{model}/{sku} failed validation:\n" + "\n".join(f"  - {f}" for f in failures),
                         hint=f"see {out.report(model, sku, 'validate')}; loosen the SKU's tolerance only if the error is understood")
    return report
