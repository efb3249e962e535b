"""Verdicts in what the device app computes: the declared postprocess's results of engine and
reference compared per sample (labels, strings, boxes, masks), with n and an interval; the FP32
tensor rule that lets a handful of elements in millions through but not a real defect; and which
gate decides when a model declares a postprocess (pipeline/verify/task.py, docs/correctness.md)."""

from __future__ import annotations

from pathlib import Path

import models
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.core.errors import ConfigError, GateFailed, InputError
from pipeline.core.io import read_json
from pipeline.core.paths import Layout
from pipeline.project.config import TaskTolerance, load_registry
from pipeline.project.data import BoxTargets
from pipeline.results import gatestats
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate
from pipeline.verify.compare import output_error, output_problems
from pipeline.verify.sequence import sequence_errors
from pipeline.verify.task import edit_distance, judge, match_boxes, metric_correct, task_agreement, task_short


def _fp32_policy(tmp_path: Path):
    models.conv_bn_model(tmp_path / "models" / "conv" / "model.onnx")
    params = models.write_project(tmp_path, {"m": models.conv_bn_spec()}, {"s": models.ort_sku("fp32")})
    return load_registry(params).tolerance("m", "s")


# --- the FP32 tensor rule ------------------------------------------------------------------------


def detector_map_model(path: Path, seed: int = 0, *, swap: bool = False, nudge: float = 0.0) -> Path:
    """x[batch,3,H,W] -> prob[batch,1,H,W]: two 3x3 convs, ReLU, a sigmoid head (a DBNet-style
    probability map) whose head sums large terms that cancel near the text edges, as a trained
    detector's logits do: there the order of a reduction moves a probability by 1e-4..1e-3.
    ``swap`` exchanges two input channels of the first conv's weights (a swapped channel order);
    ``nudge`` scales one weight of the head by 1 + nudge (a wrong weight)."""
    rng = np.random.default_rng(seed)
    w1 = (rng.normal(0, 0.4, (8, 3, 3, 3)) * 10).astype(np.float32)
    w2 = (rng.normal(0, 0.3, (1, 8, 3, 3)) * 200).astype(np.float32)
    if swap:
        w1 = w1[:, [2, 1, 0]].copy()
    w2[0, 3, 1, 1] *= 1 + nudge
    init = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(rng.normal(0, 0.1, 8).astype(np.float32), "b1"),
        numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array(np.array([-1.0], np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c2"], ["prob"]),
    ]
    graph = helper.make_graph(
        nodes,
        "detector",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "h", "w"])],
        [helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["batch", 1, "h", "w"])],
        init,
    )
    return models.save_graph(graph, path)


def _ort(path: Path, x: np.ndarray, optimised: bool) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimised else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    so.intra_op_num_threads = 2
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.fixture(scope="module")
def big_map(tmp_path_factory):
    """4 images of 3x1280x1280 (6,553,600 map elements), the reference (ORT, no optimisation)."""
    folder = tmp_path_factory.mktemp("map")
    x = np.random.default_rng(1).uniform(-1, 1, (4, 3, 1280, 1280)).astype(np.float32)
    good = detector_map_model(folder / "model.onnx")
    return folder, x, _ort(good, x, optimised=False)


def test_fp32_onnxruntime_optimised_passes_against_unoptimised_on_a_6_5_million_element_map(big_map, tmp_path):
    folder, x, ref = big_map
    engine = _ort(folder / "model.onnx", x, optimised=True)
    policy = _fp32_policy(tmp_path)
    err = output_error("prob", engine, ref, policy, "regression")
    assert err.elements == 6_553_600
    assert err.passed and not output_problems(err), output_problems(err)
    # a few elements in a million may be beyond atol/rtol; none 10x beyond
    assert err.max_outlier_factor == 10.0 and err.outlier_count == 0
    # the rule before (no element beyond) failed the engine that is ONNX Runtime wherever the
    # kernels of this host reorder a reduction enough (5 of 6,553,600 on an AMD EPYC)
    before = policy.for_kind("regression").model_copy(update={"max_mismatch": 0.0, "max_outlier_factor": None})
    assert bool(output_problems(output_error("prob", engine, ref, before))) == (err.mismatch_count > 0)


@pytest.mark.parametrize("defect", ["swap", "nudge"])
def test_fp32_a_real_defect_on_the_same_map_fails(big_map, tmp_path, defect):
    folder, x, ref = big_map
    bad = detector_map_model(tmp_path / f"{defect}.onnx", swap=defect == "swap", nudge=0.1 if defect == "nudge" else 0)
    err = output_error("prob", _ort(bad, x, optimised=True), ref, _fp32_policy(tmp_path), "regression")
    assert not err.passed
    assert any("elements" in line and "beyond" in line for line in output_problems(err))


def test_fp32_one_element_far_off_in_millions_is_an_outlier(tmp_path):
    """The fraction lets a few elements in a million through, the outlier bound none that far off."""
    ref = np.random.default_rng(0).uniform(0, 1, 2_000_000).astype(np.float32)
    policy = _fp32_policy(tmp_path)
    near = ref.copy()
    near[7] += 3e-3  # beyond atol+rtol*|r| (<= 1.1e-3), within 10x
    err = output_error("y", near, ref, policy, "regression")
    assert err.mismatch_count == 1 and err.outlier_count == 0 and err.passed
    far = ref.copy()
    far[7] += 0.5
    err = output_error("y", far, ref, policy, "regression")
    assert err.outlier_count == 1 and not err.passed
    assert "a few elements that far off are a defect" in output_problems(err)[0]
    assert err.min_passing_atol is not None and err.min_passing_atol > 0.04  # 0.5 / 10 - rtol * |r|
    again = output_error("y", far, ref, policy.for_kind("regression").model_copy(update={"atol": err.min_passing_atol}))
    assert again.passed


def test_a_small_fp32_output_stays_strict(tmp_path):
    """1e-5 of 640 elements: one element beyond is already evidence."""
    ref = np.linspace(0, 1, 640, dtype=np.float32)
    engine = ref.copy()
    engine[3] += 2e-3
    assert not output_error("y", engine, ref, _fp32_policy(tmp_path), "regression").passed


# --- the statistics --------------------------------------------------------------------------------

TOL = TaskTolerance(min_agreement=0.97, max_cer=0.03, min_box_f1=0.9, min_mean_iou=0.9)


def test_edit_distance():
    assert edit_distance([1, 2, 3], [1, 2, 3]) == 0
    assert edit_distance([1, 2, 3], [1, 3]) == 1
    assert edit_distance([], [4, 5]) == 2
    assert edit_distance([1, 2, 3, 4], [2, 1, 3, 5]) == 3


def test_boxes_match_one_to_one_at_the_iou():
    r = np.array([[0, 0, 10, 10], [20, 20, 30, 30]], float)
    e = np.array([[1, 1, 11, 11], [0, 0, 10, 10], [50, 50, 60, 60]], float)
    assert match_boxes(e, [0, 0, 0], r, [0, 0], 0.5) == 1  # two engine boxes on one reference box: one match
    assert match_boxes(e, [1, 1, 1], r, [0, 0], 0.5) == 0  # another class never matches


def _spec(postprocess: dict | str):
    return models.conv_bn_spec() | {"postprocess": postprocess}


def _registry_spec(tmp_path: Path, postprocess):
    models.conv_bn_model(tmp_path / "models" / "conv" / "model.onnx")
    params = models.write_project(tmp_path, {"m": _spec(postprocess)}, {"s": models.ort_sku("int8")})
    return load_registry(params).model("m")


def test_ctc_text_agreement_is_a_character_error_rate_with_an_interval(tmp_path):
    spec = _registry_spec(tmp_path, {"kind": "ctc_greedy", "output": "y", "blank": 0})
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 6, (300, 12))  # 300 strings of up to 12 characters
    ref = np.eye(6, dtype=np.float32)[frames]
    engine = ref.copy()
    engine[:30, 5] = np.eye(6, dtype=np.float32)[(frames[:30, 5] % 5) + 1]  # one frame changed in 30 strings
    results = {t.statistic: t for t in task_agreement(spec, TOL, {"golden": {"y": engine}}, {"golden": {"y": ref}})}
    cer, exact = results["cer"], results["exact_match"]
    assert cer.threshold == 0.03 and exact.threshold is None  # the CER gates, exact match is reported
    assert exact.samples == 300 and 265 <= exact.agree <= 290 and exact.method == "clopper-pearson"
    assert 0 < cer.value < 0.03 and cer.interval[0] <= cer.value <= cer.interval[1]
    assert cer.units >= cer.needed_units == 117 and cer.judgeable and cer.passed and cer.failure is None
    garbled = np.roll(ref, 1, axis=-1)
    bad = task_agreement(spec, TOL, {"golden": {"y": garbled}}, {"golden": {"y": ref}})
    cer = next(t for t in bad if t.statistic == "cer")
    assert not cer.passed and cer.interval[0] > 0.03
    assert cer.failure.startswith("ctc_greedy character error rate against the reference's strings ")
    assert "above 3.00% at 95% confidence" in cer.failure


def test_a_statistic_that_cannot_resolve_its_threshold_joins_the_next_split_then_says_so(tmp_path):
    spec = _registry_spec(tmp_path, "argmax")
    rng = np.random.default_rng(0)
    splits = {s: {"y": rng.normal(size=(n, 5)).astype(np.float32)} for s, n in (("golden", 40), ("evaluation", 100))}
    got = task_agreement(spec, TOL, dict(splits), dict(splits))
    top1 = got[0]
    assert top1.splits == ["golden", "evaluation"] and top1.samples == 140 and top1.judgeable and top1.passed
    small = task_agreement(spec, TOL, {"golden": splits["golden"]}, {"golden": splits["golden"]})[0]
    assert not small.judgeable and small.passed and small.failure is None
    assert "40 samples (golden) cannot resolve 97.00% at 95% confidence: it needs 117" in task_short(small)


def test_counts_and_ratios_are_recomputed_from_the_recorded_evidence():
    """The promotion gate calls judge() on what the manifest holds: the same rows give the same verdict."""
    rows = [[2.0, 4.0]] * 50 + [[0.0, 4.0]] * 10
    first = judge("box_f1", "nms", ["golden"], rows, 0.9, "min", 0.95)
    again = judge("box_f1", "nms", ["golden"], first.per_sample, 0.9, "min", 0.95)
    assert first == again and not first.passed and first.value == pytest.approx(100 / 240)
    counts = judge("top1_agreement", "argmax", ["golden"], [[1.0]] * 115 + [[0.0]] * 5, 0.97, "min", 0.95)
    assert counts.agree == 115 and counts.per_sample == [] and counts.passed


def test_the_bootstrap_bounds_are_seeded():
    rng = np.random.default_rng(3)
    num, den = rng.integers(0, 3, 400), rng.integers(5, 12, 400)
    assert gatestats.ratio_bounds(num, den, 0.95) == gatestats.ratio_bounds(num, den, 0.95)
    low, high = gatestats.ratio_bounds(num, den, 0.95)
    assert low < num.sum() / den.sum() < high


# --- which gate decides, end to end on a real INT8 engine --------------------------------------------


def classifier_model(path: Path, seed: int = 0) -> Path:
    """x[batch,16] -> probs[batch,5]: Gemm, ReLU, Gemm, Softmax, with confident classes."""
    rng = np.random.default_rng(seed)
    init = [
        numpy_helper.from_array(rng.normal(0, 0.6, (16, 32)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.6, (32, 5)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 5])],
        init,
    )
    return models.save_graph(graph, path)


def _classifier_project(root: Path, tolerance: dict) -> tuple:
    classifier_model(root / "m" / "model.onnx")
    spec = {
        "dir": "m",
        "source": "model.onnx",
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 16], "range": [-1.0, 1.0]}],
        "postprocess": "argmax",
        "output_kinds": {"probs": "probabilities"},
        "datasets": {"golden": {"generate": {"count": 200, "seed": 1}}},
    }
    # atol 0 on an INT8 engine: every element is beyond, so the tensor gates fail it
    params = models.write_project(root, {"m": spec}, {"s": models.ort_sku("int8", tolerance=tolerance)})
    registry = load_registry(params)
    prepare(registry, "m")
    make_data(registry, "m")
    reference(registry, "m")
    calibrate(registry, "m")
    build(registry.pair("m", "s"))
    return registry, Layout(root)


STRICT = {"atol": 0.0, "rtol": 0.0, "max_mismatch": 0.0}


def test_a_declared_postprocess_decides_and_the_tensor_gates_are_diagnostics(tmp_path):
    registry, _ = _classifier_project(tmp_path, STRICT)
    report = validate(registry.pair("m", "s"))
    assert report.passed
    top1 = next(t for t in report.task if t.statistic == "top1_agreement")
    assert top1.samples == 200 and top1.judgeable and top1.passed and top1.postprocess == "argmax"
    assert all(not o.gating and not o.passed for o in report.outputs)  # the tensor verdict: failed, not deciding
    assert report.diagnostics and "(diagnostic: the task agreement decides)" in report.diagnostics[0]


def test_enforce_makes_the_tensor_gates_decide_again(tmp_path):
    registry, _ = _classifier_project(tmp_path, STRICT | {"enforce": True})
    with pytest.raises(GateFailed, match="beyond atol=0.0 rtol=0.0"):
        validate(registry.pair("m", "s"))


def test_a_task_that_cannot_judge_leaves_the_verdict_to_the_tensor_gates(tmp_path):
    registry, out = _classifier_project(tmp_path, STRICT | {"min_agreement": 0.999})  # needs 4,001 samples
    with pytest.raises(GateFailed):
        validate(registry.pair("m", "s"))
    doc = read_json(out.report("m", "s", "validate"))
    assert any("cannot resolve 99.90%" in w and "the tensor gates decide" in w for w in doc["warnings"])
    assert all(o["gating"] for o in doc["outputs"])


# --- labelled task metrics ---------------------------------------------------------------------------


def _labelled_spec(tmp_path: Path, postprocess: dict, metric: str):
    models.conv_bn_model(tmp_path / "models" / "conv" / "model.onnx")
    spec = models.conv_bn_spec() | {
        "postprocess": postprocess,
        "metric": {"kind": metric, "output": "y"},
        "datasets": {"golden": {"generate": {"count": 4}}, "evaluation": {"generate": {"count": 4}}},
    }
    return load_registry(models.write_project(tmp_path, {"m": spec}, {"s": models.ort_sku("int8")})).model("m")


def test_word_accuracy_compares_the_decoded_string_with_the_text_label(tmp_path):
    spec = _labelled_spec(tmp_path, {"kind": "ctc_greedy", "output": "y", "alphabet": "abc"}, "word_accuracy")
    frames = np.array([[1, 1, 0, 2, 3], [3, 0, 3, 0, 0], [2, 2, 2, 0, 1]])  # "abc", "cc", "ba"
    right, figures = metric_correct(spec, {"y": np.eye(4, dtype=np.float32)[frames]}, ["abc", "cc", "bb"])
    assert right.tolist() == [True, True, False]
    assert figures == {"cer": pytest.approx(1 / 7)}  # one substitution over 3 + 2 + 2 label characters


def test_top1_accuracy_refuses_a_label_past_the_outputs_classes(tmp_path):
    """Where the data stage could not tell the class count (a dynamic class axis), the run does."""
    spec = _labelled_spec(tmp_path, "argmax", "top1_accuracy")
    scores = np.eye(4, dtype=np.float32)[[0, 1, 2]]
    assert metric_correct(spec, {"y": scores}, np.array([0, 1, 3]))[0].tolist() == [True, True, False]
    with pytest.raises(InputError, match=r"sample 1 is 57, but the metric's output 'y' has 4 classes \(0..3\)"):
        metric_correct(spec, {"y": scores}, np.array([0, 57, 3]))


def test_detection_accuracy_needs_every_box_of_an_image_matched(tmp_path):
    spec = _labelled_spec(
        tmp_path, {"kind": "nms", "boxes": "y", "scores": "s", "iou_threshold": 0.5}, "detection_accuracy"
    )
    boxes = np.array([[[0, 0, 10, 10], [20, 20, 30, 30]], [[0, 0, 10, 10], [50, 50, 60, 60]]], np.float32)
    scores = np.array([[[0.9], [0.8]], [[0.9], [0.1]]], np.float32)  # the second image keeps one box
    labels = BoxTargets(
        boxes=[
            np.array([[1, 1, 10, 10], [20, 20, 30, 30]], np.float32),
            np.array([[0, 0, 10, 10], [50, 50, 60, 60]], np.float32),
        ],
        classes=[np.zeros(2, np.int64), np.zeros(2, np.int64)],
    )
    right, figures = metric_correct(spec, {"y": boxes, "s": scores}, labels)
    assert right.tolist() == [True, False] and figures == {"box_f1": pytest.approx(2 * 3 / 7)}


@pytest.mark.parametrize(
    "postprocess, metric, message",
    [
        ({"kind": "ctc_greedy", "output": "y"}, "word_accuracy", "needs postprocess ctc_greedy with an alphabet"),
        ("argmax", "detection_accuracy", "needs postprocess nms or db_boxes"),
        ({"kind": "db_boxes", "output": "z"}, "detection_accuracy", "metric.output 'y' is not an output"),
    ],
)
def test_a_labelled_metric_needs_the_postprocess_that_computes_it(tmp_path, postprocess, metric, message):
    with pytest.raises(ConfigError, match=message):
        _labelled_spec(tmp_path, postprocess, metric)


# --- stateful models: the state fed back over a sequence -----------------------------------------------


def integrator_model(path: Path) -> Path:
    """x[batch,4], h[batch,8] -> prob[batch,1], h_out[batch,8]: h_out = h + 0.1 tanh(x W) (a state
    that integrates its inputs, as a voice-activity model's smoothed energy does), prob = sigmoid(h_out v)."""
    rng = np.random.default_rng(0)
    init = [
        numpy_helper.from_array(rng.normal(0, 1, (4, 8)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([0.1], np.float32), "k"),
        numpy_helper.from_array(rng.normal(0, 1, (8, 1)).astype(np.float32), "v"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"]),
        helper.make_node("Tanh", ["xw"], ["t"]),
        helper.make_node("Mul", ["t", "k"], ["dt"]),
        helper.make_node("Add", ["h", "dt"], ["h_out"]),
        helper.make_node("MatMul", ["h_out", "v"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["prob"]),
    ]
    graph = helper.make_graph(
        nodes,
        "integrator",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", 8]),
        ],
        [
            helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("h_out", TensorProto.FLOAT, ["batch", 8]),
        ],
        init,
    )
    return models.save_graph(graph, path)


INTEGRATOR = {
    "dir": "m",
    "source": "model.onnx",
    "inputs": [
        {"name": "x", "dtype": "float32", "shape": ["batch", 4], "range": [-1.0, 1.0]},
        {"name": "h", "dtype": "float32", "shape": ["batch", 8], "range": [-0.1, 0.1]},
    ],
}


def _sequence_setup(tmp_path: Path, feed: dict | None = None):
    path = integrator_model(tmp_path / "m" / "model.onnx")
    spec = INTEGRATOR | {
        "sequence": {"steps": 100, "feed": feed or {"h_out": "h"}},
    }
    registry = load_registry(models.write_project(tmp_path, {"m": spec}, {"s": models.ort_sku("fp32")}))
    rng = np.random.default_rng(2)
    golden = {"x": rng.uniform(-1, 1, (300, 4)).astype(np.float32), "h": np.zeros((300, 8), np.float32)}
    return registry, path, golden


def test_a_state_error_within_tolerance_per_call_fails_after_a_sequence(tmp_path):
    import onnxruntime as ort

    registry, path, golden = _sequence_setup(tmp_path)
    spec, policy = registry.model("m"), registry.tolerance("m", "s")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def exact(feeds):
        return dict(zip(["prob", "h_out"], session.run(None, feeds), strict=True))

    def drifting(feeds):  # 2e-5 off per call: within atol 1e-4 on one call, 2e-3 after 100
        got = exact(feeds)
        return got | {"h_out": got["h_out"] + np.float32(2e-5)}

    plan = ({"x": 0, "h": 0}, {"prob": 0, "h_out": 0}, 1)
    single = output_error("h_out", drifting(golden)["h_out"], exact(golden)["h_out"], policy, "state")
    assert single.passed  # one call cannot see it
    ok = sequence_errors(spec, spec.sequence, golden, exact, path, *plan, policy)
    assert [e.output for e in ok] == ["h_out@100", "prob@100"] and all(e.passed for e in ok)
    assert all(e.sequence_steps == 100 and e.elements for e in ok) and ok[0].kind == "state"
    bad = {e.output: e for e in sequence_errors(spec, spec.sequence, golden, drifting, path, *plan, policy)}
    assert not bad["h_out@100"].passed and bad["h_out@100"].max_abs_error == pytest.approx(2e-3, rel=0.05)
    assert bad["h_out@100"].elements == 3 * 8  # 300 golden samples: 3 sequences of 100 calls


def test_a_feed_naming_no_input_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"sequence.feed: \['state'\] are not inputs of the model"):
        _sequence_setup(tmp_path, {"h_out": "state"})


def test_validate_judges_a_stateful_model_after_its_sequence(tmp_path):
    integrator_model(tmp_path / "m" / "model.onnx")
    spec = INTEGRATOR | {
        "output_kinds": {"prob": "regression"},
        "sequence": {"steps": 50, "feed": {"h_out": "h"}},
        "datasets": {"golden": {"generate": {"count": 100, "seed": 3}}},
    }
    registry = load_registry(models.write_project(tmp_path, {"m": spec}, {"s": models.ort_sku("fp32")}))
    for stage in (prepare, make_data, reference):
        stage(registry, "m")
    build(registry.pair("m", "s"))
    report = validate(registry.pair("m", "s"))
    after = {o.output: o for o in report.outputs if o.sequence_steps}
    assert report.passed and set(after) == {"h_out@50", "prob@50"} and after["h_out@50"].kind == "state"
