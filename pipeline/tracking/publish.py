"""Publish one engine: an MLflow run with params, metrics, artifacts, tags and dataset inputs, then
a registered model version of the engine.

Idempotent on the manifest digest (a tag on the run and on the version):

1. a version with this digest exists: return it, touch nothing;
2. else find the run with this digest, or create it (the digest is a tag from the start, so a
   run whose creation answer was lost is found on the next try);
3. log what is missing (params not yet there; metrics once, with a marker tag in the same batch),
   upload every artifact, list them back and compare sizes, then mark the run complete;
4. only then register the version (found again by digest first).

A crash or an unreachable server at any point leaves a state the next publish completes without
duplicates. A run whose logging or upload failed while the store still answered (a read-only
artifact folder, a bad input) is marked FAILED (KILLED on Ctrl-C) on the way out; the next publish
resumes it and marks it FINISHED.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from pipeline import __version__
from pipeline.core.env import (
    BUILD_URL,
    CI_JOB_URL,
    GITHUB_REPOSITORY,
    GITHUB_RUN_ATTEMPT,
    GITHUB_RUN_ID,
    GITHUB_SERVER_URL,
    RUNNER_NAME,
)
from pipeline.core.errors import ServiceError
from pipeline.core.progress import Progress
from pipeline.project.config import Registry
from pipeline.results.manifest import Manifest
from pipeline.results.reports import BenchReport
from pipeline.results.signing import signing_key
from pipeline.tracking.client import (
    TAG_COMPLETE,
    TAG_CORRECTNESS,
    TAG_DIGEST,
    TAG_LOGGED,
    TAG_MODEL,
    TAG_SIGNATURE,
    TAG_SIGNATURE_BEFORE,
    TAG_SKU,
    Tracking,
    actor,
    experiment_name,
    registered_model_name,
    unreachable,
)
from pipeline.tracking.gates import correctness_problems
from pipeline.tracking.reports import PublishResult
from pipeline.tracking.views import experiment_tags

log = logging.getLogger(__name__)

MAX_PARAM_VALUE = 6000  # MLflow's limit
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
MANIFEST_ARTIFACT = "manifest.json"
ENGINE_ARTIFACTS = "engine"
REPORT_ARTIFACTS = "reports"
LATENCY_FILE = "latency.csv"
LATENCY_ARTIFACT = f"{REPORT_ARTIFACTS}/{LATENCY_FILE}"
BENCH_ARTIFACT = f"{REPORT_ARTIFACTS}/bench.json"


@dataclass(frozen=True)
class PublishInputs:
    """Everything one publish uploads, read and checked by the publish stage."""

    manifest: Manifest
    manifest_path: Path
    engine_dir: Path
    engine_files: list[str]  # relative to engine_dir, engine.json included
    reports: list[Path]  # uploaded under reports/
    config: dict[str, Any]  # the pair's effective settings, logged as params
    datasets: dict[str, tuple[str, str]]  # split -> (sha256, where the set lives)
    env: Mapping[str, str] = field(default_factory=dict)  # CI variables for tags
    bench: BenchReport | None = None  # the run's volatile detail, logged as bench.* metrics
    build_seconds: float | None = None


def _name(key: str) -> str:
    """A metric or param key MLflow accepts (letters, digits, _ - . space; no path tricks)."""
    return re.sub(r"[^\w.\- ]", "_", key)[:250]


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """Nested settings as dotted params; lists as JSON."""
    out: dict[str, str] = {}
    if isinstance(obj, dict) and obj:
        for key, value in obj.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    elif prefix:
        text = obj if isinstance(obj, str) else json.dumps(obj, sort_keys=True)
        out[_name(prefix)] = text if len(text) <= MAX_PARAM_VALUE else text[: MAX_PARAM_VALUE - 1] + "…"
    return out


def params(inputs: PublishInputs) -> dict[str, str]:
    m = inputs.manifest
    return flatten(
        {
            **inputs.config,
            "toolchain": m.toolchain,
            "skuforge_version": __version__,
            "model_source_sha256": m.source.sha256,
            "build_config_sha256": m.build_config_sha256,
        }
    )


def manifest_metrics(
    m: Manifest, bench: BenchReport | None = None, build_seconds: float | None = None
) -> dict[str, float]:
    """Latency, throughput, memory, error statistics, task-metric deltas and gate results; with
    the bench report, the run's volatile detail too (``bench.*``: unrounded statistics, warm-up,
    drift, load time, every memory reading)."""
    out: dict[str, Any] = {**_benchmark_metrics(m), **_correctness_metrics(m)}
    if bench is not None:
        out.update(_bench_metrics(bench))
    if build_seconds is not None:
        out["build.seconds"] = build_seconds
    return {
        _name(k): float(v)
        for k, v in out.items()
        if isinstance(v, (int, float)) and not (isinstance(v, float) and not math.isfinite(v))
    }


def _benchmark_metrics(m: Manifest) -> dict[str, Any]:
    """The manifest's benchmark summary: latency, steps, energy, sustained run, preprocessing, memory."""
    out: dict[str, Any] = {}
    b = m.benchmark
    for kind in ("engine_only", "end_to_end"):
        for key, value in getattr(b, kind).to_json().items():
            if isinstance(value, list):
                out[f"latency.{kind}.{key}_low"], out[f"latency.{kind}.{key}_high"] = value
            else:
                out[f"latency.{kind}.{key}"] = value
    for step, stats in b.end_to_end_steps.items():  # where an end-to-end call's time goes
        out[f"latency.end_to_end.{step}.p50_ms"] = stats.p50_ms
        out[f"latency.end_to_end.{step}.p99_ms"] = stats.p99_ms
    if b.energy.available:  # never a zero where nothing was measured: the reason is a tag
        out["energy.joules_per_inference"] = b.energy.joules_per_inference
        out["energy.mean_power_w"] = b.energy.mean_power_w
        out["energy.idle_power_w"] = b.energy.idle_power_w
        out["energy.above_idle_joules_per_inference"] = b.energy.above_idle_joules_per_inference
    if b.sustained is not None:
        out["sustained.p50_ms"] = b.sustained.p50_ms
        out["sustained.p99_ms"] = b.sustained.p99_ms
        out["sustained.seconds"] = b.sustained.seconds
        for key in ("latency_drift_pct", "clock_drop_pct", "temperature_rise_c"):
            out[f"sustained.{key}"] = getattr(b.sustained, key)
    for name, p in m.preprocessing.items():
        out[f"preprocessing.{name}.max_abs_input_diff"] = p.max_abs_input_diff
        out[f"preprocessing.{name}.samples_differing"] = p.samples_differing
        out[f"preprocessing.{name}.metric_drop"] = p.metric_drop
        out[f"gate.preprocessing.{name}.passed"] = p.passed
    out["throughput_per_s"] = b.throughput_per_s
    out["memory.peak_rss_mb"] = b.peak_rss_mb
    out["memory.engine_load_mb"] = b.engine_load_mb
    return out


def _bench_metrics(bench: BenchReport) -> dict[str, Any]:
    """The bench run's volatile detail (``bench.*``)."""
    out: dict[str, Any] = {}
    for kind in ("engine_only", "end_to_end", "warmup"):
        for key, value in (getattr(bench, kind).to_json() if getattr(bench, kind) else {}).items():
            if not isinstance(value, list):
                out[f"bench.{kind}.{key}"] = value
    for key in ("throughput_per_s", "first_inference_ms", "load_seconds"):
        out[f"bench.{key}"] = getattr(bench, key)
    for key, value in bench.memory_mb.items():
        out[f"bench.memory.{key}_mb"] = value
    if bench.roofline_fraction is not None:
        out["bench.roofline_fraction"] = bench.roofline_fraction
    out["bench.steady_state.reached"] = bench.steady_state.reached
    out["bench.steady_state.warmup_iterations"] = bench.steady_state.warmup_iterations
    if bench.drift is not None:
        out["bench.drift.ratio"] = bench.drift.ratio
        out["bench.drift.flagged"] = bench.drift.flagged
    return out


def _correctness_metrics(m: Manifest) -> dict[str, Any]:
    """Error statistics per output, task-metric deltas, the gates, the layers."""
    out: dict[str, Any] = {}
    c = m.correctness
    for o in c.outputs:
        for key in (
            "max_abs_error",
            "max_rel_error",
            "mean_abs_error",
            "p99_abs_error",
            "mismatch_fraction",
            "cosine_similarity",
            "top1_agreement",
            "min_passing_atol",
        ):
            if getattr(o, key) is not None:  # a figure over no elements does not exist
                out[f"error.{o.output}.{key}"] = getattr(o, key)
    for x in c.metrics:
        for key in ("delta", "engine", "reference"):
            out[f"task.{x.split}.{key}"] = getattr(x, key)
    out["gate.correctness_passed"] = c.passed
    out["gate.placement_passed"] = c.placement.passed
    out["gate.precision_passed"] = c.precision.passed
    out["placement.offending_layers"] = c.placement.offending
    out["precision.mismatched_layers"] = c.precision.mismatched_layers
    out["layers"] = len(m.layers)
    out["layers.fused"] = sum(1 for layer in m.layers if len(layer.fused_from) > 1)
    return out


def ci_tags(m: Manifest, env: Mapping[str, str]) -> dict[str, str]:
    """Git commit, runner and CI run URL where the environment says."""
    tags = {"skuforge.runner": RUNNER_NAME.get(env) or m.provenance.host}
    if m.provenance.git_commit:
        tags["mlflow.source.git.commit"] = m.provenance.git_commit
        tags["skuforge.git_commit"] = m.provenance.git_commit
    run_id, repository, attempt = GITHUB_RUN_ID.get(env), GITHUB_REPOSITORY.get(env), GITHUB_RUN_ATTEMPT.get(env)
    if run_id and repository:
        url = f"{GITHUB_SERVER_URL.get(env)}/{repository}/actions/runs/{run_id}"
        if attempt:
            url += f"/attempts/{attempt}"
        tags["skuforge.ci_run_url"] = url
    elif CI_JOB_URL.get(env) or BUILD_URL.get(env):  # GitLab, Jenkins
        tags["skuforge.ci_run_url"] = CI_JOB_URL.get(env) or BUILD_URL.get(env) or ""
    return tags


def _summary(m: Manifest) -> str:
    e = m.benchmark.engine_only
    state = "passed" if m.correctness.passed else "FAILED"
    return (
        f"{m.model} on {m.sku}: {m.backend} {m.precision}, correctness {state}, p50 {e.p50_ms:.4g} ms, "
        f"p99 {e.p99_ms:.4g} ms, {m.benchmark.throughput_per_s:.4g} samples/s; manifest {m.digest[:12]}"
    )


def _run_tags(m: Manifest, env: Mapping[str, str]) -> dict[str, str]:
    return {
        TAG_MODEL: m.model,
        TAG_SKU: m.sku,
        TAG_DIGEST: m.digest,
        "skuforge.backend": m.backend,
        "skuforge.precision": m.precision,
        "skuforge.version": __version__,
        "skuforge.hardware_specific": str(m.hardware_specific).lower(),
        # the meter, or why there is none (a metric would have to be a zero)
        "skuforge.energy": (m.benchmark.energy.source or "")
        if m.benchmark.energy.available
        else (m.benchmark.energy.reason or "unavailable")[:MAX_PARAM_VALUE],
        "mlflow.user": actor(dict(env)),
        "mlflow.note.content": _summary(m),
        **ci_tags(m, env),
    }


def expected_artifacts(inputs: PublishInputs) -> dict[str, int]:
    """Artifact path -> size in bytes, as they must be listed after the upload."""
    out = {
        str(PurePosixPath(ENGINE_ARTIFACTS, rel)): (inputs.engine_dir / rel).stat().st_size
        for rel in inputs.engine_files
    }
    out[MANIFEST_ARTIFACT] = inputs.manifest_path.stat().st_size
    out.update({f"{REPORT_ARTIFACTS}/{p.name}": p.stat().st_size for p in inputs.reports})
    return out


def _listing(tracking: Tracking, run_id: str, path: str | None = None) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for f in tracking.call("list artifacts", tracking.client.list_artifacts, run_id, path):
        if f.is_dir:
            out.update(_listing(tracking, run_id, f.path))
        else:
            out[f.path] = f.file_size
    return out


def _version_by_digest(client, name: str, digest: str):
    found = client.search_model_versions(f"name = '{name}' and tags.`{TAG_DIGEST}` = '{digest}'")
    return min(found, key=lambda v: int(v.version)) if found else None


def _find_runs(client, experiment_id: str, digest: str):
    from mlflow.entities import ViewType

    return client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{TAG_DIGEST}` = '{digest}'",
        run_view_type=ViewType.ACTIVE_ONLY,
        order_by=["attributes.start_time ASC"],
    )


def _pick(runs):
    complete = [r for r in runs if r.data.tags.get(TAG_COMPLETE) == "true"]
    return (complete or runs or [None])[0]


def _log_data(tracking: Tracking, run_id: str, inputs: PublishInputs) -> None:
    """Params not yet logged, dataset inputs, then metrics with the marker tag in one batch."""
    from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag

    client = tracking.client
    run = tracking.call("read run", client.get_run, run_id)
    if run.data.tags.get(TAG_LOGGED) == "true":
        return
    have = run.data.params
    todo = [Param(k, v) for k, v in params(inputs).items() if k not in have]  # a resumed run keeps its first values
    for i in range(0, len(todo), PARAMS_PER_BATCH):
        tracking.call("log params", client.log_batch, run_id, params=todo[i : i + PARAMS_PER_BATCH])
    m = inputs.manifest
    datasets = [
        DatasetInput(
            Dataset(
                name=f"{m.model}.{split}",
                digest=sha[:32],
                source_type="local",
                source=json.dumps({"uri": where}),
                profile=json.dumps({"sha256": sha}),
            ),
            tags=[InputTag("mlflow.data.context", split)],
        )
        for split, (sha, where) in sorted(inputs.datasets.items())
    ]
    if datasets:
        tracking.call("log dataset inputs", client.log_inputs, run_id, datasets=datasets)
    now = int(time.time() * 1000)
    metrics = [Metric(k, v, now, 0) for k, v in sorted(manifest_metrics(m, inputs.bench, inputs.build_seconds).items())]
    for i in range(0, max(len(metrics), 1), METRICS_PER_BATCH):
        chunk = metrics[i : i + METRICS_PER_BATCH]
        last = i + METRICS_PER_BATCH >= len(metrics)

        def batch(chunk=chunk, last=last) -> None:
            # the marker rides in the last batch: a retry after a lost answer must not log twice
            if last and client.get_run(run_id).data.tags.get(TAG_LOGGED) == "true":
                return
            client.log_batch(run_id, metrics=chunk, tags=[RunTag(TAG_LOGGED, "true")] if last else [])

        tracking.call("log metrics", batch)


def _upload(tracking: Tracking, run_id: str, inputs: PublishInputs, progress: Progress) -> None:
    client = tracking.client
    # (file, artifact folder): None puts it at the run's artifact root
    files: list[tuple[Path, str | None]] = [
        (inputs.engine_dir / rel, str(PurePosixPath(ENGINE_ARTIFACTS, rel).parent)) for rel in inputs.engine_files
    ]
    files += [(p, REPORT_ARTIFACTS) for p in inputs.reports]
    with tempfile.TemporaryDirectory(prefix="skuforge-publish-") as tmp:
        manifest_copy = Path(tmp) / MANIFEST_ARTIFACT  # the manifest travels under a fixed name
        shutil.copyfile(inputs.manifest_path, manifest_copy)
        files.append((manifest_copy, None))
        for i, (path, where) in enumerate(files):
            progress("publish: artifacts", 0.3 + 0.5 * i / len(files))
            tracking.call(f"upload {path.name}", client.log_artifact, run_id, str(path), where)


@contextlib.contextmanager
def _ended_on_failure(tracking: Tracking, run_id: str) -> Iterator[None]:
    """A failure inside marks the run FAILED (KILLED on Ctrl-C) before it propagates, so the MLflow UI
    does not show it RUNNING forever; not when the store is unreachable (marking would wait on it
    again). The next publish resumes the run either way."""
    try:
        yield
    except BaseException as exc:
        if not unreachable(exc):
            status = "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
            try:
                tracking.call(f"mark run {run_id} {status}", tracking.client.set_terminated, run_id, status)
            except Exception as also:  # noqa: BLE001 - e.g. a read-only database too: the first error is the one to show
                log.debug("run %s left as it was: %s", run_id, also)
        raise


def _verdict_tags(m: Manifest, registry: Registry, key) -> dict[str, str]:
    """The version tags promotion trusts: correctness recomputed against params.yaml, and the
    publisher's signature of the manifest digest."""
    return {
        TAG_CORRECTNESS: "failed" if correctness_problems(m, registry) else "passed",
        TAG_SIGNATURE: json.dumps(key.sign(m.digest, m.model, m.sku).to_json(), sort_keys=True),
    }


def _logged(inputs: PublishInputs) -> list[str]:
    """The metric names a run of these inputs holds."""
    return list(manifest_metrics(inputs.manifest, inputs.bench, inputs.build_seconds))


def _update_version_tags(tracking: Tracking, name: str, version, verdict: dict[str, str]) -> None:
    """A version registered before publish signed (or by an interrupted older skuforge) gets the tags
    promotion needs; tags it already has are left alone. A signature under the tag's earlier, visible
    name moves as it is (signing it again here could swap a trusted signer for this host's key)."""
    tags = dict(version.tags or {})
    where = f"tag version {version.version} of {name}"
    if TAG_SIGNATURE_BEFORE in tags:
        if TAG_SIGNATURE not in tags:
            moved = tags[TAG_SIGNATURE_BEFORE]
            tracking.call(where, tracking.client.set_model_version_tag, name, version.version, TAG_SIGNATURE, moved)
            tags[TAG_SIGNATURE] = moved
        tracking.call(where, tracking.client.delete_model_version_tag, name, version.version, TAG_SIGNATURE_BEFORE)
    for tag, value in verdict.items():
        if tag not in tags:
            tracking.call(where, tracking.client.set_model_version_tag, name, version.version, tag, value)


def _complete_run(tracking: Tracking, run_id: str, inputs: PublishInputs, step: Callable[[str, float], None]) -> None:
    """Log the run's data and upload its artifacts, check the listing against what was uploaded,
    then mark it complete (a run ended on failure is resumed by the next publish)."""
    client = tracking.client
    with _ended_on_failure(tracking, run_id):
        _log_data(tracking, run_id, inputs)
        _upload(tracking, run_id, inputs, step)
        expected = expected_artifacts(inputs)
        listed = _listing(tracking, run_id)
        wrong = sorted(
            p for p, size in expected.items() if p not in listed or (listed[p] is not None and listed[p] != size)
        )
        if wrong:
            raise ServiceError(
                f"MLflow at {tracking.display}: artifacts of run {run_id} missing or "
                f"truncated after upload: {', '.join(wrong)}",
                hint="publish again (the run is resumed); check the artifact store's space",
            )
        tracking.call("mark run complete", client.set_tag, run_id, TAG_COMPLETE, "true")


def _register(tracking: Tracking, registry: Registry, name: str, m: Manifest, run: Any, key: Any) -> tuple[Any, bool]:
    """The registered model's version of this manifest (found by digest, else created from the
    run's engine artifacts with its tags); whether it was created."""
    client = tracking.client
    tracking.registered_model(
        name,
        tags={TAG_MODEL: m.model, TAG_SKU: m.sku},
        description=f"Engines of model {m.model} for SKU {m.sku} (skuforge)",
    )
    engine_path = f"{run.info.artifact_uri.rstrip('/')}/{ENGINE_ARTIFACTS}"
    version_tags = {
        TAG_DIGEST: m.digest,
        TAG_MODEL: m.model,
        TAG_SKU: m.sku,
        "skuforge.backend": m.backend,
        "skuforge.precision": m.precision,
        **_verdict_tags(m, registry, key),
        "skuforge.p50_ms": f"{m.benchmark.engine_only.p50_ms:.6g}",
    }
    if m.provenance.git_commit:
        version_tags["skuforge.git_commit"] = m.provenance.git_commit

    def register():
        found = _version_by_digest(client, name, m.digest)
        if found is not None:
            return found, False
        return client.create_model_version(
            name, engine_path, run_id=run.info.run_id, tags=version_tags, description=_summary(m)
        ), True

    return tracking.call(f"register a version of {name}", register)


def publish_engine(
    tracking: Tracking, registry: Registry, inputs: PublishInputs, progress: Progress | None = None
) -> PublishResult:
    """Record one engine in MLflow and register it; see the module docstring for the steps.

    The version is tagged with the correctness verdict recomputed from the manifest's figures
    against params.yaml (not the manifest's own flag) and with the publisher's signature of the
    manifest digest, which promotion verifies against the keys params.yaml trusts."""

    release = registry.release
    started = time.perf_counter()
    step = progress or (lambda label, fraction: None)
    m = inputs.manifest
    name = registered_model_name(release, m.model, m.sku)
    client = tracking.client
    where = f"{m.model}/{m.sku}"

    key = signing_key()  # before anything is written: a bad key fails the publish cleanly
    step("publish: look up", 0.05)
    version = tracking.call(f"search versions of {name}", _version_by_digest, client, name, m.digest)
    created_run = created_version = resumed = False
    if version is not None and version.run_id:
        run = tracking.call("read run", client.get_run, version.run_id)
        log.debug("[%s] manifest %s already published: %s version %s", where, m.digest[:12], name, version.version)
        _update_version_tags(tracking, name, version, _verdict_tags(m, registry, key))
        # an experiment of an older skuforge gets the UI tags (kind, key view) a new one is created with
        tracking.experiment_id(experiment_name(release, m.model), experiment_tags(_logged(inputs)))
    else:
        experiment_id = tracking.experiment_id(experiment_name(release, m.model), experiment_tags(_logged(inputs)))

        def find_or_create():
            found = _pick(_find_runs(client, experiment_id, m.digest))
            if found is not None:
                return found, False
            return client.create_run(
                experiment_id, tags=_run_tags(m, inputs.env), run_name=f"{m.sku} {m.digest[:12]}"
            ), True

        step("publish: run", 0.1)
        run, created_run = tracking.call(f"create run in experiment {experiment_id}", find_or_create)
        run_id = run.info.run_id
        if run.data.tags.get(TAG_COMPLETE) != "true":
            resumed = not created_run
            _complete_run(tracking, run_id, inputs, step)
            tracking.call("end run", client.set_terminated, run_id, "FINISHED")
        step("publish: register", 0.9)
        version, created_version = _register(tracking, registry, name, m, run, key)
        log.debug(
            "[%s] %s %s version %s (run %s)",
            where,
            "registered" if created_version else "found",
            name,
            version.version,
            run_id,
        )
    step("publish: done", 1.0)
    return PublishResult(
        model=m.model,
        sku=m.sku,
        digest=m.digest,
        tracking_uri=tracking.display,
        experiment_id=run.info.experiment_id,
        run_id=run.info.run_id,
        artifact_uri=run.info.artifact_uri,
        registered_model=name,
        version=str(version.version),
        created_run=created_run,
        created_version=created_version,
        resumed=resumed,
        seconds=round(time.perf_counter() - started, 3),
    )
