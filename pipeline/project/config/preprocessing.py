"""Preprocessing in params.yaml: the steps from a raw file to a model input (decode, colour, resize,
layout, normalise, dtype), the device's own variant and the gate on their drift."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from pipeline.project.config.base import (
    Strict,
)


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
