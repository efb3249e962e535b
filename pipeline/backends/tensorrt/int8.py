"""INT8 for TensorRT: the shared QDQ graph adjusted to what its explicit quantization takes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.backends.contract import BuildContext
from pipeline.backends.quantize import QdqSettings, quantize_qdq
from pipeline.core.errors import InputError

if TYPE_CHECKING:
    import onnx


log = logging.getLogger(__name__)


def nonzero_zero_points(model: onnx.ModelProto) -> list[str]:
    """Q/DQ nodes whose zero point is not all zeros (TensorRT refuses them)."""
    import numpy as np
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    return [
        n.name
        for n in model.graph.node
        if n.op_type in ("QuantizeLinear", "DequantizeLinear")
        and len(n.input) > 2
        and n.input[2]
        and (n.input[2] not in inits or np.any(numpy_helper.to_array(inits[n.input[2]])))
    ]


def quantize_for_tensorrt(source: Path, out: Path, ctx: BuildContext) -> dict[str, Any]:
    """The shared INT8 QDQ graph as TensorRT's explicit quantization takes it: symmetric int8
    activations and weights (zero point 0), biases left in float (TensorRT quantizes them)."""
    import onnx

    calibration = quantize_qdq(
        source,
        out,
        ctx,
        QdqSettings(
            per_channel=True,
            reduce_range=False,
            activation_type="int8",
            weight_type="int8",
            symmetric_activations=True,
            quantize_bias=False,
        ),
    )
    left = nonzero_zero_points(onnx.load(str(out)))
    if left:
        raise InputError(
            f"Q/DQ nodes {left} have nonzero zero points, which TensorRT refuses",
            hint="quantize the model with symmetric int8 activations",
        )
    return {**calibration, "quantization": "explicit (Q/DQ), symmetric int8"}
