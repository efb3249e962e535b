"""Bisection and its remedy on planted defects, on every backend here that builds each model.

Two models carry one defect each in a named node (tests/models.py):
- ``outlier_channel``: node ``outlier_scale`` multiplies one channel by 500 (the next Conv divides
  it back). INT8 with one scale per activation tensor wipes out the other channels.
- ``fp16_overflow``: node ``overflow_scale`` pushes values past FP16's 65504, ``rescale`` brings
  them back. FP16 turns them into Inf, then NaN.

For each (model, SKU): validate fails and its report carries the bisection naming the node; the
remedy (``skuforge bisect --fix --apply``) writes the override into params.yaml; the rebuilt
engine passes, and the manifest records the override. Engines that pass are scanned tensor by
tensor: no tensor may be called divergent (no false alarms).
"""

from __future__ import annotations

import json

import models
import pytest
import yaml
from cli_helpers import skuforge

import pipeline.verify.bisect as bisect_module
import pipeline.verify.bisect.search as bisect_search
import pipeline.verify.remedy as remedy_module
from pipeline.backends import get_backend
from pipeline.backends.opset import convert_opset
from pipeline.core.errors import GateFailed
from pipeline.core.paths import Layout
from pipeline.model.graph import default_opset, pin_axes
from pipeline.project.config import SkuSpec, load_registry
from pipeline.stages.bench import bench
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.manifest import write_manifest
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate
from pipeline.verify.bisect import (
    Graph,
    bisect,
    channel_axis,
    float_node_inputs,
    outer_reads,
    overflow_source,
    remedy_nodes,
    tensor_error,
    unkeepable,
)
from pipeline.verify.remedy import fix

SKUS = models.CPU_SKUS
# LiteRT INT8 (its own test below: a ~10 s conversion per build); XNNPACK leaves the int8 Softmax to
# the built-in kernels, which its placement allows; validate does not bisect (fix does, once)
PLANTED_SKUS = SKUS | {
    "litert_int8": models.cpu_sku("litert", "int8", {"delegate": "xnnpack", "per_channel": True})
    | {"placement": {"allowed": ["xnnpack", "cpu"]}, "bisect": {"on_failure": False}},
}
# (defect, SKU) -> the planted node, the cause bisection must give, the nodes the remedy keeps
PLANTED = {
    ("outlier", "ort_int8"): ("outlier_scale", "range", ["outlier_scale", "conv2"]),
    ("outlier", "ov_int8"): ("outlier_scale", "range", ["outlier_scale", "conv2"]),
    ("overflow", "iree_fp16"): ("overflow_scale", "overflow", ["overflow_scale", "relu", "rescale"]),
}
BUILDERS = {
    "outlier": (models.outlier_channel_model, models.outlier_channel_spec()),
    "overflow": (models.fp16_overflow_model, models.fp16_overflow_spec()),
    "bias_outlier": (models.bias_outlier_model, models.outlier_channel_spec()),
    "unknown_rank": (models.unknown_rank_model, models.outlier_channel_spec()),
    # 4 of 16 golden samples at up to 4x the calibrated range: INT8 saturates on those alone
    "edge_cases": (
        models.feature_map_model,
        models.feature_map_spec() | {"datasets": {"golden": {"generate": {"count": 16, "edge_cases": True}}}},
    ),
}


def _project(root, defect: str, sku: str):
    builder, spec = BUILDERS[defect]
    builder(root / "m" / "model.onnx")
    models.write_project(root, {"m": spec}, {sku: PLANTED_SKUS[sku]})
    return _stages(load_registry(root / "params.yaml"), sku)


def _stages(reg, sku: str):
    """The model stages before build (calibrate for an INT8 SKU)."""
    prepare(reg, "m")
    make_data(reg, "m")
    reference(reg, "m")
    if reg.sku(sku).precision == "int8":
        calibrate(reg, "m")
    return reg


@pytest.mark.slow
@pytest.mark.parametrize("defect,sku", sorted(PLANTED))
def test_planted_defect_is_found_and_fixed(tmp_path, defect, sku):
    node, cause, keep = PLANTED[(defect, sku)]
    reg = _project(tmp_path, defect, sku)
    build(reg.pair("m", sku))
    with pytest.raises(GateFailed) as failed:
        validate(reg.pair("m", sku))
    assert node in str(failed.value) and "skuforge bisect" in failed.value.hint
    out = Layout(tmp_path)
    report = json.loads(out.report("m", sku, "validate").read_text())
    bisection = report["bisection"]
    assert bisection["verdict"] == "diverges", bisection["summary"]
    suspect = bisection["suspects"][0]
    assert (suspect["node"], suspect["cause"]) == (node, cause), bisection["summary"]
    # searched by parts: fewer builds than candidates + the anchor and the confirmation
    assert 1 < bisection["builds"] <= bisection["candidates"] + 2
    assert all(
        len(p["marked"]) <= PLANTED_SKUS[sku].get("bisect", {}).get("marks_per_build", 3) + 2
        for p in bisection["probes"]
    )
    if cause == "overflow":
        assert bisection["first_nonfinite"] == node and suspect["error"]["inf"] > 0
    if cause == "range":
        ratio = max(v for k, v in suspect["error"]["channel_abs_max"].items() if k != "median")
        assert ratio > 100 * suspect["error"]["channel_abs_max"]["median"]
    if sku.startswith("ov"):  # fused layers are reported with the ONNX nodes they came from
        assert any(
            {node, f"{suspect['tensor']}_QuantizeLinear"} & set(layer["fused_from"]) and len(layer["fused_from"]) > 1
            for layer in suspect["engine_layers"]
        ), suspect["engine_layers"]

    # the remedy from the command line, written into params.yaml
    proc = skuforge("bisect", "--model", "m", "--sku", sku, "--fix", "--apply", "--json", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    remedy = json.loads(proc.stdout)
    assert remedy["passed"] and remedy["keep_precise"] == keep, remedy["summary"]
    assert not remedy["before"]["passed"] and remedy["after"]["passed"]
    assert remedy["before"]["p50_ms"] > 0 and remedy["after"]["p50_ms"] > 0 and remedy["latency_ratio"] > 0
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    assert params["models"]["m"]["higher_precision"] == {sku: keep}

    # the stages from params.yaml alone: the engine passes and the manifest names the override
    reg = load_registry(tmp_path / "params.yaml")
    built = build(reg.pair("m", sku))
    assert built.keep_precise == keep
    assert validate(reg.pair("m", sku)).passed
    bench(reg.pair("m", sku))
    manifest = write_manifest(reg.pair("m", sku))
    assert manifest.build.keep_precise == keep


@pytest.mark.slow
def test_planted_outlier_is_found_and_fixed_on_litert_int8(tmp_path):
    """The outlier on LiteRT: bisection names ``outlier_scale`` (range), and the remedy passes. TFLite's
    quantizer gives the Mul's input (conv1+relu1's fused CONV_2D output) the Mul output's scale, so
    keeping outlier_scale and conv2 in float is not enough there: the remedy also keeps relu1 (and with
    it conv1: one op). (tests/backends/test_litert.py checks that kept nodes' ops compute in fp32.)"""
    if not _litert_builds():
        pytest.skip("LiteRT cannot build here (ai-edge-litert, or python -m pipeline.backends.litert_converter)")
    reg = _project(tmp_path, "outlier", "litert_int8")
    build(reg.pair("m", "litert_int8"))
    with pytest.raises(GateFailed):
        validate(reg.pair("m", "litert_int8"))
    remedy = fix(reg.pair("m", "litert_int8"))
    suspect = remedy.rounds[0].suspects[0]
    assert (suspect.node, suspect.cause) == ("outlier_scale", "range"), remedy.rounds[0].summary
    assert remedy.passed and remedy.keep_precise == ["outlier_scale", "conv2", "relu1"], remedy.summary
    assert [(s.keep_precise, s.passed) for s in remedy.steps[1:]] == [
        (["outlier_scale", "conv2"], False),
        (["outlier_scale", "conv2", "relu1"], True),
    ], remedy.summary


def _litert_builds() -> bool:
    sku = SkuSpec.model_validate(PLANTED_SKUS["litert_int8"])
    return not get_backend("litert").environment_problems(sku, "build")


@pytest.mark.slow
def test_fix_during_build(tmp_path):
    """skus.<s>.bisect.fix_during_build: the build itself bisects and keeps the suspects precise."""
    reg = _project(tmp_path, "outlier", "ort_int8")
    doc = yaml.safe_load((tmp_path / "params.yaml").read_text())
    doc["skus"]["ort_int8"]["bisect"] = {"fix_during_build": True}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(doc))
    reg = load_registry(tmp_path / "params.yaml")
    report = build(reg.pair("m", "ort_int8"))
    assert report.keep_precise == ["outlier_scale", "conv2"]
    assert report.remedy is not None and report.remedy.passed
    assert validate(reg.pair("m", "ort_int8")).passed


@pytest.mark.slow
@pytest.mark.parametrize("sku", sorted(SKUS))
def test_no_false_alarm_on_passing_engines(tmp_path, sku):
    """A healthy model (conv_bn) on every SKU: bisection says clean, and a scan of every tensor
    finds none divergent."""
    models.conv_bn_model(tmp_path / "models/conv/model.onnx")
    models.write_project(tmp_path, {"m": models.conv_bn_spec()}, {sku: SKUS[sku]})
    reg = _stages(load_registry(tmp_path / "params.yaml"), sku)
    build(reg.pair("m", sku))
    assert validate(reg.pair("m", sku)).passed

    assert bisect(reg.pair("m", sku)).verdict == "clean"
    scanned = bisect(reg.pair("m", sku), scan=True)
    assert scanned.tensors and not [t.node for t in scanned.tensors if t.divergent], scanned.summary


def test_bisect_cli_errors(tmp_path):
    models.conv_bn_model(tmp_path / "models/conv/model.onnx")
    models.write_project(tmp_path, {"m": models.conv_bn_spec()}, {"ort_fp32": SKUS["ort_fp32"]})
    proc = skuforge("bisect", "--model", "m", "--sku", "ort_fp32", "--apply", cwd=tmp_path)
    assert proc.returncode == 2 and "--apply" in proc.stderr
    proc = skuforge("bisect", "--model", "nope", "--sku", "ort_fp32", cwd=tmp_path)
    assert proc.returncode == 2 and "nope" in proc.stderr
    proc = skuforge("bisect", "--model", "m", "--sku", "ort_fp32", "--marks", "0", cwd=tmp_path)
    assert proc.returncode == 2


def test_unknown_node_to_keep_is_refused(tmp_path):
    """A typo in higher_precision would silently keep nothing precise: the build names it."""
    _project(tmp_path, "outlier", "ort_int8")
    doc = yaml.safe_load((tmp_path / "params.yaml").read_text())
    doc["models"]["m"]["higher_precision"] = {"ort_int8": ["outlier_scal"]}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(doc))
    proc = skuforge("build", "--model", "m", "--sku", "ort_int8", cwd=tmp_path)
    assert proc.returncode == 2 and "outlier_scal" in proc.stderr and "Traceback" not in proc.stderr


def test_higher_precision_config_checks(tmp_path):
    models.conv_bn_model(tmp_path / "models/conv/model.onnx")
    spec = models.conv_bn_spec() | {"higher_precision": {"nosuch": ["conv"], "ort_fp32": ["conv"]}}
    models.write_project(tmp_path, {"m": spec}, {"ort_fp32": SKUS["ort_fp32"]})
    proc = skuforge("config", "validate", cwd=tmp_path)
    assert proc.returncode == 2
    assert "unknown SKU 'nosuch'" in proc.stderr and "higher_precision.ort_fp32" in proc.stderr


# --- the statistics, without builds ---------------------------------------------------------------


def test_channel_axis():
    assert [channel_axis(r) for r in (1, 2, 3, 4, 5)] == [None, 1, 2, 1, 1]


def test_outlier_channel_is_divergent_though_the_tensor_error_is_small(tmp_path):
    """One channel at 500x: a per-tensor INT8 scale zeroes the others. The tensor-wide relative
    error stays small (the outlier carries the energy); the median channel's does not."""
    import numpy as np

    graph = Graph.of(__import__("onnx").load(str(models.outlier_channel_model(tmp_path / "m.onnx"))))
    rng = np.random.default_rng(0)
    ref = rng.uniform(0, 2, (4, 1, 8, 8, 8)).astype(np.float32)
    ref[:, :, 7] *= 500
    scale = ref.max() / 255
    got = np.round(ref / scale) * scale  # uint8, one scale for the tensor
    err = tensor_error(graph, "scaled", got, ref, "int8")
    assert err.relative_error < 0.01 < 0.5 < err.channel_relative_error
    assert err.divergent and err.channel_abs_max["7"] > 100 * err.channel_abs_max["median"]
    fine = np.round(ref[:, :, :7] / (ref[:, :, :7].max() / 255)) * (ref[:, :, :7].max() / 255)
    assert not tensor_error(graph, "scaled", fine, ref[:, :, :7], "int8").divergent


def test_overflow_remedy_follows_the_values_out_of_range(tmp_path):
    import numpy as np

    graph = Graph.of(__import__("onnx").load(str(models.fp16_overflow_model(tmp_path / "m.onnx"))))
    big = {"big": 2e5, "big_relu": 2e5, "small": 50.0, "h": 50.0}
    assert remedy_nodes(graph, "big", "overflow", "fp16", big.get) == ["overflow_scale", "relu", "rescale"]
    assert remedy_nodes(graph, "big", "compiler", "fp16", big.get) == ["overflow_scale"]
    got = np.full((2, 1, 32), np.inf, np.float32)
    err = tensor_error(graph, "big", got, np.ones((2, 1, 32), np.float32), "fp16")
    assert err.divergent and err.inf == 64 and err.first_nonfinite == [0, 0, 0]


@pytest.mark.slow
def test_openvino_qdq_gather_fault_found_through_fusion(tmp_path):
    """A real compiler fault, not a planted one: OpenVINO 2026.4's CPU plugin computes the QDQ
    graph's quantized Gather -> ReduceSum path of multi_io_model wrong, and right as soon as the
    Gather's output is a graph output (tests/test_corpus.py keeps the pair as a strict xfail).
    Marking a few tensors per build still finds it, and the remedy walks up from the kept
    ReduceSum to the Gather."""
    models.multi_io_model(tmp_path / "m" / "model.onnx")
    models.write_project(tmp_path, {"m": models.multi_io_spec("m")}, {"ov_int8": SKUS["ov_int8"]})
    reg = _stages(load_registry(tmp_path / "params.yaml"), "ov_int8")
    build(reg.pair("m", "ov_int8"))
    with pytest.raises(GateFailed):
        validate(reg.pair("m", "ov_int8"))
    bisection = json.loads(Layout(tmp_path).report("m", "ov_int8", "validate").read_text())["bisection"]
    suspect = bisection["suspects"][0]
    assert (suspect["node"], suspect["cause"]) == ("pool", "compiler"), bisection["summary"]
    # the first build marked the Gather's output beside the ReduceSum's and saw nothing wrong
    assert any(not p["divergent"] for p in bisection["probes"])

    remedy = fix(reg.pair("m", "ov_int8"))
    assert remedy.passed and "embed" in remedy.keep_precise, remedy.summary


# --- control flow, overflow sources, the remedy's stopping rule -----------------------------------


@pytest.fixture(scope="module")
def if_project(tmp_path_factory):
    """models.if_outer_scope_model on ort_int8, built (bisect and fix only write scratch folders)."""
    root = tmp_path_factory.mktemp("if_outer")
    models.if_outer_scope_model(root / "m" / "model.onnx")
    models.write_project(root, {"m": models.if_outer_scope_spec()}, {"ort_int8": SKUS["ort_int8"]})
    reg = _stages(load_registry(root / "params.yaml"), "ort_int8")
    build(reg.pair("m", "ort_int8"))
    return reg


def test_graph_follows_outer_scope_reads(tmp_path):
    import onnx

    graph = Graph.of(onnx.load(str(models.if_outer_scope_model(tmp_path / "if.onnx"))))
    branch = graph.producer["r2"]
    assert graph.inputs(branch) == ["bright", "c2"]
    assert float_node_inputs(graph, "r2") == ["c2"]  # the condition is bool, not a candidate
    assert {"c2", "scaled", "r1"} <= graph.ancestors(["probs"])
    assert branch in graph.consumers["c2"]
    loop = onnx.load(str(models.loop_model(tmp_path / "loop.onnx"))).graph.node[0]
    assert outer_reads(loop) == ["W"]  # the body's weight, from the outer scope


def test_if_reading_outer_scope_is_searched_through(if_project):
    """The defect is upstream of the If, reached only through the branches' outer-scope read: the
    search names it (not the If), and the remedy passes in one round."""

    found = bisect(if_project.pair("m", "ort_int8"))
    suspect = found.suspects[0]
    assert (suspect.node, suspect.cause) == ("outlier_scale", "range"), found.summary
    assert found.max_builds == 12 and found.builds <= found.max_builds
    remedy = fix(if_project.pair("m", "ort_int8"))
    assert remedy.passed and remedy.keep_precise == ["outlier_scale", "conv2"], remedy.summary
    assert len(remedy.rounds) == 1 and [s.passed for s in remedy.steps] == [False, True]
    assert remedy.steps[1].max_abs_error < remedy.steps[0].max_abs_error


def test_build_cap_is_stated_with_the_best_found_so_far(if_project):

    found = bisect(if_project.pair("m", "ort_int8"), max_builds=2)
    assert found.verdict == "inconclusive" and found.builds == 2 and found.max_builds == 2
    assert "2 of 2 builds" in found.summary and "earliest divergent tensor measured so far" in found.summary
    remedy = fix(if_project.pair("m", "ort_int8"), max_builds=2)
    assert not remedy.passed and remedy.builds == 3 and remedy.max_builds == 2
    assert "cap 2 builds per bisection" in remedy.summary and "best found" in remedy.summary
    assert remedy.lessons[0] == found.summary and remedy.scan is None
    assert "accuracy-aware phase did not run" in remedy.lessons[1] and "cap is 2" in remedy.lessons[1]


def test_a_remedy_that_does_not_move_the_error_stops(if_project, monkeypatch):
    """A suspect whose keeping leaves the error where it was (here: the real bisection's suspect
    swapped for the classifier head) is undone after one round, with what it showed, instead of
    bisecting again to the same place. The accuracy-aware phase then ranks the nodes by the error
    their tensors add (a scan), keeps them greedily until the gate passes and drops what it can
    spare, the latest first, within the cap: it finds the planted node and its reader."""

    real = remedy_module.bisect

    def misled(*args, **kwargs):
        found = real(*args, **kwargs)
        found.suspects[0].keep = ["fc"]
        return found

    monkeypatch.setattr(remedy_module, "bisect", misled)
    remedy = remedy_module.fix(if_project.pair("m", "ort_int8"))
    assert len(remedy.rounds) == 1
    # fc, then fc with what feeds it (flatten), then both ways (softmax): none moves the error, all undone
    assert [(s.phase, s.keep_precise, s.kept) for s in remedy.steps[1:4]] == [
        ("bisect", ["fc"], False),
        ("widen", ["fc", "flatten"], False),
        ("widen", ["fc", "flatten", "softmax"], False),
    ]
    (lesson,) = remedy.lessons
    assert "keeping fc precise left max abs error at" in lesson and "not the cause" in lesson, lesson
    assert f"{remedy.steps[1].max_abs_error:.4g}" in lesson and lesson in remedy.summary
    assert "keeping flatten, softmax too did not" in lesson
    # the accuracy-aware phase: outlier_scale adds the most error, kept with conv2 (which reads it)
    assert remedy.scan is not None and remedy.ranked[:2] == ["outlier_scale", "conv2"], remedy.ranked
    assert remedy.passed and remedy.keep_precise == ["outlier_scale", "conv2"], remedy.summary
    assert [(s.phase, s.keep_precise, s.passed) for s in remedy.steps[4:]] == [
        ("greedy", ["outlier_scale", "conv2"], True),
        ("drop", ["outlier_scale"], False),  # neither can go: conv2 quantizes the outlier as it reads it
        ("drop", ["conv2"], False),
    ]
    assert remedy.builds - remedy.steps[3].builds <= remedy.max_builds  # the phase's budget
    assert remedy.after.passed and remedy.latency_ratio > 0 and remedy.fp32_latency_ratio > 0


def test_control_flow_nodes_are_kept_only_where_the_tools_can(tmp_path):
    import onnx

    graph = Graph.of(onnx.load(str(models.if_outer_scope_model(tmp_path / "if.onnx"))))
    branch = graph.producer["r2"]
    assert "top-level graph only" in unkeepable(graph, branch, "int8")
    assert "c2" in unkeepable(graph, branch, "fp16")  # its branches read the FP16 outer-scope c2
    assert unkeepable(graph, graph.producer["c2"], "fp16") is None  # not control flow
    plain = Graph.of(onnx.load(str(models.if_model(tmp_path / "plain.onnx"))))
    assert unkeepable(plain, plain.producer["y"], "fp16") is None  # reads a graph input only: FP32 stays
    big = {"c2": 1e6, "r2": 1e6, "gap": 10.0}
    assert remedy_nodes(graph, "c2", "overflow", "fp16", big.get) == ["conv2", "gap"]


def test_overflow_is_blamed_on_the_node_that_makes_it(tmp_path):
    """A node whose inputs are already beyond FP16's range in the reference is not the culprit:
    walk up to the node that made the value (or the graph input holding it)."""
    import onnx

    graph = Graph.of(onnx.load(str(models.fp16_overflow_model(tmp_path / "m.onnx"))))
    big = {"h": 50.0, "big": 2e5, "big_relu": 2e5, "small": 50.0, "y": 10.0}
    assert overflow_source(graph, "small", "fp16", big.get) == "big"  # rescale reads relu's, relu reads big
    assert overflow_source(graph, "y", "fp16", big.get) == "y"  # fc2's input is in range
    assert overflow_source(graph, "small", "int8", big.get) == "small"  # no finite limit to leave
    assert overflow_source(graph, "h", "fp16", {"x": 1e5}.get) == "x"  # a graph input beyond it


# --- the build's own graph, the gate's own samples, a defect only the consumer undoes (issue 36) ------


def test_opset_conversion_takes_values_without_a_shape(tmp_path):
    """Shape inference leaves a tensor of unknown rank with an element type and no shape. Marked as
    an output (as bisection marks it), the converted graph failed the ONNX checker ("Field 'shape'
    of 'type' is required but missing"). Shapeless value infos are left out before converting, and
    an output that had no shape before is checked by the probe run instead."""
    import numpy as np
    import onnx

    path = models.unknown_rank_model(tmp_path / "m.onnx")
    model = pin_axes(onnx.load(str(path)), {"batch": 1}, path)
    shapeless = [v.name for v in model.graph.value_info if not v.type.tensor_type.HasField("shape")]
    assert shapeless[:2] == ["reshaped", "c2"], shapeless  # and what follows it
    marked = Graph.of(model).with_outputs(["reshaped"])
    x = {"x": np.random.default_rng(0).uniform(0, 1, (1, 4, 8, 8)).astype(np.float32)}
    converted, record = convert_opset(marked, 17, x, "a test")
    assert default_opset(converted) == 17 and record is not None and record.max_abs_error == 0.0
    assert [o.name for o in converted.graph.output] == ["probs", "reshaped"]


def test_bisection_searches_the_graph_the_build_converted(tmp_path):
    """The INT8 build converts the opset-11 model to 17 (QDQ needs 13): bisection searches that
    graph (reference, candidates, marked builds), the tensor of unknown rank included."""

    reg = _project(tmp_path, "unknown_rank", "ort_int8")
    report = build(reg.pair("m", "ort_int8"))
    assert report.calibration["opset_conversion"]["from_opset"] == 11
    scanned = bisect(reg.pair("m", "ort_int8"), scan=True)
    assert scanned.opset == 17 and "reshaped" in [t.tensor for t in scanned.tensors], scanned.summary
    assert not [t.tensor for t in scanned.tensors if t.divergent], scanned.summary
    assert bisect(reg.pair("m", "ort_int8")).verdict == "clean"


def test_the_anchor_is_the_gates_verdict_on_the_gates_samples(tmp_path, monkeypatch):
    """The gate fails on the 4 edge-case samples of 16 (INT8 saturates beyond the calibrated range).
    The anchor is the gate's own verdict on its 16 samples; where memory holds fewer, bisection takes
    those whose outputs fail most, not the first (which pass: "within tolerance on 1 golden sample")."""

    reg = _project(tmp_path, "edge_cases", "ort_int8")
    build(reg.pair("m", "ort_int8"))
    found = bisect_module.bisect(reg.pair("m", "ort_int8"))
    assert found.gate_samples == {"golden": 16} and found.samples == 16 and found.golden_indices == []
    assert found.gate_failures and found.verdict == "diverges", found.summary
    monkeypatch.setattr(bisect_search, "MAX_INTERMEDIATE_BYTES", 2000)  # one sample's tensors
    capped = bisect_module.bisect(reg.pair("m", "ort_int8"))
    assert capped.samples == 1 and set(capped.golden_indices) <= {12, 13, 14, 15}, capped.golden_indices
    assert capped.gate_failures == found.gate_failures and capped.verdict == "diverges", capped.summary


def test_planted_bias_outlier_is_fixed_with_the_node_that_reads_it(tmp_path, monkeypatch):
    """An Add puts +1e4 on one channel, a Relu passes it on, a 1x1 Conv drops that channel. The
    Relu's output stays out of INT8 only when the Conv reading it is float too: the remedy follows
    the outlier through the Relu to its reader and passes in one round. Keeping the producers alone
    (the remedy before) leaves the error where it was; the engine's layers show why (a QuantizeLinear
    on the Relu's output) and the remedy widens to its reader."""

    reg = _project(tmp_path, "bias_outlier", "ort_int8")
    build(reg.pair("m", "ort_int8"))
    remedy = remedy_module.fix(reg.pair("m", "ort_int8"))
    suspect = remedy.rounds[0].suspects[0]
    assert (suspect.node, suspect.cause) == ("outlier_bias", "range"), remedy.rounds[0].summary
    assert remedy.passed and remedy.keep_precise == ["outlier_bias", "relu3", "drop"], remedy.summary
    assert remedy.steps[1].max_abs_error < remedy.steps[0].max_abs_error / 10

    real = remedy_module.bisect

    def producers_only(*args, **kwargs):
        found = real(*args, **kwargs)
        found.suspects[0].keep = ["outlier_bias", "relu3"]
        return found

    monkeypatch.setattr(remedy_module, "bisect", producers_only)
    remedy = remedy_module.fix(reg.pair("m", "ort_int8"))
    assert [(s.phase, s.keep_precise, s.passed, s.still_quantized) for s in remedy.steps[1:]] == [
        ("bisect", ["outlier_bias", "relu3"], False, ["r3"]),
        ("widen", ["outlier_bias", "relu3", "drop"], True, []),
    ], remedy.summary
    assert remedy.steps[1].max_abs_error == remedy.steps[0].max_abs_error  # the INT8 figure, exactly
