"""The manifest: one JSON document per (model, SKU), validated against a published schema.

Everything but the ``provenance`` block is a function of the stage reports, so the same inputs
give the same document; ``digest`` is the sha256 of the document without digest and provenance.
"""

from __future__ import annotations

import socket
import subprocess
from datetime import datetime, timezone
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from pipeline import __version__
from pipeline.core.errors import InputError
from pipeline.core.io import read_json, sha256_json
from pipeline.results.base import Result
from pipeline.results.benchstats import round_ci, round_to_ci, same_figure
from pipeline.results.power import EnergyResult, SustainedResult
from pipeline.results.reports import (
    BenchReport,
    Bisection,
    BuildReport,
    FileRecord,
    HostInfo,
    LatencyStats,
    LayerInfo,
    MetricResult,
    OutputError,
    PassRecord,
    PreprocessingDrift,
    Remedy,
    Reproducibility,
    Signature,
    TaskAgreement,
    cache_unused,
)

# --- the manifest document -------------------------------------------------------------------------


class Provenance(Result):
    created: str
    host: str
    git_commit: str | None
    skuforge_version: str


class SourceInfo(Result):
    path: str
    sha256: str = Field(description="the ONNX file and every external-data file it references")
    prepared_sha256: str
    opset: dict[str, int]
    producer: str
    passes: list[PassRecord]


class TargetInfo(Result):
    arch: str
    device: str
    os: str
    cpu_features: list[str]
    runner_labels: list[str]


class BuildInfo(Result):
    warnings: list[str]
    options: dict[str, Any] = Field(description="the backend options as applied (backend-specific keys)")
    reproducibility: Reproducibility | None = Field(
        None, exclude_if=lambda v: v is None, description="the build's reproducibility check (absent: not checked)"
    )
    keep_precise: list[str] = Field(
        default_factory=list,
        exclude_if=lambda v: not v,
        description="ONNX nodes kept in higher precision (params.yaml higher_precision)",
    )
    remedy: Remedy | None = Field(
        None,
        exclude_if=lambda v: v is None,
        description="the bisection remedy the build ran (skus.<s>.bisect.fix_during_build)",
    )


class CacheInfo(Result):
    kind: str
    sha256: str | None = Field(description="sha256 over the cache files (pipeline.backends.caches.files_digest)")
    key: dict[str, str] = Field(description="compiler version and target the cache is valid for")
    state: str = Field(
        description="fresh: the build replayed a trusted cache; missing: it made one; stale or corrupt: it found "
        "the checked-in cache and used none of it (built without it, the folder left as it was)"
    )
    reason: str = Field("", description="why the cache was in that state")
    hits: int
    misses: int
    required: bool
    ignored: list[str] = Field(
        default_factory=list, description="an editor's files in the cache folder: never read, never removed"
    )

    def unused(self) -> str | None:
        return cache_unused(self.kind, self.state)


class CalibrationInfo(Result):
    method: str
    calibration_set_sha256: str
    samples: int
    table_sha256: str | None
    settings: dict[str, Any] = Field(description="the backend's quantization settings as applied")


class PlacementSummary(Result):
    passed: bool
    allowed: list[str] | None
    offending: int
    partition_boundaries: int


class PrecisionSummary(Result):
    passed: bool
    requested: str
    policy: str
    mismatched_layers: int


class Correctness(Result):
    passed: bool
    failures: list[str]
    outputs: list[OutputError]
    metrics: list[MetricResult]
    placement: PlacementSummary
    precision: PrecisionSummary
    warnings: list[str]
    bisection: Bisection | None = Field(
        None, exclude_if=lambda v: v is None, description="first divergent node, when a correctness gate failed"
    )
    task: list[TaskAgreement] = Field(
        default_factory=list, description="the declared postprocess's results, engine against reference"
    )
    diagnostics: list[str] = Field(
        default_factory=list, description="tensor-gate lines that did not decide (the task agreement did)"
    )


class LatencySummary(Result):
    """Percentiles rounded to the decade their interval resolves, intervals widened outward to it."""

    p50_ms: float
    p50_ci_ms: tuple[float, float] | None
    p99_ms: float
    p99_ci_ms: tuple[float, float] | None


class Benchmark(Result):
    """What judges the engine's speed, rounded so that a rerun of the same engine reads the same.
    Raw samples, device state, load time and the run's other volatile detail are in bench.json and MLflow."""

    batch: int
    concurrency: int
    engine_only: LatencySummary
    end_to_end: LatencySummary
    throughput_per_s: float
    throughput_ci_per_s: tuple[float, float] | None
    peak_rss_mb: float = Field(description="whole MB")
    engine_load_mb: float = Field(description="RSS the engine's load added, whole MB")
    end_to_end_input: str | None = Field(None, description="what an end-to-end call starts from")
    end_to_end_steps: dict[str, LatencySummary] = Field(
        default_factory=dict, description="decode, preprocess, infer, postprocess: each step of the end-to-end calls"
    )
    energy: EnergySummary = Field(description="joules per inference over the engine-only phase, or why none")
    sustained: SustainedSummary | None = Field(
        None, exclude_if=lambda v: v is None, description="bench.sustained: figures at equilibrium"
    )


class EnergySummary(Result):
    """Energy per inference (3 significant digits), or ``reason``: never a zero where nothing was measured."""

    available: bool
    source: str | None = None
    joules_per_inference: float | None = None
    mean_power_w: float | None = None
    idle_power_w: float | None = Field(None, description="the host's floor just before, the engine idle")
    above_idle_joules_per_inference: float | None = Field(None, description="what the inferences added above it")
    domains: list[str] = Field(default_factory=list, description="what was summed (RAPL zones, rails, GPUs)")
    reason: str | None = None


class SustainedSummary(Result):
    """The sustained run: how it ended and the figures at equilibrium, rounded as the other figures."""

    stopped: str
    seconds: float
    p50_ms: float
    p99_ms: float
    latency_drift_pct: float | None
    clock_drop_pct: float | None
    temperature_rise_c: float | None


class PreprocessingSummary(Result):
    """One input made from raw files: both implementations and what the drift check measured."""

    reference: dict[str, Any] = Field(description="training side: steps, libraries and versions (the data stage's)")
    device: dict[str, Any] = Field(description="device side: steps, libraries and versions (validate's host)")
    differing_steps: list[str]
    split: str
    samples: int
    max_abs_input_diff: float
    samples_differing: int
    metric: str | None
    metric_drop: float | None
    drop_interval: tuple[float, float] | None
    culprit: str | None
    gated: bool = Field(
        description="skus.<sku>.preprocessing sets max_metric_drop, max_input_diff or max_agreement_drop"
    )
    agreement: float | None = Field(
        None, description="the postprocess's results with the device's inputs against the training side's"
    )
    agreement_statistic: str | None = Field(None, description="which statistic `agreement` is (cer, box_f1, ...)")
    passed: bool


class Evidence(Result):
    """What the manifest summarises, by hash: the engine and the build and validation reports. The
    benchmark is bound to it by bench.json's engine hash and by its figures' intervals
    (pipeline.results.manifest.benchmark_matches), not by a hash of samples that change on every run."""

    engine_sha256: str
    files: dict[str, str] = Field(
        description="report file name (build.json, validate.json) -> sha256 of its canonical "
        "JSON without the fields that change on every run "
        "(pipeline.results.manifest.evidence_digest)"
    )


class Manifest(Result):
    """One engine, described. Everything but ``provenance`` is a function of the inputs."""

    schema_version: Literal[8] = 8
    model: str
    sku: str
    digest: str = Field(description="sha256 of this document without 'digest' and 'provenance'")
    source: SourceInfo
    target: TargetInfo
    backend: str
    precision: str
    toolchain: dict[str, str]
    build_config_sha256: str
    shapes: dict[str, int]
    profiles: dict[str, dict[str, int]]
    signature: Signature
    engine: list[FileRecord]
    evidence: Evidence
    build: BuildInfo
    hardware_specific: bool
    calibration: CalibrationInfo | None
    cache: CacheInfo | None = Field(
        description="the checked-in compiler cache the build replayed; null where the backend keeps none"
    )
    datasets: dict[str, str]
    synthetic_datasets: list[str] = Field(
        default_factory=list, description="splits generated from the input spec rather than real data"
    )
    layers: list[LayerInfo]
    placement: dict[str, int]
    precision_counts: dict[str, int]
    correctness: Correctness
    preprocessing: dict[str, PreprocessingSummary] = Field(
        default_factory=dict, description="per input made from raw files (docs/preprocessing.md)"
    )
    benchmark: Benchmark
    host: HostInfo
    provenance: Provenance


BuildReport.model_rebuild()  # it names Remedy, defined further down


# --- its schema, digest and checks ----------------------------------------------------------------

SCHEMA_FILE = "manifest.schema.json"
_UNHASHED = ("digest", "provenance")


def schema() -> dict[str, Any]:
    """The JSON Schema of the manifest, generated from the typed model."""
    doc = Manifest.model_json_schema()
    doc["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    doc["$id"] = "https://skuforge.dev/schemas/manifest-8.json"
    return doc


@lru_cache(maxsize=1)
def published_schema() -> dict[str, Any]:
    return __import__("json").loads(resources.files("pipeline.schemas").joinpath(SCHEMA_FILE).read_text())


def digest(body: dict[str, Any]) -> str:
    return sha256_json({k: v for k, v in body.items() if k not in _UNHASHED})


# Fields of a report that change on every run of an unchanged build: left out of its evidence digest.
VOLATILE = {"build.json": (("build_seconds",), ("reproducibility", "second_build_seconds"))}
MEMORY_TOLERANCE_MB = 2.0
# energy per inference has no interval from one run: a rerun within this fraction is the same figure
ENERGY_TOLERANCE = 0.10
SUSTAINED_TOLERANCE = 0.10


def evidence_digest(name: str, path: Path) -> str | None:
    """sha256 of a report's canonical JSON without its volatile fields; None when unreadable."""
    try:
        doc = read_json(path)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    for keys in VOLATILE.get(name, ()):
        parent: Any = doc
        for key in keys[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if isinstance(parent, dict):
            parent.pop(keys[-1], None)
    return sha256_json(doc)


def host_problems(host: HostInfo, bench: BenchReport | None, where: str = "bench.json") -> list[str]:
    """Each field of the manifest's ``host`` that is not the host its bench report was timed on, by
    name; a bench report missing, or without a host (an older one), vouches for none (fail closed)."""
    if bench is None or bench.host is None:
        state = "is missing or unreadable" if bench is None else "records no host (written by an older skuforge)"
        return [f"{where} {state}: nothing vouches for the manifest's host"]
    mine, timed = host.to_json(), bench.host.to_json()
    return [
        f"host.{key} {_short(mine.get(key))} is not the host {where} was timed on ({_short(timed.get(key))})"
        for key in sorted(mine.keys() | timed.keys())
        if mine.get(key) != timed.get(key)
    ]


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _floored(value: float, ci: tuple[float, float] | None, floor: float) -> tuple[float, float] | None:
    """``ci`` widened to at least ``value`` ± ``floor`` (a fraction)."""
    if ci is None:
        return None
    return (min(ci[0], value * (1 - floor)), max(ci[1], value * (1 + floor)))


def _figure(value: float, ci: tuple[float, float] | None, floor: float, digits: int = 4) -> tuple[float, tuple | None]:
    wide = _floored(value, ci, floor)
    return round_to_ci(value, wide, digits), round_ci(wide)


def _summary(stats: LatencyStats, floor: float) -> LatencySummary:
    p50, p50_ci = _figure(stats.p50_ms, stats.p50_ci_ms, floor)
    p99, p99_ci = _figure(stats.p99_ms, stats.p99_ci_ms, floor)
    return LatencySummary(p50_ms=p50, p50_ci_ms=p50_ci, p99_ms=p99, p99_ci_ms=p99_ci)


def benchmark_summary(bench: BenchReport, noise_floor: float = 0.0) -> Benchmark:
    """The reviewed benchmark figures of one run: intervals at least ``noise_floor`` of each figure
    either side (bench.noise_floor), figures rounded to what those intervals resolve."""
    mem = bench.memory_mb
    throughput, throughput_ci = _figure(bench.throughput_per_s, bench.throughput_ci_per_s, noise_floor, digits=3)
    return Benchmark(
        batch=bench.batch,
        concurrency=bench.concurrency,
        engine_only=_summary(bench.engine_only, noise_floor),
        end_to_end=_summary(bench.end_to_end, noise_floor),
        throughput_per_s=throughput,
        throughput_ci_per_s=throughput_ci,
        peak_rss_mb=float(round(mem.get("peak_rss", 0.0))),
        engine_load_mb=float(round(mem.get("engine_load_delta", 0.0))),
        end_to_end_input=bench.end_to_end_input,
        end_to_end_steps={k: _summary(v, noise_floor) for k, v in bench.end_to_end_steps.items()},
        energy=energy_summary(bench.energy),
        sustained=_sustained_summary(bench.sustained, noise_floor) if bench.sustained else None,
    )


def preprocessing_summary(d: PreprocessingDrift) -> PreprocessingSummary:
    """The drift check as the manifest keeps it: both implementations, the input difference and
    the metric drop (4 significant digits: the same files and libraries give the same figures)."""
    return PreprocessingSummary(
        reference=d.reference,
        device=d.device,
        differing_steps=d.differing_steps,
        split=d.split,
        samples=d.samples,
        max_abs_input_diff=float(f"{d.diff.max_abs:.4g}"),
        samples_differing=d.diff.samples_differing,
        metric=d.metric,
        metric_drop=_sig(d.metric_drop, 4),
        drop_interval=(float(f"{d.drop_interval[0]:.4g}"), float(f"{d.drop_interval[1]:.4g}"))
        if d.drop_interval
        else None,
        culprit=d.culprit,
        gated=d.max_metric_drop is not None or d.max_input_diff is not None or d.max_agreement_drop is not None,
        agreement=_sig(d.agreement.value, 4) if d.agreement is not None else None,
        agreement_statistic=d.agreement.statistic if d.agreement is not None else None,
        passed=d.passed,
    )


def _sig(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else float(f"{value:.{digits}g}")


def energy_summary(energy: EnergyResult | None) -> EnergySummary:
    if energy is None:
        return EnergySummary(available=False, reason="unavailable: bench.json predates energy measurement")
    if not energy.available:
        return EnergySummary(available=False, source=energy.source, reason=energy.reason)
    return EnergySummary(
        available=True,
        source=energy.source,
        joules_per_inference=_sig(energy.joules_per_inference),
        mean_power_w=_sig(energy.mean_power_w),
        idle_power_w=_sig(energy.idle_power_w),
        above_idle_joules_per_inference=_sig(energy.above_idle_joules_per_inference),
        domains=sorted(energy.summed),
    )


def _sustained_summary(run: SustainedResult, floor: float) -> SustainedSummary:
    p50, _ = _figure(run.p50_ms, None, floor)
    p99, _ = _figure(run.p99_ms, None, floor)
    throttle = run.throttling
    return SustainedSummary(
        stopped=run.stopped,
        seconds=round(run.seconds),
        p50_ms=p50,
        p99_ms=p99,
        latency_drift_pct=_sig(throttle.latency_drift_pct, 2),
        clock_drop_pct=_sig(throttle.clock_drop_pct, 2),
        temperature_rise_c=_sig(throttle.temperature_rise_c, 2),
    )


def benchmark_changes(old: Benchmark, new: Benchmark) -> list[str]:
    """The figures of ``new`` that moved beyond their intervals from ``old`` (empty: the same
    measurement, within what the runs can tell apart)."""
    moved = []
    if (old.batch, old.concurrency) != (new.batch, new.concurrency):
        moved.append("batch/concurrency")
    for kind in ("engine_only", "end_to_end"):
        a, b = getattr(old, kind), getattr(new, kind)
        for q in ("p50", "p99"):
            if not same_figure(
                getattr(a, f"{q}_ms"), getattr(a, f"{q}_ci_ms"), getattr(b, f"{q}_ms"), getattr(b, f"{q}_ci_ms")
            ):
                moved.append(f"{kind}.{q}_ms {getattr(a, f'{q}_ms')} -> {getattr(b, f'{q}_ms')}")
    if not same_figure(old.throughput_per_s, old.throughput_ci_per_s, new.throughput_per_s, new.throughput_ci_per_s):
        moved.append(f"throughput_per_s {old.throughput_per_s} -> {new.throughput_per_s}")
    for step in sorted(set(old.end_to_end_steps) | set(new.end_to_end_steps)):
        a, b = old.end_to_end_steps.get(step), new.end_to_end_steps.get(step)
        if a is None or b is None or not same_figure(a.p50_ms, a.p50_ci_ms, b.p50_ms, b.p50_ci_ms):
            moved.append(f"end_to_end_steps.{step}.p50_ms {a and a.p50_ms} -> {b and b.p50_ms}")
    ea, eb = old.energy, new.energy
    if (ea.available, ea.source) != (eb.available, eb.source) or (
        ea.joules_per_inference is not None
        and eb.joules_per_inference is not None
        and abs(ea.joules_per_inference - eb.joules_per_inference)
        > ENERGY_TOLERANCE * max(ea.joules_per_inference, eb.joules_per_inference)
    ):
        moved.append(f"energy {ea.joules_per_inference or ea.reason} -> {eb.joules_per_inference or eb.reason}")
    if _sustained_moved(old.sustained, new.sustained):
        moved.append("sustained")
    for key in ("peak_rss_mb", "engine_load_mb"):
        a, b = getattr(old, key), getattr(new, key)
        if abs(a - b) > max(MEMORY_TOLERANCE_MB, 0.05 * max(abs(a), abs(b))):
            moved.append(f"{key} {a} -> {b}")
    return moved


def _sustained_moved(a: SustainedSummary | None, b: SustainedSummary | None) -> bool:
    """One run's equilibrium has no interval: a rerun that stopped the same way, its p50 and p99
    within SUSTAINED_TOLERANCE, is the same figure."""
    if a is None or b is None:
        return (a is None) != (b is None)
    return a.stopped != b.stopped or any(
        abs(getattr(a, k) - getattr(b, k)) > SUSTAINED_TOLERANCE * max(getattr(a, k), getattr(b, k))
        for k in ("p50_ms", "p99_ms")
    )


def settle(doc: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """``doc`` (a freshly assembled manifest) with ``previous``'s benchmark figures where nothing
    else differs and no figure moved beyond its interval: a rerun of an unchanged engine then
    leaves the reviewed document as it was. ``doc`` itself otherwise."""
    if not previous or previous.get("schema_version") != doc.get("schema_version"):
        return doc
    try:
        old = Benchmark.model_validate(previous.get("benchmark"))
    except ValueError:
        return doc
    kept = {**doc, "benchmark": old.to_json()}
    kept["digest"] = digest(kept)
    if kept["digest"] != previous.get("digest") or benchmark_changes(old, Benchmark.model_validate(doc["benchmark"])):
        return doc
    return kept


@lru_cache(maxsize=1)
def _schema_validator() -> Any:
    """One validator of the published schema per process. ``jsonschema.validate`` checks the schema
    against its metaschema on every call: 0.6 s a manifest, most of ``skuforge summary``'s time
    (a test checks the schema once instead: tests/runner/test_hostcheck_cache.py)."""
    import jsonschema

    schema = published_schema()
    return jsonschema.validators.validator_for(schema)(schema)


def validate_document(doc: Any, where: str = "manifest") -> None:
    """Check a manifest against the published schema and its own digest."""
    import jsonschema

    exc = jsonschema.exceptions.best_match(_schema_validator().iter_errors(doc))  # the error validate() raises
    if exc is not None:
        path = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise InputError(
            f"{where} does not match the manifest schema at {path}: {exc.message}",
            hint="regenerate it with skuforge manifest",
        ) from None
    if doc["digest"] != digest(doc):
        raise InputError(
            f"{where}: digest does not match its content (edited by hand?)", hint="regenerate it with skuforge manifest"
        )


def load_manifest(path: Path) -> Manifest:
    if not path.is_file():
        raise InputError(f"{path} does not exist", hint="run the manifest stage (dvc repro)")
    doc = read_json(path)
    validate_document(doc, str(path))
    return Manifest.model_validate(doc)


def provenance(root: Path) -> Provenance:
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return Provenance(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        host=socket.gethostname(),
        git_commit=commit,
        skuforge_version=__version__,
    )
