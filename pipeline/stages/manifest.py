"""manifest: every report of one (model, SKU) in one schema-valid document."""

from __future__ import annotations

from pipeline.core.errors import InputError
from pipeline.core.io import atomic_write_json, read_json, sha256_file
from pipeline.core.progress import Progress
from pipeline.project.artifacts import layout, log, read_report
from pipeline.project.config import Pair, Registry
from pipeline.results.benchstats import latency_stats
from pipeline.results.dvcmetrics import write_metrics
from pipeline.results.latency import read_latency_csv
from pipeline.results.manifest import (
    BuildInfo,
    CacheInfo,
    CalibrationInfo,
    Correctness,
    Evidence,
    Manifest,
    PlacementSummary,
    PrecisionSummary,
    SourceInfo,
    TargetInfo,
    benchmark_summary,
    digest,
    evidence_digest,
    preprocessing_summary,
    provenance,
    settle,
    validate_document,
)
from pipeline.results.reports import (
    BenchReport,
    BuildReport,
    CalibrationReport,
    DataReport,
    EngineBound,
    PrepareReport,
    ValidationReport,
)


def _bound(build: BuildReport, reports: dict[str, EngineBound], model: str, sku: str) -> None:
    """Refuse reports written about another engine or other build settings than build.json's."""
    other = [
        name
        for name, r in reports.items()
        if (r.engine_sha256, r.build_config_sha256) != (build.engine_sha256, build.build_config_sha256)
    ]
    if other:
        raise InputError(
            f"{', '.join(other)} of {model}/{sku} describe another build than build.json "
            f"(engine {build.engine_sha256[:12]})",
            hint=f"rerun them for this engine: skuforge repro --model {model} --sku {sku} (or dvc repro)",
        )


def _bench_bound(pair: Pair, bench: BenchReport) -> None:
    """Refuse latency samples that are not the bench report's, a report whose figures are not its
    samples', and one that does not say which host timed the engine."""
    model, sku = pair.model, pair.sku
    out = layout(pair.registry)
    latency = out.latency_csv(model, sku)
    latency_sha = sha256_file(latency) if latency.is_file() else None
    if latency_sha != bench.latency_sha256:
        raise InputError(
            f"{latency} is {'missing' if latency_sha is None else 'not the samples bench.json was written with'}",
            hint=f"rerun the bench stage: skuforge bench --model {model} --sku {sku}",
        )
    if bench.host is None:
        raise InputError(
            f"{out.report(model, sku, 'bench')} does not say which host the engine was timed on "
            "(written by an older skuforge)",
            hint=f"rerun the bench stage on the SKU's host: skuforge bench --model {model} --sku {sku}",
        )
    recomputed = latency_stats(read_latency_csv(latency.read_text(encoding="utf-8")), pair.bench.confidence)
    if recomputed != bench.engine_only:
        raise InputError(
            f"{out.report(model, sku, 'bench')}: its engine-only figures are not those of its samples "
            f"(p50 {bench.engine_only.p50_ms:.4g} ms, the samples' {recomputed.p50_ms:.4g} ms): edited?",
            hint=f"rerun the bench stage: skuforge bench --model {model} --sku {sku}",
        )


def _calibration(registry: Registry, model: str, build: BuildReport) -> CalibrationInfo | None:
    """The INT8 calibration the engine was built with: method, set and table hashes, settings."""
    if build.calibration is None:
        return None
    out = layout(registry)
    cal = read_report(out.report(model, None, "calibrate"), CalibrationReport, "calibrate")
    settings = {k: v for k, v in build.calibration.items() if k not in ("method", "table_sha256")}
    return CalibrationInfo(
        method=build.calibration.get("method", cal.method),
        calibration_set_sha256=cal.calibration_set_sha256,
        samples=cal.samples,
        table_sha256=build.calibration.get("table_sha256"),
        settings=settings,
    )


def _correctness(val: ValidationReport) -> Correctness:
    """The validate report's verdict as the manifest states it (gate summaries, not every layer)."""
    return Correctness(
        passed=val.passed,
        failures=val.failures,
        outputs=val.outputs,
        metrics=val.metrics,
        placement=PlacementSummary(
            passed=val.placement.passed,
            allowed=val.placement.allowed,
            offending=len(val.placement.offending),
            partition_boundaries=val.placement.partition_boundaries,
        ),
        precision=PrecisionSummary(
            passed=val.precision_gate.passed,
            requested=val.precision_gate.requested,
            policy=val.precision_gate.policy,
            mismatched_layers=len(val.precision_gate.mismatched),
        ),
        warnings=val.warnings,
        bisection=val.bisection,
        task=val.task,
        diagnostics=val.diagnostics,
    )


def assemble(pair: Pair) -> dict:
    """The manifest document of one pair from its reports (with digest, without provenance).

    Refuses reports of different builds, latency samples that are not the bench report's, and a
    bench report that does not say which host timed the engine (the manifest's ``host`` is that one)."""
    registry, model, sku, spec, sku_spec = pair.registry, pair.model, pair.sku, pair.spec, pair.sku_spec
    out = layout(registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    data = read_report(out.report(model, None, "data"), DataReport, "data")
    build = read_report(out.report(model, sku, "build"), BuildReport, "build")
    val = read_report(out.report(model, sku, "validate"), ValidationReport, "validate")
    bench = read_report(out.report(model, sku, "bench"), BenchReport, "bench")
    _bound(build, {"validate.json": val, "bench.json": bench}, model, sku)
    _bench_bound(pair, bench)
    assert bench.host is not None  # _bench_bound refused a report without it
    files = {
        f"{stage}.json": evidence_digest(f"{stage}.json", out.report(model, sku, stage))
        for stage in ("build", "validate")
    }
    # digest and provenance are left unset (excluded from the dump below, filled in after it): the
    # pydantic plugin types model_construct like __init__, every required field, though it validates nothing
    body = Manifest.model_construct(  # type: ignore[call-arg]
        model=model,
        sku=sku,
        source=SourceInfo(
            path=f"{spec.dir}/{spec.source}",
            sha256=prep.source_sha256,
            prepared_sha256=prep.prepared_sha256,
            opset=prep.opset,
            producer=prep.producer,
            passes=prep.passes,
        ),
        target=TargetInfo(**sku_spec.target.model_dump(mode="json"), runner_labels=sku_spec.runner_labels),
        backend=build.backend,
        precision=build.precision,
        toolchain=build.versions,
        build_config_sha256=build.build_config_sha256,
        shapes=build.shapes,
        profiles=build.profiles,
        signature=prep.signature,
        engine=build.engine_files,
        evidence=Evidence(engine_sha256=build.engine_sha256, files=files),
        build=BuildInfo(
            warnings=build.warnings,
            options=build.options,
            keep_precise=build.keep_precise,
            remedy=build.remedy,
            reproducibility=build.reproducibility,
        ),
        hardware_specific=build.hardware_specific,
        calibration=_calibration(registry, model, build),
        cache=CacheInfo(
            **build.cache.model_dump(
                include={"kind", "sha256", "key", "state", "reason", "hits", "misses", "required", "ignored"}
            )
        )
        if build.cache
        else None,
        datasets={k: v.sha256 for k, v in data.splits.items()},
        synthetic_datasets=sorted(k for k, v in data.splits.items() if v.synthetic),
        layers=build.layers,
        placement=build.placement,
        precision_counts=build.precision_counts,
        correctness=_correctness(val),
        preprocessing={d.input: preprocessing_summary(d) for d in val.preprocessing},
        benchmark=benchmark_summary(bench, pair.bench.noise_floor),
        host=bench.host,
    )
    doc = body.model_dump(mode="json", exclude={"digest", "provenance"})
    doc["digest"] = digest(doc)
    return doc


def write_manifest(pair: Pair, progress: Progress | None = None) -> Manifest:
    registry, model, sku = pair.registry, pair.model, pair.sku
    path = layout(registry).manifest(model, sku)
    old = _previous(path)
    doc = settle(assemble(pair), old)
    prov = old.get("provenance") if old.get("digest") == doc["digest"] else None  # a no-op rebuild leaves no diff
    doc["provenance"] = prov or provenance(registry.root).to_json()
    manifest = Manifest.model_validate(doc)
    doc = manifest.to_json()
    validate_document(doc, str(path))
    atomic_write_json(path, doc)
    out = layout(registry)
    bench = read_report(out.report(model, sku, "bench"), BenchReport, "bench")
    write_metrics(registry.root, doc, out.latency_csv(model, sku), out.timeline_csv(model, sku), bench.sweep)
    log(model, sku).info("manifest %s (digest %s)", path, doc["digest"][:12])
    return manifest


def _previous(path) -> dict:
    """The manifest already there (for its provenance), or {} when absent or unreadable."""
    try:
        old = read_json(path)
    except (OSError, ValueError):
        return {}
    return old if isinstance(old, dict) else {}
