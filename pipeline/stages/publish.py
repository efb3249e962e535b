"""publish: record one (model, SKU) in MLflow and register its engine (pipeline/tracking/publish.py).

The stage reads what the earlier stages wrote (manifest, reports, engine, latency samples), checks
that they belong together, and writes ``publish.json``: the store, run and registered version.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.core.env import process_environment
from pipeline.core.errors import InputError
from pipeline.core.io import atomic_write_json, sha256_file
from pipeline.core.progress import Progress
from pipeline.project.artifacts import layout, log, read_report
from pipeline.project.config import Pair
from pipeline.report import write_pair_report
from pipeline.results.manifest import evidence_digest, host_problems, load_manifest, settle
from pipeline.results.reports import BenchReport, BuildReport
from pipeline.stages.manifest import assemble
from pipeline.tracking.client import Tracking, connect
from pipeline.tracking.publish import PublishInputs, publish_engine
from pipeline.tracking.reports import PublishResult


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
    write_pair_report(pair.registry, model, sku)  # report.html: the pair's page, self-contained (docs/report.md)
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


def publish(pair: Pair, progress: Progress | None = None, tracking: Tracking | None = None) -> PublishResult:
    registry, model, sku = pair.registry, pair.model, pair.sku
    inputs = collect(pair)
    result = publish_engine(tracking or connect(registry), registry, inputs, progress)
    atomic_write_json(layout(registry).report(model, sku, "publish"), result.receipt())
    log(model, sku).info(
        "published: %s version %s (run %s%s)",
        result.registered_model,
        result.version,
        result.run_id[:12],
        ", new" if result.created_version else "",
    )
    return result
