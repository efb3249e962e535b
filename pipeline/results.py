"""Typed results of each stage. Each has a JSON form; the manifest is assembled from them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


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


class BuildReport(Result):
    model: str
    sku: str
    backend: str
    precision: str
    versions: dict[str, str]
    options: dict[str, Any]
    shapes: dict[str, int]
    profiles: dict[str, dict[str, int]] = Field(default_factory=dict)
    config_sha256: str
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


class ValidationReport(Result):
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


class BenchReport(Result):
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


class Provenance(Result):
    created: str
    host: str
    git_commit: str | None
    skuforge_version: str


class Manifest(Result):
    """One engine, described. Everything but ``provenance`` is a function of the inputs."""

    schema_version: Literal[1] = 1
    model: str
    sku: str
    digest: str = Field(description="sha256 of this document without 'digest' and 'provenance'")
    source: dict[str, Any]
    target: dict[str, Any]
    backend: str
    precision: str
    toolchain: dict[str, str]
    build_config_sha256: str
    shapes: dict[str, int]
    profiles: dict[str, dict[str, int]]
    signature: Signature
    engine: list[FileRecord]
    build: dict[str, Any] = Field(description="build time, warnings and backend options as applied")
    hardware_specific: bool
    calibration: dict[str, Any] | None
    timing_cache_sha256: str | None
    datasets: dict[str, str]
    layers: list[LayerInfo]
    placement: dict[str, int]
    precision_counts: dict[str, int]
    correctness: dict[str, Any]
    benchmark: dict[str, Any]
    host: dict[str, Any]
    provenance: Provenance
