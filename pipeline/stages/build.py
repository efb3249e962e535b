"""build: the SKU's backend compiles the engine; the report says what the compiler did."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pipeline import reproducible
from pipeline.backends import get_backend
from pipeline.backends.base import BuildContext, BuildOutcome
from pipeline.caches import write_plain_index
from pipeline.config import Registry
from pipeline.data import LABELS, iter_batches
from pipeline.errors import EnvironmentProblem
from pipeline.io import atomic_dir, atomic_write_json, sha256_file, sha256_json
from pipeline.results import BuildReport, FileRecord, LayerInfo, PrepareReport, engine_digest
from pipeline.runner.check import Purpose, host_problems
from pipeline.stages import Progress
from pipeline.stages.calibrate import calibration_table
from pipeline.stages.common import batch_indices, layout, load_arrays, log, read_report


def require_host(registry: Registry, sku: str, purpose: Purpose = "run") -> None:
    """Exit 3 with the runner labels when this host cannot build (or run) ``sku``'s engines."""
    problems = host_problems(registry, sku, purpose)
    if problems:
        labels = ", ".join(registry.sku(sku).runner_labels)
        raise EnvironmentProblem(
            f"this host cannot {purpose} SKU {sku}: " + "; ".join(problems),
            hint=f"build it on a runner with labels [{labels}] (skuforge skus --buildable-here lists what this host can build)",
        )


def config_hash(
    registry: Registry,
    model: str,
    sku: str,
    prepared_sha256: str,
    calibration_sha256: str | None,
    keep: list[str] | None = None,
) -> str:
    """Everything that decides the engine's bytes, hashed. ``keep``: the nodes kept precise (default:
    params.yaml's; a remedy run during the build adds to them)."""
    spec = registry.sku(sku)
    keep = registry.higher_precision(model, sku) if keep is None else keep
    return sha256_json(
        {
            "sku": spec.model_dump(
                mode="json", include={"backend", "precision", "target", "shapes", "profiles", "options"}
            ),
            "pins": registry.pins(model, sku),
            "prepared_sha256": prepared_sha256,
            "calibration_sha256": calibration_sha256 if spec.precision == "int8" else None,
            # nodes kept in higher precision change the engine; an empty list leaves the hash as it was
            **({"keep_precise": list(keep)} if keep else {}),
        }
    )


@dataclass(frozen=True)
class Built:
    """An engine written by ``build_engine``: the backend's outcome and the engine's file records."""

    outcome: BuildOutcome
    files: list[FileRecord]
    seconds: float
    keep_precise: tuple[str, ...] = ()


def build_engine(
    registry: Registry,
    model: str,
    sku: str,
    engine_dir: Path,
    *,
    prepared: Path | None = None,
    cache_dir: Path | None = None,
    keep_precise: tuple[str, ...] | None = None,
    progress: Progress | None = None,
    cache_required: bool | None = None,
    cache_refresh: bool = False,
    tuning_trials: int | None = None,
    search: bool = True,
) -> Built:
    """Build ``model`` for ``sku`` into ``engine_dir`` (written whole or not at all).

    The build stage, bisection (``prepared``: the model with intermediate tensors marked as
    outputs) and the reproducibility check share it, so they build exactly as the stage does.
    ``keep_precise``: ONNX node names kept in higher precision (default: the registry's).
    ``cache_required``, ``cache_refresh``, ``tuning_trials``, ``search``: the cache policy (pipeline.caches)."""
    spec, sku_spec = registry.model(model), registry.sku(sku)
    backend = get_backend(sku_spec.backend)
    out = layout(registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    run_at = registry.pins(model, sku)  # profile axes run at their opt value...
    pins = {k: v for k, v in run_at.items() if k not in sku_spec.profiles}  # ...but stay dynamic in the engine
    golden = load_arrays(out.split(model, "golden"), "data")
    golden.pop(LABELS, None)
    in_idx, _ = batch_indices(registry, model, prep.signature)
    _, probe = next(iter_batches(golden, in_idx, run_at.get(spec.batch_axis or "", 1)))
    table = calibration_table(registry, model) if sku_spec.precision == "int8" else None
    keep = tuple(registry.higher_precision(model, sku)) if keep_precise is None else tuple(keep_precise)
    started = time.perf_counter()
    with atomic_dir(engine_dir) as staging:
        ctx = BuildContext(
            model=model,
            sku=sku,
            spec=spec,
            sku_spec=sku_spec,
            prepared=prepared or out.prepared_model(model),
            pins=pins,
            profiles=dict(sku_spec.profiles),
            engine_dir=staging,
            calibration_table=table,
            probe_inputs=probe,
            cache_dir=cache_dir or out.cache_dir(model, sku),
            progress=progress,
            keep_precise=keep,
            cache_required=cache_required,
            cache_refresh=cache_refresh,
            tuning_trials=tuning_trials,
            search=search,
        )
        outcome = backend.build(ctx)
        files = backend.write_meta(staging, outcome.files, outcome.meta, model=model, sku=sku, keep_precise=list(keep))
    if outcome.cache is not None:  # the engine is in place: now the cache it was built with
        outcome.cache.commit()
    return Built(outcome=outcome, files=files, seconds=time.perf_counter() - started, keep_precise=keep)


def build(
    registry: Registry,
    model: str,
    sku: str,
    progress: Progress | None = None,
    check_reproducible: bool = False,
    cache_required: bool | None = None,
    cache_refresh: bool = False,
    tuning_trials: int | None = None,
) -> BuildReport:
    """Build the engine and write build.json; ``check_reproducible`` (or the SKU's reproducibility
    option) also builds it a second time and records the verdict (exit 1 below the SKU's require).
    ``cache_required`` (None: the SKU's cache.require or SKUFORGE_REQUIRE_CACHE), ``cache_refresh``
    and ``tuning_trials``: the cache policy of pipeline.caches."""
    require_host(registry, sku, "build")
    spec, sku_spec = registry.model(model), registry.sku(sku)
    backend = get_backend(sku_spec.backend)
    out = layout(registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    pins = {k: v for k, v in registry.pins(model, sku).items() if k not in sku_spec.profiles}
    table = calibration_table(registry, model) if sku_spec.precision == "int8" else None
    table_sha = sha256_file(table) if table is not None and table.is_file() else None
    keep = registry.higher_precision(model, sku)
    policy = dict(cache_required=cache_required, cache_refresh=cache_refresh, tuning_trials=tuning_trials)
    built = build_engine(registry, model, sku, out.engine_dir(model, sku), progress=progress, **policy)
    remedy = None
    if sku_spec.bisect.fix_during_build and sku_spec.precision != "fp32":
        from pipeline.remedy import fix, judged

        if not judged(registry, model, sku, out.engine_dir(model, sku))[2]:
            remedy = fix(registry, model, sku, progress=progress)
            if remedy.passed and remedy.keep_precise != keep:
                keep = remedy.keep_precise
                built = build_engine(
                    registry,
                    model,
                    sku,
                    out.engine_dir(model, sku),
                    keep_precise=tuple(keep),
                    progress=progress,
                    cache_required=cache_required,
                )
            log(model, sku).info("remedy during the build: %s", remedy.summary)
    outcome, files, seconds = built.outcome, built.files, built.seconds
    if backend.capabilities.cache is None:
        write_plain_index(out.cache_dir(model, sku), backend)
    reproducibility = None
    if reproducible.wanted(sku_spec, check_reproducible):
        reproducibility = reproducible.check(registry, model, sku, built, out.engine_dir(model, sku), progress=progress)
    calibration = None
    if outcome.calibration is not None:
        calibration = {**outcome.calibration, "method": spec.calibration.method, "table_sha256": table_sha}
    report = BuildReport(
        model=model,
        sku=sku,
        backend=backend.name,
        precision=sku_spec.precision,
        versions=backend.versions(),
        options=outcome.options,
        shapes=pins,
        profiles={k: v.model_dump() for k, v in sku_spec.profiles.items()},
        build_config_sha256=config_hash(registry, model, sku, prep.prepared_sha256, table_sha, keep),
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
    log(model, sku).info("built in %.1fs: %d layers, placement %s", seconds, len(outcome.layers), report.placement)
    if reproducibility is not None:
        reproducible.require(reproducibility, model, sku, out.report(model, sku, "build"))
    return report


def _counts(layers: list[LayerInfo], field: str) -> dict[str, int]:
    return dict(sorted(Counter(getattr(layer, field) or "unknown" for layer in layers).items()))
