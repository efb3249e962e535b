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
