"""Promotion gates: each a small function of what MLflow holds, returning a typed result.

They read the manifest and latency samples the publish step uploaded, never the local build
folder: promotion runs wherever the registry is reachable (a release job, a laptop).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError
from pipeline.core.io import sha256_file
from pipeline.core.versions import unmet
from pipeline.project.config import PerformanceGate, Registry
from pipeline.results.gatestats import max_mismatches
from pipeline.results.latency import compare_latency
from pipeline.results.manifest import Manifest, host_problems, validate_document
from pipeline.results.reports import BenchReport, OutputError, engine_digest
from pipeline.results.signing import verify
from pipeline.tracking.reports import GateResult
from pipeline.verify.compare import (
    input_problems,
    metric_input_problems,
    metric_problems,
    output_problems,
    structural_problems,
)
from pipeline.verify.task import GATED, judge, step_kind


def chain_gate(chain: Sequence[str], alias: str, version: str, holds: Sequence[str]) -> GateResult:
    """A version enters the first alias freely; a later alias only from the one before it."""
    i = list(chain).index(alias)
    if i == 0:
        return GateResult(name="chain", passed=True, detail=f"{alias!r} is the first alias of the chain")
    before = chain[i - 1]
    if before in holds:
        return GateResult(
            name="chain", passed=True, detail=f"version {version} holds {before!r}, the alias before {alias!r}"
        )
    return GateResult(
        name="chain",
        passed=False,
        detail=f"version {version} does not hold {before!r} (it holds {', '.join(holds) or 'no alias'}); "
        f"promote it to {before!r} first",
        data={"required": before, "holds": list(holds)},
    )


def correctness_problems(m: Manifest, registry: Registry) -> list[str]:
    """Why the manifest's evidence does not show a correct engine, recomputed against the SKU's
    tolerances in params.yaml; every recorded ``passed`` flag and failure list must agree too.
    An empty list is a pass; anything missing or contradictory is a problem (fail closed)."""
    c, bad = m.correctness, []
    policy = registry.tolerance(m.model, m.sku)
    gate = registry.metric_gate(m.model, m.sku)
    spec = registry.model(m.model)
    eps = 1e-12
    wanted = spec.outputs if spec.outputs is not None else [o.name for o in m.signature.outputs]
    seen = {o.output for o in c.outputs}
    bad += [f"output {name}: no error figures in the manifest" for name in wanted if name not in seen]
    task_bad, task_decides = _task_problems(m, registry)
    bad += task_bad
    tensor_decides = policy.enforce or not task_decides
    if spec.sequence is not None:
        wanted_seq = {f"{name}@{spec.sequence.steps}" for name in wanted}
        bad += [f"output {name}: no sequence figures in the manifest" for name in sorted(wanted_seq - seen)]
    for o in c.outputs:
        if o.sequence_steps is not None:
            bad += _sequence_problems(o, spec, policy)
            continue
        if o.gating != tensor_decides:
            bad.append(
                f"output {o.output}: recorded with gating={o.gating}, but params.yaml and the task evidence say "
                f"the tensor gates {'decide' if tensor_decides else 'are diagnostics'}"
            )
        if not tensor_decides:
            contradictions = _figure_problems(o)
            bad += [f"output {o.output}: {p}" for p in contradictions] + structural_problems(o)
            continue
        bad += _kind_problems(o, policy.declared.get(o.output))
        tol = policy.for_kind(o.kind)
        if o.atol > tol.atol + eps or o.rtol > tol.rtol + eps:
            bad.append(
                f"output {o.output}: measured with atol={o.atol} rtol={o.rtol}, looser than the SKU's "
                f"atol={tol.atol} rtol={tol.rtol} for {o.kind} outputs"
            )
        contradictions = _figure_problems(o)
        bad += [f"output {o.output}: {p}" for p in contradictions]
        if not contradictions:
            # judged at today's confidence: a manifest's own (higher) level would ask for more evidence to fail
            bad += output_problems(o, tol) + input_problems(o, tol)
        if not o.passed:
            bad.append(f"output {o.output}: recorded as failed")
    if spec.metric is not None and not any(x.split == "evaluation" for x in c.metrics):
        bad.append("task metric: no evaluation figure in the manifest")
    for x in c.metrics:
        allowed = gate.max_drop_hard_tail if x.split == "hard_tail" else gate.max_drop
        paired = x.samples > 0 and x.worse >= 0 and x.better >= 0 and x.worse + x.better <= x.samples
        if (
            not all(math.isfinite(v) for v in (x.engine, x.reference, x.delta))
            or abs(x.engine - x.reference - x.delta) > 1e-9
            or not paired
            or abs(x.delta - (x.better - x.worse) / x.samples) > 1e-9
        ):
            bad.append(
                f"{x.split} metric: figures do not add up (engine {x.engine}, reference {x.reference}, delta "
                f"{x.delta}, {x.samples} samples, {x.worse} worse, {x.better} better)"
            )
        else:
            bad += metric_problems(x, spec.metric.kind if spec.metric else "metric", allowed, gate.confidence)
            bad += metric_input_problems(x, allowed, gate.confidence)
        if not x.passed:
            bad.append(f"{x.split} metric: recorded as failed")
    if not c.precision.passed:
        bad.append(f"{c.precision.mismatched_layers} layers ran in another precision than {c.precision.requested}")
    if not c.passed or c.failures:
        bad.append("validation recorded as failed" + (f": {'; '.join(c.failures)}" if c.failures else ""))
    return list(dict.fromkeys(bad))


def _sequence_problems(o: OutputError, spec: Any, policy: Any) -> list[str]:
    """A stateful model's output after its sequence: judged by the tensor gates whatever decides
    the single call (a fed-back output as state), with the steps params.yaml declares."""
    seq = spec.sequence
    base = o.output.rsplit("@", 1)[0]
    if seq is None or o.sequence_steps != seq.steps or o.output != f"{base}@{seq.steps}":
        return [f"output {o.output}: sequence figures for {o.sequence_steps} steps, params.yaml declares none or other"]
    expected = "state" if base in seq.feed else policy.declared.get(base, o.kind)
    bad = [f"output {o.output}: judged as {o.kind}, expected {expected}"] if o.kind != expected else []
    if not o.gating:
        bad.append(f"output {o.output}: a sequence output recorded as not deciding")
    contradictions = _figure_problems(o)
    bad += [f"output {o.output}: {p}" for p in contradictions]
    if not contradictions:
        tol = policy.for_kind(o.kind)
        bad += output_problems(o, tol) + input_problems(o, tol)
    if not o.passed:
        bad.append(f"output {o.output}: recorded as failed")
    return bad


def _task_problems(m: Manifest, registry: Registry) -> tuple[list[str], bool]:
    """The task agreement recomputed from its recorded evidence against today's thresholds, and
    whether it decides (every gated statistic judgeable). A declared postprocess with no record of
    its gated statistic fails closed."""
    c, bad = m.correctness, []
    spec, policy = registry.model(m.model), registry.tolerance(m.model, m.sku)
    kind = step_kind(spec)
    if kind not in GATED or policy.task is None:
        return [], False
    gated, key = GATED[kind]
    threshold = float(getattr(policy.task, key))
    records = [t for t in c.task if t.statistic == gated]
    if len(records) != 1:
        return [f"task {gated} ({kind}): {len(records)} records in the manifest, expected one"], False
    t = records[0]
    if t.statistic in ("top1_agreement", "exact_match"):
        if t.agree is None or not 0 <= t.agree <= t.samples:
            return [f"task {gated}: counts ({t.agree} of {t.samples}) do not add up"], False
        rows: list[list[float]] = [[1.0]] * t.agree + [[0.0]] * (t.samples - t.agree)
    else:
        rows = t.per_sample
        ok = len(rows) == t.samples and all(len(r) == 2 and math.isfinite(r[0]) and r[1] >= 0 for r in rows)
        if not ok:
            return [f"task {gated}: the per-sample evidence does not match its {t.samples} samples"], False
    again = judge(t.statistic, kind, t.splits, rows, threshold, t.direction, policy.task.confidence)
    if t.value is not None and (again.value is None or abs(again.value - t.value) > 1e-9):
        bad.append(f"task {gated}: recorded value {t.value} contradicts its evidence ({again.value})")
    if again.failure:
        bad.append(again.failure)
    if t.passed != (again.passed or not again.judgeable) and again.judgeable:
        bad.append(f"task {gated}: recorded as {'passed' if t.passed else 'failed'}, the evidence says otherwise")
    return bad, again.judgeable


def _kind_problems(o: OutputError, declared: str | None) -> list[str]:
    """The kind an output was judged as must be the one params.yaml declares, or inferred where it declares none."""
    how = "inferred" if o.kind_inferred else "declared"
    if declared is not None and (o.kind != declared or o.kind_inferred):
        return [f"output {o.output}: judged as {o.kind} ({how}), params.yaml declares {declared}"]
    if declared is None and not o.kind_inferred:
        return [f"output {o.output}: judged as {o.kind} (declared), params.yaml declares no kind for it"]
    return []


def _figure_problems(o: OutputError) -> list[str]:
    """Figures that are missing where the output had values, out of range, or contradict each other."""
    stats = (
        o.max_abs_error,
        o.mean_abs_error,
        o.median_abs_error,
        o.p99_abs_error,
        o.max_rel_error,
        o.median_rel_error,
        o.p99_rel_error,
        o.cosine_similarity,
        o.min_passing_atol,
        o.min_passing_rtol,
    )
    fractions = (o.mismatch_fraction, o.top1_agreement, o.top5_agreement)
    if not all(x is None or math.isfinite(x) for x in stats + fractions):
        return ["non-finite error figures"]
    if not all(x is None or 0 <= x <= 1 for x in fractions) or min(o.nan_count, o.inf_count, o.elements) < 0:
        return ["error figures out of range"]
    if o.shape_mismatch is not None:
        return [] if o.mismatch_fraction == 1 else ["a shape mismatch recorded with elements within tolerance"]
    bad, unexpected = [], o.nan_count + o.inf_count
    if (unexpected > 0) != (o.first_non_finite is not None) or o.mismatch_fraction * o.elements + 0.5 < unexpected:
        bad.append(f"non-finite counts ({o.nan_count} NaN, {o.inf_count} Inf) contradict the other figures")
    if o.max_abs_error is None and o.elements > unexpected + o.reference_non_finite:
        bad.append("no error figures for its finite elements")
    if o.elements and abs(o.mismatch_count / o.elements - o.mismatch_fraction) > 1e-9:
        bad.append(f"{o.mismatch_count} of {o.elements} elements beyond contradicts the fraction {o.mismatch_fraction}")
    if o.top1_rows is not None and (
        o.top1_agree is None
        or not 0 <= o.top1_agree <= o.top1_rows
        or o.top1_rows < 0
        or (o.top1_rows and abs(o.top1_agree / o.top1_rows - (o.top1_agreement or 0)) > 1e-9)
    ):
        bad.append(f"top-1 counts ({o.top1_agree} of {o.top1_rows}) contradict the agreement {o.top1_agreement}")
    # the element-wise verdict and the smallest passing atol come from one measurement: they agree
    within = o.mismatch_count <= max_mismatches(o.elements, o.max_mismatch, o.confidence) and not (
        o.max_outlier_factor is not None and o.outlier_count
    )
    if o.elements and not unexpected and within != (o.min_passing_atol is not None and o.min_passing_atol <= o.atol):
        bad.append(
            f"{o.mismatch_fraction:.2%} beyond tolerance (allowed {o.max_mismatch:.2%}) contradicts the smallest "
            f"passing atol {o.min_passing_atol} at atol={o.atol}"
        )
    return bad


def correctness_gate(m: Manifest, registry: Registry, version_tag: str | None = None) -> GateResult:
    """Outputs within tolerance, task metric within its allowed drop, precision gate (placement is
    its own gate), recomputed from the figures; the version's correctness tag must agree."""
    bad = correctness_problems(m, registry)
    if version_tag != "passed":
        bad.append(f"the registered version is tagged correctness={version_tag or 'nothing'}")
    if bad:
        return GateResult(name="correctness", passed=False, detail="; ".join(bad), data={"failures": bad})
    return GateResult(
        name="correctness",
        passed=True,
        detail=f"{len(m.correctness.outputs)} outputs within tolerance, {len(m.correctness.metrics)} "
        "task metrics within their drop (recomputed against params.yaml)",
    )


def placement_gate(m: Manifest, registry: Registry) -> GateResult:
    """Layers on devices the SKU allows, counted again from the manifest's layers."""
    sku = registry.sku(m.sku)
    allowed = sku.placement.allowed if sku.placement.allowed is not None else m.correctness.placement.allowed
    if allowed is None:
        return GateResult(name="placement", passed=False, detail="no allowed devices recorded or configured")
    offending = [layer.name for layer in m.layers if layer.device is not None and layer.device not in allowed]
    shown = ", ".join(allowed)
    if len(offending) > sku.placement.max_fallback_nodes or not m.correctness.placement.passed:
        return GateResult(
            name="placement",
            passed=False,
            detail=f"{len(offending)} layers ran outside {shown} (allowed {sku.placement.max_fallback_nodes})"
            + ("" if m.correctness.placement.passed else "; recorded as failed"),
            data={"offending": offending[:50], "allowed": allowed},
        )
    return GateResult(name="placement", passed=True, detail=f"every layer on {shown}")


def manifest_gate(
    document: Any, version_digest: str | None, registry: Registry | None = None, bench: BenchReport | None = None
) -> GateResult:
    """The uploaded manifest matches its schema, its own digest, the version's digest tag and,
    with ``registry``, the SKU it claims to be for (backend, precision, toolchain, architecture) and
    the host its run's ``bench`` report was timed on (every host field; no report: fails)."""

    try:
        validate_document(document, "the manifest artifact")
    except InputError as exc:
        return GateResult(name="manifest", passed=False, detail=exc.message)
    if version_digest != document["digest"]:
        return GateResult(
            name="manifest",
            passed=False,
            detail=f"the manifest artifact has digest {document['digest'][:12]}, the version's tag says "
            f"{(version_digest or 'nothing')[:12]}: the artifact was replaced after registration",
        )
    if registry is not None:
        m = Manifest.model_validate(document)
        bad = sku_mismatches(m, registry) + host_problems(m.host, bench, "the run's bench.json")
        if bad:
            return GateResult(name="manifest", passed=False, detail="; ".join(bad))
    return GateResult(name="manifest", passed=True, detail=f"schema-valid, digest {document['digest'][:12]}")


def sku_mismatches(m: Manifest, registry: Registry) -> list[str]:
    """What in the manifest contradicts its SKU in params.yaml. Recorded toolchain versions are
    read as their vendor writes them (OpenVINO's build suffix, nvcc's build line: pipeline.core.versions)."""
    sku, bad = registry.sku(m.sku), []
    if m.backend != sku.backend:
        bad.append(f"built by {m.backend}, the SKU asks for {sku.backend}")
    if m.precision != sku.precision:
        bad.append(f"precision {m.precision}, the SKU asks for {sku.precision}")
    if m.target.arch != sku.target.arch or m.host.arch != sku.target.arch:
        bad.append(f"target/host architecture {m.target.arch}/{m.host.arch}, the SKU is {sku.target.arch}")
    for package, spec in sku.toolchain.items():
        why = unmet(m.toolchain.get(package), spec)
        if why:
            bad.append(f"toolchain {package}: {why}")
    if engine_digest(m.engine) != m.evidence.engine_sha256:
        bad.append("the engine file list does not match the engine hash its reports were bound to")
    return bad


def signature_gate(signature: Any, m: Manifest, alias: str, registry: Registry) -> GateResult:
    """The manifest digest signed by a key params.yaml trusts for ``alias``."""

    verdict = verify(signature, m.digest, m.model, m.sku, alias, registry.release.signing)
    return GateResult(
        name="signature",
        passed=verdict.passed,
        detail=verdict.detail,
        data={"key": verdict.key_name} if verdict.key_name else {},
    )


def engine_gate(m: Manifest, files: dict[str, Path] | None, where: str) -> GateResult:
    """The engine files in the artifact store, hashed against the manifest."""
    if files is None:
        return GateResult(name="engine", passed=False, detail=f"no engine artifacts under {where}")
    bad = []
    for rec in m.engine:
        path = files.get(rec.path)
        if path is None:
            bad.append(f"{rec.path} missing")
        elif path.stat().st_size != rec.bytes or sha256_file(path) != rec.sha256:
            bad.append(
                f"{rec.path} differs from the manifest (sha256 {sha256_file(path)[:12]}, manifest {rec.sha256[:12]})"
            )
    if bad:
        return GateResult(
            name="engine",
            passed=False,
            detail=f"engine in the store at {where}: " + "; ".join(bad),
            data={"problems": bad},
        )
    return GateResult(
        name="engine", passed=True, detail=f"{len(m.engine)} engine files in the store match the manifest's sha256"
    )


def performance_gate(
    candidate: Sequence[float] | None,
    incumbent: Sequence[float] | None,
    incumbent_version: str | None,
    alias: str,
    settings: PerformanceGate,
) -> GateResult:
    """Candidate latency samples against those of the version holding ``alias`` now."""
    if incumbent_version is None:
        return GateResult(name="performance", passed=True, detail=f"no version holds {alias!r}: nothing to compare")
    if candidate is None or incumbent is None:
        which = "candidate" if candidate is None else f"version {incumbent_version}"
        return GateResult(
            name="performance",
            passed=settings.on_noisy == "allow",
            detail=f"no latency samples for the {which}: cannot compare",
            data={"outcome": "too_noisy"},
        )
    cmp = compare_latency(
        candidate,
        incumbent,
        max_regression=settings.max_regression,
        alpha=settings.alpha,
        confidence=settings.confidence,
        resamples=settings.bootstrap,
        min_samples=settings.min_samples,
    )
    passed = cmp.outcome == "not_regressed" or (cmp.outcome == "too_noisy" and settings.on_noisy == "allow")
    note = " (release.performance.on_noisy: allow)" if cmp.outcome == "too_noisy" and passed else ""
    return GateResult(
        name="performance",
        passed=passed,
        detail=f"against version {incumbent_version}: {cmp.outcome.replace('_', ' ')}; {cmp.reason}{note}",
        data=cmp.to_json() | {"incumbent": incumbent_version},
    )


def release_gate(required: Sequence[str], present: Sequence[str], why: dict[str, str] | None = None) -> GateResult:
    """Every SKU the promotion covers has a version to move (``why``: SKU -> what is missing)."""
    missing = [s for s in required if s not in present]
    if missing:
        each = ", ".join(f"{s} ({(why or {}).get(s)})" if (why or {}).get(s) else s for s in missing)
        return GateResult(
            name="release_skus",
            passed=False,
            detail=f"no version to promote for {each}; {len(required) - len(missing)} of {len(required)} SKUs present",
            data={"missing": missing},
        )
    return GateResult(name="release_skus", passed=True, detail=f"all {len(required)} SKUs present")
