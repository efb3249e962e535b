"""ONNX Runtime backend: execution providers, placement recorded per node, the silent-fallback gate."""

from __future__ import annotations

from pathlib import Path

import models
import onnxruntime as ort
import pytest

from pipeline.core.errors import ConfigError, EnvironmentProblem, GateFailed, UnsupportedOp
from pipeline.core.io import read_json
from pipeline.core.paths import Layout
from pipeline.project.config import load_registry
from pipeline.stages.build import build
from pipeline.stages.data import make_data
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate

CPU = "CPUExecutionProvider"
AZURE = "AzureExecutionProvider"  # in the CPU wheel; runs no node of a local model


def project(root: Path, skus: dict):
    models.conv_bn_model(root / "models/conv/model.onnx")
    reg = load_registry(models.write_project(root, {"conv": models.conv_bn_spec()}, skus))
    for stage in (prepare, make_data, reference):
        stage(reg, "conv")
    return reg


@pytest.mark.skipif(
    AZURE not in ort.get_available_providers(), reason="this onnxruntime build has no AzureExecutionProvider"
)
def test_silent_fallback_to_cpu_is_caught_with_the_nodes_named(tmp_path):
    skus = {
        "planted": models.ort_sku("fp32", options={"providers": [AZURE, CPU]}, placement={"allowed": [AZURE]}),
        "tolerated": models.ort_sku(
            "fp32", options={"providers": [AZURE, CPU]}, placement={"allowed": [AZURE], "max_fallback_nodes": 100}
        ),
    }
    reg = project(tmp_path, skus)
    report = build(reg.pair("conv", "planted"))
    assert report.requested_devices == [AZURE, CPU]
    assert report.placement == {CPU: len(report.layers)}  # ONNX Runtime put every node on the CPU, silently
    with pytest.raises(GateFailed) as info:
        validate(reg.pair("conv", "planted"))
    assert f"nodes ran outside ['{AZURE}']" in info.value.message
    for layer in report.layers:
        assert f"{layer.name} ({layer.op_type}) on {CPU}" in info.value.message
    saved = read_json(Layout(reg.root).report("conv", "planted", "validate"))
    assert saved["placement"]["passed"] is False and len(saved["placement"]["offending"]) == len(report.layers)
    build(reg.pair("conv", "tolerated"))
    assert validate(reg.pair("conv", "tolerated")).passed


def test_missing_provider_is_an_environment_problem_unless_optional(tmp_path):
    skus = {
        "needs_cuda": models.ort_sku("fp32", options={"providers": ["CUDAExecutionProvider", CPU]}),
        "prefers_cuda": models.ort_sku(
            "fp32",
            options={"providers": ["CUDAExecutionProvider", CPU], "require_all_providers": False},
            placement={"allowed": ["CUDAExecutionProvider"]},
        ),
    }
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime build has CUDA")
    reg = project(tmp_path, skus)
    with pytest.raises(EnvironmentProblem, match="CUDAExecutionProvider is not in this onnxruntime build"):
        build(reg.pair("conv", "needs_cuda"))
    report = build(reg.pair("conv", "prefers_cuda"))  # skipped and recorded; the placement gate judges
    assert any("CUDAExecutionProvider" in w and "skipped" in w for w in report.warnings)
    with pytest.raises(GateFailed, match="nodes ran outside"):
        validate(reg.pair("conv", "prefers_cuda"))


def test_fp16_on_the_cpu_provider_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="fp16 is not supported by onnxruntime on CPUExecutionProvider"):
        project(tmp_path, {"half": models.ort_sku("fp16")})


def test_an_op_the_reference_runtime_lacks_stops_prepare_naming_the_op_and_the_node(tmp_path):
    """ONNX Runtime is also the reference runtime: prepare refuses the model before any backend sees it.
    (The ONNX Runtime backend's own refusal of it: tests/backends/test_contract.py.)"""
    models.int16_relu_model(tmp_path / "models/int16/model.onnx")
    reg = load_registry(
        models.write_project(tmp_path, {"int16": models.int16_relu_spec()}, {"cpu": models.ort_sku("fp32")})
    )
    with pytest.raises(UnsupportedOp) as info:
        prepare(reg, "int16")
    assert info.value.exit_code == 3
    assert "onnxruntime cannot compile op 'Relu' (node 'relu_int16')" in info.value.message


def test_the_runner_calls_the_binding_and_an_ep_failure_goes_through_the_session_fallback(tmp_path):
    """The engine's runner skips InferenceSession.run's second check of the feed (Runner.infer did it)
    but not its EP fallback: an EPFail from the binding's run goes through InferenceSession.run."""
    import numpy as np
    from onnxruntime.capi.onnxruntime_pybind11_state import EPFail

    from pipeline.backends import get_backend
    from pipeline.backends.onnxruntime import OnnxRuntimeRunner

    reg = project(tmp_path, {"ort": models.ort_sku("fp32")})
    build(reg.pair("conv", "ort"))
    runner = get_backend("onnxruntime").load(Layout(reg.root).engine_dir("conv", "ort"), reg.sku("ort"))
    assert isinstance(runner, OnnxRuntimeRunner) and runner._run is not None
    sig = runner.inputs[0]
    feeds = {sig.name: np.random.default_rng(0).normal(size=[1, *sig.shape[1:]]).astype(np.float32)}
    want = runner.session.run(runner.output_names, feeds)
    got = runner.infer(feeds)
    assert list(got) == runner.output_names
    for name, arr in zip(runner.output_names, want, strict=True):
        np.testing.assert_array_equal(got[name], arr)

    calls = []

    def failing(*args):
        calls.append("binding")
        raise EPFail("planted EP failure")

    public = runner.session.run
    runner._run = failing
    runner.session.run = lambda *args: calls.append("session") or public(*args)
    got = runner.infer(feeds)
    assert calls == ["binding", "session"]
    np.testing.assert_array_equal(got[runner.output_names[0]], want[0])


def _engine_ops(reg, model: str, sku: str) -> list[str]:
    import onnx

    engine = onnx.load(str(Layout(reg.root).engine_dir(model, sku) / "model.onnx"), load_external_data=False)
    return [n.op_type for n in engine.graph.node]


def test_int8_lstms_are_quantized_dynamically_on_the_cpu_provider_and_kept_float_when_asked(tmp_path):
    """Static QDQ has no LSTM; on the CPU provider the INT8 engine's LSTM gets INT8 weights
    (DynamicQuantizeLSTM), recorded in the build report and run in int8 as its profile shows;
    options.recurrent: float and a node kept precise leave it in FP32. All three pass validation."""
    from pipeline.stages.calibrate import calibrate

    models.rnn_model(tmp_path / "models/lstm/model.onnx", "LSTM", seq=16, hidden=32)
    skus = {
        "int8": models.ort_sku("int8"),
        "float": models.ort_sku("int8", options={"recurrent": "float"}),
        "kept": models.ort_sku("int8", options={"nodes_to_exclude": ["lstm"]}),
    }
    reg = load_registry(
        models.write_project(tmp_path, {"lstm": models.rnn_spec("models/lstm", "LSTM", seq=16, hidden=32)}, skus)
    )
    for stage in (prepare, make_data, reference, calibrate):
        stage(reg, "lstm")

    report = build(reg.pair("lstm", "int8"))
    dynamic = report.calibration["dynamic"]
    assert dynamic["nodes"] == ["lstm"] and dynamic["kept_float"] == {}
    assert dynamic["reduce_range"] == report.calibration["reduce_range"]  # 7-bit weights where static ones are
    assert "DynamicQuantizeLSTM" in _engine_ops(reg, "lstm", "int8") and "LSTM" not in _engine_ops(reg, "lstm", "int8")
    (layer,) = [layer for layer in report.layers if layer.op_type == "DynamicQuantizeLSTM"]
    assert layer.precision == "int8" and layer.kernel == "com.microsoft.DynamicQuantizeLSTM"
    assert validate(reg.pair("lstm", "int8")).passed

    report = build(reg.pair("lstm", "float"))
    assert "dynamic" not in report.calibration and "LSTM" in _engine_ops(reg, "lstm", "float")
    report = build(reg.pair("lstm", "kept"))
    assert report.calibration["dynamic"] == {**dynamic, "nodes": [], "kept_float": {"lstm": "kept precise"}}
    assert "LSTM" in _engine_ops(reg, "lstm", "kept") and not any("stays in float" in w for w in report.warnings)
    for sku in ("float", "kept"):
        assert validate(reg.pair("lstm", sku)).passed


def test_a_batch_first_lstm_stays_float_with_the_reason(tmp_path):
    """DynamicQuantizeLSTM has no layout attribute and ONNX Runtime's quantizer drops it: a
    batch-first LSTM (layout 1) would be computed as time-major. It is left in float, said why."""
    import onnx

    from pipeline.backends.quantize import conversion_warnings, quantize_lstm_dynamic

    source = models.rnn_model(tmp_path / "lstm.onnx", "LSTM")
    model = onnx.load(str(source))
    assert quantize_lstm_dynamic(source, tmp_path / "out.onnx", (), reduce_range=False, per_channel=True) is not None
    model.graph.node[0].attribute.append(onnx.helper.make_attribute("layout", 1))
    onnx.save(model, str(tmp_path / "batch_first.onnx"))
    out = tmp_path / "out_batch_first.onnx"
    record = quantize_lstm_dynamic(tmp_path / "batch_first.onnx", out, (), reduce_range=False, per_channel=True)
    assert record is not None and record["nodes"] == [] and not out.exists()
    assert "layout 1 (batch first)" in record["kept_float"]["lstm"]
    (warning,) = conversion_warnings({"dynamic": record})
    assert warning.startswith("INT8: LSTM lstm stays in float: layout 1")
    models.conv_bn_model(tmp_path / "conv.onnx")
    assert quantize_lstm_dynamic(tmp_path / "conv.onnx", out, (), reduce_range=False, per_channel=True) is None
