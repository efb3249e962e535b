"""Typed results of each stage. Each has a JSON form; the manifest is assembled from them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pipeline.core.io import sha256_json
from pipeline.results.base import Result
from pipeline.results.power import EnergyResult, SustainedResult


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
    synthetic: bool = Field(
        False,
        description="generated from the input spec, not real data: it may not exercise the model as real inputs do",
    )
    files: int | None = Field(None, description="raw files the set was decoded from (a files dataset)")
    raw_sha256: str | None = Field(None, description="the packed raw files (<split>.raw.npz) of a files dataset")


class DataReport(Result):
    model: str
    splits: dict[str, DatasetRecord]
    preprocessing: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="per input made from raw files: the declared training-side steps, their libraries "
        "and versions as the data stage ran them",
    )


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


# Precisions a layer computes in; "n/a" (data movement) and integer index ops are not judged.
COMPUTE_PRECISIONS = frozenset({"fp32", "fp16", "bf16", "int8", "fp8", "int4"})


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


def engine_digest(files: list[FileRecord] | list[dict[str, Any]]) -> str:
    """One hash naming an engine: its files' paths, sizes and sha256, in path order. Every report
    about an engine carries it, so evidence of one build cannot be passed off as another's."""
    records = [f.to_json() if isinstance(f, FileRecord) else dict(f) for f in files]
    return sha256_json(sorted(records, key=lambda r: r["path"]))


class EngineBound(Result):
    """A report about one built engine: which engine (files) and which build settings."""

    engine_sha256: str = Field(description="engine_digest of the engine files the report is about")
    build_config_sha256: str = Field(description="hash of everything that decided the engine's bytes")


# A reproducibility verdict, worst to best, and the least one a SKU may require ("none": any)
ReproducibilityVerdict = Literal["differs", "unverified", "equivalent", "bitwise"]
ReproducibilityLevel = Literal["none", "equivalent", "bitwise"]


class OutputDiff(Result):
    output: str
    max_abs_diff: float = Field(
        description="largest |first - second| (the largest float64 where one side is NaN or inf)"
    )
    differing: float = Field(description="fraction of elements whose bits differ")


class Reproducibility(Result):
    """The engine built a second time and compared with the first (pipeline/verify/reproducible.py)."""

    verdict: ReproducibilityVerdict = Field(
        description="bitwise: identical engine files; equivalent: files differ but layers and golden outputs are "
        "identical bit for bit; unverified: files differ, layers are identical, but this host cannot "
        "run the engines to compare outputs; differs: layers or outputs differ"
    )
    required: ReproducibilityLevel = Field(description="the SKU's reproducibility.require")
    passed: bool
    differing_files: list[str] = Field(description="engine files whose bytes differ (or that only one build wrote)")
    layers_added: list[str] = Field(default_factory=list, description="layers only the second build has")
    layers_removed: list[str] = Field(default_factory=list, description="layers only the first build has")
    layers_changed: list[str] = Field(default_factory=list, description="'<layer>: <field> <first> -> <second>'")
    outputs: list[OutputDiff] = Field(default_factory=list, description="golden outputs whose bits differ")
    samples: int = Field(description="golden samples run through both engines (0 when the files are identical)")
    not_run: list[str] = Field(default_factory=list, description="why the outputs were not compared (unverified)")
    second_build_seconds: float


UNUSED_CACHE_STATES = ("stale", "corrupt")  # a checked-in cache was there and the build used none of it
_CACHE_DECISIONS = {"tuning-database": "tuning", "timing-cache": "timing cache"}


def cache_unused(kind: str, state: str) -> str | None:
    """``cache: corrupt — built without checked-in tuning`` when a build found its checked-in cache
    stale or corrupt and so used none of it (pipeline.backends.caches), else None."""
    if state not in UNUSED_CACHE_STATES:
        return None
    return f"cache: {state} — built without checked-in {_CACHE_DECISIONS.get(kind, kind)}"


class CacheRecord(Result):
    """How a build used the SKU's checked-in cache (pipeline.backends.caches)."""

    kind: str = Field(description="tuning-database or timing-cache")
    state: str = Field(
        description="what the build found: fresh (trusted, replayed), missing (made), stale or corrupt (not "
        "used: the engine was built without it, and the folder left as it was)"
    )
    reason: str
    key: dict[str, str] = Field(description="what the cache is valid for: compiler version and target")
    sha256: str | None = Field(
        description="sha256 over the cache files after the build (path and content); null when it holds none "
        "the build trusted or wrote"
    )
    files: list[FileRecord] = Field(default_factory=list)
    hits: int
    misses: int
    missed: list[str] = Field(default_factory=list, description="what was not in the cache (first 20)")
    hit_rate: float | None
    updated: bool = Field(description="the build wrote the cache (it was made, extended or refreshed)")
    required: bool = Field(description="a miss would have failed the build")
    ignored: list[str] = Field(
        default_factory=list, description="an editor's files in the cache folder: never read, never removed"
    )

    def unused(self) -> str | None:
        return cache_unused(self.kind, self.state)


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
    cache: CacheRecord | None = None
    engine_files: list[FileRecord]
    layers: list[LayerInfo]
    placement: dict[str, int] = Field(description="node count per device/provider")
    requested_devices: list[str] = Field(description="devices/providers the SKU asked for, in priority order")
    partition_boundaries: int
    precision_counts: dict[str, int]
    hardware_specific: bool = False
    keep_precise: list[str] = Field(
        default_factory=list, description="ONNX nodes kept in higher precision than the SKU's"
    )
    remedy: Remedy | None = Field(
        None, description="the bisection remedy run during the build (bisect.fix_during_build)"
    )
    warnings: list[str] = Field(default_factory=list)
    build_seconds: float
    # left out when unchecked, so reports and manifests of unchecked builds read as before
    reproducibility: Reproducibility | None = Field(
        None,
        exclude_if=lambda v: v is None,
        description="set when the build was checked (build --check-reproducible, skus.<s>.reproducibility)",
    )


OutputKind = Literal["probabilities", "logits", "regression", "state"]


class OutputError(Result):
    """One output of the engine against the reference. Error statistics are taken over the elements
    finite in both; a statistic over no elements is null (JSON has no infinity). docs/correctness.md"""

    output: str
    kind: OutputKind
    kind_inferred: bool = Field(description="the kind was inferred from the reference values, not declared")
    elements: int = Field(description="elements compared (0 when the shapes differ)")
    shape_mismatch: str | None = Field(None, description="engine shape vs reference shape, when they differ")
    nan_count: int = Field(description="NaN in the engine output where the reference is finite")
    inf_count: int = Field(description="+-Inf in the engine output where the reference is finite")
    first_non_finite: list[int] | None = Field(description="index of the first of them")
    reference_non_finite: int = Field(description="NaN/Inf in the reference (must be matched in kind and sign)")
    max_abs_error: float | None
    mean_abs_error: float | None
    median_abs_error: float | None
    p99_abs_error: float | None
    max_rel_error: float | None = Field(description="|e - r| / |r| over elements where r != 0")
    median_rel_error: float | None
    p99_rel_error: float | None
    cosine_similarity: float | None = Field(
        description="of the flattened outputs (float64); null when one is all zeros"
    )
    top1_agreement: float | None = Field(
        description="samples (rows of the last axis) whose top-1 class is one of the "
        "reference's; probabilities and logits only"
    )
    top5_agreement: float | None = Field(
        description="samples whose reference top-1 class is in the engine's top 5; with more than 5 classes"
    )
    top1_rows: int | None = Field(None, description="decisive rows the agreement was judged on (ties left out)")
    top1_agree: int | None = Field(None, description="of them, rows whose engine top-1 class is the reference's")
    top1_ties: int | None = Field(None, description="rows left out: reference top-two margin within the tolerance")
    top1_interval: tuple[float, float] | None = Field(
        None, description="exact one-sided bounds of the agreement rate, each at `confidence`"
    )
    top1_splits: list[str] = Field(
        default_factory=list,
        description="splits whose rows were judged (golden first; more when golden alone cannot resolve the gate)",
    )
    mismatch_fraction: float = Field(description="elements beyond atol + rtol * |reference|, non-finite ones included")
    mismatch_count: int = Field(0, description="elements beyond, non-finite ones included")
    mismatch_interval: tuple[float, float] | None = Field(
        None, description="exact one-sided bounds of the mismatch rate, each at `confidence`"
    )
    snr_db: float | None = Field(
        None,
        description="10 log10 of the reference's squared variation about its mean over "
        "the squared error; null when either is zero",
    )
    reference_range: float | None = Field(None, description="max - min of the finite reference values")
    exercised: bool = Field(True, description="the reference varies beyond what a constant output would pass")
    degenerate: bool = Field(False, description="the engine's output is constant where the reference varies")
    engine_constant: float | None = Field(None, description="the engine's value when its output is constant")
    min_passing_atol: float | None = Field(
        description="smallest atol that passes the element-wise check at this rtol "
        "and max_mismatch; null: none does (non-finite values)"
    )
    min_passing_rtol: float | None = Field(
        description="smallest rtol that passes it at this atol and max_mismatch; null: none does"
    )
    atol: float
    rtol: float
    max_mismatch: float
    min_top1_agreement: float | None = Field(description="the agreement gate applied; null for regression and state")
    min_snr_db: float = Field(0.0, description="the signal-to-noise floor applied")
    confidence: float = Field(0.95, description="one-sided level of the exact tests")
    max_outlier_factor: float | None = Field(
        None, description="no element may be beyond this multiple of atol + rtol * |r| (None: no bound)"
    )
    outlier_count: int = Field(0, description="elements beyond max_outlier_factor times the tolerance")
    sequence_steps: int | None = Field(
        None, description="a stateful model's output after this many calls feeding its state back (models.sequence)"
    )
    passed: bool
    gating: bool = Field(
        True,
        description="the tensor verdict decides; false: a diagnostic beside the task agreement (which decides) "
        "but for shape, NaN/Inf and a degenerate output, which always fail",
    )


TaskStatistic = Literal["top1_agreement", "topk_overlap", "exact_match", "cer", "box_f1", "mean_iou"]


class TaskAgreement(Result):
    """What the device app computes from the outputs (the declared postprocess), the engine's against
    the reference's on the same inputs, per sample; no labels needed. A count statistic (top-1
    agreement, exact match) has an exact Clopper-Pearson interval; a ratio over samples (CER, box F1,
    mean IoU, top-k overlap) a seeded percentile bootstrap over samples, recomputed from
    ``per_sample`` (docs/correctness.md, "Task agreement")."""

    statistic: TaskStatistic
    postprocess: str = Field(description="the postprocess step whose results are compared")
    splits: list[str] = Field(description="the splits whose samples were compared")
    samples: int
    value: float | None = Field(description="the statistic; None: nothing to compare (no units)")
    agree: int | None = Field(None, description="count statistics: samples that agree")
    units: int = Field(description="what the statistic counts: samples, reference characters, boxes (resolution)")
    per_sample: list[list[float]] = Field(
        default_factory=list,
        description="ratio statistics: per sample the numerator and denominator (cer: edits, reference "
        "characters; box_f1: 2*matched, engine + reference boxes; mean_iou and topk_overlap: value, 1)",
    )
    interval: tuple[float, float] | None = Field(None, description="one-sided bounds, each at `confidence`")
    method: Literal["clopper-pearson", "bootstrap"]
    threshold: float | None = Field(None, description="the gate; None: reported only")
    direction: Literal["min", "max"] = Field(description="min: fails below the threshold; max: above")
    confidence: float = 0.95
    needed_units: int | None = Field(None, description="units the set needs to resolve the threshold")
    passed: bool
    judgeable: bool = Field(True, description="false: too few units to resolve the threshold")
    failure: str | None = None

    def text(self) -> str:
        """The statistic in the user's terms, with n and its interval."""
        if self.value is None:
            return f"task {self.statistic} ({self.postprocess}): nothing to compare on {self.samples} samples"
        interval = f", {self.interval[0]:.2%}..{self.interval[1]:.2%}" if self.interval else ""
        if self.statistic in ("top1_agreement", "exact_match"):
            what = "top-1 labels agree" if self.statistic == "top1_agreement" else "strings identical"
            return f"{self.postprocess} {what} on {self.agree}/{self.samples} samples = {self.value:.2%}{interval}"
        n = f"{self.units} {UNIT_NAMES.get(self.statistic, 'samples')}, {self.samples} samples"
        return f"{self.postprocess} {_STATISTIC_NAMES[self.statistic]} {self.value:.2%}{interval} ({n})"


UNIT_NAMES = {"cer": "reference characters", "box_f1": "boxes"}
_STATISTIC_NAMES = {
    "cer": "character error rate against the reference's strings",
    "box_f1": "box F1 against the reference's boxes",
    "mean_iou": "mean IoU against the reference's masks",
    "topk_overlap": "top-k overlap",
}


class MetricResult(Result):
    """The task metric of engine and reference on the same labelled samples, paired: an exact
    one-sided McNemar test on the samples where exactly one of them is right."""

    split: str
    reference: float
    engine: float
    delta: float
    max_drop: float
    samples: int = Field(0, description="labelled samples")
    worse: int = Field(0, description="samples the reference gets right and the engine wrong")
    better: int = Field(0, description="samples the engine gets right and the reference wrong")
    p_value: float | None = Field(None, description="one-sided exact McNemar p-value: the engine is worse")
    drop_interval: tuple[float, float] | None = Field(
        None, description="bounds of the drop, each one-sided at `confidence` (given the discordant count)"
    )
    confidence: float = 0.95
    figures: dict[str, float] = Field(
        default_factory=dict,
        description="more labelled figures, reported: engine_cer/reference_cer (word_accuracy), "
        "engine_box_f1/reference_box_f1 (detection_accuracy)",
    )
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


# --- bisection and its remedy (pipeline/verify/bisect.py, pipeline/verify/remedy.py) ---------------------------

Cause = Literal["overflow", "range", "accumulation", "compiler"]


class TensorError(Result):
    tensor: str
    node: str
    op_type: str
    relative_error: float | None = Field(
        None,
        description="||engine - reference|| / ||reference|| over finite elements, "
        "per engine run (batch); the median run",
    )
    channel_relative_error: float | None = Field(None, description="the median channel's relative error (median run)")
    worst_run_relative_error: float | None = Field(
        None, description="the worst run's relative error (hard-tail inputs)"
    )
    max_abs_error: float | None = None
    nan: int = 0
    inf: int = 0
    first_nonfinite: list[int] | None = Field(
        None, description="index of the first NaN/Inf (batch run, then tensor index)"
    )
    reference_min: float | None = None
    reference_max: float | None = None
    reference_abs_max: float | None = None
    channel_axis: int | None = None
    channel_abs_max: dict[str, float] = Field(
        default_factory=dict, description="largest channels' reference abs-max, and 'median' over all channels"
    )
    divergent: bool


class EngineLayer(Result):
    name: str
    op_type: str
    fused_from: list[str]


class Suspect(Result):
    node: str
    op_type: str
    tensor: str
    error: TensorError
    inputs: list[TensorError]
    cause: Cause
    explanation: str
    engine_layers: list[EngineLayer] = Field(description="layers of the SKU's engine holding the node (fusion)")
    keep: list[str] = Field(description="nodes the remedy keeps in higher precision for this suspect")


class Probe(Result):
    marked: list[str]
    divergent: list[str]


class Bisection(Result):
    model: str
    sku: str
    backend: str
    precision: str
    verdict: Literal["diverges", "clean", "inconclusive"]
    summary: str
    failing_outputs: list[str]
    candidates: int
    builds: int
    marks_per_build: int
    max_builds: int | None = Field(None, description="the build cap of this bisection")
    samples: int
    keep_precise: list[str] = Field(default_factory=list, description="nodes already kept precise in these builds")
    suspects: list[Suspect] = Field(default_factory=list)
    first_nonfinite: str | None = Field(None, description="node whose output first holds NaN/Inf")
    outputs: list[TensorError] = Field(default_factory=list)
    probes: list[Probe] = Field(default_factory=list)
    search_range: list[str] = Field(default_factory=list, description="inconclusive: the candidates still in question")
    tensors: list[TensorError] = Field(default_factory=list, description="scan: every candidate tensor's error")
    gate_samples: dict[str, int] = Field(
        default_factory=dict, description="samples per split the validate gate judged the anchor engine on"
    )
    gate_failures: list[str] = Field(
        default_factory=list, description="the validate gate's failures on the anchor engine (nothing marked)"
    )
    golden_indices: list[int] = Field(
        default_factory=list,
        description="the golden samples bisected when not all fit in memory: those whose outputs fail most "
        "(empty: all of them)",
    )
    opset: int | None = Field(
        None, description="the ai.onnx opset of the graph searched: the build's, after any conversion it made"
    )


class Outcome(Result):
    """One engine configuration, judged and timed."""

    keep_precise: list[str]
    passed: bool
    failures: list[str]
    outputs: list[OutputError]
    metrics: list[MetricResult]
    p50_ms: float | None = Field(
        None,
        description="engine-only median latency of one golden batch, timed interleaved with the other configuration",
    )


class FixStep(Result):
    """One engine configuration of the remedy: the nodes kept, the error it reached."""

    keep_precise: list[str]
    passed: bool
    max_abs_error: float | None = Field(None, description="the largest max abs error over the outputs")
    builds: int = Field(description="builds spent so far, this one included")
    kept: bool = Field(True, description="false when the remedy dropped the nodes it added (no effect)")
    still_quantized: list[str] = Field(
        default_factory=list,
        description="INT8: output tensors of kept nodes the engine still quantizes (a QuantizeLinear on them "
        "for a consumer that reads them in INT8)",
    )
    phase: Literal["before", "bisect", "widen", "greedy", "drop"] = Field(
        "bisect",
        description="before: the engine as configured; bisect: a bisection's suspect kept; widen: with its "
        "producers and consumers; greedy, drop: the accuracy-aware phase adding, then dropping nodes",
    )


class Remedy(Result):
    model: str
    sku: str
    backend: str
    precision: str
    passed: bool
    summary: str
    keep_precise: list[str] = Field(description="nodes kept in higher precision after the remedy")
    rounds: list[Bisection]
    builds: int = Field(description="engine builds, bisection and re-validation together")
    before: Outcome
    after: Outcome
    latency_ratio: float | None = Field(None, description="after p50 / before p50: what the fix costs")
    overrides: str = Field(description="params.yaml fragment that applies the remedy")
    max_builds: int | None = Field(None, description="the build cap of each round's bisection")
    max_rounds: int | None = Field(None, description="the cap on rounds")
    steps: list[FixStep] = Field(
        default_factory=list, description="each configuration the remedy built and judged, in order"
    )
    lessons: list[str] = Field(
        default_factory=list, description="what a round that did not move the error showed, in words"
    )
    scan: Bisection | None = Field(
        None, description="the accuracy-aware phase's scan of every tensor (when the suspects did not fix it)"
    )
    ranked: list[str] = Field(
        default_factory=list,
        description="the accuracy-aware phase's nodes, by the error their tensors add (most first), as tried",
    )
    fp32_p50_ms: float | None = Field(
        None,
        description="the prepared model on ONNX Runtime CPU FP32 (all graph optimisations), timed interleaved "
        "with the two engines",
    )
    fp32_latency_ratio: float | None = Field(None, description="after p50 / the FP32 p50")


class InputDiff(Result):
    """How far one variant of the preprocessing moves a model input from the reference's."""

    max_abs: float
    mean_abs: float
    samples_differing: int = Field(description="samples with any element different")
    elements_differing: float = Field(description="fraction of all elements that differ")


class StepDrift(Result):
    """One step swapped alone (the reference's steps with only this one the device's)."""

    step: str
    reference: Any = Field(description="the step's settings on the training side")
    device: Any = Field(description="the step's settings on the device")
    input: InputDiff
    metric_drop: float | None = Field(None, description="task metric lost by this step alone (None: no metric)")
    worse: int = 0
    better: int = 0


class PreprocessingDrift(Result):
    """The device's preprocessing against the declared training-side one, on the same raw files,
    through this engine: the difference in the model's input and in the task metric (paired, as
    the metric gate: the exact one-sided McNemar test on the samples where exactly one is right)."""

    input: str = Field(description="the model input made from raw files")
    split: str
    samples: int
    reference: dict[str, Any] = Field(description="training-side steps, libraries and versions (data stage's host)")
    device: dict[str, Any] = Field(description="device-side steps, libraries and versions (this host)")
    differing_steps: list[str] = Field(description="steps whose settings or library differ")
    diff: InputDiff
    metric: str | None = None
    metric_reference: float | None = Field(None, description="the metric with the reference's preprocessing")
    metric_device: float | None = Field(None, description="the metric with the device's preprocessing")
    metric_drop: float | None = None
    worse: int = 0
    better: int = 0
    p_value: float | None = None
    drop_interval: tuple[float, float] | None = None
    confidence: float = 0.95
    max_metric_drop: float | None = Field(None, description="the gate (skus.<sku>.preprocessing); None: reported only")
    max_input_diff: float | None = None
    steps: list[StepDrift] = Field(default_factory=list, description="per differing step, swapped alone")
    culprit: str | None = Field(None, description="the step that alone moves the metric (else the input) most")
    passed: bool
    failure: str | None = None
    judgeable: bool = Field(
        True, description="false: the split cannot judge the gate (no labels, too few samples): fails closed"
    )
    agreement: TaskAgreement | None = Field(
        None,
        description="the declared postprocess's results with the device's inputs against those with the "
        "training side's, through this engine (no labels needed)",
    )
    max_agreement_drop: float | None = Field(None, description="the gate on that agreement; None: reported only")


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
    outputs_sha256: str | None = Field(
        None, description="sha256_arrays of the engine's golden outputs (outputs.npz) written with this report"
    )
    bisection: Bisection | None = Field(None, description="first divergent node, when a correctness gate failed")
    task: list[TaskAgreement] = Field(
        default_factory=list, description="the declared postprocess's results, engine against reference"
    )
    diagnostics: list[str] = Field(
        default_factory=list, description="tensor-gate lines that did not decide (the task agreement did)"
    )
    preprocessing: list[PreprocessingDrift] = Field(
        default_factory=list, description="the drift check per input made from raw files"
    )
    emulation: dict[str, Any] | None = Field(
        None,
        description="set when the engine ran under QEMU user-mode emulation (emulator, emulated CPU, runtime, "
        "the aarch64 environment): validated under emulation, not benchmarked",
    )


class LatencyStats(Result):
    iterations: int
    mean_ms: float
    std_ms: float
    min_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    # moving-block bootstrap intervals (pipeline.results.benchstats); absent where too few samples
    p50_ci_ms: tuple[float, float] | None = Field(None, exclude_if=lambda v: v is None)
    p95_ci_ms: tuple[float, float] | None = Field(None, exclude_if=lambda v: v is None)
    p99_ci_ms: tuple[float, float] | None = Field(None, exclude_if=lambda v: v is None)
    mean_ci_ms: tuple[float, float] | None = Field(None, exclude_if=lambda v: v is None)


class SteadyState(Result):
    """How warm-up ended: the medians of the last three windows settled, or the time cap."""

    reached: bool
    warmup_iterations: int
    warmup_seconds: float
    window: int
    tolerance: float
    reason: str


class Drift(Result):
    """First against last steady window (thermal throttling, a neighbour starting up)."""

    first_p50_ms: float
    last_p50_ms: float
    ratio: float = Field(description="last / first window median")
    threshold: float
    flagged: bool
    window: int


class Execution(Result):
    """The thread and affinity settings the engine ran under."""

    affinity: list[int] | None = Field(description="CPUs this process may run on (None: not reported by the OS)")
    usable_cores: int
    engine_threads: dict[str, Any] = Field(description="the backend's thread settings as applied")
    env: dict[str, str] = Field(description="threading environment variables that were set (OMP_NUM_THREADS, ...)")
    concurrency: int
    timer: str


class SweepPoint(Result):
    batch: int
    concurrency: int
    iterations: int
    p50_ms: float
    p99_ms: float
    throughput_per_s: float


class HostInfo(Result):
    arch: str
    os: str
    cpu_model: str | None
    cpu_cores: int | None
    cpu_features: list[str]
    python: str


class BenchReport(EngineBound):
    model: str
    sku: str
    batch: int
    concurrency: int
    load_seconds: float
    first_inference_ms: float
    warmup: LatencyStats | None
    steady_state: SteadyState
    engine_only: LatencyStats
    end_to_end: LatencyStats
    end_to_end_steps: dict[str, LatencyStats] = Field(
        default_factory=dict,
        description="the end-to-end calls timed per step, in order: decode, preprocess, infer, postprocess "
        "(decode only from raw files); their p50s need not add up to the whole's",
    )
    end_to_end_input: str | None = Field(
        None, description="what an end-to-end call starts from: raw files (how many, their format) or raw arrays"
    )
    preprocessing: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per input from raw files: the device-side steps the calls ran, with versions"
    )
    energy: EnergyResult | None = Field(None, description="energy over the engine-only steady phase, or why none")
    sustained: SustainedResult | None = Field(None, description="bench.sustained: the run to thermal equilibrium")
    stopped: Literal["iterations", "max_seconds", "budget"] = Field(
        description="what ended the engine-only phase (budget: what was left of skus.<sku>.max_seconds)"
    )
    drift: Drift | None = Field(description="None: too few samples for two windows")
    throughput_per_s: float = Field(description="samples per second at the SKU's batch and concurrency")
    throughput_ci_per_s: tuple[float, float] | None = None
    execution: Execution
    sweep: list[SweepPoint] = Field(default_factory=list)
    memory_mb: dict[str, float]
    device_state: dict[str, Any]
    latency_sha256: str = Field(description="sha256 of the latency samples file (latency.csv) written with this report")
    timeline_sha256: str = Field(description="sha256 of timeline.csv (warm-up and steady calls in order)")
    roofline_sha256: str | None = Field(None, description="sha256 of roofline.json, where the bench wrote one")
    roofline_fraction: float | None = Field(
        None,
        description="achieved op/s at p50 over the host's measured peak: the INT8 one for an INT8 engine, "
        "else the FP32 one (roofline.json peak_kind)",
    )
    e2e_below_engine: bool = Field(
        False,
        description="end-to-end p50 below engine-only p50: impossible (end to end includes the engine), "
        "so a measurement error; rerun the bench",
    )
    warnings: list[str] = Field(default_factory=list, description="what makes the figures doubtful, one line each")
    host: HostInfo | None = Field(
        None,
        description="the host the engine was timed on: the manifest's host must be it "
        "(None: an older report, which cannot vouch for one)",
    )
