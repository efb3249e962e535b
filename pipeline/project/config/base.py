"""The literal types and the strict base model every params.yaml entry uses."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
)

from pipeline.core.kinds import Precision
from pipeline.results.reports import OutputKind

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
