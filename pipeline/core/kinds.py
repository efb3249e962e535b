"""The literal kinds several layers name, declared once: the params.yaml schema (project) and the
backend contract (backends) both import them from here."""

from __future__ import annotations

from typing import Literal

Precision = Literal["fp32", "fp16", "int8"]
TargetDevice = Literal["cpu", "gpu", "npu"]
