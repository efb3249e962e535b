"""The evidence of one (model, SKU), gathered and checked against itself.

``assemble`` derives the manifest document from the stage reports (the manifest stage writes it;
publish derives it again to prove the manifest on disk says what its reports say); ``collect``
gathers what publishing and a release need (manifest, reports, engine, samples) and refuses them
when they do not belong together. Both read files only: the stages above write them.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.core.env import process_environment
from pipeline.core.errors import InputError
from pipeline.core.io import sha256_file
from pipeline.project.artifacts import layout, read_report
from pipeline.project.config import Pair, Registry
from pipeline.results.benchstats import latency_stats
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
    host_problems,
    load_manifest,
    preprocessing_summary,
    settle,
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
from pipeline.tracking.publish import PublishInputs


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


def collect(pair: Pair) -> PublishInputs:
    """The manifest, reports and engine of one pair, refused when they do not match each other."""
    model, sku = pair.model, pair.sku
    out = layout(pair.registry)
    manifest_path = out.manifest(model, sku)
    manifest = load_manifest(manifest_path)
    if (manifest.model, manifest.sku) != (model, sku):
        raise InputError(
            f"{manifest_path} describes {manifest.model}/{manifest.sku}, not {model}/{sku}",
            hint=f"regenerate it: skuforge manifest --model {model} --sku {sku}",
        )
    evidence = {f"{stage}.json": out.report(model, sku, stage) for stage in ("build", "validate")}
    stale = [
        name
        for name, path in evidence.items()
        if not path.is_file() or evidence_digest(name, path) != manifest.evidence.files.get(name)
    ]
    if stale:
        raise InputError(
            f"{', '.join(stale)} of {model}/{sku} are missing or are not the reports {manifest_path} was written from",
            hint=f"run skuforge manifest --model {model} --sku {sku} (or dvc repro)",
        )
    bench = read_report(out.report(model, sku, "bench"), BenchReport, "bench")
    wrong_host = host_problems(manifest.host, bench)
    if wrong_host:
        raise InputError(
            f"{manifest_path} names another host than the bench report it was written from: {'; '.join(wrong_host)}",
            hint=f"regenerate it: skuforge manifest --model {model} --sku {sku} "
            "(rerun skuforge bench first on the SKU's host if bench.json names none)",
        )
    # the bench report and samples of this run: about this engine, and measuring what the manifest says
    # (its figures may be an earlier run's, kept because this one lies within their intervals)
    rederived = settle(assemble(pair), manifest.to_json())
    if rederived["digest"] != manifest.digest:
        raise InputError(
            f"{manifest_path} says other things than the reports it names (edited after it was written, "
            "or the benchmark moved beyond its intervals since)",
            hint=f"regenerate it: skuforge manifest --model {model} --sku {sku} (or dvc repro)",
        )
    build = read_report(out.report(model, sku, "build"), BuildReport, "build")
    samples = [out.report(model, sku, "bench"), out.latency_csv(model, sku)]
    # the run's other files, each only when it is the one bench.json names
    samples += [
        p
        for p, sha in (
            (out.timeline_csv(model, sku), bench.timeline_sha256),
            (out.roofline(model, sku), bench.roofline_sha256),
        )
        if p.is_file() and sha256_file(p) == sha
    ]
    engine_dir = out.engine_dir(model, sku)
    for rec in manifest.engine:
        path = engine_dir / rec.path
        if not path.is_file() or path.stat().st_size != rec.bytes or sha256_file(path) != rec.sha256:
            raise InputError(
                f"engine file {path} is missing or differs from {manifest_path}",
                hint=f"rebuild: skuforge build --model {model} --sku {sku} (or dvc repro)",
            )
    engine_files = [rec.path for rec in manifest.engine]
    if (engine_dir / "engine.json").is_file():
        engine_files.append("engine.json")
    sku_dir = out.sku_dir(model, sku)
    reports = list(evidence.values()) + samples
    reports += sorted(sku_dir.glob("*.html"))  # an HTML report, where a stage wrote one
    # what a release needs for the device's smoke test: the golden inputs and the engine's outputs on
    # them, bound to the manifest by datasets.golden and validate.json's outputs_sha256
    reports += [p for p in (out.engine_outputs(model, sku), out.split(model, "golden")) if p.is_file()]
    config = pair.settings()  # what build/.config/<pair>.json holds, resolved once
    settings = {"sku": config["sku_spec"], **{k: config[k] for k in ("pins", "tolerance", "metric_gate", "bench")}}
    datasets = {
        split: (sha, Path(os.path.relpath(out.split(model, split), pair.registry.root)).as_posix())
        for split, sha in manifest.datasets.items()
    }
    return PublishInputs(
        manifest=manifest,
        manifest_path=manifest_path,
        engine_dir=engine_dir,
        engine_files=engine_files,
        reports=reports,
        config=settings,
        datasets=datasets,
        env=dict(process_environment()),
        bench=bench,
        build_seconds=build.build_seconds,
    )
