"""The engine-building service: one function that builds a (model, SKU) engine exactly as the build
stage does. The build stage, bisection, the remedy loop and the reproducibility check call it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.backends import backend_class, get_backend
from pipeline.backends.contract import BuildContext, BuildOutcome
from pipeline.core.errors import EnvironmentProblem
from pipeline.core.io import atomic_dir, sha256_json
from pipeline.core.progress import Progress
from pipeline.engine.hostcheck import Purpose, emulation_problems, sku_host_problems
from pipeline.project.artifacts import (
    batch_indices,
    calibration_batches,
    calibration_table,
    layout,
    load_arrays,
    read_report,
)
from pipeline.project.config import Pair, SkuSpec
from pipeline.project.data import LABELS, iter_batches
from pipeline.results.reports import FileRecord, PrepareReport


def require_host(sku: str, spec: SkuSpec, purpose: Purpose = "run") -> None:
    """Exit 3 with the runner labels when this host cannot build (or run) ``sku``'s engines."""
    problems = sku_host_problems(spec, purpose)
    if problems:
        labels = ", ".join(spec.runner_labels)
        raise EnvironmentProblem(
            f"this host cannot {purpose} SKU {sku}: " + "; ".join(problems),
            hint=f"build it on a runner with labels [{labels}] "
            "(skuforge skus --buildable-here lists what this host can build)",
        )


def require_emulation(sku: str, spec: SkuSpec) -> None:
    """Exit 3 unless this host validates the SKU's engines under emulation (an aarch64 CPU SKU on an
    x86-64 host with QEMU and the aarch64 environment)."""
    problems = emulation_problems(spec)
    if problems is None or problems:
        why = (
            "; ".join(problems)
            if problems
            else (
                f"its {spec.target.arch} {spec.target.device} engines run natively or on a device bench here, or "
                f"its backend ({spec.backend}) has no emulated runner"
            )
        )
        raise EnvironmentProblem(
            f"this host does not validate SKU {sku} under emulation: {why}",
            hint="scripts/setup.sh --with emulation on an x86-64 Linux host; on the SKU's runner: skuforge validate",
        )


def config_hash(
    pair: Pair,
    prepared_sha256: str,
    calibration_sha256: str | None,
    keep: list[str] | tuple[str, ...] | None = None,
) -> str:
    """Everything that decides the engine's bytes, hashed. ``keep``: the nodes kept precise (default:
    params.yaml's; a remedy run during the build adds to them)."""
    spec = pair.sku_spec
    keep = pair.higher_precision if keep is None else keep
    fingerprint = backend_class(spec.backend).config_fingerprint()
    return sha256_json(
        {
            "sku": spec.model_dump(
                mode="json", include={"backend", "precision", "target", "shapes", "profiles", "options"}
            ),
            "pins": pair.pins,
            "prepared_sha256": prepared_sha256,
            "calibration_sha256": calibration_sha256 if spec.precision == "int8" else None,
            # nodes kept in higher precision change the engine; an empty list leaves the hash as it was
            **({"keep_precise": list(keep)} if keep else {}),
            # a converter environment's lock (LiteRT): none for the other backends, so their hashes stay
            **({"backend": fingerprint} if fingerprint else {}),
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
    pair: Pair,
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
    ``cache_required``, ``cache_refresh``, ``tuning_trials``, ``search``: the cache policy
    (pipeline.backends.caches)."""
    registry, model, sku, spec, sku_spec = pair.registry, pair.model, pair.sku, pair.spec, pair.sku_spec
    backend = get_backend(sku_spec.backend)
    out = layout(registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    run_at = pair.pins  # profile axes run at their opt value...
    pins = {k: v for k, v in run_at.items() if k not in sku_spec.profiles}  # ...but stay dynamic in the engine
    golden = load_arrays(out.split(model, "golden"), "data")
    golden.pop(LABELS, None)
    in_idx, _ = batch_indices(spec, prep.signature)
    _, probe = next(iter_batches(golden, in_idx, run_at.get(spec.batch_axis or "", 1)))
    table = calibration_table(registry, model) if sku_spec.precision == "int8" else None
    samples = None
    if sku_spec.precision == "int8" and backend.capabilities.calibration == "samples":
        samples, _ = calibration_batches(registry, model, spec, run_at, prep.signature)
    keep = pair.higher_precision if keep_precise is None else tuple(keep_precise)
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
            calibration_batches=samples,
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
