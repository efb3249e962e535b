"""Declared preprocessing from raw files, end to end on a real model with real PNG files: the data
stage decodes them through the training side's steps, validate runs the drift check against the
SKU's device-side steps (a planted colour swap fails its gate naming the step), bench times the
end-to-end calls per step and the manifest records both implementations."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from pathlib import Path

import jsonschema
import models
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from pipeline.core.errors import ConfigError, GateFailed, InputError
from pipeline.core.io import read_json
from pipeline.core.paths import Layout
from pipeline.host.energy import open_meter
from pipeline.project.config import load_registry
from pipeline.results.manifest import schema, validate_document
from pipeline.stages import bench as bench_stage
from pipeline.stages.bench import bench
from pipeline.stages.build import build
from pipeline.stages.data import make_data
from pipeline.stages.manifest import write_manifest
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate

STEPS = {
    "decode": "image",
    "library": "pillow",
    "color": "rgb",
    "resize": {"size": [8, 8], "interpolation": "area"},
    "layout": "chw",
    "normalize": {"mean": [0, 0, 0], "std": [255, 255, 255]},
}


def colour_model(path: Path) -> Path:
    """x[batch,3,8,8] (RGB, 0..1) -> probs[batch,2]: class 0 where red outweighs blue, 1 where blue
    outweighs red. A swapped colour order flips every answer."""
    w = numpy_helper.from_array(np.array([[8.0, 0.0, -8.0], [-8.0, 0.0, 8.0]], np.float32), "w")
    b = numpy_helper.from_array(np.zeros(2, np.float32), "b")
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"]),
        helper.make_node("Gemm", ["flat", "w", "b"], ["logits"], transB=1),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "colour",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 2])],
        [w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def write_pngs(folder: Path, count: int, seed: int) -> None:
    """``count`` 20x20 RGB PNG files, half red-dominant (label 0), half blue-dominant (label 1), with noise."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    rows = ["file,label"]
    for i in range(count):
        label = i % 2
        pixels = rng.integers(0, 60, size=(20, 20, 3))
        pixels[..., 0 if label == 0 else 2] += 150
        buffer = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(buffer, format="PNG")
        (folder / f"{i:03d}.png").write_bytes(buffer.getvalue())
        rows.append(f"{i:03d}.png,{label}")
    (folder / "labels.csv").write_text("\n".join(rows) + "\n")


def colour_spec() -> dict:
    return {
        "dir": "models/colour",
        "source": "model.onnx",
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 3, 8, 8]}],
        "preprocess": {"x": STEPS},
        "postprocess": {"kind": "topk", "output": "probs", "k": 2},
        "datasets": {
            "golden": {"files": "images/golden"},
            "calibration": {"files": "images/golden"},
            "evaluation": {"files": "images/evaluation"},
        },
        # 60 labelled samples resolve a drop of 0.1 (the default 0.01 needs 201)
        "metric": {"kind": "top1_accuracy", "output": "probs", "gate": {"max_drop": 0.1, "max_drop_hard_tail": 0.1}},
    }


SKUS = {
    "same": models.ort_sku("fp32"),  # ships the training side's steps
    "opencv": models.ort_sku("fp32", preprocessing={"device": {"library": "opencv"}, "max_metric_drop": 0.05}),
    "swapped": models.ort_sku("fp32", preprocessing={"device": {"color": "bgr"}, "max_metric_drop": 0.05}),
    "tight": models.ort_sku("fp32", preprocessing={"max_metric_drop": 0.01}),
    # no labels needed: what the postprocess computes with the device's inputs against the training side's
    "swapped_agree": models.ort_sku("fp32", preprocessing={"device": {"color": "bgr"}, "max_agreement_drop": 0.1}),
    "metered": models.ort_sku("fp32", bench={"min_seconds": 0.3}),  # a steady phase a counter resolves
    # a sustained run of 0.2..1.5 s in windows of 0.1 s, flat when the latency moves < 50% a window
    "sustained": models.ort_sku(
        "fp32",
        bench={
            "sustained": {
                "min_seconds": 0.2,
                "max_seconds": 1.5,
                "window_seconds": 0.1,
                "trend_windows": 3,
                "max_latency_slope": 0.5,
            }
        },
    ),
}


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    colour_model(root / "models/colour/model.onnx")
    write_pngs(root / "models/colour/images/golden", 8, seed=1)
    write_pngs(root / "models/colour/images/evaluation", 60, seed=2)
    # the same model declared without a metric: an unlabelled model as far as the gates know
    plain = {k: v for k, v in colour_spec().items() if k != "metric"} | {"skus": list(PLAIN_SKUS)}
    reg = load_registry(models.write_project(root, {"colour": colour_spec(), "plain": plain}, SKUS))
    made = {}
    for model in ("colour", "plain"):
        prepare(reg, model)
        made[model] = make_data(reg, model)
        reference(reg, model)
    data = made["colour"]
    for sku in SKUS:
        build(reg.pair("colour", sku))
    for sku in PLAIN_SKUS:
        build(reg.pair("plain", sku))
    return reg, data


PLAIN_SKUS = ("same", "swapped", "swapped_agree")


def test_data_stage_decodes_files_through_the_declared_steps(proj):
    reg, data = proj
    out = Layout(reg.root)
    with np.load(out.split("colour", "evaluation")) as arrays:
        x, labels = arrays["x"], arrays["labels"]
    assert x.shape == (60, 3, 8, 8) and x.dtype == np.float32 and list(labels[:4]) == [0, 1, 0, 1]
    # the training side's steps, by hand from the same file: Pillow box resize, / 255, CHW
    first = Image.open(reg.root / "models/colour/images/evaluation/000.png").convert("RGB")
    expected = np.asarray(first.resize((8, 8), Image.Resampling.BOX), np.float64).transpose(2, 0, 1) / 255
    np.testing.assert_allclose(x[0], expected.astype(np.float32))
    assert data.splits["evaluation"].files == 60 and data.splits["evaluation"].raw_sha256
    assert data.preprocessing["x"]["versions"]["pillow"]
    assert out.split("colour", "evaluation", raw=True).is_file()  # the packed files the drift check reads


def test_the_same_steps_on_the_device_show_no_drift(proj):
    reg, _ = proj
    report = validate(reg.pair("colour", "same"))
    (drift,) = report.preprocessing
    assert drift.differing_steps == [] and drift.diff.samples_differing == 0 and drift.diff.max_abs == 0
    assert drift.metric_drop == 0 and drift.passed and drift.max_metric_drop is None


def test_another_library_is_measured_and_attributed(proj):
    reg, _ = proj
    report = validate(reg.pair("colour", "opencv"))  # area resize, RGB: a small input drift, no metric drop
    (drift,) = report.preprocessing
    assert drift.device["versions"]["opencv"] and drift.reference["versions"]["pillow"]
    assert "resize" in drift.differing_steps and drift.passed
    assert drift.metric_drop is not None and drift.metric_drop <= 0.05
    assert {s.step for s in drift.steps} == set(drift.differing_steps)


def test_a_planted_colour_swap_fails_its_gate_naming_the_step(proj):
    reg, _ = proj
    with pytest.raises(GateFailed) as caught:
        validate(reg.pair("colour", "swapped"))
    message = str(caught.value)
    assert "preprocessing of input 'x'" in message and "max_metric_drop 0.05" in message
    assert "the step: color (device: order bgr, library pillow; training side: order rgb, library pillow)" in message
    # the report is written before the gate exits, with the figures behind the verdict
    doc = read_json(Layout(reg.root).report("colour", "swapped", "validate"))
    (drift,) = doc["preprocessing"]
    assert drift["differing_steps"] == ["color"] and drift["culprit"] == "color" and not drift["passed"]
    assert drift["worse"] == 60 and drift["better"] == 0 and drift["metric_drop"] == 1.0
    assert drift["p_value"] < 1e-6 and drift["drop_interval"][0] > 0.05


def test_end_to_end_is_timed_per_step_and_recorded(proj):
    reg, _ = proj
    validate(reg.pair("colour", "opencv"))
    report = bench(reg.pair("colour", "opencv"))
    assert list(report.end_to_end_steps) == ["decode", "preprocess", "infer", "postprocess"]
    for stats in report.end_to_end_steps.values():
        assert stats.iterations == report.end_to_end.iterations and stats.p50_ms > 0
    assert "png" in (report.end_to_end_input or "") and report.preprocessing["x"]["versions"]["opencv"]
    assert report.energy is not None and (report.energy.available or report.energy.reason.startswith("unavailable"))
    manifest = write_manifest(reg.pair("colour", "opencv"))
    doc = json.loads(Layout(reg.root).manifest("colour", "opencv").read_text())
    validate_document(doc)
    jsonschema.validate(doc, schema())
    summary = manifest.preprocessing["x"]
    assert summary.reference["versions"]["pillow"] and summary.device["versions"]["opencv"]
    assert set(doc["benchmark"]["end_to_end_steps"]) == {"decode", "preprocess", "infer", "postprocess"}
    energy = doc["benchmark"]["energy"]
    assert energy["available"] or (
        energy["reason"].startswith("unavailable: ") and energy["joules_per_inference"] is None
    )


def test_files_datasets_need_a_decoded_input(tmp_path):
    spec = colour_spec()
    spec["preprocess"] = {}
    models.write_project(tmp_path, {"colour": spec}, {"same": models.ort_sku("fp32")})
    with pytest.raises(ConfigError, match="declared with preprocess.<input>.decode"):
        load_registry(tmp_path / "params.yaml")


def test_a_resize_that_does_not_give_the_input_shape_is_refused(tmp_path):
    spec = colour_spec()
    spec["preprocess"] = {"x": {**STEPS, "resize": {"size": [7, 8], "interpolation": "area"}}}
    models.write_project(tmp_path, {"colour": spec}, {"same": models.ort_sku("fp32")})
    with pytest.raises(ConfigError, match=r"resize.size \[7, 8\] is not the input's \(H, W\) \[8, 8\]"):
        load_registry(tmp_path / "params.yaml")


def test_a_sustained_run_is_recorded_with_its_stop_reason(proj):
    reg, _ = proj
    validate(reg.pair("colour", "sustained"))
    report = bench(reg.pair("colour", "sustained"))
    run = report.sustained
    assert run is not None and run.stopped in ("flat", "cap") and run.reason
    assert len(run.windows) >= 3 and all(w.calls > 0 for w in run.windows)
    assert run.p50_ms > 0 and run.p99_ms >= run.p50_ms and run.throughput_per_s > 0
    assert "latency" in run.judged_on
    if not any(w.temperature_c is not None for w in run.windows):
        assert run.throttling.temperature_rise_c is None  # no sensor: no figure, never a zero
    manifest = write_manifest(reg.pair("colour", "sustained"))
    assert manifest.benchmark.sustained is not None and manifest.benchmark.sustained.stopped == run.stopped


def test_a_device_preprocessing_the_library_cannot_run_is_refused_at_load(tmp_path):
    sku = models.ort_sku(
        "fp32",
        preprocessing={"device": {"library": "opencv", "resize": {"interpolation": "bilinear", "antialias": True}}},
    )
    models.write_project(tmp_path, {"colour": colour_spec()}, {"dev": sku})
    with pytest.raises(ConfigError) as caught:
        load_registry(tmp_path / "params.yaml")
    assert "skus.dev.preprocessing.device with models.colour.preprocess.x" in str(caught.value)
    assert "OpenCV's bilinear resize has no antialias filter" in str(caught.value)


def test_a_decoded_input_needs_golden_files(tmp_path):
    spec = colour_spec()
    del spec["datasets"]["golden"]  # the default: generated
    models.write_project(tmp_path, {"colour": spec}, {"same": models.ort_sku("fp32")})
    with pytest.raises(ConfigError, match="give golden as files"):
        load_registry(tmp_path / "params.yaml")


def test_a_split_too_small_for_the_drift_gate_fails_closed(proj):
    reg, _ = proj
    # 0.01 needs 201 labelled samples at 95%: the 60 evaluation files cannot judge it, drift or none
    with pytest.raises(InputError, match=r"60 evaluation samples cannot resolve .*max_metric_drop 0.01.*needs 201"):
        validate(reg.pair("colour", "tight"))
    (drift,) = read_json(Layout(reg.root).report("colour", "tight", "validate"))["preprocessing"]
    assert not drift["passed"] and not drift["judgeable"] and drift["diff"]["max_abs"] == 0


def test_an_unlabelled_model_is_judged_by_what_its_postprocess_computes(proj):
    """max_agreement_drop needs no labels: the top-1 labels with the device's inputs against those
    with the training side's, through the same engine. Swapped colours flip every label."""
    reg, _ = proj
    same = validate(reg.pair("plain", "same")).preprocessing[0]
    assert same.agreement is not None and same.agreement.value == 1.0 and same.agreement.threshold is None
    with pytest.raises(GateFailed) as caught:
        validate(reg.pair("plain", "swapped_agree"))
    message = str(caught.value)
    assert "with the device's steps, topk top-1 labels agree on 0/60 samples = 0.00%" in message
    assert "a change above skus.swapped_agree.preprocessing.max_agreement_drop 0.1" in message
    assert "the step: color" in message
    (drift,) = read_json(Layout(reg.root).report("plain", "swapped_agree", "validate"))["preprocessing"]
    assert drift["agreement"]["samples"] == 60 and drift["max_agreement_drop"] == 0.1 and drift["judgeable"]


def test_max_metric_drop_on_an_unlabelled_model_is_judged_as_agreement(proj):
    """A SKU gated by max_metric_drop no longer refuses a model without a metric: the drop is the
    share of the postprocess's results that change, at the same threshold (0.05 needs 71 samples)."""
    reg, _ = proj
    with pytest.raises(InputError, match=r"60 samples \(evaluation\) cannot resolve 95.00%.*it needs 71.*fails closed"):
        validate(reg.pair("plain", "swapped"))


class DrivenRapl:
    """A powercap tree whose package counter a thread advances at ``watts`` (as RAPL does, in
    microjoules of wall time), for a bench on a host that has no readable RAPL."""

    def __init__(self, root: Path, watts: float):
        self.base = root / "sys/class/powercap/intel-rapl:0"
        self.base.mkdir(parents=True)
        (self.base / "name").write_text("package-0\n")
        (self.base / "max_energy_range_uj").write_text("262143328850\n")
        self.watts, self.stop = watts, threading.Event()
        self._write(0)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _write(self, uj: int) -> None:
        staged = self.base / ".energy_uj"
        staged.write_text(f"{uj}\n")
        os.replace(staged, self.base / "energy_uj")

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self.stop.wait(0.002):
            self._write(int((time.perf_counter() - t0) * self.watts * 1e6))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def test_energy_per_inference_over_the_steady_phase_above_the_idle_floor(proj, tmp_path, monkeypatch):
    reg, _ = proj
    validate(reg.pair("colour", "metered"))
    # the bench reads this tree's package zone instead of the host's /sys (which has none here)
    monkeypatch.setattr(bench_stage, "open_meter", lambda sources: open_meter(tmp_path, sources=("rapl",)))
    with DrivenRapl(tmp_path, watts=20.0):
        report = bench(reg.pair("colour", "metered"))
    energy = report.energy
    assert energy is not None and energy.available and energy.source == "rapl" and energy.summed == ["package-0"]
    assert energy.inferences == report.engine_only.iterations  # batch 1: one inference per timed call
    assert energy.joules_per_inference == pytest.approx(energy.joules / energy.inferences)
    # a constant draw: the floor and the steady phase's mean power are the same 20 W (sampled every 2 ms)
    assert energy.idle_power_w == pytest.approx(20.0, rel=0.25) and energy.mean_power_w == pytest.approx(20.0, rel=0.5)
    assert energy.above_idle_joules_per_inference is not None
    assert abs(energy.above_idle_joules_per_inference) < energy.joules_per_inference  # nothing above the floor
    summary = write_manifest(reg.pair("colour", "metered")).benchmark.energy
    assert summary.available and summary.source == "rapl" and summary.joules_per_inference is not None


def test_a_preprocessing_gate_on_a_model_without_raw_files_says_it_did_not_run(tmp_path):
    models.conv_bn_model(tmp_path / "models/conv/model.onnx")
    sku = models.ort_sku("fp32", preprocessing={"max_metric_drop": 0.03})
    reg = load_registry(models.write_project(tmp_path, {"conv": models.conv_bn_spec()}, {"s": sku}))
    prepare(reg, "conv")
    make_data(reg, "conv")
    reference(reg, "conv")
    build(reg.pair("conv", "s"))
    report = validate(reg.pair("conv", "s"))
    assert report.preprocessing == []
    assert any("skus.s.preprocessing: conv has no input made from raw files" in w for w in report.warnings)
