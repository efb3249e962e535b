"""The registry: params.yaml parsed once into typed models.

Errors name the YAML key path and suggest the nearest valid key. Nothing outside this module
reads params.yaml as a raw dict.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from pipeline.backends import backend_class, known_backends
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.io import MERGE_CONFLICT_FIX, merge_conflict
from pipeline.core.limits import (
    DTYPE_BYTES,
    MAX_DATASET_BYTES,
    MAX_TENSOR_BYTES,
    MAX_TENSOR_ELEMENTS,
    human_bytes,
    largest_within,
    tensor_limit,
)
from pipeline.core.paths import PATH_RULE, Layout, inside, path_problem
from pipeline.core.validation import did_you_mean, validation_problems
from pipeline.core.versions import specifier_problem
from pipeline.results import gatestats
from pipeline.results.reports import OutputKind, ReproducibilityLevel
from pipeline.results.signing import parse_public_key

Precision = Literal["fp32", "fp16", "int8"]
DType = Literal["float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"]
CalibrationMethod = Literal["minmax", "entropy", "percentile"]
MetricKind = Literal["top1_accuracy", "word_accuracy", "detection_accuracy"]
Postprocess = Literal["none", "argmax"]

PRECISIONS: tuple[str, ...] = get_args(Precision)
DTYPES: tuple[str, ...] = get_args(DType)
OUTPUT_KINDS: tuple[str, ...] = get_args(OutputKind)
CLASS_KINDS: tuple[str, ...] = ("probabilities", "logits")  # class scores on the last axis: agreement is gated


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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


def _default_task_tolerances() -> dict[str, TaskTolerance]:
    """Built-in task-agreement thresholds per precision; docs/correctness.md gives the reasoning."""
    t = TaskTolerance
    return {
        "fp32": t(min_agreement=0.99, max_cer=0.01, min_box_f1=0.98, min_mean_iou=0.98),
        "fp16": t(min_agreement=0.99, max_cer=0.01, min_box_f1=0.97, min_mean_iou=0.97),
        "int8": t(min_agreement=0.97, max_cer=0.03, min_box_f1=0.9, min_mean_iou=0.9),
    }


def _default_tolerances() -> dict[str, dict[str, Tolerance]]:
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


class Affine(Strict):
    """Preprocessing of one raw input: x * scale + offset, then cast to the input dtype."""

    scale: float = 1.0
    offset: float = 0.0


Interpolation = Literal["nearest", "bilinear", "bicubic", "area", "lanczos"]
ProcessingLibrary = Literal["pillow", "opencv", "scipy"]
ColorOrder = Literal["rgb", "bgr", "gray"]
Layout2D = Literal["chw", "hwc"]
# the order the steps run in; a report names a step by these words
PREPROCESSING_STEPS: tuple[str, ...] = ("decode", "color", "resize", "layout", "normalize", "dtype")


class Resize(Strict):
    """Resize an image to the model's (height, width)."""

    size: tuple[int, int] = Field(description="(height, width) the model takes")
    interpolation: Interpolation = "bilinear"
    antialias: bool | None = Field(
        None,
        description="low-pass filter when downscaling; null: the library's own behaviour (Pillow filters, "
        "OpenCV's bilinear does not); a value the library cannot honour is refused",
    )
    keep_aspect: bool = Field(False, description="scale to fit inside size and pad the rest (letterbox, centred)")
    pad_value: float = Field(0.0, ge=0, le=255, description="pixel value of the padding (keep_aspect)")

    @field_validator("size")
    @classmethod
    def _positive(cls, size: tuple[int, int]) -> tuple[int, int]:
        if min(size) < 1 or max(size) > 16384:
            raise ValueError(f"size {list(size)}: height and width must be 1..16384")
        return size


class Normalize(Strict):
    """(x - mean) / std per channel, on the decoded values (0..255 for 8-bit images)."""

    mean: list[float] = Field(min_length=1, description="one value per channel, or one for all")
    std: list[float] = Field(min_length=1, description="one value per channel, or one for all; never 0")

    @model_validator(mode="after")
    def _valid(self) -> Normalize:
        if any(v == 0 or not math.isfinite(v) for v in self.std):
            raise ValueError(f"std {self.std}: every value must be finite and non-zero")
        if any(not math.isfinite(v) for v in self.mean):
            raise ValueError(f"mean {self.mean}: every value must be finite")
        return self


class FilePreprocessing(Strict):
    """Raw files to one model input, step by step (PREPROCESSING_STEPS order): decode, colour order,
    resize, layout, normalise, dtype. Decode runs in ``decode_library`` (default ``library``), colour
    and resize in ``library``, the rest in numpy; docs/preprocessing.md."""

    decode: Literal["image", "audio"] = Field(description="image files (PNG, JPEG, BMP) or WAV audio")
    library: ProcessingLibrary = Field(
        "pillow", description="pillow or opencv for images, scipy (scipy.io.wavfile) for audio"
    )
    decode_library: ProcessingLibrary | None = Field(
        None, description="decode the files with another library than the rest (color, resize); null: `library`"
    )
    color: ColorOrder = Field("rgb", description="the channel order the model takes (images)")
    resize: Resize | None = None
    layout: Layout2D = Field("chw", description="channels first (chw) or last (hwc), images")
    normalize: Normalize | None = None
    length: int | None = Field(None, ge=1, description="audio: samples per clip, shorter clips zero-padded")
    sample_rate: int | None = Field(None, ge=1, description="audio: the rate the model takes; another is refused")

    @model_validator(mode="after")
    def _consistent(self) -> FilePreprocessing:
        if self.decode == "audio":
            for key, lib in (("library", self.library), ("decode_library", self.decode_library)):
                if lib not in (None, "scipy"):
                    default = "" if key in self.model_fields_set else " (the default)"
                    raise ValueError(f"decode audio: {key} {lib!r}{default} cannot read WAV: set {key}: scipy")
            if self.resize is not None:
                raise ValueError("decode audio: resize is for images; use length to pad or trim clips")
        else:
            if "scipy" in (self.library, self.decode_library):
                key = "library" if self.library == "scipy" else "decode_library"
                raise ValueError(f"decode image: {key} scipy decodes audio only: use pillow or opencv")
            if self.length is not None or self.sample_rate is not None:
                raise ValueError("decode image: length and sample_rate are for audio")
            if self.resize is not None:
                problem = resize_problem(self.library, self.resize)
                if problem:
                    raise ValueError(problem)
        if self.normalize is not None:
            channels = 1 if self.color == "gray" or self.decode == "audio" else 3
            for key in ("mean", "std"):
                values = getattr(self.normalize, key)
                if len(values) not in (1, channels):
                    raise ValueError(
                        f"normalize.{key} has {len(values)} values; {self.color} has {channels} channel(s): "
                        "give one per channel or one for all"
                    )
        return self

    @property
    def decoder(self) -> ProcessingLibrary:
        """The library that decodes the files: ``decode_library``, else ``library``."""
        return self.decode_library or self.library

    def steps(self) -> dict[str, Any]:
        """Each step's settings, PREPROCESSING_STEPS order, as JSON: what a drift report compares.
        Decode, colour and resize carry the library that runs them, so a library change shows as a
        settings change of each step the library runs (an image without resize has none to run)."""
        image = self.decode == "image"
        return {
            "decode": {"kind": self.decode, "library": self.decoder, "sample_rate": self.sample_rate},
            "color": {"order": self.color, "library": self.library} if image else None,
            "resize": (
                ({**self.resize.model_dump(), "library": self.library} if self.resize is not None else None)
                if image
                else {"length": self.length}
            ),
            "layout": self.layout if image else None,
            "normalize": self.normalize.model_dump() if self.normalize is not None else None,
            "dtype": None,
        }


def resize_problem(library: str, resize: Resize) -> str | None:
    """What a library cannot do of a resize: Pillow's resize always filters when it downscales
    (bilinear, bicubic, lanczos), OpenCV's never does (area averages)."""
    if resize.antialias is True and resize.interpolation == "nearest":
        return "resize: nearest-neighbour interpolation never filters: antialias: true needs another interpolation"
    if library == "pillow" and resize.antialias is False and resize.interpolation in ("bilinear", "bicubic", "lanczos"):
        return (
            f"resize: Pillow's {resize.interpolation} resize always antialiases when downscaling; "
            "antialias: false is OpenCV's behaviour (library: opencv)"
        )
    if library == "opencv" and resize.antialias is True and resize.interpolation != "area":
        return (
            f"resize: OpenCV's {resize.interpolation} resize has no antialias filter; use interpolation: area "
            "(it averages) or library: pillow"
        )
    return None


class ResizeOverride(Strict):
    interpolation: Interpolation | None = None
    antialias: bool | None = None
    keep_aspect: bool | None = None


class DevicePreprocessing(Strict):
    """What the device ships in place of the model's declared (training-side) preprocessing: any
    key given replaces the model's for every image or audio input of every model on the SKU
    (``library`` alone leaves a model's own ``decode_library`` in place)."""

    library: ProcessingLibrary | None = None
    decode_library: ProcessingLibrary | None = Field(
        None, description="the library that decodes the files on the device; null: the model's"
    )
    color: ColorOrder | None = None
    resize: ResizeOverride | None = None
    layout: Layout2D | None = None
    normalize: Normalize | None = None


class PreprocessingGate(Strict):
    """The SKU's device-side preprocessing and its drift check (docs/preprocessing.md)."""

    device: DevicePreprocessing | None = Field(
        None, description="the device's implementation; null: the model's declared one, run on the device"
    )
    max_metric_drop: float | None = Field(
        None,
        ge=0,
        le=1,
        description="fail when the device's preprocessing costs more than this in the task metric "
        "(paired McNemar, as the metric gate); null: reported, not gated",
    )
    max_input_diff: float | None = Field(
        None, ge=0, description="fail when a model input differs by more than this (max abs); null: reported"
    )
    max_agreement_drop: float | None = Field(
        None,
        ge=0,
        le=1,
        description="fail when the device's preprocessing changes more than this share of what the declared "
        "postprocess computes (labels, strings, boxes, masks), engine against itself, no labels needed; "
        "null: reported; a model without labels is judged this way against max_metric_drop too",
    )


def _preprocess_form(value: Any) -> str:
    """An entry with ``decode`` is the steps from raw files, any other an affine map: each is checked as
    that form alone, so a mistake in the steps is not reported as the affine map's unknown keys."""
    if isinstance(value, dict):
        return "files" if "decode" in value else "affine"
    return "files" if isinstance(value, FilePreprocessing) else "affine"


Preprocess = Annotated[
    Annotated[Affine, Tag("affine")] | Annotated[FilePreprocessing, Tag("files")], Discriminator(_preprocess_form)
]


def device_preprocessing(model: FilePreprocessing, device: DevicePreprocessing | None) -> FilePreprocessing:
    """The model's declared preprocessing with the SKU's device-side keys in place."""
    if device is None:
        return model
    merged = model.model_dump()
    merged.update(device.model_dump(exclude_none=True, exclude={"resize"}))
    if device.resize is not None and merged["resize"] is not None:  # a model without resize keeps none
        merged["resize"].update(device.resize.model_dump(exclude_none=True))
    return FilePreprocessing.model_validate(merged)


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


class Target(Strict):
    arch: Literal["x86_64", "aarch64"]
    device: Literal["cpu", "gpu", "npu"] = "cpu"
    os: Literal["linux", "windows", "macos"] = "linux"
    cpu_features: list[str] = Field(default_factory=list, description="e.g. avx2; checked on the host")


class Placement(Strict):
    allowed: list[str] | None = Field(None, description="devices/providers nodes may run on")
    max_fallback_nodes: int = Field(0, ge=0)


class PrecisionGate(Strict):
    """Layers that run in another precision than the SKU asked for (e.g. FP16 asked, FP32 run)."""

    policy: Literal["warn", "fail"] = Field("warn", description="what a mismatch does to the validate stage")
    max_mismatched_layers: int = Field(0, ge=0, description="mismatches tolerated before the policy applies")


class BisectSpec(Strict):
    """Bisection to the first divergent layer when validate fails, and its remedy."""

    on_failure: bool = Field(
        True, description="bisect when validate fails a correctness gate (result in validate.json)"
    )
    max_builds: int = Field(12, ge=1, le=200, description="engine builds one bisection may take")
    marks_per_build: int = Field(3, ge=1, le=64, description="intermediate tensors marked as outputs per build")
    fix_during_build: bool = Field(
        False,
        description="build: when the engine fails the gate, bisect and keep the "
        "suspects in higher precision until it passes",
    )
    max_fix_rounds: int = Field(4, ge=1, le=20, description="rebuild-and-revalidate rounds of the remedy")


class ReproducibilitySpec(Strict):
    """Build the engine a second time and compare it with the first (the build report's verdict)."""

    check: bool = Field(False, description="check on every build (skuforge build --check-reproducible checks once)")
    require: ReproducibilityLevel = Field(
        "none", description="the least verdict a build must reach, else it exits 1 (anything but none implies check)"
    )


class CacheSpec(Strict):
    """The SKU's checked-in compiler cache (TVM tuning database, TensorRT timing cache)."""

    require: bool = Field(
        False,
        description="fail the build on any cache miss (a stale, corrupt or missing cache, "
        "a tuning task not in the database): release builds replay the "
        "checked-in decisions; SKUFORGE_REQUIRE_CACHE=1 sets it for every SKU",
    )


GAP_REF_RULE = "owner/repo#N (a GitHub issue or pull request) or an https://github.com/ address"
GAP_REF_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,38}/[A-Za-z0-9._-]{1,100}#[1-9][0-9]{0,9}")
GAP_URL_PATTERN = re.compile(
    r"https://github\.com/[A-Za-z0-9][A-Za-z0-9-]{0,38}/[A-Za-z0-9._-]{1,100}(/[A-Za-z0-9._~/-]*)?(#[A-Za-z0-9_-]*)?"
)
MAX_GAP_SAYS = 199


class KnownGap(Strict):
    """A shortfall of the SKU's stack that is known upstream (``skus.<s>.known_gaps``): shown next to
    the SKU in the matrix, the selection and the report so a slow engine is explained, never judged.
    Both fields are untrusted text: checked here, escaped where rendered."""

    ref: str = Field(description=f"where upstream tracks it: {GAP_REF_RULE}")
    says: str = Field(description=f"what the gap is, one printable line of at most {MAX_GAP_SAYS} characters")

    @field_validator("ref")
    @classmethod
    def _ref(cls, ref: str) -> str:
        if len(ref) > 300 or not (GAP_REF_PATTERN.fullmatch(ref) or GAP_URL_PATTERN.fullmatch(ref)):
            raise ValueError(f"{ref[:80]!r} is not {GAP_REF_RULE}, e.g. 'iree-org/iree#22674'")
        return ref

    @field_validator("says")
    @classmethod
    def _says(cls, says: str) -> str:
        if not says.strip():
            raise ValueError("is empty: say what the gap is in one line")
        if not says.isprintable():
            bad = sorted({repr(c) for c in says if not c.isprintable()})
            raise ValueError(f"holds control characters ({', '.join(bad)}): one printable line, no line breaks")
        if len(says) > MAX_GAP_SAYS:
            raise ValueError(f"is {len(says)} characters long: at most {MAX_GAP_SAYS}; link the details in 'ref'")
        return says

    @property
    def url(self) -> str:
        """The web address of ``ref`` (``owner/repo#N`` -> its issue page, which GitHub redirects
        to the pull request when N is one)."""
        if self.ref.startswith("https://"):
            return self.ref
        repo, _, number = self.ref.partition("#")
        return f"https://github.com/{repo}/issues/{number}"

    @property
    def line(self) -> str:
        return f"{self.ref}: {self.says}"


class Profile(Strict):
    min: int = Field(ge=1)
    opt: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> Profile:
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"need min <= opt <= max, got {self.min}, {self.opt}, {self.max}")
        return self


class SkuSpec(Strict):
    backend: str
    precision: Precision
    target: Target
    runner_labels: list[str] = Field(min_length=1)
    toolchain: dict[str, str] = Field(
        default_factory=dict, description="package -> PEP 440 specifier the host must satisfy"
    )
    shapes: dict[str, int] = Field(default_factory=dict, description="pins for dynamic axes")
    profiles: dict[str, Profile] = Field(default_factory=dict, description="dynamic axis ranges")
    options: dict[str, Any] = Field(default_factory=dict, description="backend options")
    placement: Placement = Placement()
    precision_gate: PrecisionGate = PrecisionGate()
    tolerance: ToleranceOverride = ToleranceOverride()
    metric: MetricGateOverride = MetricGateOverride()
    bench: BenchOverride = BenchOverride()
    preprocessing: PreprocessingGate = PreprocessingGate()
    max_seconds: float | None = Field(
        3600.0,
        gt=0,
        description="wall-clock budget of each of validate and bench for this SKU: past it the stage "
        "fails its gate as timed out (exit 1), even inside one engine call; null: no budget",
    )
    bisect: BisectSpec = BisectSpec()
    reproducibility: ReproducibilitySpec = ReproducibilitySpec()
    cache: CacheSpec = CacheSpec()
    device_class: str | None = Field(
        None,
        description="the devices this SKU's engine serves (x86-avx2, rpi5, jetson-orin, ...): the SKUs of one class "
        "are candidates for the same devices, and `skuforge select` picks one per model (docs/registry.md); "
        "unset: no class, not a candidate (the portable fallback)",
    )
    known_gaps: list[KnownGap] = Field(
        default_factory=list,
        max_length=8,
        description="shortfalls of the stack known upstream ([{ref: owner/repo#N, says: one line}]): shown in the "
        "matrix, the selection and the report; they change no verdict and rebuild nothing (docs/registry.md)",
    )
    ci: bool = Field(
        True,
        description="false: the rendered build workflow has no job for this SKU (its runners are not in "
        "CI yet, or it is built by hand); `skuforge repro` still builds it where the host can (docs/ci.md)",
    )
    description: str = ""

    @model_validator(mode="after")
    def _shapes(self) -> SkuSpec:
        both = set(self.shapes) & set(self.profiles)
        if both:
            raise ValueError(f"axes {sorted(both)} are in both 'shapes' and 'profiles': pick one")
        return self

    @field_validator("device_class")
    @classmethod
    def _device_class(cls, name: str | None) -> str | None:
        problem = None if name is None else device_class_problem(name)
        if problem:
            raise ValueError(problem)
        return name

    @field_validator("toolchain")
    @classmethod
    def _toolchain(cls, toolchain: dict[str, str]) -> dict[str, str]:
        for package, spec in toolchain.items():
            if not PACKAGE_PATTERN.match(package):
                raise ValueError(
                    f"{package!r} is not a package name (PEP 508: letters, digits, '.', '_', '-'; "
                    "a letter or digit at both ends)"
                )
            problem = specifier_problem(spec)
            if problem:
                raise ValueError(f"{package}: {problem}")
        return toolchain


class Example(Strict):
    """An example model trained from code by the export stage."""

    dir: str
    seed: int = 0
    epochs: int | None = None
    opset: int = 17


ALIAS_PATTERN = re.compile(r"^[A-Za-z0-9_-]+$")
NAME_FORBIDDEN = ("/", ":", "'", '"', "`")  # MLflow refuses '/' and ':'; quotes would break its filter strings
# Model, SKU and example names become shell words (dvc.yaml), paths, workflow values and MLflow
# names: one strict rule keeps them inert everywhere and keeps '<model>-<sku>' unambiguous.
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,63}")
NAME_RULE = "a lowercase letter, then lowercase letters, digits or '_', at most 64 characters"
# A device class is a key of the selection record and a CLI argument, never a path or a shell word
# on its own; '-' is allowed as in runner labels (x86-avx2).
DEVICE_CLASS_PATTERN = re.compile(r"[a-z][a-z0-9_-]{0,62}[a-z0-9]|[a-z]")
DEVICE_CLASS_RULE = (
    "a lowercase letter, then lowercase letters, digits, '-' or '_', ending in a letter or digit, at most 64 characters"
)
PREFIX_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
PACKAGE_PATTERN = re.compile(r"^([A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9])$", re.IGNORECASE)
RESERVED_MODEL_NAMES = (
    "config",
    "ci",
    "report",
)  # build/config, build/ci and build/report: resolved config, CI locks, the HTML report


def suggest_name(name: str) -> str:
    """A valid spelling of ``name``: lower-cased, each run of other characters replaced by one '_'."""
    fixed = re.sub(r"[^a-z0-9_]+", "_", str(name).lower()).strip("_")
    fixed = fixed if "a" <= fixed[:1] <= "z" else f"n_{fixed}".rstrip("_")
    return fixed[:64].rstrip("_")


def name_problem(name: Any) -> str | None:
    """Why ``name`` cannot name a model, SKU or example, with a valid spelling; None when it can."""
    if not isinstance(name, str):
        return f"is not a string ({type(name).__name__}); quote it or use e.g. {suggest_name(name)!r}"
    if NAME_PATTERN.fullmatch(name):
        return None
    bad = sorted({c for c in name if not ("a" <= c <= "z" or "0" <= c <= "9" or c == "_")})
    what = [f"is {len(name)} characters long"] if len(name) > 64 else []
    what += ["is empty"] if not name else [] if "a" <= name[0] <= "z" else ["does not start with a lowercase letter"]
    what += [f"contains {' '.join(repr(c) for c in bad)}"] if bad else []
    return f"{', '.join(what)}: names are {NAME_RULE}; use e.g. {suggest_name(name)!r}"


def device_class_problem(name: Any) -> str | None:
    """Why ``name`` cannot name a device class, with a valid spelling; None when it can."""
    if isinstance(name, str) and DEVICE_CLASS_PATTERN.fullmatch(name):
        return None
    fixed = re.sub(r"[^a-z0-9_-]+", "-", str(name).lower()).strip("-_")[:64].rstrip("-_")
    fixed = fixed if "a" <= fixed[:1] <= "z" else f"c-{fixed}".rstrip("-")
    return f"{name!r} is not a device class name: {DEVICE_CLASS_RULE}; use e.g. {fixed!r}"


Objective = Literal["p50", "p99", "throughput"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)
DEFAULT_PREFERENCE = ("onnxruntime", "openvino", "litert", "iree", "tvm", "tensorrt")


class SelectionSpec(Strict):
    """How `skuforge select` picks one engine per (model, device class) among the passing candidates."""

    objective: Objective = Field(
        "p50",
        description="p50 or p99: engine-only latency from the bench's steady-state samples (lower wins); "
        "throughput: samples per second (higher wins)",
    )
    confidence: float = Field(
        0.95, gt=0, lt=1, description="level of the interval of the runner-up's figure over the winner's"
    )
    bootstrap: int = Field(2000, ge=100, description="bootstrap resamples of that interval")
    min_samples: int = Field(30, ge=5, description="fewer steady-state samples on either side: not separated")
    prefer: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PREFERENCE),
        description="backends in order of preference: breaks a tie (candidates not separated from the fastest); "
        "a backend not listed comes after those listed",
    )

    @field_validator("prefer")
    @classmethod
    def _prefer(cls, prefer: list[str]) -> list[str]:
        repeated = sorted({b for b in prefer if prefer.count(b) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} listed more than once; list each backend once")
        unknown = [b for b in prefer if b not in known_backends()]
        if unknown:
            raise ValueError(
                f"unknown backend {unknown[0]!r}{did_you_mean(unknown[0], known_backends())}; "
                f"known backends: {', '.join(known_backends())}"
            )
        return prefer


class PerformanceGate(Strict):
    """Promotion gate on latency: the candidate's steady-state samples against the alias holder's."""

    max_regression: float = Field(0.05, ge=0, description="allowed growth of the median latency (0.05 = 5%)")
    alpha: float = Field(0.05, gt=0, lt=1, description="significance level of the one-sided Mann-Whitney U test")
    confidence: float = Field(0.95, gt=0, lt=1, description="level of the bootstrap interval of the median ratio")
    bootstrap: int = Field(2000, ge=100, description="bootstrap resamples")
    min_samples: int = Field(30, ge=5, description="fewer samples on either side: too noisy to decide")
    on_noisy: Literal["block", "allow"] = Field("block", description="what 'too noisy to decide' does to a promotion")


class TrackingSpec(Strict):
    """How MLflow calls are retried: exponential backoff on connection errors, 5xx and a locked database;
    a server that is down or does not answer fails each call within ``deadline_seconds``."""

    retries: int = Field(4, ge=0, description="retries after the first attempt")
    backoff_seconds: float = Field(0.5, ge=0, description="first wait; doubles each retry")
    max_backoff_seconds: float = Field(8.0, ge=0)
    timeout_seconds: float = Field(
        5.0, gt=0, description="to connect and to read each HTTP answer (MLFLOW_HTTP_REQUEST_TIMEOUT wins)"
    )
    deadline_seconds: float = Field(
        10.0,
        gt=0,
        description="no retry of an unreachable or silent server starts "
        "that could not end this long after the call began",
    )


class SigningSpec(Strict):
    """Who may publish what reaches each alias (pipeline/results/signing.py verifies).

    ``trust.<alias>`` lists key names, or ``"*"``: any signature that verifies, whoever signed
    (integrity only: the manifest was not altered after it was signed). An alias missing from
    ``trust`` refuses every version, unless ``trust`` is empty as a whole (an unconfigured project:
    every alias accepts ``"*"``).
    """

    keys: dict[str, str] = Field(
        default_factory=dict, description="name -> public key 'ed25519:<base64>' (`skuforge keys show` prints it)"
    )
    trust: dict[str, list[str]] = Field(default_factory=dict, description="alias -> key names, or '*' for any signer")

    @field_validator("keys")
    @classmethod
    def _keys(cls, keys: dict[str, str]) -> dict[str, str]:

        for name, text in keys.items():
            if not ALIAS_PATTERN.match(name):
                raise ValueError(f"keys: {name!r} is not a key name (letters, digits, _ and - only)")
            try:
                parse_public_key(text)
            except ValueError as exc:
                raise ValueError(f"keys.{name}: {exc}") from None
        return keys

    @model_validator(mode="after")
    def _names(self) -> SigningSpec:
        for alias, names in self.trust.items():
            if not names:
                raise ValueError(f"trust.{alias}: an empty list trusts no key; list key names or '*'")
            for name in names:
                if name != "*" and name not in self.keys:
                    raise ValueError(
                        f"trust.{alias}: unknown key {name!r}{did_you_mean(name, self.keys)}; "
                        f"known keys: {', '.join(sorted(self.keys)) or '(none: add release.signing.keys)'}"
                    )
        return self


class Release(Strict):
    """MLflow: experiment and registered-model names, the alias chain, promotion gates."""

    name_prefix: str = Field(
        "", description="prepended to the experiment '<model>' and registered model '<model>.<sku>'"
    )
    aliases: list[str] = Field(
        default_factory=lambda: ["candidate", "staging", "production"],
        min_length=1,
        description="the promotion chain, first to last",
    )
    reason_required: list[str] = Field(
        default_factory=lambda: ["production"], description="aliases whose moves need --reason"
    )
    skus: list[str] | None = Field(None, description="SKUs a release (promote --all) requires; default: every SKU")
    history: int = Field(50, ge=1, description="alias moves kept per alias (rollback reads them)")
    performance: PerformanceGate = PerformanceGate()
    tracking: TrackingSpec = TrackingSpec()
    signing: SigningSpec = SigningSpec()

    @field_validator("name_prefix")
    @classmethod
    def _prefix(cls, prefix: str) -> str:
        bad = [c for c in NAME_FORBIDDEN if c in prefix]
        if bad:
            raise ValueError(f"may not contain {' '.join(bad)} (MLflow names)")
        if prefix and not PREFIX_PATTERN.fullmatch(prefix):
            raise ValueError(
                f"{prefix!r}: a prefix is empty or a letter or digit, then letters, digits, "
                "'_', '.' or '-', at most 64 characters (e.g. 'team-')"
            )
        return prefix

    @model_validator(mode="after")
    def _chain(self) -> Release:
        for alias in self.aliases:
            if not ALIAS_PATTERN.match(alias):
                raise ValueError(f"aliases: {alias!r} is not a valid MLflow alias (letters, digits, _ and - only)")
            if alias.lower() == "latest" or re.fullmatch(r"[vV]\d+", alias):
                raise ValueError(f"aliases: {alias!r} is reserved by MLflow ('latest' and v<number>)")
        if len(set(self.aliases)) != len(self.aliases):
            raise ValueError(f"aliases repeat: {self.aliases}")
        unknown = [a for a in self.reason_required if a not in self.aliases]
        if unknown:
            raise ValueError(f"reason_required: {unknown} not in aliases {self.aliases}")
        unknown = [a for a in self.signing.trust if a not in self.aliases]
        if unknown:
            raise ValueError(f"signing.trust: {unknown} not in aliases {self.aliases}")
        return self


class Wave(Strict):
    """One step of a rollout: a share of the fleet (by a stable hash of the device id) or named rings."""

    name: str = Field(description="shown in status and logs, e.g. canary")
    percent: float | None = Field(None, gt=0, le=100, description="cumulative share of each SKU's devices")
    rings: list[str] | None = Field(
        None, min_length=1, description="devices whose ring is listed (cumulative with earlier waves)"
    )
    bake_minutes: float = Field(60, ge=0, description="how long the wave runs before the next may start")
    timeout_minutes: float | None = Field(
        None,
        gt=0,
        description="in-progress time-out: a device of the wave with no report this long after the wave "
        "started counts as timed out (default: rollout.timeout_minutes)",
    )

    @model_validator(mode="after")
    def _one(self) -> Wave:
        if (self.percent is None) == (self.rings is None):
            raise ValueError(f"wave {self.name!r}: give exactly one of percent or rings")
        if not ALIAS_PATTERN.match(self.name):
            raise ValueError(f"wave {self.name!r}: letters, digits, _ and - only")
        return self


class HealthGates(Strict):
    """When a wave is healthy enough to go on; any failed gate aborts the rollout and rolls it back."""

    min_reports: int = Field(20, ge=1, description="device reports a wave needs before it can pass (fewer: wait)")
    max_failure_rate: float = Field(
        0.02, ge=0, le=1, description="failed reports / reports: smoke-test, verification and other errors"
    )
    max_fallback_rate: float = Field(
        0.05,
        ge=0,
        le=1,
        description="reports of devices that could not run their SKU's "
        "engine (runtime, architecture) and took the portable one",
    )
    max_smoke_failures: int = Field(0, ge=0, description="devices whose smoke test failed on the new engine")
    max_latency_regression: float = Field(
        0.10, ge=0, description="median of (new / previous engine latency) - 1 over devices that ran both"
    )
    max_timeout_rate: float = Field(
        0.5,
        ge=0,
        le=1,
        description="after a wave's time-out: devices of the wave that never reported / devices of the wave",
    )


class Expiry(Strict):
    """Lifetimes of the signed TUF metadata; a device refuses metadata past its expiry (freeze attack)."""

    root_days: float = Field(365, gt=0)
    targets_days: float = Field(90, gt=0)
    snapshot_days: float = Field(90, gt=0)
    timestamp_days: float = Field(
        1, gt=0, description="`skuforge rollout advance` (scheduled) re-signs it at half life"
    )


class RolloutSpec(Strict):
    """Shipping engines to devices: the release store, waves, health gates (docs/rollout.md)."""

    store: str = Field(
        "build/release-store",
        description="a folder (relative to params.yaml) or s3://bucket/prefix; SKUFORGE_STORE overrides it",
    )
    fallback_sku: str | None = Field(None, description="the portable ONNX Runtime CPU FP32 SKU every release carries")
    waves: list[Wave] = Field(
        default_factory=lambda: [
            Wave(name="canary", percent=1, bake_minutes=60),
            Wave(name="early", percent=10, bake_minutes=240),
            Wave(name="half", percent=50, bake_minutes=720),
            Wave(name="all", percent=100, bake_minutes=0),
        ],
        min_length=1,
    )
    gates: HealthGates = HealthGates()
    expiry: Expiry = Expiry()
    inventory: str | None = Field(
        None,
        description="the fleet inventory (CSV or YAML, relative to params.yaml) with each device's public key: "
        "the controller counts only reports signed by a device of the current wave; --inventory overrides it",
    )
    timeout_minutes: float | None = Field(
        1440, gt=0, description="default in-progress time-out of a wave (null: wait for reports forever)"
    )
    max_per_minute: float | None = Field(
        None, gt=0, description="rate limit: devices a wave admits per minute (null: all of it at once)"
    )
    max_attempts: int = Field(
        3, ge=1, description="installs a device tries per rollout before it stops retrying (failed or reverted)"
    )
    health_window_minutes: float = Field(
        30,
        ge=0,
        description="after activation the device re-checks the new engine for this long and reverts to the "
        "previous slot by itself when it fails (0: off)",
    )

    @model_validator(mode="after")
    def _waves(self) -> RolloutSpec:
        names = [w.name for w in self.waves]
        if len(set(names)) != len(names):
            raise ValueError(f"waves: names repeat: {names}")
        shares = [w.percent for w in self.waves if w.percent is not None]
        if any(b < a for a, b in pairwise(shares)):
            raise ValueError(f"waves: percentages are cumulative and may not shrink: {shares}")
        return self


class Registry(Strict):
    # Both keys are required because dvc.yaml names them (DVC has no default for a missing key).
    defaults: Defaults = Field(description="dvc.yaml tracks it: write `defaults: {}` to take the built-in defaults")
    examples: dict[str, Example] = Field(description="dvc.yaml iterates over it: write `examples: {}` if you have none")
    models: dict[str, ModelSpec]
    skus: dict[str, SkuSpec]
    release: Release = Field(default_factory=Release)
    selection: SelectionSpec = Field(default_factory=SelectionSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    _root: Path = PrivateAttr(default_factory=lambda: Path("."))

    @property
    def root(self) -> Path:
        """The folder holding params.yaml: every path in the registry is relative to it."""
        return self._root

    def model(self, name: str) -> ModelSpec:
        return _lookup(self.models, name, "model")

    def sku(self, name: str) -> SkuSpec:
        return _lookup(self.skus, name, "SKU")

    def known_gaps(self) -> dict[str, list[KnownGap]]:
        """SKU -> its declared upstream gaps (skus.<s>.known_gaps), for the SKUs that declare any."""
        return {name: list(spec.known_gaps) for name, spec in self.skus.items() if spec.known_gaps}

    def path(self, *parts: str) -> Path:
        """``parts`` under the root; an InputError when they resolve (symlinks too) outside it."""
        return inside(self.root, *parts)

    def model_file(self, model: str) -> Path:
        spec = self.model(model)
        return self.path(spec.dir, spec.source)

    def tolerance(self, model: str, sku: str) -> TolerancePolicy:
        """Per output kind: the built-in default for the SKU's precision, then the keys set in
        defaults, the model and the SKU (each wins over the one before, for every kind)."""
        s, spec = self.sku(sku), self.model(model)
        overrides = [self.defaults.tolerances.get(s.precision), spec.tolerances.get(s.precision), s.tolerance]
        update = {k: v for o in overrides if o is not None for k, v in o.model_dump(exclude_none=True).items()}
        enforce = bool(update.pop("enforce", False))
        # one confidence for every test of the pair; the other task keys are the task's alone
        task_update = {k: update.pop(k) if k != "confidence" else update[k] for k in TASK_KEYS if k in update}
        kinds = {kind: tol.model_copy(update=update) for kind, tol in _default_tolerances()[s.precision].items()}
        task = _default_task_tolerances()[s.precision].model_copy(update=task_update)
        return TolerancePolicy(
            precision=s.precision, kinds=kinds, declared=dict(spec.output_kinds), task=task, enforce=enforce
        )

    def higher_precision(self, model: str, sku: str) -> list[str]:
        """ONNX nodes of ``model`` kept in higher precision than ``sku``'s (params.yaml override)."""
        self.sku(sku)
        return list(self.model(model).higher_precision.get(sku, []))

    def metric_gate(self, model: str, sku: str) -> MetricGate:
        base = self.defaults.metric
        m = self.model(model).metric
        for override in (m.gate if m else None, self.sku(sku).metric):
            if override is not None:
                base = base.model_copy(update=override.model_dump(exclude_none=True))
        return base

    def bench(self, sku: str) -> BenchSpec:
        merged = {**self.defaults.bench.model_dump(), **self.sku(sku).bench.model_dump(exclude_none=True)}
        try:
            return BenchSpec.model_validate(merged)
        except ValidationError as exc:
            raise ConfigError(
                f"skus.{sku}.bench with defaults.bench: {exc.errors()[0]['msg']}",
                hint="make min_seconds at most max_seconds (params.yaml)",
            ) from None

    def pins(self, model: str, sku: str | None = None) -> dict[str, int]:
        """Axis values for a (model, SKU): model pins, then the SKU's shapes, then profile opt."""
        spec = self.model(model)
        pins = dict(spec.pins)
        axes = {a for i in spec.inputs for a in i.axes}
        if spec.batch_axis in axes:
            pins.setdefault(spec.batch_axis, 1)
        if sku is not None:
            s = self.sku(sku)
            pins.update({k: v for k, v in s.shapes.items() if k in axes})
            pins.update({k: p.opt for k, p in s.profiles.items() if k in axes})
        return pins

    def pairs(self, models: Iterable[str] | None = None, skus: Iterable[str] | None = None) -> list[tuple[str, str]]:
        """Every (model, SKU) the registry builds, model-major in registry order: each model with the
        SKUs ``models.<m>.skus`` selects (all when unset). ``models`` / ``skus`` narrow it (None: all)."""
        wanted_models = set(self.models if models is None else models)
        wanted_skus = set(self.skus if skus is None else skus)
        return [
            (m, s)
            for m, spec in self.models.items()
            if m in wanted_models
            for s in self.skus
            if s in wanted_skus and (spec.skus is None or s in spec.skus)
        ]

    def device_classes(self) -> dict[str, list[str]]:
        """Device class -> its SKUs, in registry order (SKUs without a class are in none)."""
        classes: dict[str, list[str]] = {}
        for name, spec in self.skus.items():
            if spec.device_class is not None:
                classes.setdefault(spec.device_class, []).append(name)
        return classes

    def release_skus(self) -> list[str]:
        """The SKUs a release requires (promote --all)."""
        return list(self.release.skus) if self.release.skus is not None else list(self.skus)


def _lookup(table: dict[str, Any], name: str, what: str) -> Any:
    try:
        return table[name]
    except KeyError:
        raise ConfigError(
            f"unknown {what} {name!r}{did_you_mean(name, table)}",
            hint=f"known {what}s: {', '.join(sorted(table)) or '(none)'}",
        ) from None


def _invalid(source: str, problems: list[str]) -> ConfigError:
    return ConfigError(
        f"{source}: invalid registry\n" + "\n".join(f"  - {p}" for p in problems),
        hint="fix the keys named above; see docs/registry.md",
    )


def parse_registry(data: Any, source: str = "params.yaml", root: Path | None = None) -> Registry:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with 'models' and 'skus' at the top level")
    problems = _name_problems(data)
    try:
        registry = Registry.model_validate(data)
    except ValidationError as exc:
        problems += validation_problems(exc, Registry)
    if problems:
        raise _invalid(source, problems) from None
    registry._root = root or Path(".")
    problems = _path_problems(registry, resolve=root is not None)
    if problems:
        raise _invalid(source, problems)
    _check_cross_references(registry, source)
    return registry


def _name_problems(data: dict) -> list[str]:
    """Every model, SKU and example name that breaks the name rule, checked before anything else."""
    problems = []
    for section in ("examples", "models", "skus"):
        table = data.get(section)
        for name in table if isinstance(table, dict) else ():
            problem = name_problem(name)
            if problem is None and section == "models" and name in RESERVED_MODEL_NAMES:
                problem = f"is reserved (build/{name} holds other files); use e.g. {name + '_model'!r}"
            if problem is not None:
                problems.append(f"{section}.{name!r}: name {problem}")
    return problems


def _path_problems(registry: Registry, resolve: bool) -> list[str]:
    """Every registry path that would lead outside the project; ``resolve`` also follows symlinks."""
    paths: list[tuple[str, str, tuple[str, ...]]] = [
        (f"examples.{n}.dir", e.dir, (e.dir,)) for n, e in registry.examples.items()
    ]
    for name, m in registry.models.items():
        paths += [(f"models.{name}.dir", m.dir, (m.dir,)), (f"models.{name}.source", m.source, (m.dir, m.source))]
        for split in Datasets.model_fields:
            ds = getattr(m.datasets, split)
            for key in ("path", "files"):  # a .npz file or a folder of raw files
                value = getattr(ds, key) if ds is not None else None
                if value is not None:
                    paths.append((f"models.{name}.datasets.{split}.{key}", value, (m.dir, value)))
    if registry.rollout.inventory is not None:
        paths.append(("rollout.inventory", registry.rollout.inventory, (registry.rollout.inventory,)))
    problems = []
    for key, value, parts in paths:
        problem = path_problem(value) or path_problem("/".join(parts))
        if problem is None and resolve:
            try:
                inside(registry.root, *parts)
            except InputError:
                problem = (
                    f"resolves to {registry.root.joinpath(*parts).resolve()}, outside the project (a symlink leads out)"
                )
        if problem is not None:
            joined = f" (joined with dir: {'/'.join(parts)!r})" if len(parts) > 1 else ""
            problems.append(f"{key}: {value!r}{joined} {problem}; paths are {PATH_RULE}")
    return problems


def _check_cross_references(registry: Registry, source: str) -> None:

    problems = []
    for name, sku in registry.skus.items():
        if sku.backend not in known_backends():
            problems.append(
                f"skus.{name}.backend: unknown backend {sku.backend!r}{did_you_mean(sku.backend, known_backends())}; "
                f"known backends: {', '.join(known_backends())}"
            )
            continue
        backend = backend_class(sku.backend)
        problems += [f"skus.{name}.{p}" for p in backend.check_sku(sku)]
        try:
            registry.bench(name)
        except ConfigError as exc:
            problems.append(exc.message)
        axes = {a for m in registry.models.values() for i in m.inputs for a in i.axes}
        for axis in [*sku.shapes, *sku.profiles]:
            if axis not in axes:
                problems.append(f"skus.{name}: axis {axis!r} is not a dynamic axis of any model (axes: {sorted(axes)})")
    for name, model in registry.models.items():
        for sname, nodes in model.higher_precision.items():
            if sname not in registry.skus:
                problems.append(
                    f"models.{name}.higher_precision: unknown SKU {sname!r}{did_you_mean(sname, registry.skus)}; "
                    f"known SKUs: {', '.join(sorted(registry.skus))}"
                )
            elif registry.skus[sname].precision == "fp32" and nodes:
                problems.append(
                    f"models.{name}.higher_precision.{sname}: the SKU builds in fp32, there is no higher "
                    "precision to keep nodes in; remove the entry"
                )
            elif (
                nodes
                and registry.skus[sname].backend in known_backends()
                and not backend_class(registry.skus[sname].backend).capabilities.per_node_precision
            ):
                problems.append(
                    f"models.{name}.higher_precision.{sname}: the {registry.skus[sname].backend} backend "
                    "cannot keep single nodes in higher precision; remove the entry"
                )
        if model.metric is not None and model.outputs is not None and model.metric.output not in model.outputs:
            problems.append(f"models.{name}.metric.output: {model.metric.output!r} is not in outputs {model.outputs}")
        for output in model.output_kinds:
            if model.outputs is not None and output not in model.outputs:
                problems.append(
                    f"models.{name}.output_kinds.{output}: not in outputs {model.outputs}"
                    + did_you_mean(output, model.outputs)
                )
        for axis in model.pins:
            if model.batch_axis == axis:
                continue
            for sname, sku in registry.skus.items():
                if axis in sku.shapes and sku.shapes[axis] != model.pins[axis]:
                    problems.append(
                        f"skus.{sname}.shapes.{axis}: only the batch axis may be re-pinned per SKU "
                        f"(datasets are generated at models.{name}.pins.{axis}={model.pins[axis]})"
                    )
        for listed in model.skus or []:
            if listed not in registry.skus:
                problems.append(
                    f"models.{name}.skus: unknown SKU {listed!r}{did_you_mean(listed, registry.skus)}; "
                    f"known SKUs: {', '.join(sorted(registry.skus))}"
                )
        if model.skus == []:
            problems.append(f"models.{name}.skus: empty, so the model is built nowhere; list a SKU or remove the key")
        repeated = sorted({s for s in model.skus or [] if (model.skus or []).count(s) > 1})
        if repeated:
            problems.append(f"models.{name}.skus: {', '.join(repeated)} listed more than once; list each SKU once")
    for listed in registry.release.skus or []:
        if listed not in registry.skus:
            problems.append(
                f"release.skus: unknown SKU {listed!r}{did_you_mean(listed, registry.skus)}; "
                f"known SKUs: {', '.join(sorted(registry.skus))}"
            )
    problems += _fallback_problems(registry)
    problems += _device_preprocessing_problems(registry)
    problems += _collisions(registry)
    problems += _size_problems(registry)
    problems += _resolution_problems(registry)
    if problems:
        raise _invalid(source, problems)


PORTABLE_LEVELS = ("disable", "basic", "extended")


def _fallback_problems(registry: Registry) -> list[str]:
    """The fallback SKU must build an engine any device with ONNX Runtime can run: CPU FP32, no
    layout-specific optimisation, no CPU feature requirement."""
    name = registry.rollout.fallback_sku
    if name is None:
        return []
    if name not in registry.skus:
        return [
            f"rollout.fallback_sku: unknown SKU {name!r}{did_you_mean(name, registry.skus)}; "
            f"known SKUs: {', '.join(sorted(registry.skus))}"
        ]
    sku = registry.skus[name]
    level = sku.options.get("graph_optimization_level", "all")
    wrong = [
        what
        for what, bad in (
            (f"backend {sku.backend!r} (needs onnxruntime)", sku.backend != "onnxruntime"),
            (f"precision {sku.precision!r} (needs fp32)", sku.precision != "fp32"),
            (f"device {sku.target.device!r} (needs cpu)", sku.target.device != "cpu"),
            (f"cpu_features {sku.target.cpu_features} (needs none)", bool(sku.target.cpu_features)),
            (
                f"options.graph_optimization_level {level!r} (needs one of {', '.join(PORTABLE_LEVELS)}: higher levels "
                "write CPU-specific layout ops into the engine)",
                level not in PORTABLE_LEVELS,
            ),
        )
        if bad
    ]
    return [f"rollout.fallback_sku: {name!r} is not portable: {'; '.join(wrong)}"] if wrong else []


def _device_preprocessing_problems(registry: Registry) -> list[str]:
    """Each SKU's device-side preprocessing merged into each of its models' declared steps: a mix the
    library cannot run (OpenCV with an antialiased bilinear resize, say) is refused here, by key."""
    problems = []
    for model, sku in registry.pairs():
        device = registry.sku(sku).preprocessing.device
        if device is None:
            continue
        for name, steps in registry.model(model).file_inputs.items():
            try:
                device_preprocessing(steps, device)
            except ValidationError as exc:
                detail = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
                problems.append(f"skus.{sku}.preprocessing.device with models.{model}.preprocess.{name}: {detail}")
    return problems


def _collisions(registry: Registry) -> list[str]:
    """Two entries whose resolved-config files coincide (e.g. pair keys '<model>-<sku>'): one would be lost."""
    layout, problems = Layout(Path(".")), []
    owners: dict[Path, str] = {}
    entries = [(f"examples.{e}", layout.config_file(e, example=True)) for e in registry.examples]
    entries += [(f"models.{m}", layout.config_file(m)) for m in registry.models]
    entries += [(f"models.{m} x skus.{s}", layout.config_file(m, s)) for m, s in registry.pairs()]
    for owner, path in entries:
        if path in owners:
            problems.append(f"{owner}: its key {path.stem!r} is also the key of {owners[path]}; rename one of them")
        owners.setdefault(path, owner)
    return problems


_AxisValues = dict[str, tuple[int, str | None]]  # axis -> (value, the key that sets it; None: the built-in batch 1)


def _resolution_problems(registry: Registry) -> list[str]:
    """A generated golden set too small to resolve the agreement threshold of an output declared as
    class scores, where no evaluation or hard-tail split can join it (docs/correctness.md). Sets
    read from files are checked by validate, once their size is known."""
    problems = []
    for name, model in registry.models.items():
        golden = model.datasets.golden.generate
        classes = sorted({kind for kind in model.output_kinds.values() if kind in CLASS_KINDS})
        if golden is None or not classes or model.datasets.evaluation or model.datasets.hard_tail:
            continue
        for _, sname in registry.pairs(models=[name]):
            for kind in classes:
                tol = registry.tolerance(name, sname).for_kind(kind)
                if tol.min_top1_agreement <= 0:
                    continue
                need = gatestats.min_rows_for_agreement(tol.min_top1_agreement, tol.confidence)
                if golden.count < need:
                    problems.append(
                        f"models.{name}.datasets.golden.generate.count: {golden.count} samples cannot resolve "
                        f"min_top1_agreement {tol.min_top1_agreement} of its {kind} outputs at {tol.confidence:.0%} "
                        f"confidence on SKU {sname}: an engine flipping twice the allowed share would pass; generate "
                        f"at least {need}, or give an evaluation split (its rows join the agreement gate)"
                    )
                    break
    return problems


def _size_problems(registry: Registry) -> list[str]:
    """Every input too large for one tensor at its largest shape (the model's pins, then each SKU's
    shapes and profile maxima) and every generated set above the dataset budget, refused before a
    stage allocates them (pipeline/core/limits.py)."""
    problems = []
    for name, model in registry.models.items():
        axes = {a for i in model.inputs for a in i.axes}
        pinned: _AxisValues = {a: (v, f"models.{name}.pins.{a}") for a, v in model.pins.items()}
        if model.batch_axis in axes:
            pinned.setdefault(model.batch_axis, (1, None))
        found = {i: _tensor_problem(name, model, i, pinned, f"models.{name}.") for i in range(len(model.inputs))}
        problems += [p for p in found.values() if p]
        for _, sname in registry.pairs(models=[name]):
            sku = registry.skus[sname]
            largest = {
                **pinned,
                **{a: (v, f"skus.{sname}.shapes.{a}") for a, v in sku.shapes.items() if a in axes},
                **{a: (p.max, f"skus.{sname}.profiles.{a}.max") for a, p in sku.profiles.items() if a in axes},
            }
            # an input already too large at the model's pins is named once, there
            problems += [
                p
                for i, at_pins in found.items()
                if at_pins is None and (p := _tensor_problem(name, model, i, largest, f"skus.{sname}."))
            ]
        if not any(found.values()):  # else a sample is too large already: its sets say nothing new
            problems += _dataset_problems(name, model, {a: v for a, (v, _) in pinned.items()})
    return problems


def _tensor_problem(model_name: str, model: ModelSpec, index: int, axes: _AxisValues, blame: str) -> str | None:
    """Why input ``index`` at ``axes`` is too large for one tensor, naming the key to lower (one
    starting with ``blame`` where the input has one) and the largest value that fits."""
    inp = model.inputs[index]
    values = {a: v for a, (v, _) in axes.items()}
    itemsize = DTYPE_BYTES[inp.dtype]
    limit, shape = tensor_limit(itemsize), inp.shape_at(values)
    elements = math.prod(shape)
    if elements <= limit:
        return None
    what = (
        f"input {inp.name!r} of model {model_name!r} at shape {list(shape)}: {elements} elements, "
        f"{human_bytes(elements * itemsize)} of {inp.dtype}, above the limit of {MAX_TENSOR_ELEMENTS} elements "
        f"and {human_bytes(MAX_TENSOR_BYTES)} per input tensor (docs/registry.md#limits)"
    )
    keys = {key: a for a in inp.axes if (key := axes[a][1]) is not None}
    keys = {k: a for k, a in keys.items() if k.startswith(blame)} or keys
    if not keys:
        return f"models.{model_name}.inputs.{index}.shape: {what}; lower its fixed dimensions"
    key, axis = max(keys.items(), key=lambda item: values[item[1]])
    most = largest_within(lambda v: math.prod(inp.shape_at({**values, axis: v})), values[axis], limit)
    fix = f"lower it to at most {most}" if most else f"lower the other dimensions of {inp.name!r}"
    return f"{key}: {values[axis]} puts {what}; {fix}"


def _dataset_problems(model_name: str, model: ModelSpec, pins: dict[str, int]) -> list[str]:
    """Every generated set whose samples (at the model's pins, every input) exceed MAX_DATASET_BYTES."""
    per_sample = sum(math.prod(i.shape_at(pins, drop=model.batch_axis)) * DTYPE_BYTES[i.dtype] for i in model.inputs)
    problems = []
    for split in Datasets.model_fields:
        source = getattr(model.datasets, split)
        if source is None or source.generate is None or source.generate.count * per_sample <= MAX_DATASET_BYTES:
            continue
        count, most = source.generate.count, MAX_DATASET_BYTES // per_sample
        fix = (
            f"lower it to at most {most}"
            if most
            else f"one sample alone is larger: lower models.{model_name}.pins or the inputs' fixed dimensions"
        )
        problems.append(
            f"models.{model_name}.datasets.{split}.generate.count: {count} samples of "
            f"{human_bytes(per_sample)} each make {human_bytes(count * per_sample)}, above the limit of "
            f"{human_bytes(MAX_DATASET_BYTES)} per dataset (docs/registry.md#limits); {fix}"
        )
    return problems


def load_registry(path: str | os.PathLike = "params.yaml") -> Registry:
    """Read and validate params.yaml. Paths in it are relative to its folder."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file", hint="run from the project root or pass --params") from None
    conflict = merge_conflict(path, text)
    if conflict:
        raise ConfigError(conflict, hint=f"{MERGE_CONFLICT_FIX}, then run again")
    try:
        data = yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as exc:
        raise ConfigError(
            f"{path}: key {exc.key} appears twice in one mapping (lines {exc.first} and {exc.second}); "
            "YAML would silently keep only the last",
            hint="remove or merge one of them",
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}", hint="fix the syntax at the position shown") from None
    return parse_registry(data, str(path), root=path.resolve().parent)


class _DuplicateKey(Exception):
    def __init__(self, key: str, first: int, second: int):
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


def _unique_key_loader() -> type:
    """A SafeLoader that refuses a key repeated in one mapping (PyYAML would keep the last). On
    libyaml's C parser where PyYAML has it: the pure-Python one took 0.3 s of every command's
    start on the example's params.yaml."""
    import yaml

    class UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
        def construct_document(self, node: yaml.Node) -> Any:
            _check_unique_keys(node, (), set())
            return super().construct_document(node)

    return UniqueKeyLoader


def _check_unique_keys(node: Any, path: tuple[str, ...], seen: set[int]) -> None:
    import yaml

    if id(node) in seen:  # an alias: checked where its anchor is
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<' keys may be overridden on purpose
                _check_unique_keys(value_node, path, seen)
                continue
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else f"<{key_node.tag}>"
            line = key_node.start_mark.line + 1
            if (key_node.tag, key) in lines:
                raise _DuplicateKey(repr(".".join((*path, str(key)))), lines[(key_node.tag, key)], line)
            lines[(key_node.tag, key)] = line
            _check_unique_keys(value_node, (*path, str(key)), seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(item, (*path, str(i)), seen)
