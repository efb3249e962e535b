"""The stages end to end on tiny real models with ONNX Runtime CPU: reports, gates and refusals."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import models
import numpy as np
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from pipeline.backends.contract import ENGINE_META, verify_engine
from pipeline.core.errors import EnvironmentProblem, GateFailed, InputError
from pipeline.core.io import read_json, sha256_arrays, sha256_file
from pipeline.core.paths import Layout
from pipeline.host.probe import host_arch
from pipeline.model import graph
from pipeline.project.artifacts import calibration_table
from pipeline.project.config import load_registry
from pipeline.results.manifest import digest, load_manifest, schema, validate_document
from pipeline.stages.bench import bench
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.manifest import write_manifest
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate

REPO = Path(__file__).resolve().parents[2]
SCHEMA_FILE = REPO / "pipeline" / "schemas" / "manifest.schema.json"
CPU = "CPUExecutionProvider"
OTHER_ARCH = "aarch64" if host_arch() == "x86_64" else "x86_64"
MODELS = ("conv", "multi")
GOOD_SKUS = ("cpu_fp32", "cpu_int8")
SKUS = {
    "cpu_fp32": models.ort_sku("fp32", placement={"allowed": [CPU]}),
    "cpu_int8": models.ort_sku("int8"),
    "strict_int8": models.ort_sku("int8", tolerance={"atol": 0, "rtol": 0, "max_mismatch": 0}),
    "elsewhere": models.ort_sku("fp32", placement={"allowed": ["SomeOtherEP"]}),
    "tamper": models.ort_sku("fp32"),
    "unbuilt": models.ort_sku("fp32"),
    "foreign": models.ort_sku(
        "fp32",
        target={"arch": OTHER_ARCH, "device": "cpu", "os": "linux"},
        runner_labels=["self-hosted", "linux", "foreign-box"],
    ),
    "old_toolchain": models.ort_sku("fp32", toolchain={"onnxruntime": "<1.0"}),
}
BUILT = ("cpu_fp32", "cpu_int8", "strict_int8", "elsewhere", "tamper")


def new_project(root: Path, model_specs: dict, skus: dict | None = None):
    """Write the models named in ``model_specs`` (name -> (builder, spec)) and params.yaml."""
    for builder, spec in model_specs.values():
        builder(root / spec["dir"] / spec["source"])
    params = models.write_project(
        root, {k: spec for k, (_, spec) in model_specs.items()}, skus or {"cpu_fp32": models.ort_sku("fp32")}
    )
    return load_registry(params)


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    reg = new_project(
        root,
        {
            "conv": (models.conv_bn_model, models.conv_bn_spec()),
            "multi": (models.multi_io_model, models.multi_io_spec()),
        },
        SKUS,
    )
    r = SimpleNamespace(
        registry=reg,
        out=Layout(reg.root),
        prepare={},
        data={},
        reference={},
        calibrate={},
        build={},
        validate={},
        bench={},
        manifest={},
    )
    for m in MODELS:
        r.prepare[m] = prepare(reg, m)
        r.data[m] = make_data(reg, m)
        r.reference[m] = reference(reg, m)
        r.calibrate[m] = calibrate(reg, m)
        for s in BUILT:
            r.build[m, s] = build(reg.pair(m, s))
        for s in GOOD_SKUS:
            r.validate[m, s] = validate(reg.pair(m, s))
            r.bench[m, s] = bench(reg.pair(m, s))
            r.manifest[m, s] = write_manifest(reg.pair(m, s))
    return r


PAIRS = [(m, s) for m in MODELS for s in GOOD_SKUS]


# --- prepare, data, reference, calibrate --------------------------------------------------------


def test_prepare_reports(proj):
    conv, multi = proj.prepare["conv"], proj.prepare["multi"]
    assert [p.changed for p in conv.passes] == [True] * 4
    assert not any(p.changed for p in multi.passes)
    assert conv.op_counts_after == {"Conv": 1, "Flatten": 1, "Gemm": 1, "GlobalAveragePool": 1, "Relu": 1, "Softmax": 1}
    for m in MODELS:
        rep = proj.prepare[m]
        assert rep.self_check_max_abs_error <= 1e-4
        assert rep.prepared_sha256 == sha256_file(proj.out.prepared_model(m))
        assert rep.source_sha256 == sha256_file(proj.registry.model_file(m))
        assert rep.opset == {"ai.onnx": models.OPSET} and rep.producer == "skuforge-tests"
        assert read_json(proj.out.report(m, None, "prepare")) == rep.to_json()
    assert [o.name for o in multi.signature.outputs] == ["y", "cls"]


def test_data_reports(proj):
    for m in MODELS:
        rep = proj.data[m]
        assert {k: v.samples for k, v in rep.splits.items()} == {"golden": 32, "calibration": 64}
        for split, rec in rep.splits.items():
            with np.load(proj.out.split(m, split)) as f:
                assert sha256_arrays({k: f[k] for k in f.files}) == rec.sha256
            assert rec.source.startswith("generated") and not rec.has_labels
        assert proj.out.split(m, "golden", raw=True).is_file()
    with np.load(proj.out.split("multi", "golden")) as f:
        assert f["scale"].shape == (32,) and f["ids"].dtype == np.int64


def test_reference_reports(proj):
    assert proj.reference["conv"].outputs == ["probs"] and proj.reference["multi"].outputs == ["y", "cls"]
    for m in MODELS:
        rep = proj.reference[m]
        assert rep.samples == {"golden": 32} and rep.runtime_version == ort.__version__
        with np.load(proj.out.reference_dir(m) / "golden.npz") as f:
            outputs = {k: f[k] for k in f.files}
        assert sha256_arrays(outputs) == rep.output_sha256["golden"]
        assert all(len(v) == 32 for v in outputs.values())


def test_calibrate_reports(proj):
    for m in MODELS:
        rep = proj.calibrate[m]
        assert rep.method == "minmax" and rep.samples == 64 and rep.tensors > 0
        assert rep.calibration_set_sha256 == proj.data[m].splits["calibration"].sha256
        assert rep.table_sha256 == sha256_file(calibration_table(proj.registry, m))


# --- build --------------------------------------------------------------------------------------


@pytest.mark.parametrize("model, sku", PAIRS)
def test_build_runs_everything_on_the_cpu_provider(proj, model, sku):
    rep = proj.build[model, sku]
    assert rep.backend == "onnxruntime" and rep.precision == SKUS[sku]["precision"]
    assert rep.requested_devices == [CPU]
    assert rep.placement == {CPU: len(rep.layers)}
    assert all(layer.device == CPU for layer in rep.layers)
    assert rep.partition_boundaries == 0
    assert rep.versions["onnxruntime"] == ort.__version__
    assert rep.shapes == {"batch": 1}
    engine = proj.out.engine_dir(model, sku)
    assert [f.path for f in rep.engine_files] == ["model.onnx"]
    assert rep.engine_files[0].sha256 == sha256_file(engine / "model.onnx")
    assert (engine / ENGINE_META).is_file()
    assert verify_engine(engine, "skuforge-onnxruntime/1")["sku"] == sku
    assert read_json(proj.out.report(model, sku, "build")) == rep.to_json()


@pytest.mark.parametrize("model", MODELS)
def test_int8_build_has_int8_layers(proj, model):
    rep = proj.build[model, "cpu_int8"]
    assert rep.precision_counts.get("int8", 0) > 0
    assert rep.calibration["format"] == "QDQ" and rep.calibration["method"] == "minmax"
    assert rep.calibration["table_sha256"] == proj.calibrate[model].table_sha256
    assert any(layer.op_type == "QuantizeLinear" for layer in rep.layers)


@pytest.mark.parametrize("model", MODELS)
def test_fp32_build_has_no_int8_layers(proj, model):
    rep = proj.build[model, "cpu_fp32"]
    assert "int8" not in rep.precision_counts and rep.precision_counts.get("fp32", 0) > 0
    assert rep.calibration is None


def test_build_config_hash_covers_what_decides_the_engine(proj):
    b = proj.build
    assert b["conv", "cpu_fp32"].build_config_sha256 != b["conv", "cpu_int8"].build_config_sha256
    assert b["conv", "cpu_fp32"].build_config_sha256 != b["multi", "cpu_fp32"].build_config_sha256
    # placement and tolerances gate an engine but do not change it
    assert (
        b["conv", "cpu_fp32"].build_config_sha256
        == b["conv", "elsewhere"].build_config_sha256
        == b["conv", "tamper"].build_config_sha256
    )
    assert b["conv", "cpu_int8"].build_config_sha256 == b["conv", "strict_int8"].build_config_sha256


# --- validate and bench -------------------------------------------------------------------------


@pytest.mark.parametrize("model, sku", PAIRS)
def test_validate_passes(proj, model, sku):
    rep = proj.validate[model, sku]
    assert rep.passed and rep.failures == []
    assert [e.output for e in rep.outputs] == proj.reference[model].outputs
    assert all(e.passed for e in rep.outputs)
    assert rep.samples == {"golden": 32}
    assert rep.placement.passed and rep.placement.offending == []
    assert read_json(proj.out.report(model, sku, "validate"))["passed"] is True


def test_fp32_engine_is_close_to_the_reference(proj):
    for m in MODELS:
        assert all(e.max_abs_error <= 1e-4 for e in proj.validate[m, "cpu_fp32"].outputs)


@pytest.mark.parametrize("model, sku", PAIRS)
def test_bench_percentiles_are_ordered(proj, model, sku):
    rep = proj.bench[model, sku]
    for stats in (rep.engine_only, rep.end_to_end):
        assert stats.iterations == 10
        assert 0 < stats.min_ms <= stats.p50_ms <= stats.p95_ms <= stats.p99_ms <= stats.max_ms
    assert rep.warmup is not None and rep.warmup.iterations >= 2
    assert rep.steady_state.warmup_iterations == rep.warmup.iterations
    assert rep.steady_state.window == 5 and rep.stopped == "iterations" and rep.execution.usable_cores >= 1
    assert rep.batch == 1 and rep.concurrency == 1 and rep.throughput_per_s > 0
    assert rep.first_inference_ms > 0 and rep.load_seconds >= 0
    assert set(rep.device_state) == {"before", "after"}
    assert rep.memory_mb["rss_after_load"] > 0
    lines = proj.out.latency_csv(model, sku).read_text().splitlines()
    assert lines[0] == "iteration,latency_ms" and len(lines) == 11


def test_bench_with_concurrency(tmp_path):
    reg = new_project(
        tmp_path,
        {"conv": (models.conv_bn_model, models.conv_bn_spec())},
        {"cpu": models.ort_sku("fp32", bench={"warmup": 0, "iterations": 8, "concurrency": 2})},
    )
    for stage in (prepare, make_data, reference):
        stage(reg, "conv")
    build(reg.pair("conv", "cpu"))
    rep = bench(reg.pair("conv", "cpu"))
    assert rep.concurrency == 2 and rep.warmup is None
    assert rep.engine_only.iterations == 8 and rep.throughput_per_s > 0


# --- manifest -----------------------------------------------------------------------------------


def test_schema_file_is_current():
    assert json.loads(SCHEMA_FILE.read_text()) == schema()


@pytest.mark.parametrize("model, sku", PAIRS)
def test_manifest_is_valid(proj, model, sku):
    path = proj.out.manifest(model, sku)
    doc = read_json(path)
    validate_document(doc, str(path))
    jsonschema.validate(doc, json.loads(SCHEMA_FILE.read_text()))
    assert doc["digest"] == digest(doc) == proj.manifest[model, sku].digest
    assert doc["model"] == model and doc["sku"] == sku and doc["precision"] == SKUS[sku]["precision"]
    assert doc["correctness"]["passed"] is True
    assert doc["engine"] == [f.to_json() for f in proj.build[model, sku].engine_files]
    assert doc["datasets"] == {k: v.sha256 for k, v in proj.data[model].splits.items()}
    generated = sorted(k for k, v in proj.data[model].splits.items() if v.source.startswith("generated"))
    assert generated and doc["synthetic_datasets"] == generated  # generated data says so
    assert doc["target"]["runner_labels"] == SKUS[sku]["runner_labels"]
    assert (doc["calibration"] is not None) == (sku == "cpu_int8")
    assert load_manifest(path).digest == doc["digest"]


def test_manifest_rerun_is_byte_identical_and_keeps_provenance(proj):
    reg, path = proj.registry, proj.out.manifest("conv", "cpu_fp32")
    doc = read_json(path)
    doc["provenance"]["created"] = "2000-01-01T00:00:00+00:00"
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    write_manifest(reg.pair("conv", "cpu_fp32"))
    first = path.read_bytes()
    assert json.loads(first)["provenance"]["created"] == "2000-01-01T00:00:00+00:00"
    write_manifest(reg.pair("conv", "cpu_fp32"))
    assert path.read_bytes() == first


def test_manifest_with_a_new_digest_gets_new_provenance(proj):
    reg, path = proj.registry, proj.out.manifest("multi", "cpu_fp32")
    doc = read_json(path)
    doc["provenance"]["created"] = "2000-01-01T00:00:00+00:00"
    doc["digest"] = "0" * 64
    path.write_text(json.dumps(doc))
    manifest = write_manifest(reg.pair("multi", "cpu_fp32"))
    assert manifest.provenance.created != "2000-01-01T00:00:00+00:00"
    assert read_json(path)["digest"] == manifest.digest != "0" * 64


def test_edited_manifest_is_refused(proj):
    doc = read_json(proj.out.manifest("conv", "cpu_int8"))
    doc["correctness"]["passed"] = False
    with pytest.raises(InputError, match="digest does not match"):
        validate_document(doc)
    del doc["digest"]
    with pytest.raises(InputError, match="schema"):
        validate_document(doc)


# --- gates --------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_zero_tolerance_on_int8_fails_the_gate_and_still_writes_the_report(proj, model):
    with pytest.raises(GateFailed) as info:
        validate(proj.registry.pair(model, "strict_int8"))
    assert info.value.exit_code == 1
    assert "atol=0" in info.value.message
    rep = read_json(proj.out.report(model, "strict_int8", "validate"))
    assert rep["passed"] is False and rep["failures"]
    assert any(not o["passed"] for o in rep["outputs"])
    assert rep["placement"]["passed"] is True


@pytest.mark.parametrize("model", MODELS)
def test_placement_gate_names_the_offending_nodes(proj, model):
    with pytest.raises(GateFailed) as info:
        validate(proj.registry.pair(model, "elsewhere"))
    assert info.value.exit_code == 1
    layers = proj.build[model, "elsewhere"].layers
    assert "placement" in info.value.message and "SomeOtherEP" in info.value.message
    for layer in layers:
        assert f"{layer.name} ({layer.op_type}) on {CPU}" in info.value.message
    rep = read_json(proj.out.report(model, "elsewhere", "validate"))
    assert rep["passed"] is False and rep["placement"]["passed"] is False
    assert [o["name"] for o in rep["placement"]["offending"]] == [layer.name for layer in layers]
    assert all(o["passed"] for o in rep["outputs"])  # the numbers were fine; only placement failed


@pytest.mark.parametrize("model, damage", [("conv", "truncate"), ("multi", "flip")])
def test_tampered_engine_is_refused(proj, model, damage):
    engine = proj.out.engine_dir(model, "tamper") / "model.onnx"
    data = engine.read_bytes()
    if damage == "truncate":
        engine.write_bytes(data[: len(data) // 2])
    else:  # same size, one byte changed
        engine.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(InputError) as info:
        validate(proj.registry.pair(model, "tamper"))
    assert "truncated or altered" in info.value.message and info.value.exit_code == 2
    with pytest.raises(InputError):
        bench(proj.registry.pair(model, "tamper"))


def test_validate_before_build_says_what_to_run(proj):
    with pytest.raises(InputError) as info:
        validate(proj.registry.pair("conv", "unbuilt"))
    assert "build" in info.value.hint


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [build, validate, bench])
def test_sku_for_another_host_is_an_environment_problem(proj, stage):
    with pytest.raises(EnvironmentProblem) as info:
        stage(proj.registry.pair("conv", "foreign"))
    err = info.value
    assert err.exit_code == 3
    assert f"needs arch {OTHER_ARCH}" in err.message and "foreign" in err.message
    assert "self-hosted, linux, foreign-box" in err.hint
    assert not proj.out.sku_dir("conv", "foreign").exists()  # no placeholder engine


def test_toolchain_mismatch_is_an_environment_problem(proj):
    with pytest.raises(EnvironmentProblem) as info:
        build(proj.registry.pair("conv", "old_toolchain"))
    assert "onnxruntime" in info.value.message and "<1.0" in info.value.message
    assert not proj.out.sku_dir("conv", "old_toolchain").exists()


def test_empty_calibration_set_is_refused(tmp_path):
    spec = {**models.conv_bn_spec(), "datasets": {"calibration": {"path": "cal.npz"}}}
    reg = new_project(tmp_path, {"conv": (models.conv_bn_model, spec)})
    np.savez(tmp_path / spec["dir"] / "cal.npz", x=np.zeros((0, 3, 8, 8), np.float32))
    with pytest.raises(InputError) as info:
        make_data(reg, "conv")
    assert "calibration" in info.value.message and "empty" in info.value.message
    assert not Layout(reg.root).report("conv", None, "data").exists()


def test_calibration_set_from_a_file(tmp_path):
    spec = {**models.conv_bn_spec(), "datasets": {"calibration": {"path": "cal.npz", "take": 5}}}
    reg = new_project(tmp_path, {"conv": (models.conv_bn_model, spec)})
    np.savez(tmp_path / spec["dir"] / "cal.npz", x=np.random.default_rng(0).uniform(size=(8, 3, 8, 8)))
    rep = make_data(reg, "conv")
    assert rep.splits["calibration"].samples == 5 and rep.splits["calibration"].source == "models/conv/cal.npz"
    with np.load(Layout(reg.root).split("conv", "calibration")) as f:
        assert f["x"].dtype == np.float32  # float64 on disk, cast to the input dtype


def test_nan_reference_is_refused(tmp_path):
    spec = {"dir": "models/nan", "source": "model.onnx", "inputs": [{"name": "x", "shape": ["batch", 4]}]}
    reg = new_project(tmp_path, {"nan": (models.nan_model, spec)})
    prepare(reg, "nan")
    make_data(reg, "nan")
    with pytest.raises(InputError) as info:
        reference(reg, "nan")
    assert "NaN" in info.value.message and "'y'" in info.value.message and info.value.exit_code == 2
    assert not Layout(reg.root).report("nan", None, "reference").exists()


def test_prepare_refuses_an_unknown_output(tmp_path):
    spec = {**models.conv_bn_spec(), "outputs": ["logits_typo"]}
    reg = new_project(tmp_path, {"conv": (models.conv_bn_model, spec)})
    with pytest.raises(InputError, match="logits_typo"):
        prepare(reg, "conv")


def test_prepare_refuses_a_shape_contradicting_the_model(tmp_path):
    spec = models.conv_bn_spec()
    spec["inputs"][0]["shape"] = ["batch", 1, 8, 8]
    reg = new_project(tmp_path, {"conv": (models.conv_bn_model, spec)})
    with pytest.raises(InputError, match="'x' dim 1 is fixed to 3"):
        prepare(reg, "conv")


def _poison(value):
    """A graph pass that changes the model's function: adds ``value`` to the final bias."""

    def poison(model):
        for init in model.graph.initializer:
            if init.name == "fc_b":
                init.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(init) + value).astype(np.float32), "fc_b"))
                return ["poisoned fc_b"]
        return []

    return poison


@pytest.fixture()
def conv_only(tmp_path):
    return new_project(tmp_path, {"conv": (models.conv_bn_model, models.conv_bn_spec())})


def test_prepare_self_check_catches_a_pass_that_changes_outputs(conv_only, monkeypatch):
    monkeypatch.setattr(graph, "PASSES", (("poison", _poison(np.array([5.0, 0, 0, 0]))), *graph.PASSES))
    with pytest.raises(GateFailed, match="graph passes changed the model's outputs"):
        prepare(conv_only, "conv")
    assert not Layout(conv_only.root).prepared_model("conv").exists()


def test_prepare_self_check_catches_a_pass_that_makes_nan(conv_only, monkeypatch):
    monkeypatch.setattr(graph, "PASSES", (("poison", _poison(np.full(4, np.nan))), *graph.PASSES))
    with pytest.raises(GateFailed):
        prepare(conv_only, "conv")


def test_damaged_dataset_file_is_an_input_error(conv_only):
    prepare(conv_only, "conv")
    make_data(conv_only, "conv")
    golden = Layout(conv_only.root).split("conv", "golden")
    golden.write_bytes(golden.read_bytes()[:100])
    with pytest.raises(InputError):
        reference(conv_only, "conv")


def test_failed_build_keeps_the_previous_engine(tmp_path):
    reg = new_project(
        tmp_path, {"conv": (models.conv_bn_model, models.conv_bn_spec())}, {"int8": models.ort_sku("int8")}
    )
    for stage in (prepare, make_data, calibrate):
        stage(reg, "conv")
    first = build(reg.pair("conv", "int8"))
    engine = Layout(reg.root).engine_dir("conv", "int8")
    calibration_table(reg, "conv").write_text("{not json")
    with pytest.raises(InputError, match="calibration table"):
        build(reg.pair("conv", "int8"))
    verify_engine(engine, "skuforge-onnxruntime/1")
    assert sha256_file(engine / "model.onnx") == first.engine_files[0].sha256
    assert sorted(p.name for p in engine.parent.iterdir()) == ["build.json", "engine"]  # no staging left over


def test_int8_build_without_calibration_says_what_to_run(tmp_path):
    reg = new_project(
        tmp_path, {"conv": (models.conv_bn_model, models.conv_bn_spec())}, {"int8": models.ort_sku("int8")}
    )
    prepare(reg, "conv")
    make_data(reg, "conv")
    with pytest.raises(InputError) as info:
        build(reg.pair("conv", "int8"))
    assert "calibrate" in info.value.hint
    assert not Layout(reg.root).engine_dir("conv", "int8").exists()


def test_profile_axis_stays_dynamic_in_the_engine_and_runs_at_opt(tmp_path):
    sku = models.ort_sku("fp32", shapes={}, profiles={"batch": {"min": 1, "opt": 4, "max": 8}})
    reg = new_project(tmp_path, {"conv": (models.conv_bn_model, models.conv_bn_spec())}, {"dyn": sku})
    for stage in (prepare, make_data, reference):
        stage(reg, "conv")
    report = build(reg.pair("conv", "dyn"))
    assert report.shapes == {} and report.profiles == {"batch": {"min": 1, "opt": 4, "max": 8}}
    engine = ort.InferenceSession(str(Layout(reg.root).engine_dir("conv", "dyn") / "model.onnx"))
    assert isinstance(engine.get_inputs()[0].shape[0], str)  # the batch axis is still symbolic
    assert validate(reg.pair("conv", "dyn")).passed
    assert bench(reg.pair("conv", "dyn")).batch == 4


def test_fixed_batch_model_records_no_batch_pin(tmp_path):
    spec = models.conv_bn_spec(batch=2)
    reg = new_project(
        tmp_path,
        {"conv": (lambda p: models.conv_bn_model(p, batch=2), spec)},
        {"cpu": models.ort_sku("fp32", shapes={})},
    )
    for stage in (prepare, make_data, reference):
        stage(reg, "conv")
    assert build(reg.pair("conv", "cpu")).shapes == {}
    assert validate(reg.pair("conv", "cpu")).passed


def test_precision_gate_names_layers_that_ran_in_another_precision(tmp_path):
    # ONNX Runtime's QDQ quantizer leaves ReduceSum in FP32: an INT8 SKU silently runs it in FP32.
    skus = {"warn": models.ort_sku("int8"), "fail": models.ort_sku("int8", precision_gate={"policy": "fail"})}
    reg = new_project(tmp_path, {"multi": (models.multi_io_model, models.multi_io_spec())}, skus)
    for stage in (prepare, make_data, reference, calibrate):
        stage(reg, "multi")
    for sku in skus:
        build(reg.pair("multi", sku))
    warned = validate(reg.pair("multi", "warn"))
    assert warned.passed and any("ReduceSum" in w for w in warned.warnings)
    assert [layer.op_type for layer in warned.precision_gate.mismatched] == ["ReduceSum"]
    with pytest.raises(GateFailed, match=r"precision: int8 was asked for but 1 layers ran in fp32.*pool \(ReduceSum"):
        validate(reg.pair("multi", "fail"))
    assert read_json(Layout(reg.root).report("multi", "fail", "validate"))["precision_gate"]["passed"] is False


def test_config_resolves_only_the_pairs_a_model_selects(tmp_path):
    from pipeline.stages.config import write_config

    table = {"a": {**models.conv_bn_spec("models/a"), "skus": ["int8"]}, "b": models.conv_bn_spec("models/b")}
    reg = load_registry(
        models.write_project(tmp_path, table, {"fp32": models.ort_sku(), "int8": models.ort_sku("int8")})
    )
    write_config(reg)
    written = sorted(p.name for p in Layout(tmp_path).config_dir().glob("*.json"))
    assert written == ["a-int8.json", "b-fp32.json", "b-int8.json", "model-a.json", "model-b.json"]
