"""The LiteRT converter's XNNPACK rewrites (``options.xnnpack_rewrites``): ops XNNPACK 2.3 has no kernel
for (HardSigmoid's RELU_0_TO_1, rewritten in the ONNX model; RESIZE_NEAREST_NEIGHBOR, rewritten in the
flatbuffer) as equal ops it has, and a TRANSPOSE_CONV whose kernel is its stride (which XNNPACK runs
slowly) as a 1x1 CONV_2D and DEPTH_TO_SPACE. Each
model is built through the pipeline and validated: its ops land on XNNPACK (the placement gate
allows nothing else) and its outputs match ONNX Runtime (the FP32 gate). Another transposed
convolution needs no rewrite: it is checked to stay on XNNPACK as it is. The transposed-convolution
rewrite is checked to give the engine without it bit for bit, in FP32 and in full-integer INT8.

Each build runs onnx2tf and TensorFlow's converter in a subprocess (~10 s); the rewrite's own rules
are checked without the converter.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import models
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.backends import get_backend
from pipeline.backends.litert import LiteRtBackend
from pipeline.backends.litert_converter.convert import _nearest_steps, _patch_block, hardsigmoid_rewrite
from pipeline.backends.reference import reference_runner
from pipeline.core.paths import Layout
from pipeline.project.config import SkuSpec, load_registry
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate

ON_XNNPACK = {"placement": {"allowed": ["xnnpack"]}}
SKUS = {
    "fp32": models.cpu_sku("litert", "fp32", {"delegate": "xnnpack"}) | ON_XNNPACK,
    "plain": models.cpu_sku("litert", "fp32", {"delegate": "xnnpack", "xnnpack_rewrites": False}),
    "int8": models.cpu_sku("litert", "int8", {"delegate": "xnnpack"}),
    "int8_plain": models.cpu_sku("litert", "int8", {"delegate": "xnnpack", "xnnpack_rewrites": False}),
}
SHAPE = [1, 4, 6, 5]


def _weights(name: str, shape: tuple[int, ...], seed: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.random.default_rng(seed).normal(0, 0.4, shape).astype(np.float32), name)


def _save(path: Path, nodes: list, init: list, out: list[int]) -> None:
    graph = helper.make_graph(
        nodes,
        path.parent.name,
        [models.value_info("x", ["batch", *SHAPE[1:]])],
        [models.value_info("y", ["batch", *out])],
        init,
    )
    models.save_graph(graph, path, opset=17)


def hardsigmoid_model(path: Path) -> None:
    """x -> Conv -> c; y = c * HardSigmoid(c) (alpha 0.25, beta 0.4: not PyTorch's 1/6, 1/2)."""
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], kernel_shape=[3, 3], name="conv"),
        helper.make_node("HardSigmoid", ["c"], ["gate"], alpha=0.25, beta=0.4, name="hsig"),
        helper.make_node("Mul", ["c", "gate"], ["y"], name="scale"),
    ]
    _save(path, nodes, [_weights("W", (6, 4, 3, 3), 0)], [6, 6, 5])


def nearest_model(path: Path) -> None:
    """x -> Conv -> Resize nearest x4 (PyTorch's: asymmetric, floor) -> Conv -> y."""
    scales = numpy_helper.from_array(np.array([1, 1, 4, 4], np.float32), "scales")
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], kernel_shape=[3, 3], name="conv"),
        helper.make_node(
            "Resize",
            ["c", "", "scales"],
            ["up"],
            mode="nearest",
            coordinate_transformation_mode="asymmetric",
            nearest_mode="floor",
            name="upsample",
        ),
        helper.make_node("Conv", ["up", "W2"], ["y"], pads=[1, 1, 1, 1], kernel_shape=[3, 3], name="smooth"),
    ]
    _save(path, nodes, [_weights("W", (6, 4, 3, 3), 1), _weights("W2", (3, 6, 3, 3), 2), scales], [3, 24, 20])


def deconv_model(path: Path) -> None:
    """x -> ConvTranspose k2 s2 (bias) -> Relu -> ConvTranspose k3 s2 (pads, output_padding) -> y."""
    bias = numpy_helper.from_array(np.linspace(-0.2, 0.2, 6).astype(np.float32), "B")
    nodes = [
        helper.make_node("ConvTranspose", ["x", "Wt", "B"], ["d"], strides=[2, 2], kernel_shape=[2, 2], name="up1"),
        helper.make_node("Relu", ["d"], ["r"], name="relu"),
        helper.make_node(
            "ConvTranspose",
            ["r", "Wt2"],
            ["y"],
            strides=[2, 2],
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
            output_padding=[1, 1],
            name="up2",
        ),
    ]
    _save(path, nodes, [_weights("Wt", (4, 6, 2, 2), 3), _weights("Wt2", (6, 2, 3, 3), 4), bias], [2, 24, 20])


BUILDERS = {"hsig": hardsigmoid_model, "nearest": nearest_model, "deconv": deconv_model}


def _spec(name: str) -> dict:
    return {
        "dir": name,
        "source": "model.onnx",
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", *SHAPE[1:]], "range": [-2.0, 2.0]}],
    }


@pytest.fixture(scope="module")
def proj(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("litert-rewrites")
    for name, make in BUILDERS.items():
        make(root / name / "model.onnx")
    reg = load_registry(models.write_project(root, {name: _spec(name) for name in BUILDERS}, SKUS))
    for name in BUILDERS:
        for stage in (prepare, make_data, reference):
            stage(reg, name)
    calibrate(reg, "deconv")
    return SimpleNamespace(registry=reg, out=Layout(reg.root))


def _buildable() -> None:
    problems = LiteRtBackend().environment_problems(SkuSpec.model_validate(SKUS["fp32"]), "build")
    if problems:
        pytest.skip(f"this host cannot build LiteRT engines: {'; '.join(problems)}")


def _matches_onnx_runtime(proj, model: str, sku: str = "fp32") -> None:
    reference_ = reference_runner(proj.out.prepared_model(model))
    with get_backend("litert").load(proj.out.engine_dir(model, sku), proj.registry.sku(sku)) as runner:
        for seed in range(3):
            feeds = {"x": np.random.default_rng(seed).uniform(-2, 2, SHAPE).astype(np.float32)}
            np.testing.assert_allclose(runner.infer(feeds)["y"], reference_.infer(feeds)["y"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("model", "rewrite", "ops", "node"),
    [
        ("hsig", "hardsigmoid", {"MUL", "ADD", "MINIMUM", "RELU"}, "hsig"),
        ("nearest", "nearest_resize", {"CONCATENATION", "DEPTH_TO_SPACE"}, "upsample"),
    ],
)
def test_the_rewritten_op_runs_on_xnnpack_and_matches_onnx_runtime(proj, model, rewrite, ops, node):
    _buildable()
    report = build(proj.registry.pair(model, "fp32"))
    assert {layer.device for layer in report.layers} == {"xnnpack"}, report.layers
    types = {layer.op_type for layer in report.layers}
    assert ops <= types and not types & {"RELU_0_TO_1", "RESIZE_NEAREST_NEIGHBOR"}, types
    assert get_backend("litert").read_meta(proj.out.engine_dir(model, "fp32")).partitions == 1
    (record,) = report.options["graph_rewrites"]
    assert record["rewrite"] == rewrite and record["nodes"] == [node], record
    assert any(node in layer.fused_from for layer in report.layers)  # the op still names its ONNX node
    assert validate(proj.registry.pair(model, "fp32")).passed  # placement: xnnpack only; outputs within the gate
    _matches_onnx_runtime(proj, model)


def test_without_the_rewrite_nearest_resize_stays_on_the_builtin_kernels(proj):
    _buildable()
    report = build(proj.registry.pair("nearest", "plain"))
    resize = [layer for layer in report.layers if layer.op_type == "RESIZE_NEAREST_NEIGHBOR"]
    assert [layer.device for layer in resize] == ["cpu"] and report.options["graph_rewrites"] == []
    _matches_onnx_runtime(proj, "nearest", "plain")


def _outputs(proj, model: str, sku: str) -> list[np.ndarray]:
    with get_backend("litert").load(proj.out.engine_dir(model, sku), proj.registry.sku(sku)) as runner:
        return [
            runner.infer({"x": np.random.default_rng(seed).uniform(-2, 2, SHAPE).astype(np.float32)})["y"]
            for seed in range(3)
        ]


@pytest.mark.parametrize(("sku", "plain"), [("fp32", "plain"), ("int8", "int8_plain")])
def test_a_transposed_convolution_whose_kernel_is_its_stride_becomes_a_1x1_convolution(proj, sku, plain):
    """up1 (k2 s2) becomes CONV_2D + DEPTH_TO_SPACE; up2 (k3 s2, pads, output_padding: overlapping
    patches) stays TRANSPOSE_CONV. Both run on XNNPACK; the engine computes what it did without the rewrite."""
    _buildable()
    report = build(proj.registry.pair("deconv", sku))
    types = [layer.op_type for layer in report.layers]
    assert types.count("TRANSPOSE_CONV") == 1 and "DEPTH_TO_SPACE" in types and "CONV_2D" in types, types
    assert {layer.device for layer in report.layers} == {"xnnpack"}
    (record,) = report.options["graph_rewrites"]
    assert record["rewrite"] == "transpose_conv" and "up1" in record["nodes"] and record["ops"] == 1, record
    assert any("up1" in layer.fused_from for layer in report.layers if layer.op_type == "DEPTH_TO_SPACE")
    before = build(proj.registry.pair("deconv", plain))
    assert [layer.op_type for layer in before.layers].count("TRANSPOSE_CONV") == 2, before.layers
    assert before.options["graph_rewrites"] == []
    for got, want in zip(_outputs(proj, "deconv", sku), _outputs(proj, "deconv", plain), strict=True):
        np.testing.assert_array_equal(got, want)
    if sku == "fp32":
        assert validate(proj.registry.pair("deconv", "fp32")).passed
        _matches_onnx_runtime(proj, "deconv")


# --- the rules, without the converter ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "src", "dst", "steps"),
    [
        ({}, [1, 3, 3, 2], [1, 6, 6, 2], 1),
        ({"halfPixelCenters": True}, [1, 3, 3, 2], [1, 24, 24, 2], 3),  # floor((i + 0.5) / 8) = floor(i / 8)
        ({"alignCorners": True}, [1, 3, 3, 2], [1, 6, 6, 2], None),
        ({}, [1, 3, 3, 2], [1, 9, 9, 2], None),  # x3: no DEPTH_TO_SPACE 2 chain
        ({}, [1, 3, 3, 2], [1, 6, 12, 2], None),  # unequal scales
        ({}, [1, 3, 3, 2], [1, 3 * 128, 3 * 128, 2], None),  # beyond MAX_NEAREST_STEPS
    ],
    ids=["x2", "x8-half-pixel", "align-corners", "x3", "unequal", "x128"],
)
def test_only_a_nearest_resize_the_rewrite_computes_exactly_is_rewritten(options, src, dst, steps):
    opts = SimpleNamespace(**({"alignCorners": False, "halfPixelCenters": False} | options))
    assert _nearest_steps(opts, src, dst) == steps


@pytest.mark.parametrize(
    ("strides", "weights", "out", "block"),
    [
        ((2, 2), [6, 2, 2, 4], [1, 6, 10, 6], 2),
        ((4, 4), [6, 4, 4, 4], [1, 12, 20, 6], 4),
        ((2, 2), [6, 3, 3, 4], [1, 6, 10, 6], None),  # k3 s2: patches overlap
        ((2, 2), [6, 2, 2, 4], [1, 7, 11, 6], None),  # output_padding: a row no input pixel gives
        ((2, 1), [6, 2, 1, 4], [1, 6, 5, 6], None),  # unequal strides: no DEPTH_TO_SPACE
        ((1, 1), [6, 1, 1, 4], [1, 3, 5, 6], None),  # a 1x1 convolution already
    ],
    ids=["k2s2", "k4s4", "k3s2", "output-padding", "unequal", "k1s1"],
)
def test_only_a_transposed_convolution_with_its_kernel_as_stride_is_rewritten(strides, weights, out, block):
    opts = SimpleNamespace(strideH=strides[0], strideW=strides[1])
    assert _patch_block(opts, weights, out, [1, 3, 5, 4]) == block


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_the_hardsigmoid_rewrite_computes_what_onnx_runtime_does():
    for opset in (17, 9):  # Clip's bounds are inputs from opset 11, attributes before
        graph = helper.make_graph(
            [helper.make_node("HardSigmoid", ["x"], ["y"], alpha=0.3, beta=0.45, name="h")],
            "h",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 50])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 50])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        x = np.linspace(-5, 5, 100, dtype=np.float32).reshape(2, 50)
        want = _run(model, x)
        assert hardsigmoid_rewrite(model) == ["h"]
        assert [n.op_type for n in model.graph.node] == ["Mul", "Add", "Clip"]
        got = _run(model, x)
        np.testing.assert_allclose(got, want, atol=1e-7, rtol=0)
