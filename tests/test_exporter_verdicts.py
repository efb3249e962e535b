"""The claims of "verdicts in what the device app computes" on exporter-style models
(tests/exporter_models.py), through the whole pipeline on real runtimes:

- ONNX Runtime FP32 passes against the reference on a detector whose probability map has millions
  of elements (the FP32 tensor rule lets reordered reductions through; the boxes decide);
- the INT8 detector gets one verdict on ONNX Runtime, OpenVINO and LiteRT where their boxes agree,
  stated as box F1 with an interval;
- the CTC recognizer's INT8 verdict is stated as a character error rate and exact match with
  intervals, and the CER gate decides it: a pass whatever the tensor figures, a failure when a bad
  calibration set makes the engine misread.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import exporter_models
import models
import numpy as np
import pytest

from pipeline.backends import litert_converter
from pipeline.core.errors import GateFailed, UnsupportedOp
from pipeline.core.paths import Layout
from pipeline.project.artifacts import read_report
from pipeline.project.config import Registry, load_registry
from pipeline.project.postprocessing import postprocess
from pipeline.results.reports import TaskAgreement, ValidationReport
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate
from pipeline.verify.task import match_boxes, task_text

HAS_OPENVINO = importlib.util.find_spec("openvino") is not None
HAS_LITERT = importlib.util.find_spec("ai_edge_litert") is not None and not litert_converter.problems()
HAS_IREE = importlib.util.find_spec("iree") is not None and importlib.util.find_spec("iree.compiler") is not None
NO_BISECT = {"bisect": {"on_failure": False}}
INT8_SKUS = {
    "ort_int8": models.CPU_SKUS["ort_int8"] | NO_BISECT,
    "ov_int8": models.CPU_SKUS["ov_int8"] | NO_BISECT,
    "litert_int8": exporter_models.LITERT_INT8 | NO_BISECT,
}


def _project(root: Path, specs: dict[str, dict], skus: dict[str, dict], int8: bool = True) -> Registry:
    """params.yaml for ``specs`` and ``skus`` under ``root``, each model prepared with its data and
    reference (and its calibration table for ``int8``)."""
    registry = load_registry(models.write_project(root, specs, skus))
    for name in specs:
        for stage in (prepare, make_data, reference, *([calibrate] if int8 else [])):
            stage(registry, name)
    return registry


def _verdict(registry: Registry, model: str, sku: str) -> ValidationReport:
    """Build and validate; the report as written, whether the gate passed or failed."""
    build(registry.pair(model, sku))
    try:
        return validate(registry.pair(model, sku))
    except GateFailed:
        return read_report(Layout(registry.root).report(model, sku, "validate"), ValidationReport, "validate")


def _gated(report: ValidationReport) -> TaskAgreement:
    (gated,) = [t for t in report.task if t.threshold is not None]
    return gated


def _stated_with_interval(t: TaskAgreement) -> None:
    assert t.value is not None and t.interval is not None
    assert t.interval[0] <= t.value <= t.interval[1]
    assert t.samples > 0 and t.units > 0


# --- FP32 on millions of map elements --------------------------------------------------------------


def test_fp32_onnxruntime_passes_on_a_detector_with_a_multi_million_element_map(tmp_path):
    """6 images of 640x640 (2,457,600 map elements), 32 rectangles each: box F1 decides at FP32
    (0.98 needs 176 boxes) and the tensor figures pass too, as diagnostics."""
    exporter_models.dbnet(tmp_path / "m" / "model.onnx", size=640, golden=6, rects=(32, 32), calibration=1)
    spec = exporter_models.dbnet_spec("m", size=640)
    registry = _project(tmp_path, {"dbnet": spec}, {"ort_fp32": models.CPU_SKUS["ort_fp32"]}, int8=False)
    report = _verdict(registry, "dbnet", "ort_fp32")
    assert report.passed, report.failures
    (prob,) = report.outputs
    assert prob.elements == 6 * 640 * 640
    assert not prob.gating and prob.passed and prob.outlier_count == 0  # the tensor rule agrees
    assert report.diagnostics == []
    f1 = _gated(report)
    assert f1.statistic == "box_f1" and f1.postprocess == "db_boxes" and f1.threshold == 0.98
    assert f1.judgeable and f1.units >= f1.needed_units == 176 and f1.passed
    _stated_with_interval(f1)
    assert f1.value == 1.0  # an FP32 engine finds the reference's boxes


# --- INT8 boxes on three backends ----------------------------------------------------------------


@pytest.fixture(scope="module")
def dbnet_int8(tmp_path_factory):
    """The detector (48 golden images, 4-5 rectangles each) validated on ONNX Runtime, OpenVINO and
    LiteRT INT8: {sku: (report, the engine's boxes per golden image)}."""
    root = tmp_path_factory.mktemp("dbnet_int8")
    exporter_models.dbnet(root / "m" / "model.onnx")
    registry = _project(root, {"dbnet": exporter_models.dbnet_spec("m")}, INT8_SKUS)
    spec, out = registry.model("dbnet"), Layout(registry.root)
    found = {}
    for sku in INT8_SKUS:
        report = _verdict(registry, "dbnet", sku)
        outputs = dict(np.load(out.engine_outputs("dbnet", sku)))
        found[sku] = (report, postprocess(spec, outputs)["boxes"])
    return found


def _box_f1(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    matched = sum(match_boxes(x, np.zeros(len(x)), y, np.zeros(len(y)), 0.5) for x, y in zip(a, b, strict=True))
    return 2 * matched / sum(len(x) + len(y) for x, y in zip(a, b, strict=True))


@pytest.mark.skipif(not (HAS_OPENVINO and HAS_LITERT), reason="needs OpenVINO and the LiteRT converter environment")
def test_int8_detector_gets_one_verdict_on_three_backends_whose_boxes_agree(dbnet_int8):
    verdicts = {}
    for sku, (report, _) in dbnet_int8.items():
        f1 = _gated(report)
        assert f1.statistic == "box_f1" and f1.threshold == 0.9 and f1.method == "bootstrap"
        assert f1.judgeable and f1.units >= f1.needed_units == 36
        _stated_with_interval(f1)
        assert task_text(f1).startswith("db_boxes box F1 against the reference's boxes ")
        assert all(not o.gating for o in report.outputs)  # the boxes decide
        verdicts[sku] = (report.passed, f1.passed)
    # the engines' boxes agree with each other (box F1 at IoU 0.5, engine against engine)...
    boxes = [found for _, found in dbnet_int8.values()]
    assert all(_box_f1(a, b) >= 0.95 for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    # ...and so do their verdicts: passed, by box F1
    assert set(verdicts.values()) == {(True, True)}, verdicts


# --- the recognizer's INT8 verdict in characters ---------------------------------------------------


@pytest.fixture(scope="module")
def crnn_int8(tmp_path_factory):
    """The recognizer (160 golden stripes) on ONNX Runtime INT8: calibrated on its own images, with
    the SKU's tolerances and with tensor tolerances no INT8 engine meets (atol 0); and calibrated on
    blank pages (noise, no glyph: the glyph channels' ranges collapse)."""
    root = tmp_path_factory.mktemp("crnn_int8")
    exporter_models.crnn(root / "m" / "model.onnx")
    np.savez(root / "m" / "blank.npz", image=np.random.default_rng(5).uniform(0, 0.1, (64, 1, 32, 96)).astype("f4"))
    spec = exporter_models.crnn_spec("m")
    blank = spec | {"datasets": spec["datasets"] | {"calibration": {"path": "blank.npz"}}}
    skus = {
        "ort_int8": models.CPU_SKUS["ort_int8"] | NO_BISECT,
        "ort_int8_strict": models.CPU_SKUS["ort_int8"]
        | NO_BISECT
        | {"tolerance": {"atol": 0.0, "rtol": 0.0, "max_mismatch": 0.0}},
    }
    registry = _project(root, {"crnn": spec, "crnn_blank": blank}, skus)
    return {
        "ort_int8": _verdict(registry, "crnn", "ort_int8"),
        "ort_int8_strict": _verdict(registry, "crnn", "ort_int8_strict"),
        "blank_calibration": _verdict(registry, "crnn_blank", "ort_int8"),
    }


def _text_stats(report: ValidationReport) -> tuple[TaskAgreement, TaskAgreement]:
    stats = {t.statistic: t for t in report.task}
    assert set(stats) == {"cer", "exact_match"}, stats
    cer, exact = stats["cer"], stats["exact_match"]
    _stated_with_interval(cer)
    _stated_with_interval(exact)
    assert cer.threshold == 0.03 and cer.direction == "max" and cer.method == "bootstrap"
    assert exact.threshold is None and exact.method == "clopper-pearson" and exact.samples == 160  # reported
    assert cer.judgeable and cer.units >= cer.needed_units == 117  # reference characters
    assert task_text(cer).startswith("ctc_greedy character error rate against the reference's strings ")
    return cer, exact


def test_int8_recognizer_is_judged_by_its_character_error_rate(crnn_int8):
    report = crnn_int8["ort_int8"]
    cer, exact = _text_stats(report)
    assert report.passed == cer.passed and cer.passed and cer.failure is None
    assert cer.value < 0.03 and exact.agree >= 150  # a few close calls change: the strings stay readable
    assert all(not o.gating for o in report.outputs)


def test_the_cer_gate_decides_not_the_tensor_figures(crnn_int8):
    """Tensor tolerances no INT8 engine meets fail every output, as diagnostics: the same strings pass."""
    report, same = crnn_int8["ort_int8_strict"], crnn_int8["ort_int8"]
    cer, _ = _text_stats(report)
    assert report.passed and cer.passed
    assert cer.value == _text_stats(same)[0].value
    assert all(not o.gating and not o.passed for o in report.outputs)
    assert report.diagnostics and all(
        line.endswith("(diagnostic: the task agreement decides)") for line in report.diagnostics
    )


def test_a_misread_fails_on_the_cer_gate(crnn_int8):
    """Calibrated on blank pages, the INT8 engine reads other strings: the CER's lower bound is above 3%."""
    report = crnn_int8["blank_calibration"]
    cer, exact = _text_stats(report)
    assert not report.passed and not cer.passed
    assert cer.interval[0] > 0.03 and exact.value < 0.5
    assert cer.failure in report.failures
    assert "above 3.00% at 95% confidence" in cer.failure


# --- a known pipeline defect --------------------------------------------------------------------


@pytest.mark.skipif(not HAS_IREE, reason="iree-base-compiler is not installed")
def test_iree_names_the_node_inside_an_if_branch_it_cannot_compile(tmp_path):
    """IREE 3.13 fails to compile the If whose branch takes its Unsqueeze axes from an initializer of
    the outer graph (docs/backends/iree.md, "Refusals": UnsupportedOp naming op, node and iree)."""
    exporter_models.stateful_if(tmp_path / "m" / "model.onnx", outer_scope_constants=True)
    spec = exporter_models.stateful_if_spec("m")
    registry = _project(tmp_path, {"vad": spec}, {"iree_fp32": models.CPU_SKUS["iree_fp32"]}, int8=False)
    with pytest.raises(UnsupportedOp) as refused:
        build(registry.pair("vad", "iree_fp32"))
    assert (refused.value.op_type, refused.value.node) == ("Unsqueeze", "speech/Unsqueeze")
