"""TensorRT: an engine plan built on an NVIDIA GPU (x86-64 or Jetson) from the prepared ONNX model.

Build: ONNX parser -> network (weakly typed with precision flags, or strongly typed), one
optimization profile from the SKU's pins and profiles, the SKU's timing cache read and written
back, then the engine inspector's DETAILED JSON for per-layer precision, kernel, fusion and
device. INT8 is explicit quantization: the shared QDQ graph from the calibrate stage's table,
adjusted to what TensorRT takes (zero-point-0 int8, float biases). Run: the engine plan, device
buffers and a stream through cuda-python's runtime API, ``execute_async_v3``.

Everything that needs no GPU (options and their checks, profiles, the QDQ adjustment, inspector
parsing, error mapping, cache files, version rules) is a plain function so it is tested on
any host; TensorRT and cuda-python are imported inside functions only.
The package on its seams: ``common`` (options, config-time checks, profiles), ``int8`` (the QDQ
graph TensorRT takes), ``inspector`` (the engine inspector's JSON, parser and builder errors),
``sdk`` (TensorRT and CUDA: versions, builder configuration, timing cache), ``runner``, ``backend``.
"""

from pipeline.backends.tensorrt.backend import TensorRtBackend, TensorRtMeta
from pipeline.backends.tensorrt.common import NOT_INSTALLED, TensorRtOptions, optimization_profile, requested_devices
from pipeline.backends.tensorrt.inspector import (
    ParserError,
    builder_failure,
    format_precision,
    layer_precision,
    onnx_nodes_of,
    parse_engine_information,
    parser_failure,
)
from pipeline.backends.tensorrt.int8 import nonzero_zero_points, quantize_for_tensorrt
from pipeline.backends.tensorrt.runner import TensorRtRunner, cast_feed
from pipeline.backends.tensorrt.sdk import cuda_version_string, cudart_module, version_compatible_runtime
from pipeline.host.probe import gpu_info, jetson_gpu, parse_nvidia_smi

__all__ = [
    "NOT_INSTALLED",
    "ParserError",
    "TensorRtBackend",
    "TensorRtMeta",
    "TensorRtOptions",
    "TensorRtRunner",
    "builder_failure",
    "cast_feed",
    "cuda_version_string",
    "cudart_module",
    "format_precision",
    "gpu_info",
    "jetson_gpu",
    "layer_precision",
    "nonzero_zero_points",
    "onnx_nodes_of",
    "optimization_profile",
    "parse_engine_information",
    "parse_nvidia_smi",
    "parser_failure",
    "quantize_for_tensorrt",
    "requested_devices",
    "version_compatible_runtime",
]
