"""build: the SKU's backend compiles the engine (pipeline/engine/build.py); the report says what the
compiler did."""

from __future__ import annotations

from collections import Counter

from pipeline.backends import get_backend
from pipeline.backends.caches import write_plain_index
from pipeline.core.io import atomic_write_json, sha256_file
from pipeline.core.progress import Progress
from pipeline.engine.build import build_engine, config_hash, require_host
from pipeline.project.artifacts import RESULT, calibration_table, layout, log, read_report
from pipeline.project.config import Pair
from pipeline.results.reports import BuildReport, LayerInfo, PrepareReport, engine_digest
from pipeline.verify import reproducible
from pipeline.verify.remedy import fix, judged


def build(
    pair: Pair,
    progress: Progress | None = None,
    check_reproducible: bool = False,
    cache_required: bool | None = None,
    cache_refresh: bool = False,
    tuning_trials: int | None = None,
) -> BuildReport:
    """Build the engine and write build.json; ``check_reproducible`` (or the SKU's reproducibility
    option) also builds it a second time and records the verdict (exit 1 below the SKU's require).
    ``cache_required`` (None: the SKU's cache.require or SKUFORGE_REQUIRE_CACHE), ``cache_refresh``
    and ``tuning_trials``: the cache policy of pipeline.backends.caches."""
    registry, model, sku, spec, sku_spec = pair.registry, pair.model, pair.sku, pair.spec, pair.sku_spec
    require_host(sku, sku_spec, "build")
    backend = get_backend(sku_spec.backend)
    out = layout(registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    pins = {k: v for k, v in pair.pins.items() if k not in sku_spec.profiles}
    table = calibration_table(registry, model) if sku_spec.precision == "int8" else None
    table_sha = sha256_file(table) if table is not None and table.is_file() else None
    keep: tuple[str, ...] = pair.higher_precision
    built = build_engine(
        pair,
        out.engine_dir(model, sku),
        progress=progress,
        cache_required=cache_required,
        cache_refresh=cache_refresh,
        tuning_trials=tuning_trials,
    )
    remedy = None
    if (
        sku_spec.bisect.fix_during_build
        and sku_spec.precision != "fp32"
        and not judged(pair, out.engine_dir(model, sku))[2]
    ):
        remedy = fix(pair, progress=progress)
        if remedy.passed and list(remedy.keep_precise) != list(keep):
            keep = tuple(remedy.keep_precise)
            built = build_engine(
                pair,
                out.engine_dir(model, sku),
                keep_precise=tuple(keep),
                progress=progress,
                cache_required=cache_required,
            )
        log(model, sku).info("remedy during the build: %s", remedy.summary)
    outcome, files, seconds = built.outcome, built.files, built.seconds
    # a backend without a cache, or one whose options use none (TVM with trials 0): the folder DVC
    # declares as an output still exists
    if backend.capabilities.cache is None or not backend.uses_cache(backend.options(sku_spec)):
        write_plain_index(out.cache_dir(model, sku), backend)
    reproducibility = None
    if reproducible.wanted(sku_spec, check_reproducible):
        reproducibility = reproducible.check(pair, built, out.engine_dir(model, sku), progress=progress)
    calibration = None
    if outcome.calibration is not None:
        calibration = {**outcome.calibration, "method": spec.calibration.method}
        # a backend that calibrates on the samples (LiteRT) records the set's hash; the others read the table
        calibration["table_sha256"] = table_sha if backend.capabilities.calibration == "table" else None
    report = BuildReport(
        model=model,
        sku=sku,
        backend=backend.name,
        precision=sku_spec.precision,
        versions=backend.versions(),
        options=outcome.options,
        shapes=pins,
        profiles={k: v.model_dump() for k, v in sku_spec.profiles.items()},
        build_config_sha256=config_hash(pair, prep.prepared_sha256, table_sha, keep),
        engine_sha256=engine_digest(files),
        prepared_sha256=prep.prepared_sha256,
        calibration=calibration,
        cache=outcome.meta.cache,
        engine_files=files,
        layers=outcome.layers,
        placement=_counts(outcome.layers, "device"),
        requested_devices=outcome.requested_devices,
        partition_boundaries=outcome.partition_boundaries,
        precision_counts=_counts(outcome.layers, "precision"),
        hardware_specific=outcome.hardware_specific,
        keep_precise=list(keep),
        remedy=remedy,
        warnings=outcome.warnings,
        build_seconds=round(seconds, 3),
        reproducibility=reproducibility,
    )
    atomic_write_json(out.report(model, sku, "build"), report.to_json())
    log(model, sku).info(
        "built in %.1fs: %d layers, placement %s", seconds, len(outcome.layers), report.placement, extra=RESULT
    )
    if reproducibility is not None:
        reproducible.require(reproducibility, model, sku, out.report(model, sku, "build"))
    return report


def _counts(layers: list[LayerInfo], field: str) -> dict[str, int]:
    return dict(sorted(Counter(getattr(layer, field) or "unknown" for layer in layers).items()))
