"""The LiteRT backend on a tiny real model (models.feature_map_model: conv1 -> relu1 -> conv2, a 4-D
NCHW output): the layer report (delegate placement, partitions, the ONNX nodes of each op), the
placement gate, full-integer INT8 (int8 I/O, the calibration record, nodes kept in float), the
output given back in ONNX layout, and what a missing converter environment does. What every
backend must do is in test_contract.py.

Four engines, each built once for the module (a LiteRT build runs onnx2tf and TensorFlow's converter
in a subprocess: ~10 s); the tests that need no engine need no converter either.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import models
import numpy as np
import pytest
from cli_helpers import skuforge
from onnx import TensorProto, helper

from pipeline.backends import backend_class, get_backend, litert, litert_converter
from pipeline.backends.litert import LiteRtBackend
from pipeline.backends.reference import reference_runner
from pipeline.core.errors import EnvironmentProblem, GateFailed
from pipeline.core.io import read_json
from pipeline.core.paths import Layout
from pipeline.engine.build import build_engine, config_hash
from pipeline.project.config import SkuSpec, load_registry
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate

ONNX_NODES = {"conv1", "relu1", "conv2"}
ON_XNNPACK = {"placement": {"allowed": ["xnnpack"]}}
SKUS = {
    "fp32": models.cpu_sku("litert", "fp32", {"delegate": "xnnpack"}) | ON_XNNPACK,
    "builtin": models.cpu_sku("litert", "fp32", {"delegate": "none"}) | ON_XNNPACK,
    "int8": models.cpu_sku("litert", "int8", {"delegate": "xnnpack", "per_channel": True, "int8_io": True}),
    "unbuilt": models.cpu_sku("litert", "fp32", {}),  # never built: the missing-converter test's
}


@pytest.fixture(scope="module")
def proj(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("litert")
    models.feature_map_model(root / "m" / "model.onnx")
    reg = load_registry(models.write_project(root, {"m": models.feature_map_spec()}, SKUS))
    for stage in (prepare, make_data, reference, calibrate):
        stage(reg, "m")
    return SimpleNamespace(registry=reg, out=Layout(reg.root), root=root)


def _sku(name: str) -> SkuSpec:
    return SkuSpec.model_validate(SKUS[name])


def _buildable() -> None:
    problems = LiteRtBackend().environment_problems(_sku("fp32"), "build")
    if problems:
        pytest.skip(f"this host cannot build LiteRT engines: {'; '.join(problems)}")


@pytest.fixture(scope="module")
def built(proj):
    """sku -> its build report, each SKU built on first use."""
    reports = {}

    def get(sku: str):
        _buildable()
        if sku not in reports:
            reports[sku] = build(proj.registry.pair("m", sku))
        return reports[sku]

    return get


def _meta(proj, sku: str):
    return get_backend("litert").read_meta(proj.out.engine_dir("m", sku))


def _feeds(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).uniform(-1, 1, (1, 3, 8, 6)).astype(np.float32)}


# --- the layer report and the placement gate ----------------------------------------------------------


def test_fp32_ops_run_on_xnnpack_in_one_partition_named_after_their_onnx_nodes(proj, built):
    report = built("fp32")
    compute = [layer for layer in report.layers if layer.precision != "n/a"]
    assert [layer.op_type for layer in compute] == ["CONV_2D", "CONV_2D"], report.layers
    assert {layer.device for layer in report.layers} == {"xnnpack"}
    assert report.placement == {"xnnpack": len(report.layers)} and report.partition_boundaries == 0
    assert _meta(proj, "fp32").partitions == 1
    # conv1 and its Relu are one fused op; every ONNX node is some op's
    assert [sorted(layer.fused_from) for layer in compute] == [["conv1", "relu1"], ["conv2"]]
    assert {n for layer in report.layers for n in layer.fused_from} == ONNX_NODES
    assert all(layer.precision == "fp32" for layer in compute)
    assert validate(proj.registry.pair("m", "fp32")).passed  # the gate below can pass


def test_without_the_delegate_every_op_is_on_the_builtin_kernels_and_the_placement_gate_fails(proj, built):
    report = built("builtin")
    assert {layer.device for layer in report.layers} == {"cpu"} and report.requested_devices == ["cpu"]
    assert _meta(proj, "builtin").partitions == 0
    with pytest.raises(GateFailed) as failed:
        validate(proj.registry.pair("m", "builtin"))
    message = str(failed.value)
    assert f"placement: {len(report.layers)} nodes ran outside ['xnnpack']" in message
    conv = next(layer for layer in report.layers if layer.op_type == "CONV_2D")
    assert f"{conv.name} (CONV_2D) on cpu" in message


# --- full-integer INT8 ----------------------------------------------------------------------------


def test_int8_is_full_integer_with_int8_io_and_the_runner_speaks_float(proj, built):
    report = built("int8")
    compute = [layer for layer in report.layers if layer.precision != "n/a"]
    assert compute and all(layer.precision == "int8" for layer in compute), report.layers
    assert {layer.device for layer in report.layers} == {"xnnpack"}
    calib = report.calibration  # the set's sha256 is the calibrate report's (the manifest's); here the batches'
    calibrated = read_json(proj.out.report("m", None, "calibrate"))
    assert calib["samples"] == calibrated["samples"] > 1 and len(calib["batches_sha256"]) == 64
    assert calib["int8_io"] is True and calib["nodes_kept_float"] == []
    meta = _meta(proj, "int8")
    for tensor in [*meta.inputs, *meta.outputs]:
        assert tensor.dtype == "int8" and tensor.quantization is not None and tensor.quantization[0] > 0, tensor
    reference_ = reference_runner(proj.out.prepared_model("m"))
    with get_backend("litert").load(proj.out.engine_dir("m", "int8"), proj.registry.sku("int8")) as runner:
        assert [(s.name, s.dtype, s.shape) for s in runner.inputs] == [("x", "float32", [1, 3, 8, 6])]
        scale = meta.outputs[0].quantization[0]
        for seed in range(3):
            feeds = _feeds(seed)
            got, want = runner.infer(feeds)["y"], reference_.infer(feeds)["y"]
            assert got.dtype == np.float32 and got.shape == want.shape == (1, 4, 8, 6)
            # a few output steps: two int8 layers and int8 input and output
            np.testing.assert_allclose(got, want, atol=4 * scale, rtol=0)


def test_int8_keeps_the_named_node_in_float(proj, built, tmp_path):
    _buildable()
    kept = build_engine(proj.registry.pair("m", "int8"), tmp_path / "engine", keep_precise=("conv1",)).outcome
    by_node = {n: layer for layer in kept.layers for n in layer.fused_from}
    assert by_node["conv1"].precision == "fp32" and by_node["conv2"].precision == "int8", kept.layers
    assert kept.calibration["nodes_to_exclude"] == ["conv1"] and kept.calibration["nodes_kept_float"]
    assert {layer.op_type for layer in kept.layers} >= {"DEQUANTIZE", "QUANTIZE"}  # around the float conv


# --- the output layout ----------------------------------------------------------------------------


def test_an_nchw_output_comes_back_in_onnx_layout(proj, built):
    built("fp32")
    (out,) = _meta(proj, "fp32").outputs
    assert out.shape == [1, 8, 6, 4] and out.perm == [0, 3, 1, 2]  # the engine's NHWC, and back
    tol = proj.registry.tolerance("m", "fp32").for_kind("regression")
    reference_ = reference_runner(proj.out.prepared_model("m"))
    with get_backend("litert").load(proj.out.engine_dir("m", "fp32"), proj.registry.sku("fp32")) as runner:
        for seed in range(3):
            got, want = runner.infer(_feeds(seed))["y"], reference_.infer(_feeds(seed))["y"]
            assert got.shape == (1, 4, 8, 6)
            np.testing.assert_allclose(got, want, atol=tol.atol, rtol=tol.rtol)


# --- the converter environment --------------------------------------------------------------------


def test_without_the_converter_environment_build_exits_3_and_writes_nothing(proj, tmp_path, monkeypatch):
    empty = tmp_path / "no-converter"
    empty.mkdir()
    monkeypatch.setenv(litert_converter.ENV_VAR, str(empty))
    backend = LiteRtBackend()
    problems = backend.environment_problems(_sku("unbuilt"), "build")
    assert any(f"the LiteRT converter environment {empty} does not exist" in p for p in problems), problems
    assert not any(str(empty) in p for p in backend.environment_problems(_sku("unbuilt"), "run"))
    proc = skuforge(
        "build",
        "--model",
        "m",
        "--sku",
        "unbuilt",
        cwd=proj.root,
        env={**os.environ, litert_converter.ENV_VAR: str(empty)},
    )
    assert proc.returncode == 3, proc.stderr
    assert str(empty) in proc.stderr and "python -m pipeline.backends.litert_converter" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not proj.out.engine_dir("m", "unbuilt").exists() and not proj.out.report("m", "unbuilt", "build").exists()
    assert list(empty.iterdir()) == []


def test_the_config_hash_follows_the_converter_lock_and_script(proj, tmp_path, monkeypatch):
    def hashed() -> str:
        return config_hash(proj.registry.pair("m", "fp32"), "0" * 64, None)

    before = hashed()
    assert backend_class("litert").config_fingerprint() == {
        "litert_converter_lock": litert_converter.lock_sha256(),
        "litert_converter_script": litert_converter.script_sha256(),
    }
    script = tmp_path / "convert.py"
    script.write_text(litert_converter.SCRIPT.read_text() + "\n# another rewrite\n")
    monkeypatch.setattr(litert_converter, "SCRIPT", script)
    assert hashed() != before  # a changed converter rebuilds its engines
    monkeypatch.undo()
    lock = tmp_path / "requirements.lock"
    pinned = litert_converter.LOCK.read_text()
    lock.write_text(pinned.replace("\nonnx2tf==", "\nonnx2tf==0.", 1))
    assert lock.read_text() != pinned  # another onnx2tf pinned
    monkeypatch.setattr(litert_converter, "LOCK", lock)
    assert hashed() != before
    assert LiteRtBackend().versions()["converter_lock"] == litert_converter.lock_sha256()[:16]
    monkeypatch.undo()
    assert hashed() == before
    assert json.dumps(backend_class("onnxruntime").config_fingerprint()) == "{}"  # other backends: nothing


@pytest.mark.parametrize(
    ("precision", "options", "problem"),
    [
        ("fp32", {"int8_io": True}, "options.int8_io: int8 inputs and outputs need precision int8, not fp32"),
        ("int8", {"pseudo_ops": ["Erf", "Sinh"]}, "options.pseudo_ops: Sinh cannot be rewritten by onnx2tf"),
        ("int8", {"pseudo_ops": ["erf", "GELU"], "int8_io": True}, None),  # onnx2tf's names are case-blind
    ],
    ids=["int8_io-fp32", "unknown-pseudo-op", "valid"],
)
def test_the_sku_checks_refuse_options_the_converter_cannot_honour(precision, options, problem):
    problems = LiteRtBackend.check_sku(SkuSpec.model_validate(models.cpu_sku("litert", precision, options)))
    assert (problems == []) if problem is None else any(p.startswith(problem) for p in problems), problems


def test_the_sku_checks_refuse_dynamic_profiles():
    sku = models.cpu_sku("litert", "fp32", {}) | {"shapes": {}, "profiles": {"batch": {"min": 1, "opt": 1, "max": 4}}}
    problems = LiteRtBackend.check_sku(SkuSpec.model_validate(sku))
    assert any(p.startswith("profiles: a LiteRT engine is built at static shapes") for p in problems), problems


def test_names_other_exporters_write_survive_the_conversion(tmp_path):
    """``x:0`` (onnx2tf renames it, and then would not keep it NCHW: its data read as NHWC), ``conv@0``
    (TensorFlow refuses it as a scope): the engine takes both inputs as the ONNX model does, computes
    what the reference runtime does, and its layers name the ONNX nodes as the model spells them."""
    _buildable()
    models.foreign_names_model(tmp_path / "m" / "model.onnx")
    reg = load_registry(models.write_project(tmp_path, {"m": models.foreign_names_spec()}, {"fp32": SKUS["fp32"]}))
    for stage in (prepare, make_data, reference):
        stage(reg, "m")
    report = build(reg.pair("m", "fp32"))
    assert {n for layer in report.layers for n in layer.fused_from} == {"conv@0", "add@1"}
    assert validate(reg.pair("m", "fp32")).passed
    rng = np.random.default_rng(3)
    feeds = {
        "input.1": rng.uniform(-1, 1, (1, 3, 6, 6)).astype(np.float32),
        "x:0": rng.uniform(-1, 1, (1, 4, 6, 6)).astype(np.float32),
    }
    with get_backend("litert").load(Layout(reg.root).engine_dir("m", "fp32"), reg.sku("fp32")) as runner:
        got = runner.infer(feeds)["out/1"]
    want = reference_runner(Layout(reg.root).prepared_model("m")).infer(feeds)["out/1"]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_a_scalar_output_comes_back_as_the_onnx_scalar(tmp_path):
    """y = ReduceSum(x) with keepdims 0 is a rank-0 output; the engine may give it as [1]: the runner
    hands back the ONNX shape."""
    _buildable()
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0, name="total")],
        "scalar",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    models.save_graph(graph, tmp_path / "m" / "model.onnx")
    spec = {"dir": "m", "source": "model.onnx", "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]}
    reg = load_registry(models.write_project(tmp_path, {"m": spec}, {"fp32": SKUS["fp32"]}))
    for stage in (prepare, make_data, reference):
        stage(reg, "m")
    build(reg.pair("m", "fp32"))
    feeds = {"x": np.arange(4, dtype=np.float32).reshape(1, 4)}
    with get_backend("litert").load(Layout(reg.root).engine_dir("m", "fp32"), reg.sku("fp32")) as runner:
        got = runner.infer(feeds)["y"]
    assert got.shape == () and got == np.float32(6.0)


# --- the conversion server ----------------------------------------------------------------------------


def test_one_server_converts_for_the_process_and_its_engine_is_a_one_shot_conversions(proj, built, monkeypatch):
    """The conversions of one process go to one conversion server (server.py: TensorFlow imported once), each
    in a forked child; what it converts is byte for byte what `convert.py` run on its own converts."""
    served = built("fp32")
    server = litert_converter.Server._current
    assert server is not None and server.proc.poll() is None
    assert not os.path.exists(f"/proc/{server.child}")  # each conversion's child is reaped
    again = build(proj.registry.pair("m", "builtin"))
    assert litert_converter.Server._current is server and again.engine_sha256
    monkeypatch.setattr(litert_converter.Server, "convert", classmethod(lambda cls, *args: None))  # no server
    alone = build(proj.registry.pair("m", "fp32"))
    assert alone.engine_sha256 == served.engine_sha256


def test_a_conversion_past_its_deadline_is_killed_and_the_server_takes_the_next(proj, monkeypatch):
    _buildable()
    real = litert._run_converter
    seen: dict[str, object] = {}

    def late_then_in_time(work, request, timeout_s):
        with pytest.raises(EnvironmentProblem, match="did not finish in 0.05 s"):
            real(work, request, 0.05)
        seen["server"], seen["child"] = litert_converter.Server._current, litert_converter.Server._current.child
        return real(work, request, timeout_s)

    monkeypatch.setattr(litert, "_run_converter", late_then_in_time)
    rep = build(proj.registry.pair("m", "builtin"))
    assert rep.engine_sha256 and not os.path.exists(f"/proc/{seen['child']}")  # killed and reaped
    assert litert_converter.Server._current is seen["server"]  # the same server converted it in time
