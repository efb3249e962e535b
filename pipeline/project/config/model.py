"""The model side of params.yaml: tolerances, metric gates, bench settings, inputs, preprocessing,
postprocessing, datasets and the model entry itself."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from pipeline.project.config.base import (
    CalibrationMethod,
    DType,
    MetricKind,
    Postprocess,
    Precision,
    Strict,
)
from pipeline.project.config.preprocessing import (
    Affine,
    FilePreprocessing,
    Preprocess,
)
from pipeline.results.reports import OutputKind


class Tolerance(Strict):
    """Element-wise check |engine - reference| <= atol + rtol * |reference|, and for class scores
    (probabilities, logits) the share of samples whose top-1 class agrees with the reference's."""

    atol: float = Field(ge=0)
    rtol: float = Field(ge=0)
    max_mismatch: float = Field(0.0, ge=0, le=1, description="fraction of elements allowed beyond")
    min_top1_agreement: float = Field(
        0.0,
        ge=0,
        le=1,
        description="least fraction of samples whose top-1 class agrees with the reference (probabilities, logits)",
    )
    min_snr_db: float = Field(
        0.0,
        description="least signal-to-noise ratio of the output: the reference's variation "
        "about its mean over the engine's error, in dB",
    )
    confidence: float = Field(
        0.95,
        gt=0.5,
        lt=1,
        description="one-sided level of the exact tests that judge max_mismatch and min_top1_agreement",
    )
    max_outlier_factor: float | None = Field(
        None,
        gt=1,
        description="no element may be beyond this multiple of atol + rtol * |r|, whatever max_mismatch "
        "lets through (None: no bound)",
    )


class TaskTolerance(Strict):
    """What the device app computes from the outputs (the declared postprocess), engine against
    reference on the same inputs, no labels needed (docs/correctness.md, "Task agreement")."""

    min_agreement: float = Field(
        ge=0, le=1, description="argmax/topk: least share of samples whose top-1 label is the reference's"
    )
    max_cer: float = Field(
        ge=0,
        le=1,
        description="ctc_greedy: largest character error rate of the engine's strings against the reference's",
    )
    min_box_f1: float = Field(
        ge=0, le=1, description="nms/db_boxes: least F1 of engine boxes matched to the reference's"
    )
    box_iou: float = Field(0.5, gt=0, le=1, description="IoU at which an engine box matches a reference box")
    min_mean_iou: float = Field(ge=0, le=1, description="segment: least mean IoU of the engine's masks")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="one-sided level of the intervals that judge them")


TASK_KEYS: tuple[str, ...] = tuple(TaskTolerance.model_fields)


class ToleranceOverride(Strict):
    atol: float | None = Field(None, ge=0)
    rtol: float | None = Field(None, ge=0)
    max_mismatch: float | None = Field(None, ge=0, le=1)
    min_top1_agreement: float | None = Field(None, ge=0, le=1)
    min_snr_db: float | None = None
    confidence: float | None = Field(None, gt=0.5, lt=1)
    max_outlier_factor: float | None = Field(None, gt=1)
    min_agreement: float | None = Field(None, ge=0, le=1)
    max_cer: float | None = Field(None, ge=0, le=1)
    min_box_f1: float | None = Field(None, ge=0, le=1)
    box_iou: float | None = Field(None, gt=0, le=1)
    min_mean_iou: float | None = Field(None, ge=0, le=1)
    enforce: bool | None = Field(
        None,
        description="true: the per-output tensor gates decide as well when the model declares a postprocess "
        "(by default they are diagnostics there and the task agreement decides)",
    )


class TolerancePolicy(Strict):
    """The tolerances of one (model, SKU): one per output kind, and the kinds params.yaml declares.
    An output whose kind is not declared is judged by the kind inferred from its reference values.
    ``task``: the thresholds of the task agreement after the declared postprocess; ``enforce``: the
    tensor gates decide even where a task agreement does."""

    precision: Precision
    kinds: dict[OutputKind, Tolerance]
    declared: dict[str, OutputKind] = Field(default_factory=dict, description="output -> kind (models.*.output_kinds)")
    task: TaskTolerance | None = None
    enforce: bool = False

    def for_kind(self, kind: OutputKind) -> Tolerance:
        return self.kinds[kind]


class MetricGate(Strict):
    """Largest allowed drop of the task metric against the reference (absolute, 0..1)."""

    max_drop: float = Field(0.01, ge=0, le=1)
    max_drop_hard_tail: float = Field(0.03, ge=0, le=1)
    confidence: float = Field(
        0.95,
        gt=0.5,
        lt=1,
        description="level of the one-sided exact McNemar test: a drop beyond max_drop fails only when significant",
    )


class MetricGateOverride(Strict):
    max_drop: float | None = Field(None, ge=0, le=1)
    max_drop_hard_tail: float | None = Field(None, ge=0, le=1)
    confidence: float | None = Field(None, gt=0.5, lt=1)


class BenchSweep(Strict):
    """A throughput-against-latency curve: each (batch, concurrency) point timed after the main run."""

    batch: list[int] = Field(
        default_factory=list, description="batch sizes (within the SKU's batch profile); empty: the SKU's batch only"
    )
    concurrency: list[int] = Field(
        default_factory=list, description="caller threads; empty: the SKU's concurrency only"
    )
    seconds: float = Field(2.0, gt=0, description="time per point")

    @field_validator("batch", "concurrency")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(x < 1 for x in v):
            raise ValueError("sweep values must be >= 1")
        return sorted(set(v))


class SustainedSpec(Strict):
    """A sustained run: windows of calls until the latency and temperature trends flatten (or the cap)."""

    min_seconds: float = Field(60.0, gt=0, description="run at least this long")
    max_seconds: float = Field(600.0, gt=0, description="the cap: stop here, flat or not (reported)")
    until_thermal_steady: bool = Field(
        True, description="after min_seconds, stop once temperature and latency trends are flat; false: run to the cap"
    )
    window_seconds: float = Field(5.0, gt=0, description="one point of the trend: its median latency and temperature")
    trend_windows: int = Field(6, ge=3, description="windows the flatness is judged over")
    max_latency_slope: float = Field(
        0.01, gt=0, description="flat: the latency trend changes less than this fraction per window"
    )
    max_temperature_slope: float = Field(
        0.05, gt=0, description="flat: the temperature trend rises less than this many degrees C per window"
    )

    @model_validator(mode="after")
    def _bounds(self) -> SustainedSpec:
        if self.min_seconds > self.max_seconds:
            raise ValueError(f"sustained.min_seconds ({self.min_seconds}) is above max_seconds ({self.max_seconds})")
        if self.window_seconds * self.trend_windows > self.max_seconds:
            raise ValueError("sustained: window_seconds * trend_windows exceeds max_seconds: no trend could be judged")
        return self


class BenchSpec(Strict):
    warmup: int = Field(20, ge=0, description="fewest warm-up calls before steady state may be declared; 0: no warm-up")
    max_warmup_seconds: float = Field(
        10.0,
        gt=0,
        description="warm-up ends here even if the latency never settled (reported: steady_state.reached false)",
    )
    steady_window: int = Field(50, ge=5, description="calls per window of the steady-state detector")
    steady_tolerance: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="steady once the medians of the last three windows lie within this fraction of each other",
    )
    iterations: int = Field(200, ge=1, description="fewest timed steady-state calls")
    min_seconds: float = Field(0.0, ge=0, description="keep iterating until this much steady time")
    max_seconds: float = Field(
        60.0,
        gt=0,
        description="each timed phase stops here even short of iterations (a slow engine on a software device)",
    )
    concurrency: int = Field(1, ge=1)
    confidence: float = Field(0.95, gt=0.5, lt=1, description="level of the percentile confidence intervals")
    drift_threshold: float = Field(
        0.05,
        gt=0,
        description="flag when the last window's median differs from the first "
        "steady window's by more than this fraction",
    )
    noise_floor: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="the manifest's intervals are at least this fraction of "
        "each figure either side: reruns on one runner vary more "
        "than one run's interval says",
    )
    roofline: bool = Field(
        True,
        description="count the graph's FLOPs and bytes and profile the layers after timing "
        "(roofline.json; peaks measured once per host)",
    )
    sweep: BenchSweep | None = None
    sustained: SustainedSpec | None = Field(
        None, description="after the timed phases, run until temperature and latency flatten (or a cap)"
    )
    energy: bool = Field(
        True, description="read the host's energy counters (RAPL, NVML, INA3221) over the steady phase"
    )

    @model_validator(mode="after")
    def _bounds(self) -> BenchSpec:
        if self.min_seconds > self.max_seconds:
            raise ValueError(f"min_seconds ({self.min_seconds}) is above max_seconds ({self.max_seconds})")
        return self


class BenchOverride(Strict):
    warmup: int | None = Field(None, ge=0)
    max_warmup_seconds: float | None = Field(None, gt=0)
    steady_window: int | None = Field(None, ge=5)
    steady_tolerance: float | None = Field(None, gt=0, lt=1)
    iterations: int | None = Field(None, ge=1)
    min_seconds: float | None = Field(None, ge=0)
    max_seconds: float | None = Field(None, gt=0)
    concurrency: int | None = Field(None, ge=1)
    confidence: float | None = Field(None, gt=0.5, lt=1)
    drift_threshold: float | None = Field(None, gt=0)
    noise_floor: float | None = Field(None, ge=0, lt=1)
    roofline: bool | None = None
    sweep: BenchSweep | None = None
    sustained: SustainedSpec | None = None
    energy: bool | None = None


_FP32_RARE: dict[str, Any] = {"max_mismatch": 1e-5, "max_outlier_factor": 10.0}


def default_task_tolerances() -> dict[str, TaskTolerance]:
    """Built-in task-agreement thresholds per precision; docs/correctness.md gives the reasoning."""
    t = TaskTolerance
    return {
        "fp32": t(min_agreement=0.99, max_cer=0.01, min_box_f1=0.98, min_mean_iou=0.98),
        "fp16": t(min_agreement=0.99, max_cer=0.01, min_box_f1=0.97, min_mean_iou=0.97),
        "int8": t(min_agreement=0.97, max_cer=0.03, min_box_f1=0.9, min_mean_iou=0.9),
    }


def default_tolerances() -> dict[str, dict[str, Tolerance]]:
    """Built-in tolerances per precision and output kind; docs/correctness.md gives the reasoning."""
    t = Tolerance
    return {
        # fp32: a correct engine differs by reduction order; a few elements in a million may land
        # beyond atol/rtol (1e-5, judged exactly), none beyond 10x: docs/correctness.md
        "fp32": {
            "probabilities": t(atol=1e-4, rtol=1e-3, **_FP32_RARE, min_top1_agreement=0.99, min_snr_db=30),
            "logits": t(atol=1e-4, rtol=1e-3, **_FP32_RARE, min_top1_agreement=0.99, min_snr_db=30),
            "regression": t(atol=1e-4, rtol=1e-3, **_FP32_RARE, min_snr_db=40),
            "state": t(atol=1e-4, rtol=1e-3, **_FP32_RARE, min_snr_db=40),
        },
        "fp16": {
            "probabilities": t(atol=1e-2, rtol=1e-2, max_mismatch=1e-3, min_top1_agreement=0.99, min_snr_db=12),
            "logits": t(atol=5e-2, rtol=1e-2, max_mismatch=1e-3, min_top1_agreement=0.99, min_snr_db=12),
            "regression": t(atol=1e-2, rtol=1e-2, min_snr_db=25),
            "state": t(atol=1e-2, rtol=1e-2, min_snr_db=25),
        },
        "int8": {
            "probabilities": t(atol=0.05, rtol=0.1, max_mismatch=0.05, min_top1_agreement=0.97, min_snr_db=6),
            "logits": t(atol=0.1, rtol=0.1, max_mismatch=0.05, min_top1_agreement=0.97, min_snr_db=6),
            "regression": t(atol=0.1, rtol=0.1, max_mismatch=0.05, min_snr_db=10),
            "state": t(atol=0.1, rtol=0.1, max_mismatch=0.01, min_snr_db=10),
        },
    }


class Defaults(Strict):
    tolerances: dict[Precision, ToleranceOverride] = Field(
        default_factory=dict,
        description="per precision; a key set here wins over the built-in default of every "
        "output kind (docs/correctness.md)",
    )
    metric: MetricGate = MetricGate()
    bench: BenchSpec = BenchSpec()


class SequenceSpec(Strict):
    """A stateful model run as the device runs it: ``steps`` calls in a row, each output named in
    ``feed`` given back as its input on the next call (the golden samples in order are the
    sequence's other inputs). Validate judges the outputs after the last step against the
    reference run the same way (docs/correctness.md, "Stateful models")."""

    steps: int = Field(ge=2, le=10_000, description="calls per sequence")
    feed: dict[str, str] = Field(min_length=1, description="output -> the input it feeds on the next call")

    @model_validator(mode="after")
    def _one_input_each(self) -> SequenceSpec:
        fed = list(self.feed.values())
        repeated = sorted({i for i in fed if fed.count(i) > 1})
        if repeated:
            raise ValueError(f"feed: inputs {repeated} are fed by more than one output")
        return self


class InputSpec(Strict):
    """One model input. ``shape`` entries are ints (fixed) or axis names (dynamic, pinned)."""

    name: str
    dtype: DType = "float32"
    shape: list[int | str]
    range: tuple[float, float] | None = Field(
        None, description="value range for generated data (default [0, 1], ints [0, 10])"
    )

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: list[int | str]) -> list[int | str]:
        for dim in shape:
            if isinstance(dim, int) and dim < 1:
                raise ValueError(
                    f"fixed dimensions must be >= 1, got {dim}: write a dynamic dimension as an axis name "
                    f"(e.g. batch; every axis but the batch axis needs a value under pins)"
                )
        return shape

    @property
    def axes(self) -> list[str]:
        return [d for d in self.shape if isinstance(d, str)]

    def shape_at(self, values: dict[str, int], drop: str | None = None) -> tuple[int, ...]:
        """The shape with each axis at its value in ``values``, the axis ``drop`` left out."""
        return tuple(values[d] if isinstance(d, str) else d for d in self.shape if d != drop)

    def value_range(self) -> tuple[float, float]:
        if self.range is not None:
            return self.range
        return (0.0, 1.0) if self.dtype.startswith("float") else (0.0, 10.0)


class TopK(Strict):
    """Class scores to the k best classes (softmax first for logits)."""

    kind: Literal["topk"]
    output: str
    k: int = Field(5, ge=1)
    softmax: bool = Field(False, description="the output holds logits: softmax before ranking")

    def outputs(self) -> list[str]:
        return [self.output]


class BoxesNms(Strict):
    """Detector boxes and scores to detections: score threshold, then non-maximum suppression (OpenCV)."""

    kind: Literal["nms"]
    boxes: str = Field(description="output of boxes, [.., N, 4]")
    scores: str = Field(description="output of per-box class scores, [.., N, classes]")
    box_format: Literal["xyxy", "cxcywh"] = "xyxy"
    score_threshold: float = Field(0.25, ge=0, le=1)
    iou_threshold: float = Field(0.45, ge=0, le=1)
    max_detections: int = Field(100, ge=1)

    def outputs(self) -> list[str]:
        return [self.boxes, self.scores]


class CtcGreedy(Strict):
    """Per-frame class scores to label sequences: best class per frame, repeats merged, blanks dropped;
    with an ``alphabet``, to text (the classes other than the blank, in order, are its characters)."""

    kind: Literal["ctc_greedy"]
    output: str = Field(description="output of per-frame scores, [.., frames, classes]")
    blank: int = Field(0, ge=0)
    alphabet: str | None = Field(
        None,
        min_length=1,
        description="the characters of the classes other than the blank, in class order (blank 0: class i is "
        "alphabet[i - 1]); the model has len(alphabet) + 1 classes, and labels.csv holds text",
    )

    @model_validator(mode="after")
    def _alphabet(self) -> CtcGreedy:
        if self.alphabet is None:
            return self
        repeated = sorted({c for c in self.alphabet if self.alphabet.count(c) > 1})
        if repeated:
            raise ValueError(f"alphabet: characters {repeated} appear more than once; each class is one character")
        if "\0" in self.alphabet:  # numpy's fixed-width strings drop trailing NULs: a label would lose them
            raise ValueError("alphabet: the NUL character cannot be a class")
        if self.blank > len(self.alphabet):
            raise ValueError(
                f"blank {self.blank}: the alphabet's {len(self.alphabet)} characters and the blank make "
                f"{len(self.alphabet) + 1} classes, 0..{len(self.alphabet)}"
            )
        return self

    def outputs(self) -> list[str]:
        return [self.output]


class DbBoxes(Strict):
    """A text detector's probability map to boxes, as DBNet does it (binarise, contours, box score,
    unclip the min-area rectangle): OpenCV, no polygon clipper."""

    kind: Literal["db_boxes"]
    output: str = Field(description="output of the probability map, [batch, 1, H, W] or [batch, H, W]")
    threshold: float = Field(0.3, ge=0, le=1, description="a pixel is text above this probability")
    box_threshold: float = Field(
        0.6, ge=0, le=1, description="keep a region whose mean probability (the box score) is at least this"
    )
    unclip_ratio: float = Field(
        1.5, ge=0, le=100, description="grow each side of a region's min-area rectangle by area * ratio / perimeter"
    )
    min_size: float = Field(3, ge=0, allow_inf_nan=False, description="drop a region whose short side is below this")
    max_candidates: int = Field(1000, ge=1, description="regions looked at per map, in reading order")

    def outputs(self) -> list[str]:
        return [self.output]


class Segment(Strict):
    """Per-pixel class scores to a class mask: argmax over the class axis, or a threshold on a
    single-channel map."""

    kind: Literal["segment"]
    output: str = Field(
        description="output of class scores, [batch, classes, H, W] (channels_last: [batch, H, W, classes])"
    )
    channels_last: bool = Field(False, description="the class axis is last")
    threshold: float | None = Field(
        None,
        allow_inf_nan=False,
        description="a single-channel map: class 1 where the value is above this, else 0 (null: argmax)",
    )

    def outputs(self) -> list[str]:
        return [self.output]


PostprocessStep = TopK | BoxesNms | CtcGreedy | DbBoxes | Segment


class GenerateSpec(Strict):
    count: int = Field(32, ge=1)
    seed: int = 0
    edge_cases: bool = Field(
        False,
        description="replace the last 4 samples by range ends, zeros and values at up to "
        "4x the range (outside it); not for calibration",
    )


class DatasetSource(Strict):
    """A .npz/.npy file (relative to the model's dir), a folder of raw files (images or WAV clips,
    read through the input's declared preprocessing), or generated from the input spec."""

    path: str | None = None
    files: str | None = Field(
        None,
        description="folder of raw files (relative to the model's dir), sorted by name; targets in its "
        "labels.csv (file,label: a class index, or text for a ctc_greedy alphabet) or boxes.csv "
        "(file,x1,y1,x2,y2[,class]) when present",
    )
    generate: GenerateSpec | None = None
    take: int | None = Field(None, ge=1, description="use only the first N samples")
    labels: str = Field("labels", description="key of the label array in an .npz")
    allow_non_finite: bool = Field(False, description="accept NaN/Inf inputs (golden and hard_tail only)")

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSource:
        if sum(x is not None for x in (self.path, self.files, self.generate)) != 1:
            raise ValueError("give exactly one of 'path', 'files' or 'generate'")
        if self.files is not None and self.labels != "labels":
            raise ValueError("labels: a files dataset reads its targets from labels.csv or boxes.csv in its folder")
        return self


def _generated(count: int) -> DatasetSource:
    return DatasetSource(generate=GenerateSpec(count=count))


class Datasets(Strict):
    golden: DatasetSource = Field(default_factory=lambda: _generated(32))
    calibration: DatasetSource = Field(default_factory=lambda: _generated(64))
    evaluation: DatasetSource | None = None
    hard_tail: DatasetSource | None = None

    @model_validator(mode="after")
    def _finite_where_needed(self) -> Datasets:
        # calibration ranges and the metric are meaningless over NaN/Inf
        for split in ("calibration", "evaluation"):
            source = getattr(self, split)
            if source is not None and source.allow_non_finite:
                raise ValueError(f"{split}.allow_non_finite: only golden and hard_tail may hold NaN/Inf values")
        # INT8 ranges are taken over the calibration set: values outside the declared range would widen them
        if self.calibration.generate is not None and self.calibration.generate.edge_cases:
            raise ValueError(
                "calibration.generate.edge_cases: calibration data stays inside each input's range; "
                "put edge cases in golden or hard_tail"
            )
        return self


class Metric(Strict):
    """The task metric on labelled splits, per sample right or wrong (docs/correctness.md):
    top1_accuracy (integer labels, the output's top class), word_accuracy (text labels, the
    ctc_greedy string with its alphabet), detection_accuracy (boxes.csv: the image's boxes matched
    one to one to its annotations at IoU >= 0.5)."""

    kind: MetricKind = "top1_accuracy"
    output: str = Field(description="the output the metric reads (for word/detection: the postprocess's)")
    gate: MetricGateOverride = MetricGateOverride()


class CalibrationSpec(Strict):
    method: CalibrationMethod = "minmax"
    samples: int | None = Field(None, ge=1, description="first N calibration samples (default all)")


class ModelSpec(Strict):
    dir: str = Field(description="folder holding the model's files; DVC tracks it")
    source: str = Field(description="ONNX file, relative to dir")
    inputs: list[InputSpec] = Field(min_length=1)
    outputs: list[str] | None = Field(None, description="outputs to check (default: all)")
    pins: dict[str, int] = Field(default_factory=dict, description="value of each dynamic axis")
    batch_axis: str | None = Field("batch", description="axis name that indexes samples")
    preprocess: dict[str, Preprocess] = Field(
        default_factory=dict,
        description="per input: an affine map of array data (scale, offset), or the steps from raw "
        "files (decode: image|audio ...; docs/preprocessing.md)",
    )
    postprocess: Postprocess | PostprocessStep = Field(
        "none",
        description="none, argmax, or a step: topk, nms, ctc_greedy, db_boxes, segment (docs/preprocessing.md)",
    )
    datasets: Datasets = Datasets()
    metric: Metric | None = None
    calibration: CalibrationSpec = CalibrationSpec()
    sequence: SequenceSpec | None = Field(
        None, description="a stateful model: run steps in a row feeding outputs back, judge the last (validate)"
    )
    tolerances: dict[Precision, ToleranceOverride] = Field(default_factory=dict)
    output_kinds: dict[str, OutputKind] = Field(
        default_factory=dict,
        description="output -> probabilities, logits, regression or state; an output not "
        "listed is inferred from its reference values (docs/correctness.md)",
    )
    higher_precision: dict[str, list[str]] = Field(
        default_factory=dict,
        description="SKU -> ONNX nodes of the prepared model kept in higher precision than the "
        "SKU's (excluded from INT8 quantization, FP32 in an FP16 engine); "
        "skuforge bisect --fix writes it",
    )
    skus: list[str] | None = Field(
        None,
        description="the SKUs this model is built for, in any order (default: every SKU); the others "
        "get no stages, config files or matrix rows",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        names = [i.name for i in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"input names repeat: {names}")
        axes = {a for i in self.inputs for a in i.axes}
        for axis, value in self.pins.items():
            if axis not in axes:
                raise ValueError(f"pins.{axis}: no input has an axis named {axis!r} (axes: {sorted(axes)})")
            if value < 1:
                raise ValueError(f"pins.{axis} must be >= 1")
        unpinned = sorted(axes - set(self.pins) - {self.batch_axis})
        if unpinned:
            raise ValueError(f"dynamic axes {unpinned} need a value under 'pins'")
        for name in self.preprocess:
            if name not in names:
                raise ValueError(f"preprocess.{name}: no such input (inputs: {names})")
        problem = self._file_problem()
        if problem:
            raise ValueError(problem)
        if self.metric is not None and self.datasets.evaluation is None:
            raise ValueError("a metric needs datasets.evaluation with labels")
        problem = self._metric_problem()
        if problem:
            raise ValueError(problem)
        if self.sequence is not None:
            unknown = sorted(set(self.sequence.feed.values()) - set(names))
            if unknown:
                raise ValueError(f"sequence.feed: {unknown} are not inputs of the model (inputs: {names})")
            if self.outputs is not None and (missing := sorted(set(self.sequence.feed) - set(self.outputs))):
                raise ValueError(f"sequence.feed: {missing} are not among the checked outputs {self.outputs}")
        return self

    def _metric_problem(self) -> str | None:
        """A labelled metric needs the postprocess that computes what its labels describe."""
        if self.metric is None or self.metric.kind == "top1_accuracy":
            return None
        step = self.postprocess
        if self.metric.kind == "word_accuracy" and not (isinstance(step, CtcGreedy) and step.alphabet):
            return "metric word_accuracy compares decoded strings: it needs postprocess ctc_greedy with an alphabet"
        if self.metric.kind == "detection_accuracy" and not isinstance(step, BoxesNms | DbBoxes):
            return "metric detection_accuracy compares boxes: it needs postprocess nms or db_boxes"
        if isinstance(step, str) or self.metric.output not in step.outputs():
            outputs = [] if isinstance(step, str) else step.outputs()
            return f"metric.output {self.metric.output!r} is not an output the postprocess reads ({outputs})"
        return None

    def input(self, name: str) -> InputSpec:
        return next(i for i in self.inputs if i.name == name)

    @property
    def file_inputs(self) -> dict[str, FilePreprocessing]:
        """Inputs made from raw files, with their declared (training-side) preprocessing."""
        return {k: v for k, v in self.preprocess.items() if isinstance(v, FilePreprocessing)}

    @property
    def alphabet(self) -> str | None:
        """The characters a ctc_greedy postprocess decodes to (a files dataset's labels.csv then holds text)."""
        step = self.postprocess
        return step.alphabet if isinstance(step, CtcGreedy) else None

    def affine(self, name: str) -> Affine | None:
        step = self.preprocess.get(name)
        return step if isinstance(step, Affine) else None

    def _file_problem(self) -> str | None:
        files = self.file_inputs
        sources = [
            (split, source)
            for split in ("golden", "calibration", "evaluation", "hard_tail")
            if (source := getattr(self.datasets, split)) is not None
        ]
        with_files = [split for split, source in sources if source.files is not None]
        if with_files and (len(self.inputs) != 1 or not files):
            return (
                f"datasets {with_files} are folders of raw files: the model needs one input, declared with "
                "preprocess.<input>.decode (image or audio)"
            )
        if files and self.datasets.golden.files is None:
            return (
                f"datasets.golden: input {next(iter(files))!r} is decoded from raw files (preprocess.<input>.decode): "
                "give golden as files: <folder> (the end-to-end benchmark decodes its files)"
            )
        if files:
            arrays = [split for split, source in sources if source.path is not None]
            if arrays:
                return (
                    f"datasets {arrays}: input {next(iter(files))!r} is decoded from raw files "
                    "(preprocess.<input>.decode): give each set as files: <folder> (or generate)"
                )
        for name, steps in files.items():
            inp = self.input(name)
            sample = [d for d in inp.shape if d != self.batch_axis]
            if steps.decode == "audio":
                if len(sample) != 1:
                    return f"preprocess.{name}: audio fills a [batch, samples] input, not shape {inp.shape}"
                continue
            if len(sample) != 3:
                return (
                    f"preprocess.{name}: an image fills a [batch, C, H, W] or [batch, H, W, C] input, not {inp.shape}"
                )
            c, h, w = sample if steps.layout == "chw" else (sample[2], sample[0], sample[1])
            want = 1 if steps.color == "gray" else 3
            if isinstance(c, int) and c != want:
                return (
                    f"preprocess.{name}: color {steps.color} gives {want} channel(s), "
                    f"the input has {c} ({steps.layout})"
                )
            if steps.resize is not None and all(isinstance(d, int) for d in (h, w)) and (h, w) != steps.resize.size:
                return f"preprocess.{name}: resize.size {list(steps.resize.size)} is not the input's (H, W) {[h, w]}"
        return None

    @property
    def default_batch(self) -> int:
        return self.pins.get(self.batch_axis or "", 1)
