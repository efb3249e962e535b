"""FLOPs and bytes per node on hand-computed cases, the join of per-layer times, the roofline (INT8
ops against the INT8 peak, the others against the FP32 one), and the runners' per-layer profiles
(ONNX Runtime, OpenVINO) on a small real engine."""

from __future__ import annotations

import models
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from pydantic import ValidationError

from pipeline.perf.cost import GraphCost, graph_cost
from pipeline.perf.roofline import RooflineReport, join_layer_times, node_precisions, roofline
from pipeline.results.reports import LayerInfo

F = TensorProto.FLOAT


def cost_of(nodes, inputs, outputs, inits=(), opsets=(("", 17),)) -> GraphCost:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, F, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, F, s) for n, s in outputs],
        [numpy_helper.from_array(np.zeros(s, np.float32), n) for n, s in inits],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 8
    return graph_cost(model)


def test_conv_with_bias():
    cost = cost_of(
        [helper.make_node("Conv", ["x", "W", "B"], ["y"], pads=[1, 1, 1, 1], name="conv")],
        [("x", [1, 3, 8, 8])],
        [("y", None)],
        [("W", [8, 3, 3, 3]), ("B", [8])],
    )
    layer = cost.layer("conv")
    # 512 outputs, each 3·3·3 multiply-adds and a bias add
    assert layer.flops == 2 * 512 * 27 + 512 == 28160
    assert layer.bytes == (3 * 64 + 8 * 27 + 8 + 8 * 64) * 4 == 3712
    assert layer.weight_bytes == (8 * 27 + 8) * 4
    assert layer.intensity == pytest.approx(28160 / 3712)
    assert cost.flops == 28160 and cost.weight_bytes == 896 and not cost.uncounted


def test_depthwise_conv_counts_one_input_channel_per_output():
    cost = cost_of(
        [helper.make_node("Conv", ["x", "W"], ["y"], pads=[1, 1, 1, 1], group=8, name="dw")],
        [("x", [1, 8, 8, 8])],
        [("y", None)],
        [("W", [8, 1, 3, 3])],
    )
    assert cost.layer("dw").flops == 2 * 512 * 9 == 9216
    assert cost.layer("dw").bytes == (512 + 72 + 512) * 4


def test_gemm_trans_b_with_c():
    cost = cost_of(
        [helper.make_node("Gemm", ["a", "w", "c"], ["y"], transB=1, name="fc")],
        [("a", [4, 16])],
        [("y", None)],
        [("w", [32, 16]), ("c", [32])],
    )
    assert cost.layer("fc").flops == 2 * 4 * 32 * 16 + 4 * 32 == 4224
    assert cost.layer("fc").bytes == (64 + 512 + 32 + 128) * 4 == 2944


def test_matmul_with_batch_dims_broadcast():
    cost = cost_of(
        [helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")],
        [("a", [2, 1, 5, 7]), ("b", [3, 7, 4])],
        [("y", None)],
    )
    # y is [2, 3, 5, 4]: 120 outputs of 7 multiply-adds each
    assert cost.layer("mm").flops == 2 * 120 * 7 == 1680
    assert cost.layer("mm").bytes == (70 + 84 + 120) * 4


def test_softmax_and_an_unknown_op():
    cost = cost_of(
        [
            helper.make_node("Softmax", ["x"], ["s"], axis=-1, name="softmax"),
            helper.make_node("Det", ["m"], ["d"], name="det"),
        ],
        [("x", [2, 10]), ("m", [3, 4, 4])],
        [("s", None), ("d", None)],
    )
    assert cost.layer("softmax").flops == 5 * 20 and cost.layer("softmax").bytes == 160
    det = cost.layer("det")
    assert (det.flops, det.bytes, det.counted) == (0, (48 + 3) * 4, False)
    assert cost.uncounted == ["det"]


@pytest.mark.parametrize("mode, flops", [("linear", 2 * 4 * 128), ("nearest", 0), ("cubic", 2 * 16 * 128)])
def test_resize(mode, flops):
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    graph = helper.make_graph(
        [helper.make_node("Resize", ["x", "", "scales"], ["y"], mode=mode, name="up")],
        "g",
        [helper.make_tensor_value_info("x", F, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", F, None)],
        [scales],
    )
    cost = graph_cost(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    # 128 outputs interpolated over 2 axes: 4 taps (linear) or 16 (cubic), a multiply-add each
    assert cost.layer("up").flops == flops
    assert cost.layer("up").bytes == (32 + 4 + 128) * 4


def integer_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"], name="mmi")],
        "g",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
        [numpy_helper.from_array(np.zeros((8, 2), np.int8), "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_integer_kernels_count_int_ops():
    cost = graph_cost(integer_model())
    layer = cost.layer("mmi")
    assert (layer.flops, layer.int_ops, layer.bytes) == (0, 2 * 8 * 8, 32 + 16 + 32)


def test_contrib_attention_shapes_flow_on():
    hidden, heads, b, s = 8, 2, 1, 4
    cost = cost_of(
        [
            helper.make_node(
                "Attention", ["x", "w", "bias"], ["att"], domain="com.microsoft", num_heads=heads, name="att"
            ),
            helper.make_node("Relu", ["att"], ["y"], name="after"),
        ],
        [("x", [b, s, hidden])],
        [("y", None)],
        [("w", [hidden, 3 * hidden]), ("bias", [3 * hidden])],
        opsets=(("", 17), ("com.microsoft", 1)),
    )
    qkv = 2 * b * s * hidden * 3 * hidden + b * s * 3 * hidden
    assert cost.layer("att").flops == qkv + 2 * b * s * s * hidden + 5 * b * heads * s * s + 2 * b * s * s * hidden
    assert cost.layer("after").flops == b * s * hidden and not cost.unshaped


def test_pins_fix_named_dims(tmp_path):
    path = models.conv_bn_model(tmp_path / "m.onnx")
    assert graph_cost(path).unshaped  # batch is dynamic
    one, four = graph_cost(path, {"batch": 1}), graph_cost(path, {"batch": 4})
    assert not one.unshaped and four.layer("conv").flops == 4 * one.layer("conv").flops


# --- the join rule and the roofline ------------------------------------------------------------------


def chain_model() -> onnx.ModelProto:
    """x -> Conv -> Relu -> MaxPool -> MatMul -> Add -> Relu, named as ONNX Runtime's tests expect."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(size=s).astype(np.float32), n)
        for n, s in (("W", (8, 3, 3, 3)), ("W2", (8 * 8 * 8, 16)), ("B2", (16,)))
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("MatMul", ["f", "W2"], ["mm"], name="mm"),
        helper.make_node("Add", ["mm", "B2"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["y"], name="relu2"),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", F, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", F, [1, 16])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize(
    "times, groups, unmatched",
    [
        # graph_optimization_level basic: nodes keep their names; MatMul+Add became a Gemm
        (
            {"conv": 1, "relu": 1, "pool": 1, "flat": 1, "mm/MatMulAddFusion": 1, "relu2": 1},
            {"conv": ["conv"], "relu": ["relu"], "mm/MatMulAddFusion": ["mm", "add"]},
            {},
        ),
        # extended: FusedConv keeps the Conv's name, FusedGemm takes the activation too
        (
            {"conv": 1, "pool": 1, "fused mm/MatMulAddFusion": 1},
            {"conv": ["conv", "relu"], "fused mm/MatMulAddFusion": ["mm", "add", "relu2"]},
            {},
        ),
        # all (x86): NCHWc nodes are named after the output tensor, plus a layout reorder of no node
        (
            {"r_nchwc": 1, "p_nchwc": 1, "ReorderOutput": 0.5},
            {"r_nchwc": ["conv", "relu"], "p_nchwc": ["pool"]},
            {"ReorderOutput": 0.5},
        ),
    ],
)
def test_join_follows_onnxruntime_renames(times, groups, unmatched):
    joined, left = join_layer_times(times, graph_cost(chain_model()))
    assert {k: joined[k] for k in groups} == groups and left == unmatched


def test_join_uses_fused_from_of_build_layers():
    layers = [
        LayerInfo(name="conv", op_type="Convolution", fused_from=["conv", "r"]),  # OpenVINO: node and tensor names
        LayerInfo(name="x_abcd_acdb_conv", op_type="Reorder"),
    ]
    joined, left = join_layer_times({"conv": 2.0, "x_abcd_acdb_conv": 0.1}, graph_cost(chain_model()), layers)
    assert joined == {"conv": ["conv", "relu"]} and left == {"x_abcd_acdb_conv": 0.1}


PEAKS = {
    "key": "k",
    "host": {},
    "measured_at": "2026-01-01T00:00:00+00:00",
    "seconds": 5.0,
    "one_core_method": "threadpoolctl",
    "compute_gflops": {"all_cores": 100.0, "one_core": 50.0, "nominal": None, "nominal_basis": None, "matmul_n": 2048},
    "int8_gops": {"all_cores": 300.0, "one_core": 150.0, "nominal": 400.0, "nominal_basis": "flags", "matmul_n": 512},
    "bandwidth_gbs": {"triad": 10.0, "memcopy": 12.0, "triad_one_core": 8.0, "array_mb": 256},
}


def test_roofline_of_an_engine():
    cost = graph_cost(chain_model())
    times = {"conv": 0.02, "pool": 0.01, "fused mm/MatMulAddFusion": 0.005, "ReorderOutput": 0.001}
    report = roofline(cost, 0.05, PEAKS, times)
    assert report.ridge == 10.0  # 100 GFLOP/s over 10 GB/s
    assert report.achieved_gflops == pytest.approx(cost.flops / 0.05e-3 / 1e9)
    assert report.compute_fraction == pytest.approx(report.achieved_gflops / 100)
    assert report.bandwidth_fraction == pytest.approx(cost.bytes / 0.05e-3 / 1e9 / 10)
    assert report.ceilings_gflops == {"all_cores": 100.0, "one_core": 50.0}
    assert report.peak_kind == "fp32" and report.int8_share_of_ops == 0 and "the FP32 peak" in report.peak_basis
    conv = next(layer for layer in report.layers if layer.name == "conv")
    assert conv.nodes == ["conv", "relu"] and conv.op == "Conv"
    conv_cost = cost.layer("conv").flops + cost.layer("relu").flops
    assert conv.flops == conv_cost and conv.time_ms == 0.02
    assert conv.achieved_gflops == pytest.approx(conv_cost / 0.02e-3 / 1e9)
    assert conv.time_share == pytest.approx(0.02 / 0.036)
    assert conv.bound == ("compute" if conv.intensity >= 10 else "memory")
    assert conv.attainable_gflops == pytest.approx(min(100.0, conv.intensity * 10))
    pool = next(layer for layer in report.layers if layer.name == "pool")
    assert pool.bound == "memory" and pool.intensity < 1
    assert report.unmatched_ms == {"ReorderOutput": 0.001} and report.profiled_ms == pytest.approx(0.036)
    assert report.listed_share_of_ops >= 0.9
    # untimed: the heaviest nodes alone, no times
    bare = roofline(cost, 0.05, PEAKS)
    assert bare.layers[0].name == "conv" and bare.layers[0].nodes == ["conv"] and bare.layers[0].time_ms is None
    assert RooflineReport.model_validate(report.to_json()) == report


def test_an_int8_engine_is_judged_against_the_int8_peak():
    cost = graph_cost(chain_model())
    fp32 = roofline(cost, 0.05, PEAKS, precision="fp32")
    int8 = roofline(cost, 0.05, PEAKS, precision="int8")
    assert fp32.achieved_gflops == int8.achieved_gflops > 0  # the same ops in the same time
    assert (fp32.peak_kind, fp32.peak_gflops, fp32.ridge) == ("fp32", 100.0, 10.0)
    assert (int8.peak_kind, int8.peak_gflops, int8.ridge) == ("int8", 300.0, 30.0)
    assert int8.compute_fraction == pytest.approx(int8.achieved_gflops / 300) == fp32.compute_fraction / 3
    assert int8.int8_share_of_ops == 1 and int8.precision == "int8"
    assert int8.peak_basis.startswith("the INT8 peak (300 GOP/s: u8 × s8 → s32 MatMulInteger")
    assert "the engine's precision (int8)" in int8.peak_basis
    assert int8.ceilings_gflops == {
        "all_cores": 100.0,
        "one_core": 50.0,
        "int8_all_cores": 300.0,
        "int8_one_core": 150.0,
        "int8_nominal": 400.0,
    }
    assert "int8_all_cores" not in fp32.ceilings_gflops
    for layer in int8.layers:
        assert layer.peak_kind == "int8" and layer.peak_gflops == 300.0
        assert layer.attainable_gflops == pytest.approx(min(300.0, layer.intensity * 10))
        assert layer.bound == ("compute" if layer.intensity >= 30 else "memory")
    assert all(layer.peak_kind == "fp32" and layer.peak_gflops == 100.0 for layer in fp32.layers)
    # FP16 on a CPU: no FP16 peak is measured, the FP32 one judges it and says so
    fp16 = roofline(cost, 0.05, PEAKS, precision="fp16")
    assert fp16.peak_kind == "fp32" and fp16.peak_basis.endswith("(no FP16 peak is measured)")


def test_layer_precisions_make_a_mixed_engine():
    """build.json layers name the precision each layer ran in: an INT8 SKU whose MatMul stayed
    float is judged partly against each peak, each layer against its own."""
    cost = graph_cost(chain_model())
    layers = [LayerInfo(name="conv", op_type="Conv", precision="int8"), LayerInfo(name="mm", op_type="MatMul")]
    layers.append(LayerInfo(name="fused mm/MatMulAddFusion", op_type="MatMul", precision="fp32"))
    layers.append(LayerInfo(name="flat", op_type="Flatten", precision="n/a"))
    said = node_precisions(cost, layers)
    assert said == {"conv": "int8", "relu": "int8", "mm": "fp32", "add": "fp32", "relu2": "fp32"}
    report = roofline(cost, 0.05, PEAKS, layers=layers, precision="int8", coverage=1.0)
    ops = {c.node: c.flops + c.int_ops for c in cost.layers}
    float_ops = ops["mm"] + ops["add"] + ops["relu2"]
    total = sum(ops.values())
    assert report.peak_kind == "mixed" and report.int8_share_of_ops == pytest.approx(1 - float_ops / total)
    # the rate at which the ops take their time at the two peaks
    assert report.peak_gflops == pytest.approx(total / ((total - float_ops) / 300 + float_ops / 100))
    assert report.compute_fraction == pytest.approx(report.achieved_gflops / report.peak_gflops)
    assert "the precision of build.json layers, the engine's precision (int8) elsewhere" in report.peak_basis
    by_node = {layer.nodes[0]: layer for layer in report.layers}
    assert by_node["conv"].peak_kind == "int8" and by_node["mm"].peak_kind == "fp32"
    assert by_node["mm"].peak_gflops == 100.0 and by_node["pool"].peak_kind == "int8"  # no layer: the SKU's
    # an FP32 SKU whose layers say one ran in INT8
    fp32 = roofline(cost, 0.05, PEAKS, layers=layers[:1], precision="fp32")
    assert fp32.peak_kind == "mixed" and 0 < fp32.int8_share_of_ops < 1


def test_integer_kernels_are_int8_whatever_the_precision():
    report = roofline(graph_cost(integer_model()), 0.001, PEAKS, precision="fp32")
    assert report.peak_kind == "int8" and report.peak_gflops == 300.0 and report.int8_share_of_ops == 1


def test_peaks_without_the_int8_figures_are_refused():
    old = {k: v for k, v in PEAKS.items() if k != "int8_gops"}
    with pytest.raises(ValidationError, match="int8_gops"):
        roofline(graph_cost(chain_model()), 0.05, old)


# --- per-layer profiles of real engines --------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from pipeline.project.config import load_registry
    from pipeline.stages.build import build
    from pipeline.stages.data import make_data
    from pipeline.stages.prepare import prepare
    from pipeline.stages.reference import reference

    root = tmp_path_factory.mktemp("roofline")
    models.conv_bn_model(root / "models/conv/model.onnx")
    skus = {
        "ort": models.cpu_sku("onnxruntime", "fp32", {}),
        "ort_basic": models.cpu_sku("onnxruntime", "fp32", {"graph_optimization_level": "basic"}),
    }
    try:
        import openvino  # noqa: F401

        skus["ov"] = models.cpu_sku("openvino", "fp32", {"device": "CPU"})
    except ImportError:
        pass
    reg = load_registry(models.write_project(root, {"conv": models.conv_bn_spec()}, skus))
    for stage in (prepare, make_data, reference):
        stage(reg, "conv")
    return reg, {sku: build(reg.pair("conv", sku)) for sku in skus}


def _profile(reg, sku: str):
    from pipeline.backends import get_backend
    from pipeline.core.paths import Layout

    out = Layout(reg.root)
    spec = reg.sku(sku)
    feeds = {"x": np.random.default_rng(0).normal(size=(1, 3, 8, 8)).astype(np.float32)}
    with get_backend(spec.backend).load(out.engine_dir("conv", sku), spec) as runner:
        times = runner.profile_layers(feeds, iterations=5)
    return times, graph_cost(out.prepared_model("conv"), reg.pins("conv", sku))


@pytest.mark.parametrize("sku", ["ort", "ort_basic", "ov"])
def test_profile_layers_joins_every_costly_node(engines, sku):
    reg, builds = engines
    if sku not in builds:
        pytest.skip("openvino is not installed (pip install openvino)")
    times, cost = _profile(reg, sku)
    assert times and all(t >= 0 for t in times.values())
    # keyed by the engine's layer names, as build.json lists them
    assert set(times) <= {layer.name for layer in builds[sku].layers}
    joined, _ = join_layer_times(times, cost, builds[sku].layers)
    timed = {n for nodes in joined.values() for n in nodes}
    assert {c.node for c in cost.layers if c.flops} <= timed, (joined, times)
    report = roofline(cost, sum(times.values()), PEAKS, times, layers=builds[sku].layers)
    assert report.profiled_ms == pytest.approx(sum(times.values()))
    conv = next(layer for layer in report.layers if "conv" in layer.nodes)
    assert conv.achieved_gflops == pytest.approx(conv.flops / conv.time_ms / 1e6), times


def test_reference_runner_profiles_onnx_node_names(tmp_path):
    from pipeline.backends.reference import reference_runner

    model = chain_model()
    with reference_runner(model.SerializeToString()) as runner:
        times = runner.profile_layers({"x": np.ones((1, 3, 16, 16), np.float32)}, iterations=3)
    assert set(times) == {n.name for n in model.graph.node}


def test_backends_without_layer_timing_say_none():
    from pipeline.backends.contract import Runner

    class Plain(Runner):
        def _infer_impl(self, feeds):
            return {}

    assert Plain([], []).profile_layers({}) is None
