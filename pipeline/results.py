"""Typed results of each stage. Each has a JSON form; the manifest is assembled from them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .io import sha256_json


class Result(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class TensorSig(Result):
    name: str
    dtype: str
    shape: list[int | str | None]

    def batch_index(self, axis: str | None) -> int | None:
        return self.shape.index(axis) if axis is not None and axis in self.shape else None


class Signature(Result):
    inputs: list[TensorSig]
    outputs: list[TensorSig]

    def output(self, name: str) -> TensorSig:
        return next(o for o in self.outputs if o.name == name)


class PassRecord(Result):
    name: str
    changed: bool
    nodes_before: int
    nodes_after: int
    details: list[str] = Field(default_factory=list)


class PrepareReport(Result):
    model: str
    source_sha256: str
    prepared_sha256: str
    opset: dict[str, int]
    producer: str
    signature: Signature
    passes: list[PassRecord]
    op_counts_before: dict[str, int]
    op_counts_after: dict[str, int]
    self_check_max_abs_error: float


class DatasetRecord(Result):
    split: str
    samples: int
    sha256: str
    source: str
    has_labels: bool


class DataReport(Result):
    model: str
    splits: dict[str, DatasetRecord]


class ReferenceReport(Result):
    model: str
    runtime: str
    runtime_version: str
    outputs: list[str]
    samples: dict[str, int]
    metric: dict[str, float] = Field(default_factory=dict, description="task metric per split")
    output_sha256: dict[str, str]


class CalibrationReport(Result):
    model: str
    method: str
    samples: int
    calibration_set_sha256: str
    tensors: int
    table_sha256: str


class LayerInfo(Result):
    name: str
    op_type: str
    precision: str | None = Field(None, description="precision the layer ran in, as observed")
    device: str | None = Field(None, description="execution provider or device that ran it")
    kernel: str | None = None
    fused_from: list[str] = Field(default_factory=list)


class FileRecord(Result):
    path: str
    sha256: str
    bytes: int


def engine_digest(files: "list[FileRecord] | list[dict[str, Any]]") -> str:
    """One hash naming an engine: its files' paths, sizes and sha256, in path order. Every report
    about an engine carries it, so evidence of one build cannot be passed off as another's."""
    records = [f.to_json() if isinstance(f, FileRecord) else dict(f) for f in files]
    return sha256_json(sorted(records, key=lambda r: r["path"]))


class EngineBound(Result):
    """A report about one built engine: which engine (files) and which build settings."""

    engine_sha256: str = Field(description="engine_digest of the engine files the report is about")
    build_config_sha256: str = Field(description="hash of everything that decided the engine's bytes")


class BuildReport(EngineBound):
    model: str
    sku: str
    backend: str
    precision: str
    versions: dict[str, str]
    options: dict[str, Any]
    shapes: dict[str, int]
    profiles: dict[str, dict[str, int]] = Field(default_factory=dict)
    prepared_sha256: str
    calibration: dict[str, Any] | None = None
    timing_cache: FileRecord | None = None
    engine_files: list[FileRecord]
    layers: list[LayerInfo]
    placement: dict[str, int] = Field(description="node count per device/provider")
    requested_devices: list[str] = Field(description="devices/providers the SKU asked for, in priority order")
    partition_boundaries: int
    precision_counts: dict[str, int]
    hardware_specific: bool = False
    keep_precise: list[str] = Field(default_factory=list, description="ONNX nodes kept in higher precision than the SKU's")
    warnings: list[str] = Field(default_factory=list)
    build_seconds: float


class OutputError(Result):
    output: str
    max_abs_error: float
    max_rel_error: float
    mean_abs_error: float
    mismatch_fraction: float
    atol: float
    rtol: float
    max_mismatch: float
    passed: bool


class MetricResult(Result):
    split: str
    reference: float
    engine: float
    delta: float
    max_drop: float
    passed: bool


class PlacementResult(Result):
    allowed: list[str] | None
    offending: list[LayerInfo]
    max_fallback_nodes: int
    partition_boundaries: int
    passed: bool


class PrecisionResult(Result):
    requested: str
    mismatched: list[LayerInfo] = Field(description="compute layers observed in another precision")
    policy: str
    max_mismatched_layers: int
    passed: bool


class ValidationReport(EngineBound):
    model: str
    sku: str
    precision: str
    passed: bool
    failures: list[str]
    outputs: list[OutputError]
    metrics: list[MetricResult]
    placement: PlacementResult
    precision_gate: PrecisionResult
    warnings: list[str] = Field(default_factory=list)
    samples: dict[str, int]


class LatencyStats(Result):
    iterations: int
    mean_ms: float
    std_ms: float
    min_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


class BenchReport(EngineBound):
    model: str
    sku: str
    batch: int
    concurrency: int
    load_seconds: float
    first_inference_ms: float
    warmup: LatencyStats | None
    engine_only: LatencyStats
    end_to_end: LatencyStats
    throughput_per_s: float = Field(description="samples per second at the SKU's batch and concurrency")
    memory_mb: dict[str, float]
    device_state: dict[str, Any]
    latency_sha256: str = Field(description="sha256 of the latency samples file (latency.csv) written with this report")


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
    seconds: float
    warnings: list[str]
    options: dict[str, Any] = Field(description="the backend options as applied (backend-specific keys)")


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


class Benchmark(Result):
    batch: int
    concurrency: int
    engine_only: LatencyStats
    end_to_end: LatencyStats
    throughput_per_s: float
    first_inference_ms: float
    load_seconds: float
    memory_mb: dict[str, float]
    device_state: dict[str, Any] = Field(description="observed host state before and after (free-form readings)")


class HostInfo(Result):
    arch: str
    os: str
    cpu_model: str | None
    cpu_cores: int | None
    cpu_features: list[str]
    python: str


class Evidence(Result):
    """What the manifest summarises, by hash: the engine and every report and sample file."""

    engine_sha256: str
    files: dict[str, str] = Field(description="report file name (build.json, validate.json, bench.json, latency.csv) -> sha256")


class Manifest(Result):
    """One engine, described. Everything but ``provenance`` is a function of the inputs."""

    schema_version: Literal[2] = 2
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
    timing_cache_sha256: str | None
    datasets: dict[str, str]
    layers: list[LayerInfo]
    placement: dict[str, int]
    precision_counts: dict[str, int]
    correctness: Correctness
    benchmark: Benchmark
    host: HostInfo
    provenance: Provenance
