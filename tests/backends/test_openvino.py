"""The OpenVINO backend through the stage functions on tiny real models, on this host's CPU plugin."""

from __future__ import annotations

import json
from io import BytesIO
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ov = pytest.importorskip("openvino", reason="openvino is not installed (pip install openvino)")

import models  # noqa: E402

from pipeline.backends import get_backend  # noqa: E402
from pipeline.backends.contract import ENGINE_META, verify_engine  # noqa: E402
from pipeline.backends.openvino import OpenVinoBackend  # noqa: E402
from pipeline.core.errors import ConfigError, EnvironmentProblem, GateFailed, InputError  # noqa: E402
from pipeline.core.io import read_json, sha256_file  # noqa: E402
from pipeline.core.paths import Layout  # noqa: E402
from pipeline.project.config import load_registry  # noqa: E402
from pipeline.results.manifest import validate_document  # noqa: E402
from pipeline.stages.bench import bench  # noqa: E402
from pipeline.stages.build import build  # noqa: E402
from pipeline.stages.calibrate import calibrate  # noqa: E402
from pipeline.stages.data import make_data  # noqa: E402
from pipeline.stages.manifest import write_manifest  # noqa: E402
from pipeline.stages.prepare import prepare  # noqa: E402
from pipeline.stages.reference import reference  # noqa: E402
from pipeline.stages.validate import validate  # noqa: E402

FORMAT = OpenVinoBackend.engine_format
LOOSE = {"atol": 0.05, "rtol": 0.05}  # bf16 (what the f16 hint runs on AVX512-BF16 CPUs) stays within this


def ov_sku(precision: str = "fp32", **extra) -> dict:
    return {**models.ort_sku(precision, **extra), "backend": "openvino"}


SKUS = {
    "ov_fp32": ov_sku("fp32", placement={"allowed": ["CPU"]}),
    "ov_int8": ov_sku("int8"),
    "ov_fp16_warn": ov_sku("fp16", tolerance=LOOSE),
    "ov_fp16_fail": ov_sku("fp16", tolerance=LOOSE, precision_gate={"policy": "fail"}),
    "hetero": ov_sku("fp32", options={"device": "HETERO:CPU"}),
    "throughput": ov_sku(
        "fp32",
        options={"performance_hint": "THROUGHPUT", "num_streams": 2},
        bench={
            "warmup": 1,
            "steady_window": 5,
            "max_warmup_seconds": 1.0,
            "roofline": False,
            "iterations": 8,
            "concurrency": 2,
        },
    ),
    "elsewhere": ov_sku("fp32", placement={"allowed": ["GPU"]}),
    "tamper": ov_sku("fp32"),
    "dyn": ov_sku("fp32", shapes={}, profiles={"batch": {"min": 1, "opt": 4, "max": 8}}),
    "gpu": ov_sku("fp32", target={"arch": models.ort_sku()["target"]["arch"], "device": "gpu", "os": "linux"}),
}
MODELS = ("conv", "multi")


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    root = tmp_path_factory.mktemp("ovproject")
    specs = {
        "conv": (models.conv_bn_model, models.conv_bn_spec()),
        "multi": (models.multi_io_model, models.multi_io_spec()),
    }
    for builder, spec in specs.values():
        builder(root / spec["dir"] / spec["source"])
    reg = load_registry(models.write_project(root, {k: s for k, (_, s) in specs.items()}, SKUS))
    r = SimpleNamespace(registry=reg, out=Layout(reg.root), build={}, validate={}, bench={}, manifest={})
    for m in MODELS:
        for stage in (prepare, make_data, reference, calibrate):
            stage(reg, m)
        for s in ("ov_fp32", "ov_int8"):
            r.build[m, s] = build(reg.pair(m, s))
        r.validate[m, "ov_fp32"] = validate(reg.pair(m, "ov_fp32"))
        for s in ("ov_fp32", "ov_int8"):
            r.bench[m, s] = bench(reg.pair(m, s))
    r.validate["conv", "ov_int8"] = validate(reg.pair("conv", "ov_int8"))
    r.build["multi", "tamper"] = build(reg.pair("multi", "tamper"))
    for s in ("ov_fp32", "ov_int8"):
        r.manifest["conv", s] = write_manifest(reg.pair("conv", s))
    r.manifest["multi", "ov_fp32"] = write_manifest(reg.pair("multi", "ov_fp32"))
    return r


PAIRS = [(m, s) for m in MODELS for s in ("ov_fp32", "ov_int8")]


# --- build --------------------------------------------------------------------------------------


@pytest.mark.parametrize("model, sku", PAIRS)
def test_build_reports_every_layer_on_the_cpu(proj, model, sku):
    rep = proj.build[model, sku]
    assert rep.backend == "openvino" and rep.versions["openvino"] == ov.get_version()
    assert rep.requested_devices == ["CPU"] and rep.partition_boundaries == 0
    assert rep.layers and rep.placement == {"CPU": len(rep.layers)}
    assert all(layer.kernel for layer in rep.layers)  # primitiveType of each executed layer
    assert not {layer.op_type for layer in rep.layers} & {"Input", "Output", "Const"}
    assert [f.path for f in rep.engine_files] == ["model.blob"]
    engine = proj.out.engine_dir(model, sku)
    meta = verify_engine(engine, FORMAT)
    assert meta["device"] == "CPU" and meta["execution_devices"] == ["CPU"]
    assert meta["devices"]["CPU"]["full_device_name"] == ov.Core().get_property("CPU", "FULL_DEVICE_NAME")
    assert "EXPORT_IMPORT" in meta["devices"]["CPU"]["optimization_capabilities"]


@pytest.mark.parametrize(
    "sku, fused, kernel",
    [
        ("ov_fp32", {"conv", "relu"}, "_f32"),
        # INT8: the Relu folds into the quantize of its output, which the convolution then writes
        ("ov_int8", {"conv", "relu_QuantizeLinear"}, "_I8"),
    ],
)
def test_convolution_layer_shows_what_was_fused_into_it(proj, sku, fused, kernel):
    conv = [layer for layer in proj.build["conv", sku].layers if layer.op_type == "Convolution"]
    assert len(conv) == 1, conv
    assert fused <= set(conv[0].fused_from), conv[0]
    assert conv[0].kernel.endswith(kernel) and conv[0].precision == ("fp32" if sku == "ov_fp32" else "int8")
    assert not any(
        layer.op_type == "Eltwise" and "relu" in layer.fused_from for layer in proj.build["conv", sku].layers
    )


@pytest.mark.parametrize("model", MODELS)
def test_fp32_layers_compute_in_fp32(proj, model):
    rep = proj.build[model, "ov_fp32"]
    assert rep.precision_counts.get("fp32", 0) > 0
    assert set(rep.precision_counts) <= {"fp32", "n/a"}  # explicit f32 hint: no bf16 even where the CPU has it
    assert rep.calibration is None


@pytest.mark.parametrize("model", MODELS)
def test_int8_build_runs_the_qdq_graph_in_int8(proj, model):
    rep = proj.build[model, "ov_int8"]
    assert rep.precision_counts.get("int8", 0) > 0
    assert rep.calibration["format"] == "QDQ" and "OpenVINO" in rep.calibration["runtime"]
    assert any("QuantizeLinear" in name for layer in rep.layers for name in layer.fused_from)
    compute = {"Convolution", "FullyConnected"}
    assert all(layer.precision == "int8" for layer in rep.layers if layer.op_type in compute)


def test_engine_reimports_with_the_build_config_and_matches_the_runner(proj):
    engine = proj.out.engine_dir("conv", "ov_fp32")
    meta = verify_engine(engine, FORMAT)
    assert meta["config"]["INFERENCE_PRECISION_HINT"] == "f32" and meta["inference_precision"] == "f32"
    compiled = ov.Core().import_model(BytesIO((engine / "model.blob").read_bytes()), "CPU", meta["config"])
    x = np.random.default_rng(1).uniform(size=(1, 3, 8, 8)).astype(np.float32)
    direct = compiled({"x": x})[0]
    with get_backend("openvino").load(engine, proj.registry.sku("ov_fp32")) as runner:
        assert [s.name for s in runner.inputs] == meta["inputs"] == ["x"]
        assert np.array_equal(runner.infer({"x": x})["probs"], direct)


def test_blob_does_not_keep_the_precision_hint(proj):
    """Why engine.json carries the compile config: import_model without it picks the importing
    host's default precision (bf16 where the CPU has it), not what the engine was built with."""
    caps = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    if "BF16" not in caps:
        pytest.skip(f"this CPU has no BF16 ({caps}): its default precision is f32 anyway")
    blob = (proj.out.engine_dir("conv", "ov_fp32") / "model.blob").read_bytes()
    bare = ov.Core().import_model(BytesIO(blob), "CPU")
    assert bare.get_property("INFERENCE_PRECISION_HINT").get_type_name() == "bf16"


# --- validate, bench, manifest ------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_fp32_validates_close_to_the_reference(proj, model):
    rep = proj.validate[model, "ov_fp32"]
    assert rep.passed and rep.placement.passed and rep.precision_gate.passed
    assert all(e.max_abs_error <= 1e-4 for e in rep.outputs)


def test_conv_int8_validates_and_names_the_layers_left_in_fp32(proj):
    rep = proj.validate["conv", "ov_int8"]
    assert rep.passed and all(e.passed for e in rep.outputs)
    assert [layer.op_type for layer in rep.precision_gate.mismatched] == ["Softmax"]  # OpenVINO keeps Softmax in f32
    assert any("Softmax" in w for w in rep.warnings)


def test_multi_int8_miscompile_is_caught_by_the_correctness_gate(proj):
    """OpenVINO 2026.4.1's CPU plugin miscomputes this QDQ graph: a uint8 constant with a nonzero zero
    point, gathered, requantized and summed (Gather -> Q/DQ -> ReduceSum) saturates at zero; ONNX Runtime
    runs the same graph right (docs/backends/openvino.md has a short repro). If this starts passing,
    OpenVINO fixed it: make multi/int8 a passing validate."""
    with pytest.raises(GateFailed) as info:
        validate(proj.registry.pair("multi", "ov_int8"))
    assert "output y" in info.value.message
    rep = read_json(proj.out.report("multi", "ov_int8", "validate"))
    assert rep["passed"] is False and rep["placement"]["passed"] is True


@pytest.mark.parametrize("model, sku", PAIRS)
def test_bench_reports_percentiles(proj, model, sku):
    rep = proj.bench[model, sku]
    stats = rep.engine_only
    assert stats.iterations == 10 and 0 < stats.min_ms <= stats.p50_ms <= stats.p99_ms <= stats.max_ms
    assert rep.load_seconds > 0 and rep.throughput_per_s > 0


@pytest.mark.parametrize("model, sku", [("conv", "ov_fp32"), ("conv", "ov_int8"), ("multi", "ov_fp32")])
def test_manifest_is_valid_and_records_the_engine(proj, model, sku):
    path = proj.out.manifest(model, sku)
    doc = read_json(path)
    validate_document(doc, str(path))
    assert doc["correctness"]["passed"] is True
    assert doc["engine"] == [f.to_json() for f in proj.build[model, sku].engine_files]
    assert doc["engine"][0]["sha256"] == sha256_file(proj.out.engine_dir(model, sku) / "model.blob")


def test_throughput_streams_serve_concurrent_requests(proj):
    build(proj.registry.pair("conv", "throughput"))
    meta = read_json(proj.out.engine_dir("conv", "throughput") / ENGINE_META)
    assert meta["config"]["PERFORMANCE_HINT"] == "THROUGHPUT" and meta["config"]["NUM_STREAMS"] == "2"
    rep = bench(proj.registry.pair("conv", "throughput"))
    assert rep.concurrency == 2 and rep.engine_only.iterations == 8 and rep.throughput_per_s > 0
    assert validate(proj.registry.pair("conv", "throughput")).passed


def test_hetero_device_builds_and_reports_its_member_devices(proj):
    rep = build(proj.registry.pair("conv", "hetero"))
    assert rep.requested_devices == ["CPU"] and {layer.device for layer in rep.layers} == {"CPU"}
    assert read_json(proj.out.engine_dir("conv", "hetero") / ENGINE_META)["device"] == "HETERO:CPU"
    assert validate(proj.registry.pair("conv", "hetero")).passed


def test_profile_axis_stays_dynamic_within_its_range(proj):
    rep = build(proj.registry.pair("multi", "dyn"))
    assert rep.shapes == {} and rep.profiles == {"batch": {"min": 1, "opt": 4, "max": 8}}
    with get_backend("openvino").load(proj.out.engine_dir("multi", "dyn"), proj.registry.sku("dyn")) as runner:
        assert [s.shape for s in runner.inputs] == [[None, 6], [None, 3], []]
        for batch in (1, 8):
            out = runner.infer(
                {
                    "x": np.zeros((batch, 6), np.float32),
                    "ids": np.zeros((batch, 3), np.int64),
                    "scale": np.array(1.0, np.float32),
                }
            )
            assert out["y"].shape == (batch, 4)
        with pytest.raises(InputError, match=r"'x' dim 0 must be in \[1, 8\].*got 9"):
            runner.infer(
                {
                    "x": np.zeros((9, 6), np.float32),
                    "ids": np.zeros((9, 3), np.int64),
                    "scale": np.array(1.0, np.float32),
                }
            )
    assert validate(proj.registry.pair("multi", "dyn")).passed
    assert bench(proj.registry.pair("multi", "dyn")).batch == 4


def test_placement_gate_names_cpu_layers_when_only_gpu_is_allowed(proj):
    build(proj.registry.pair("conv", "elsewhere"))
    with pytest.raises(GateFailed) as info:
        validate(proj.registry.pair("conv", "elsewhere"))
    assert "placement" in info.value.message and "on CPU" in info.value.message


# --- the precision gate: FP16 asked, something else run -----------------------------------------


def test_fp16_hint_that_runs_another_precision_is_caught_by_the_precision_gate(proj):
    caps = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    if "FP16" in caps:
        pytest.skip(f"this CPU runs FP16 ({caps}): the f16 hint is honoured, nothing falls back")
    warned = build(proj.registry.pair("conv", "ov_fp16_warn"))
    assert any("FP16 was asked for" in w for w in warned.warnings)
    fallback = {layer.precision for layer in warned.layers} - {"n/a"}
    assert "fp16" not in fallback and fallback <= {"fp32", "bf16"}, fallback
    rep = validate(proj.registry.pair("conv", "ov_fp16_warn"))
    assert rep.passed and rep.precision_gate.policy == "warn"
    mismatched = {layer.name for layer in rep.precision_gate.mismatched}
    conv = next(layer for layer in warned.layers if layer.op_type == "Convolution")
    assert conv.name in mismatched and any("fp16 was asked for" in w for w in rep.warnings)

    build(proj.registry.pair("conv", "ov_fp16_fail"))
    with pytest.raises(GateFailed) as info:
        validate(proj.registry.pair("conv", "ov_fp16_fail"))
    assert info.value.exit_code == 1
    assert "precision: fp16 was asked for" in info.value.message
    assert f"{conv.name} (Convolution, {conv.precision})" in info.value.message
    assert read_json(proj.out.report("conv", "ov_fp16_fail", "validate"))["precision_gate"]["passed"] is False


# --- refusals -----------------------------------------------------------------------------------


def _rewrite_blob(engine: Path, data: bytes) -> None:
    """Replace the blob and re-record its hash, so only import_model can notice."""
    (engine / "model.blob").write_bytes(data)
    meta = read_json(engine / ENGINE_META)
    meta["files"] = [{"path": "model.blob", "sha256": sha256_file(engine / "model.blob"), "bytes": len(data)}]
    (engine / ENGINE_META).write_text(json.dumps(meta))


def test_truncated_blob_openvino_cannot_import_is_an_input_error(proj):
    """(Garbage in place of the blob: tests/backends/test_contract.py.)"""
    engine = proj.out.engine_dir("multi", "tamper")
    blob = (engine / "model.blob").read_bytes()
    _rewrite_blob(engine, blob[: len(blob) // 2])
    verify_engine(engine, FORMAT)  # the hashes match: only OpenVINO can tell
    for stage in (validate, bench):
        with pytest.raises(InputError) as info:
            stage(proj.registry.pair("multi", "tamper"))
        assert "could not import the engine" in info.value.message and "rebuild" in info.value.hint
    _rewrite_blob(engine, blob)


def test_missing_device_names_the_available_ones(proj):
    if "GPU" in {d.split(".")[0] for d in ov.Core().available_devices}:
        pytest.skip("this host has an OpenVINO GPU device")
    problems = get_backend("openvino").environment_problems(proj.registry.sku("gpu"))
    assert len(problems) == 1 and "GPU is not available" in problems[0] and "available: CPU" in problems[0]
    with pytest.raises(EnvironmentProblem) as info:
        build(proj.registry.pair("conv", "gpu"))
    assert info.value.exit_code == 3 and "GPU" in info.value.message
    assert not proj.out.sku_dir("conv", "gpu").exists()


# --- config -------------------------------------------------------------------------------------


def _sku(**options):
    from pipeline.project.config import SkuSpec

    return SkuSpec.model_validate(ov_sku("fp32", options=options))


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"device": "AUTO"}, "cannot be exported"),
        ({"device": "GPU"}, "target.device is 'cpu'"),
        ({"device": "HETERO:"}, "HETERO needs its devices"),
        ({"performance_hint": "FAST"}, "options.performance_hint"),
        ({"streams": 2}, "unknown key"),
    ],
)
def test_bad_options_are_config_problems(options, expected):
    problems = OpenVinoBackend.check_sku(_sku(**options))
    assert len(problems) == 1 and expected in problems[0], problems


def test_good_options_pass_and_the_device_follows_the_target():
    assert OpenVinoBackend.check_sku(_sku(device="HETERO:CPU", num_streams=2, enable_cpu_pinning=True)) == []
    with pytest.raises(ConfigError, match="num_streams"):
        OpenVinoBackend.options(_sku(num_streams=0))
