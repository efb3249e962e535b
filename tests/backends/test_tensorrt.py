"""The TensorRT backend. Without a GPU: options and their config-time checks, optimization
profiles, the QDQ adjustment for explicit quantization (run for real with ONNX Runtime), the
engine inspector's JSON, error mapping, timing-cache files, version rules, and the refusal to
build on a host without TensorRT or a GPU. With one (``-m gpu``): real builds, validation and
benchmarks of the tiny models.

The inspector fixtures below are hand-written from TensorRT's documented DETAILED layer
information format (the layout of the engine-explorer examples NVIDIA publishes), for the
conv_bn test model; they were not captured from a real engine.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import models
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import numpy_helper

from pipeline.backends import get_backend
from pipeline.backends import tensorrt as trt_backend
from pipeline.backends.contract import ENGINE_META, BuildContext
from pipeline.backends.tensorrt import (
    NOT_INSTALLED,
    ParserError,
    TensorRtOptions,
    builder_failure,
    cast_feed,
    cuda_version_string,
    format_precision,
    layer_precision,
    nonzero_zero_points,
    optimization_profile,
    parse_engine_information,
    parse_nvidia_smi,
    parser_failure,
    quantize_for_tensorrt,
    requested_devices,
    version_compatible_runtime,
)
from pipeline.core.errors import ConfigError, EnvironmentProblem, InputError, UnsupportedOp
from pipeline.core.paths import Layout
from pipeline.host.probe import host_arch
from pipeline.project.artifacts import calibration_table
from pipeline.project.config import Profile, load_registry, parse_registry
from pipeline.results.reports import TensorSig
from pipeline.stages.bench import bench
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate
from pipeline.verify.check import placement_gate, precision_gate

PACKAGE = Path(trt_backend.__file__).parent  # pipeline/backends/tensorrt/

# The repository's TensorRT SKUs, as params.yaml declares them (docs/backends/tensorrt.md explains them).
EXAMPLE_SKUS = {
    name: sku
    for name, sku in yaml.safe_load((PACKAGE.parents[2] / "params.yaml").read_text())["skus"].items()
    if sku["backend"] == "tensorrt"
}


def trt_sku(precision: str = "fp32", **extra) -> dict:
    """A TensorRT SKU for this host's architecture (buildable where TensorRT and a GPU exist)."""
    sku = {
        "backend": "tensorrt",
        "precision": precision,
        "target": {"arch": host_arch(), "device": "gpu", "os": "linux"},
        "runner_labels": ["self-hosted", "linux", "x64", "gpu", "nvidia"],
        "shapes": {"batch": 1},
        "bench": {
            "warmup": 5,
            "steady_window": 5,
            "max_warmup_seconds": 1.0,
            "roofline": False,
            "iterations": 30,
            "min_seconds": 0.0,
        },
    }
    sku.update(extra)
    return sku


def registry_with(skus: dict) -> object:
    return parse_registry({"defaults": {}, "examples": {}, "models": {"conv": models.conv_bn_spec()}, "skus": skus})


def config_error(sku: dict) -> str:
    with pytest.raises(ConfigError) as info:
        registry_with({"s": sku})
    return info.value.message


# --- import hygiene ------------------------------------------------------------------------------


def test_module_imports_no_sdk_at_top_level():
    """`skuforge --help` and config validation must not import TensorRT, CUDA or onnx (no module of
    the package at its top level)."""
    heavy = {"tensorrt", "cuda", "pynvml", "onnx", "onnxruntime", "numpy", "torch"}
    found = []
    nodes = [node for module in sorted(PACKAGE.glob("*.py")) for node in ast.parse(module.read_text()).body]
    assert len(nodes) > 50
    for node in nodes:  # module level only; TYPE_CHECKING blocks are not run
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in heavy]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in heavy:
            found.append(node.module)
    assert found == []


# --- options and config-time checks -------------------------------------------------------------


def test_example_skus_validate():
    reg = registry_with(EXAMPLE_SKUS)
    for name in EXAMPLE_SKUS:
        opts = get_backend("tensorrt").options(reg.sku(name))
        assert opts.dla_core is None and opts.timing_cache and not opts.tf32
    assert get_backend("tensorrt").options(reg.sku("jetson_orin_trt_int8")).min_compute_capability == 8.7
    assert requested_devices(TensorRtOptions()) == ["gpu"]  # what the examples' placement.allowed names


@pytest.mark.parametrize(
    "change, words",
    [
        ({"options": {"workspace": 64}}, ["skus.s.options.workspace", "did you mean 'workspace_mb'"]),
        ({"options": {"builder_optimization_level": 6}}, ["builder_optimization_level", "less than or equal to 5"]),
        ({"options": {"hardware_compatibility": "ampere"}}, ["hardware_compatibility", "ampere_plus"]),
        ({"options": {"fp8": True}}, ["skus.s.options.fp8", "8.9"]),
        ({"options": {"fp8": True, "min_compute_capability": 8.6}}, ["options.fp8", "it says 8.6"]),
        (
            {"options": {"fp8": True, "strongly_typed": True, "min_compute_capability": 9.0}},
            ["options.fp8", "strongly typed"],
        ),
        ({"options": {"dla_core": 0}}, ["skus.s.options.dla_core", "Jetson"]),
        ({"options": {"allow_gpu_fallback": True}}, ["options.allow_gpu_fallback", "dla_core"]),
        ({"options": {"hardware_compatibility": "ampere_plus", "min_compute_capability": 7.5}}, ["ampere_plus", "7.5"]),
        ({"target": {"arch": "x86_64", "device": "cpu", "os": "linux"}}, ["skus.s.target.device", "gpu"]),
        ({"target": {"arch": "x86_64", "device": "gpu", "os": "macos"}}, ["skus.s.target.os"]),
    ],
)
def test_bad_options_are_config_errors(change, words):
    message = config_error({**trt_sku("fp16"), "target": {"arch": "x86_64", "device": "gpu", "os": "linux"}, **change})
    for word in words:
        assert word in message, (word, message)


def test_jetson_specific_checks():
    jetson = {**EXAMPLE_SKUS["jetson_orin_trt_fp16"]}
    dla = {**jetson, "options": {"dla_core": 0, "allow_gpu_fallback": True}}
    opts = get_backend("tensorrt").options(registry_with({"dla": dla}).sku("dla"))
    assert requested_devices(opts) == ["dla:0", "gpu"]
    assert requested_devices(opts.model_copy(update={"allow_gpu_fallback": False})) == ["dla:0"]
    assert "precision: DLA runs fp16 and int8 only" in config_error({**dla, "precision": "fp32"})
    assert "not supported on JetPack" in config_error({**jetson, "options": {"hardware_compatibility": "ampere_plus"}})
    assert "options.fp8: DLA" in config_error(
        {**jetson, "options": {"dla_core": 1, "fp8": True, "min_compute_capability": 8.9}}
    )


# --- optimization profiles ----------------------------------------------------------------------


def test_profile_from_pins_profiles_and_fixed_dims():
    inputs = [
        TensorSig(name="x", dtype="float32", shape=["batch", 3, "height", 8]),
        TensorSig(name="scale", dtype="float32", shape=[]),
    ]
    table = optimization_profile(inputs, {"height": 8}, {"batch": Profile(min=1, opt=4, max=16)})
    assert table == {"x": ((1, 3, 8, 8), (4, 3, 8, 8), (16, 3, 8, 8)), "scale": ((), (), ())}
    pinned = optimization_profile(inputs, {"height": 8, "batch": 2}, {})
    assert pinned["x"] == ((2, 3, 8, 8),) * 3


def test_dynamic_axis_without_pin_or_profile_is_a_config_error():
    inputs = [TensorSig(name="x", dtype="float32", shape=["batch", "seq", None])]
    with pytest.raises(ConfigError) as info:
        optimization_profile(inputs, {"batch": 1}, {})
    err = info.value
    assert "input 'x' dim 1 (seq)" in err.message and "dim 2 (unnamed)" in err.message
    assert "profiles" in err.hint and err.exit_code == 2


# --- INT8: the QDQ graph TensorRT takes ---------------------------------------------------------


def _session(model: onnx.ModelProto | Path) -> ort.InferenceSession:
    """ONNX Runtime as the semantics of a graph, optimisations off."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return _session(model).run(None, {"x": x})[0]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """conv and multi models through prepare, data and calibrate (ONNX Runtime), as the build stage sees them."""
    root = tmp_path_factory.mktemp("trt-int8")
    specs = {
        "conv": (models.conv_bn_model, models.conv_bn_spec()),
        "multi": (models.multi_io_model, models.multi_io_spec()),
    }
    for builder, spec in specs.values():
        builder(root / spec["dir"] / spec["source"])
    reg = load_registry(models.write_project(root, {k: s for k, (_, s) in specs.items()}, {"trt": trt_sku("int8")}))
    for m in specs:
        prepare(reg, m)
        make_data(reg, m)
        calibrate(reg, m)
    return reg


@pytest.mark.parametrize("model", ["conv", "multi"])
def test_int8_qdq_for_tensorrt_on_the_test_models(calibrated, model, tmp_path):
    reg, out = calibrated, Layout(calibrated.root)
    ctx = BuildContext(
        model=model,
        sku="trt",
        spec=reg.model(model),
        sku_spec=reg.sku("trt"),
        prepared=out.prepared_model(model),
        pins={"batch": 1},
        profiles={},
        engine_dir=tmp_path / "engine",
        calibration_table=calibration_table(reg, model),
        probe_inputs={},
        cache_dir=tmp_path / "cache",
    )
    qdq = tmp_path / "qdq.onnx"
    record = quantize_for_tensorrt(out.prepared_model(model), qdq, ctx)
    assert record["format"] == "QDQ" and record["activation_type"] == record["weight_type"] == "int8"
    assert (
        record["quantization"].startswith("explicit")
        and record["symmetric_activations"]
        and not record["quantize_bias"]
    )
    graph = onnx.load(str(qdq))
    assert nonzero_zero_points(graph) == []
    assert not any(
        n.op_type == "DequantizeLinear"
        and n.input[0].endswith("_quantized")
        and numpy_helper.to_array(next(i for i in graph.graph.initializer if i.name == n.input[0])).dtype == np.int32
        for n in graph.graph.node
        if n.input[0] in {i.name for i in graph.graph.initializer}
    )
    # the adjusted graph still computes the model (ONNX Runtime runs Q/DQ for real)
    golden = dict(np.load(out.split(model, "golden")))
    reference_session, qdq_session = _session(out.prepared_model(model)), _session(qdq)
    worst = 0.0
    for i in range(8):
        feeds = {k: (np.asarray(v[i]) if k == "scale" else v[i : i + 1]) for k, v in golden.items()}
        for want, got in zip(reference_session.run(None, feeds), qdq_session.run(None, feeds), strict=True):
            worst = max(worst, float(np.abs(want.astype(np.float64) - got).max()))
    assert worst < 0.1  # the int8 tolerance the registry defaults to


def test_int8_without_a_calibration_table_says_what_to_run(calibrated, tmp_path):
    reg, out = calibrated, Layout(calibrated.root)
    ctx = BuildContext(
        model="conv",
        sku="trt",
        spec=reg.model("conv"),
        sku_spec=reg.sku("trt"),
        prepared=out.prepared_model("conv"),
        pins={"batch": 1},
        profiles={},
        engine_dir=tmp_path,
        calibration_table=None,
        probe_inputs={},
        cache_dir=tmp_path,
    )
    with pytest.raises(InputError) as info:
        quantize_for_tensorrt(out.prepared_model("conv"), tmp_path / "q.onnx", ctx)
    assert "calibrate" in info.value.hint


# --- the engine inspector's JSON ----------------------------------------------------------------

# conv_bn at batch 1, FP16 build, two optimization profiles (the second's layers carry
# " [profile 1]"). Hand-written in the DETAILED format; see the module docstring.
FP16_ENGINE = r"""{"Layers": [{
  "Name": "Reformatting CopyNode for Input Tensor 0 to conv + relu",
  "LayerType": "Reformat",
  "Inputs": [{"Name": "x", "Location": "Device", "Dimensions": [1,3,8,8], "Format/Datatype": "Row major linear FP32"}],
  "Outputs": [{"Name": "Reformatted Input Tensor 0 to conv + relu", "Location": "Device", "Dimensions": [1,3,8,8],
               "Format/Datatype": "Channel major FP16 format where channel % 8 == 0"}],
  "ParameterType": "Reformat", "Origin": "REFORMAT", "TacticValue": "0x00000000000003e8", "StreamId": 0, "Metadata": ""
},{
  "Name": "conv + relu",
  "LayerType": "CaskConvolution",
  "Inputs": [{"Name": "Reformatted Input Tensor 0 to conv + relu", "Location": "Device", "Dimensions": [1,3,8,8],
              "Format/Datatype": "Channel major FP16 format where channel % 8 == 0"}],
  "Outputs": [{"Name": "relu", "Location": "Device", "Dimensions": [1,8,8,8],
               "Format/Datatype": "Channel major FP16 format where channel % 8 == 0"}],
  "ParameterType": "Convolution", "Kernel": [3,3], "PaddingMode": "kEXPLICIT_ROUND_DOWN", "PrePadding": [1,1],
  "PostPadding": [1,1], "Stride": [1,1], "Dilation": [1,1], "OutMaps": 8, "Groups": 1,
  "Weights": {"Type": "Half", "Count": 216}, "Bias": {"Type": "Half", "Count": 8}, "HasBias": 1, "HasReLU": 1,
  "HasSparseWeights": 0, "Activation": "RELU",
  "TacticName": "sm80_xmma_fprop_implicit_gemm_f16f16_f16f16_f16_nhwckrsc_nhwc_tilesize32x32x64_stage5_warpsize2x2x1_g1_tensor16x8x16",
  "TacticValue": "0x7e29bdfccd92c42c", "StreamId": 0, "Metadata": "[ONNX Layer: conv]\u001e[ONNX Layer: relu]"
},{
  "Name": "gap",
  "LayerType": "CaskPooling",
  "Inputs": [{"Name": "relu", "Location": "Device", "Dimensions": [1,8,8,8],
              "Format/Datatype": "Channel major FP16 format where channel % 8 == 0"}],
  "Outputs": [{"Name": "gap", "Location": "Device", "Dimensions": [1,8,1,1],
               "Format/Datatype": "Channel major FP16 format where channel % 8 == 0"}],
  "ParameterType": "Pooling", "PoolingType": "AVERAGE", "WindowSize": [8,8],
  "TacticName": "sm50_xmma_pooling_fw_4d_FP16FP32NHWC_Average_FastDiv_CAlign8", "TacticValue": "0xdaa6f29208dec74b",
  "StreamId": 0, "Metadata": "[ONNX Layer: gap]"
},{
  "Name": "flatten",
  "LayerType": "NoOp",
  "Inputs": [{"Name": "gap", "Location": "Device", "Dimensions": [1,8,1,1],
              "Format/Datatype": "Channel major FP16 format where channel % 8 == 0"}],
  "Outputs": [{"Name": "flat", "Location": "Device", "Dimensions": [1,8], "Format/Datatype": "Row major linear FP16 format"}],
  "TacticValue": "0x0000000000000000", "StreamId": 0, "Metadata": "[ONNX Layer: flatten]"
},{
  "Name": "fc",
  "LayerType": "CaskGemmMatrixMultiply",
  "Inputs": [{"Name": "flat", "Location": "Device", "Dimensions": [1,8], "Format/Datatype": "Row major linear FP16 format"}],
  "Outputs": [{"Name": "logits", "Location": "Device", "Dimensions": [1,4], "Format/Datatype": "Row major linear FP16 format"}],
  "ParameterType": "MatrixMultiply", "MatrixOpA": "NONE", "MatrixOpB": "TRANSPOSE",
  "TacticName": "sm80_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize32x32x64_stage6_warpsize2x2x1_tensor16x8x16",
  "TacticValue": "0x0c0088d5219e5d8e", "StreamId": 0, "Metadata": "[ONNX Layer: fc]"
},{
  "Name": "Reformatting CopyNode for Input Tensor 0 to softmax",
  "LayerType": "Reformat",
  "Inputs": [{"Name": "logits", "Location": "Device", "Dimensions": [1,4], "Format/Datatype": "Row major linear FP16 format"}],
  "Outputs": [{"Name": "Reformatted Input Tensor 0 to softmax", "Location": "Device", "Dimensions": [1,4],
               "Format/Datatype": "Row major linear FP32"}],
  "ParameterType": "Reformat", "Origin": "REFORMAT", "TacticValue": "0x00000000000003e8", "StreamId": 0, "Metadata": ""
},{
  "Name": "softmax",
  "LayerType": "CaskSoftMaxV2",
  "Inputs": [{"Name": "Reformatted Input Tensor 0 to softmax", "Location": "Device", "Dimensions": [1,4],
              "Format/Datatype": "Row major linear FP32"}],
  "Outputs": [{"Name": "probs", "Location": "Device", "Dimensions": [1,4], "Format/Datatype": "Row major linear FP32"}],
  "ParameterType": "SoftMax", "Axes": 2, "TacticValue": "0x00000000000003ea", "StreamId": 0,
  "Metadata": "[ONNX Layer: softmax]"
},{
  "Name": "conv + relu [profile 1]",
  "LayerType": "CaskConvolution",
  "Inputs": [{"Name": "x [profile 1]", "Location": "Device", "Dimensions": [4,3,8,8], "Format/Datatype": "Row major linear FP32"}],
  "Outputs": [{"Name": "relu [profile 1]", "Location": "Device", "Dimensions": [4,8,8,8], "Format/Datatype": "Row major linear FP32"}],
  "ParameterType": "Convolution", "TacticValue": "0x7e29bdfccd92c42c", "StreamId": 0,
  "Metadata": "[ONNX Layer: conv]\u001e[ONNX Layer: relu]"
}],
"Bindings": ["x", "probs", "x [profile 1]", "probs [profile 1]"]}
"""  # noqa: E501  (the inspector's JSON as TensorRT writes it: long names and tactics)

# conv_bn as the QDQ graph, INT8 build: a standalone Q, a convolution fused with its Q/DQ
# neighbours, the FP32 tail. Hand-written like the one above.
INT8_ENGINE = r"""{"Layers": [{
  "Name": "x_QuantizeLinear",
  "LayerType": "Scale",
  "Inputs": [{"Name": "x", "Location": "Device", "Dimensions": [1,3,8,8], "Format/Datatype": "Row major linear FP32"}],
  "Outputs": [{"Name": "x_QuantizeLinear_Output", "Location": "Device", "Dimensions": [1,3,8,8],
               "Format/Datatype": "Four wide channel vectorized row major Int8 format"}],
  "ParameterType": "Scale", "Mode": "UNIFORM", "TacticValue": "0x0000000000000000",
  "Metadata": "[ONNX Layer: x_QuantizeLinear]"
},{
  "Name": "conv_bnfolded_W_DequantizeLinear + x_DequantizeLinear + conv + relu_QuantizeLinear",
  "LayerType": "CaskConvolution",
  "Inputs": [{"Name": "x_QuantizeLinear_Output", "Location": "Device", "Dimensions": [1,3,8,8],
              "Format/Datatype": "Four wide channel vectorized row major Int8 format"}],
  "Outputs": [{"Name": "relu_QuantizeLinear_Output", "Location": "Device", "Dimensions": [1,8,8,8],
               "Format/Datatype": "Thirty-two wide channel vectorized row major Int8 format"}],
  "ParameterType": "Convolution", "Weights": {"Type": "Int8", "Count": 216}, "Bias": {"Type": "Float", "Count": 8},
  "TacticName": "sm80_xmma_fprop_implicit_gemm_interleaved_i8i8_i8i32_f32_nchw_vect_c_32kcrs_vect_c_32_nchw_vect_c_32_tilesize32x32x64_stage4_warpsize2x2x1_g1_tensor16x8x32",
  "TacticValue": "0x5c3c5e1d6d1e8f50",
  "Metadata": "[ONNX Layer: conv_bnfolded_W_DequantizeLinear]\u001e[ONNX Layer: x_DequantizeLinear]\u001e[ONNX Layer: conv]\u001e[ONNX Layer: relu_QuantizeLinear]"
},{
  "Name": "softmax",
  "LayerType": "CaskSoftMaxV2",
  "Inputs": [{"Name": "logits", "Location": "Device", "Dimensions": [1,4], "Format/Datatype": "Float"}],
  "Outputs": [{"Name": "probs", "Location": "Device", "Dimensions": [1,4], "Format/Datatype": "Float"}],
  "ParameterType": "SoftMax", "TacticValue": "0x00000000000003ea", "Metadata": "[ONNX Layer: softmax]"
}],
"Bindings": ["x", "probs"]}
"""  # noqa: E501  (the inspector's JSON as TensorRT writes it: long names and tactics)

# conv_bn, FP16 on DLA core 0 with GPU fallback: the DLA subgraph, its transfers, and a layer
# that silently fell back to the GPU. Hand-written like the ones above.
DLA_ENGINE = r"""{"Layers": [{
  "Name": "x to nvm", "LayerType": "Reformat",
  "Inputs": [{"Name": "x", "Location": "Device", "Dimensions": [1,3,8,8], "Format/Datatype": "Row major linear FP32"}],
  "Outputs": [{"Name": "x copy", "Location": "Device", "Dimensions": [1,3,8,8], "Format/Datatype": "Channel major FP16 format"}],
  "TacticValue": "0x0000000000000000"
},{
  "Name": "{ForeignNode[conv...fc]}", "LayerType": "DLA",
  "Inputs": [{"Name": "x copy", "Location": "Device", "Dimensions": [1,3,8,8], "Format/Datatype": "Channel major FP16 format"}],
  "Outputs": [{"Name": "logits dla", "Location": "Device", "Dimensions": [1,4], "Format/Datatype": "Channel major FP16 format"}],
  "TacticValue": "0x0000000000000003",
  "Metadata": "[ONNX Layer: conv]\u001e[ONNX Layer: relu]\u001e[ONNX Layer: gap]\u001e[ONNX Layer: flatten]\u001e[ONNX Layer: fc]"
},{
  "Name": "logits from nvm", "LayerType": "Reformat",
  "Inputs": [{"Name": "logits dla", "Location": "Device", "Dimensions": [1,4], "Format/Datatype": "Channel major FP16 format"}],
  "Outputs": [{"Name": "logits", "Location": "Device", "Dimensions": [1,4], "Format/Datatype": "Row major linear FP16 format"}],
  "TacticValue": "0x0000000000000000"
},{
  "Name": "softmax", "LayerType": "CaskSoftMaxV2",
  "Inputs": [{"Name": "logits", "Location": "Device", "Dimensions": [1,4], "Format/Datatype": "Row major linear FP16 format"}],
  "Outputs": [{"Name": "probs", "Location": "Device", "Dimensions": [1,4], "Format/Datatype": "Row major linear FP16 format"}],
  "TacticValue": "0x00000000000003ea", "Metadata": "[ONNX Layer: softmax]"
}],
"Bindings": ["x", "probs"]}
"""  # noqa: E501  (the inspector's JSON as TensorRT writes it: long names and tactics)

CONV_NODES = {"conv", "relu", "gap", "flatten", "fc", "softmax"}


def test_inspector_fp16_engine():
    described = parse_engine_information(FP16_ENGINE, CONV_NODES)
    rows = [(layer.name, layer.op_type, layer.precision, layer.device) for layer in described.layers]
    assert rows == [
        ("Reformatting CopyNode for Input Tensor 0 to conv + relu", "Reformat", "n/a", "gpu"),
        ("conv + relu", "CaskConvolution", "fp16", "gpu"),
        ("gap", "CaskPooling", "fp16", "gpu"),
        ("flatten", "NoOp", "n/a", "gpu"),
        ("fc", "CaskGemmMatrixMultiply", "fp16", "gpu"),
        ("Reformatting CopyNode for Input Tensor 0 to softmax", "Reformat", "n/a", "gpu"),
        ("softmax", "CaskSoftMaxV2", "fp32", "gpu"),
    ]  # the second profile's layers are left out
    conv = described.layers[1]
    assert conv.fused_from == ["conv", "relu"] and conv.kernel.startswith("sm80_xmma_fprop_implicit_gemm_f16f16")
    assert described.layers[0].fused_from == [] and described.layers[0].kernel == "0x00000000000003e8"
    assert [layer.name for layer in described.fused] == ["conv + relu"]
    assert described.bindings == ["x", "probs"] and described.partition_boundaries == 0
    # the precision gate on this engine: an FP16 SKU whose softmax ran in FP32
    report = SimpleNamespace(
        layers=described.layers, precision="fp16", requested_devices=["gpu"], partition_boundaries=0
    )
    gate = precision_gate(report, "fail", 0)
    assert [layer.name for layer in gate.mismatched] == ["softmax"] and not gate.passed
    assert placement_gate(report, ["gpu"], 0).passed


def test_inspector_int8_engine():
    described = parse_engine_information(
        INT8_ENGINE,
        {
            "x_QuantizeLinear",
            "x_DequantizeLinear",
            "conv",
            "conv_bnfolded_W_DequantizeLinear",
            "relu_QuantizeLinear",
            "softmax",
        },
    )
    assert [(layer.op_type, layer.precision) for layer in described.layers] == [
        ("Scale", "int8"),
        ("CaskConvolution", "int8"),
        ("CaskSoftMaxV2", "fp32"),
    ]
    assert described.layers[1].fused_from == [
        "conv_bnfolded_W_DequantizeLinear",
        "x_DequantizeLinear",
        "conv",
        "relu_QuantizeLinear",
    ]


def test_inspector_dla_engine_exposes_a_silent_gpu_fallback():
    described = parse_engine_information(DLA_ENGINE, CONV_NODES, dla_core=0)
    assert [(layer.name, layer.device, layer.precision) for layer in described.layers] == [
        ("x to nvm", "dla:0", "n/a"),
        ("{ForeignNode[conv...fc]}", "dla:0", "fp16"),
        ("logits from nvm", "dla:0", "n/a"),
        ("softmax", "gpu", "fp16"),
    ]
    assert described.layers[1].fused_from == ["conv", "relu", "gap", "flatten", "fc"]
    assert described.partition_boundaries == 1  # DLA -> GPU at the softmax
    report = SimpleNamespace(layers=described.layers, requested_devices=["dla:0"], partition_boundaries=1)
    gate = placement_gate(report, None, 0)
    assert not gate.passed and [layer.name for layer in gate.offending] == ["softmax"]
    assert placement_gate(report, ["dla:0", "gpu"], 0).passed
    # without a DLA core configured the same names run on the GPU
    assert {layer.device for layer in parse_engine_information(DLA_ENGINE, CONV_NODES).layers} == {"gpu"}


def test_inspector_edge_cases():
    names_only = parse_engine_information(
        json.dumps({"Layers": ["conv + relu", "softmax"], "Bindings": ["x", "probs"]}), CONV_NODES
    )
    assert [(layer.op_type, layer.precision, layer.fused_from) for layer in names_only.layers] == [
        ("unknown", None, ["conv", "relu"]),
        ("unknown", None, ["softmax"]),
    ]
    # raw separators (not escaped) and names joined with them; signal/wait layers are skipped
    raw = (
        '{"Layers": [{"Name": "conv\x1frelu", "LayerType": "CaskConvolution", "Inputs": [], "Outputs": []},'
        '{"Name": "sync", "LayerType": "signal", "Inputs": [], "Outputs": []}], "Bindings": []}'
    )
    (layer,) = parse_engine_information(raw, CONV_NODES).layers
    assert layer.name == "conv + relu" and layer.fused_from == ["conv", "relu"] and layer.precision is None
    meta = {
        "Name": "x",
        "LayerType": "Myelin",
        "Metadata": "[ONNX Layer: /blk/Conv | blk (Block)]\x1e[ONNX Layer: /blk/Relu]",
    }
    assert trt_backend.onnx_nodes_of(meta, set()) == ["/blk/Conv", "/blk/Relu"]
    for bad in ("not json", '{"Bindings": []}'):
        with pytest.raises(InputError):
            parse_engine_information(bad)


@pytest.mark.parametrize(
    "description, precision",
    [
        ("Row major linear FP32", "fp32"),
        ("Float", "fp32"),
        ("Half", "fp16"),
        ("Row major linear FP16 format", "fp16"),
        ("Channel major FP16 format where channel % 8 == 0", "fp16"),
        ("Thirty-two wide channel vectorized row major Int8 format", "int8"),
        ("Channel major INT8 format where channel % 16 == 0", "int8"),
        ("Row major linear BFloat16 format", "bf16"),
        ("Row major linear FP8 format", "fp8"),
        ("FP8", "fp8"),
        ("Row major linear Int32", "int32"),
        ("Row major linear BOOL", "bool"),
        ("Row major linear UInt8 format", "uint8"),
        ("Row major linear Int64 format", "int64"),
        ("Unknown format", None),
    ],
)
def test_format_precision(description, precision):
    assert format_precision(description) == precision


def test_layer_precision_rules():
    t = lambda fmt: {"Name": "t", "Format/Datatype": fmt}  # noqa: E731
    assert layer_precision({"LayerType": "Shuffle", "Inputs": [t("Half")], "Outputs": [t("Half")]}) == "n/a"
    assert layer_precision({"LayerType": "CaskGather", "ParameterType": "Gather", "Inputs": [t("Float")]}) == "n/a"
    assert layer_precision({"LayerType": "Scale", "Inputs": [t("Half")], "Outputs": [t("Int8")]}) == "int8"  # a Q layer
    assert layer_precision({"LayerType": "kgen", "Inputs": [t("Int32"), t("Half")], "Outputs": [t("Float")]}) == "fp16"
    assert layer_precision({"LayerType": "CaskCast", "Inputs": [t("Int64")], "Outputs": [t("Int32")]}) == "n/a"
    assert layer_precision({"LayerType": "Constant", "Inputs": [], "Outputs": [t("Float")]}) == "n/a"


# --- errors --------------------------------------------------------------------------------------


def test_parser_errors_name_the_op_and_node():
    err = parser_failure(
        [
            ParserError("UNSUPPORTED_NODE", "No importer registered for op: DeformConv", "dcn_3", "DeformConv"),
            ParserError("INVALID_NODE", "shape mismatch", "add_1", "Add"),
        ]
    )
    assert isinstance(err, UnsupportedOp) and err.exit_code == 3
    assert err.op_type == "DeformConv" and err.node == "dcn_3" and err.backend == "tensorrt"
    assert "'DeformConv' (node 'dcn_3')" in err.message and "and 1 more parser errors" in err.message
    other = parser_failure([ParserError("INVALID_GRAPH", "graph has a cycle")])
    assert isinstance(other, InputError) and "INVALID_GRAPH: graph has a cycle" in other.message
    assert isinstance(parser_failure([]), InputError)


def test_builder_errors():
    ops = {"conv": "Conv", "relu": "Relu"}
    msg = (
        "[optimizer.cpp::computeCosts::4040] Error Code 10: Internal Error "
        "(Could not find any implementation for node conv + relu.)"
    )
    err = builder_failure(["some warning-level noise", msg], ops)
    assert (
        isinstance(err, UnsupportedOp) and err.op_type == "Conv" and err.node == "conv" and "workspace_mb" in err.hint
    )
    oom = builder_failure(["Requested amount of GPU memory (1073741824 bytes) could not be allocated."], ops)
    assert isinstance(oom, EnvironmentProblem) and not isinstance(oom, UnsupportedOp) and "1073741824" in oom.message
    assert "no error was logged" in builder_failure([], ops).message


# --- small rules ---------------------------------------------------------------------------------


def test_gpu_probe_parsing_and_versions():
    h100 = parse_nvidia_smi("NVIDIA H100 80GB HBM3, 9.0, 550.54.15\nNVIDIA H100 80GB HBM3, 9.0, 550.54.15\n")
    assert (h100.name, h100.compute_capability, h100.driver, h100.cc) == (
        "NVIDIA H100 80GB HBM3",
        "9.0",
        "550.54.15",
        9.0,
    )
    orin = parse_nvidia_smi("Orin (nvgpu), [N/A], 540.4.0\n")
    assert orin.name == "Orin (nvgpu)" and orin.compute_capability is None and orin.cc is None
    assert parse_nvidia_smi("") is None
    agx = trt_backend.jetson_gpu("NVIDIA Jetson AGX Orin Developer Kit\0")
    assert (agx.name, agx.compute_capability) == ("NVIDIA Jetson AGX Orin Developer Kit", "8.7")
    assert trt_backend.jetson_gpu("NVIDIA Jetson Xavier NX Developer Kit").cc == 7.2
    assert trt_backend.jetson_gpu("Raspberry Pi 5 Model B Rev 1.0") is None
    assert (
        cuda_version_string(12040) == "12.4"
        and cuda_version_string(11080) == "11.8"
        and cuda_version_string(12010) == "12.1"
    )


@pytest.mark.parametrize(
    "built, have, ok",
    [
        ("10.3.0", "10.3.0", True),
        ("10.3.0", "10.7.0.23", True),
        ("10.7.0", "10.3.0", False),
        ("10.3.0", "11.0.0", False),
        ("8.6.1", "10.3.0", False),
        ("garbage", "10.3.0", False),
    ],
)
def test_version_compatible_runtime(built, have, ok):
    assert version_compatible_runtime(built, have) is ok


def test_cast_feed():
    ids = np.array([[1, 2, 3]], np.int64)
    out = cast_feed(ids, np.dtype(np.int32), "ids")
    assert out.dtype == np.int32 and out.flags.c_contiguous and out.tolist() == [[1, 2, 3]]
    with pytest.raises(InputError, match="outside int32"):
        cast_feed(np.array([2**40], np.int64), np.dtype(np.int32), "ids")
    scalar = cast_feed(np.array(1.5, np.float32), np.dtype(np.float32), "scale")
    assert scalar.shape == () and scalar == 1.5
    strided = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    assert cast_feed(strided, np.dtype(np.float32), "x").flags.c_contiguous


# --- this host: no TensorRT or no GPU -----------------------------------------------------------


def _problems() -> list[str]:
    return get_backend("tensorrt").environment_problems(registry_with({"s": trt_sku("fp16")}).sku("s"), "build")


def test_environment_problems_name_what_is_missing():
    problems = _problems()
    try:
        import tensorrt  # noqa: F401
    except (ImportError, OSError):
        assert NOT_INSTALLED in problems
        assert (
            NOT_INSTALLED == "tensorrt is not installed (pip install tensorrt on a host with an NVIDIA GPU and driver)"
        )
    if trt_backend.gpu_info() is None:
        assert any("no NVIDIA GPU is visible" in p for p in problems)
    if not problems:
        pytest.skip("this host has TensorRT and a GPU: the gpu tests cover it")


def test_build_on_a_host_without_tensorrt_exits_3_naming_the_runner(tmp_path, capsys):
    if not _problems():
        pytest.skip("this host can build TensorRT engines")
    params = models.write_project(tmp_path, {"conv": models.conv_bn_spec()}, {"trt": trt_sku("fp16")})
    models.conv_bn_model(tmp_path / "models/conv/model.onnx")
    reg = load_registry(params)
    for stage in (build, validate, bench):
        with pytest.raises(EnvironmentProblem) as info:
            stage(reg.pair("conv", "trt"))
        err = info.value
        assert err.exit_code == 3 and "this host cannot" in err.message and "SKU trt" in err.message
        assert "self-hosted, linux, x64, gpu, nvidia" in err.hint
    assert not Layout(reg.root).sku_dir("conv", "trt").exists()  # no placeholder engine
    from pipeline.cli import main

    assert main(["--params", str(params), "build", "--model", "conv", "--sku", "trt"]) == 3
    stderr = capsys.readouterr().err
    assert "skuforge: error: this host cannot build SKU trt" in stderr and "runner with labels" in stderr
    assert "Traceback" not in stderr


# --- on a GPU host -------------------------------------------------------------------------------

GPU_SKUS = {
    "trt_fp32": trt_sku("fp32"),
    "trt_fp16": trt_sku("fp16", precision_gate={"policy": "warn"}),
    "trt_int8": trt_sku("int8"),
    "trt_dynamic": trt_sku("fp32", shapes={}, profiles={"batch": {"min": 1, "opt": 4, "max": 8}}),
}


@pytest.fixture(scope="module")
def gpu_project(tmp_path_factory):
    try:
        import tensorrt
    except (ImportError, OSError) as exc:
        pytest.skip(f"tensorrt is not importable here ({type(exc).__name__}: {exc})")
    if trt_backend.gpu_info() is None:
        pytest.skip("no NVIDIA GPU visible (NVML, nvidia-smi and the CUDA runtime found none)")
    try:
        trt_backend.cudart_module()
    except EnvironmentProblem as exc:
        pytest.skip(exc.message)
    root = tmp_path_factory.mktemp("trt-gpu")
    specs = {
        "conv": (models.conv_bn_model, models.conv_bn_spec()),
        "multi": (models.multi_io_model, models.multi_io_spec()),
    }
    for builder, spec in specs.values():
        builder(root / spec["dir"] / spec["source"])
    reg = load_registry(models.write_project(root, {k: s for k, (_, s) in specs.items()}, GPU_SKUS))
    built = {}
    for m in specs:
        for stage in (prepare, make_data, reference, calibrate):
            stage(reg, m)
        for s in GPU_SKUS:
            built[m, s] = build(reg.pair(m, s))
    return SimpleNamespace(registry=reg, out=Layout(reg.root), build=built, trt=tensorrt)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["conv", "multi"])
@pytest.mark.parametrize("sku", list(GPU_SKUS))
def test_gpu_build_validate_bench(gpu_project, model, sku):
    p = gpu_project
    rep = p.build[model, sku]
    assert rep.backend == "tensorrt" and rep.versions["tensorrt"] == p.trt.__version__
    assert [f.path for f in rep.engine_files] == ["engine.plan", "layers.json"]
    assert set(rep.placement) == {"gpu"} and rep.requested_devices == ["gpu"] and rep.partition_boundaries == 0
    assert rep.cache is not None and rep.cache.kind == "timing-cache" and rep.cache.files
    assert (p.out.cache_dir(model, sku) / "timing.cache").is_file()
    compute = {k: v for k, v in rep.precision_counts.items() if k != "n/a"}
    assert compute, rep.precision_counts
    if sku == "trt_int8":
        assert rep.precision_counts.get("int8", 0) > 0 and rep.calibration["format"] == "QDQ"
    if sku == "trt_fp16":
        assert rep.precision_counts.get("fp16", 0) > 0
    if model == "conv":
        assert any(len(layer.fused_from) > 1 for layer in rep.layers)  # conv + relu at least
    val = validate(p.registry.pair(model, sku))
    assert val.passed, val.failures
    if sku in ("trt_fp32", "trt_dynamic"):
        assert all(e.max_abs_error <= 1e-4 for e in val.outputs)
    b = bench(p.registry.pair(model, sku))
    assert 0 < b.engine_only.p50_ms <= b.engine_only.p99_ms


@pytest.mark.gpu
def test_gpu_rebuild_hits_the_timing_cache(gpu_project):
    p = gpu_project
    build(p.registry.pair("conv", "trt_fp32"))
    meta = json.loads((p.out.engine_dir("conv", "trt_fp32") / ENGINE_META).read_text())
    assert meta["cache"]["state"] == "fresh" and meta["cache"]["hits"] == 1 and meta["cache"]["misses"] == 0


@pytest.mark.gpu
def test_gpu_dynamic_profile_refuses_a_batch_beyond_max(gpu_project):
    p = gpu_project
    sku = p.registry.sku("trt_dynamic")
    with get_backend("tensorrt").load(p.out.engine_dir("conv", "trt_dynamic"), sku) as runner:
        assert runner.infer({"x": np.zeros((8, 3, 8, 8), np.float32)})["probs"].shape == (8, 4)
        with pytest.raises(InputError, match="outside the engine's optimization profile"):
            runner.infer({"x": np.zeros((9, 3, 8, 8), np.float32)})
