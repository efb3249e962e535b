"""Models as other exporters write them: dynamic dims as -1, 0, unnamed or per-tensor names,
outputs whose batch axis is named differently or not at all, dynamic height/width and sequence
length, int64 scalars, PyTorch exports. Each runs prepare -> data -> reference -> calibrate ->
build -> validate on an ONNX Runtime FP32 SKU. Every hint about shapes or ranges is followed by a
test that edits params.yaml as it says and reruns to success."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import models
import numpy as np
import pytest
import yaml

from pipeline.core.errors import ConfigError, InputError
from pipeline.core.paths import Layout
from pipeline.project.config import load_registry
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.prepare import prepare, probe_batch_axes
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate

SKUS = {"cpu": models.ort_sku("fp32"), "cpu_b3": models.ort_sku("fp32", shapes={"batch": 3})}


def write(root: Path, specs: dict, skus: dict | None = None):
    models.write_project(root, specs, skus or SKUS)
    return load_registry(root / "params.yaml")


def project(root: Path, cases: dict, skus: dict | None = None):
    """``cases``: model name -> (builder, params entry)."""
    for builder, spec in cases.values():
        builder(root / spec["dir"] / spec["source"])
    return write(root, {name: spec for name, (_, spec) in cases.items()}, skus)


def run_model(reg, model: str, skus=("cpu",)) -> SimpleNamespace:
    r = SimpleNamespace(prepare=prepare(reg, model), data=make_data(reg, model))
    r.reference, r.calibrate = reference(reg, model), calibrate(reg, model)
    r.validate = {}
    for sku in skus:
        build(reg.pair(model, sku))
        r.validate[sku] = validate(reg.pair(model, sku))
        assert r.validate[sku].passed, r.validate[sku].failures
    return r


def output_batch_axes(report) -> dict[str, int | None]:
    return {o.name: o.batch_index("batch") for o in report.signature.outputs}


def arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


# --- exporter dims and batch axes, end to end -----------------------------------------------------

CASES = {
    # torch's TorchScript names per tensor: batch_size in, output_dim_0 out
    "per_tensor_names": (models.exporter_dense_model, models.dense_spec("models/a"), {"y": 0}),
    "minus_one": (lambda p: models.exporter_dense_model(p, [-1, 6], [-1, 4]), models.dense_spec("models/b"), {"y": 0}),
    "zero": (lambda p: models.exporter_dense_model(p, [0, 6], [0, 4]), models.dense_spec("models/c"), {"y": 0}),
    "unnamed": (
        lambda p: models.exporter_dense_model(p, [None, 6], [None, 4]),
        models.dense_spec("models/d"),
        {"y": 0},
    ),
    # batch at 0 and 1, found by inference (y, t) and by the two-batch probe (r, rt); a scalar without one
    "batch_positions": (
        models.batch_positions_model,
        models.dense_spec("models/e"),
        {"y": 0, "t": 1, "r": 0, "rt": 1, "total": None},
    ),
    # Resize and ConvTranspose: inference loses every dim, the probe finds the batch
    "upsample": (models.upsample_model, models.upsample_spec("models/f"), {"y": 0}),
    # dynamic sequence width and an int64 scalar input
    "sequence": (models.sequence_model, models.sequence_spec("models/g"), {"emb": 0, "pooled": 0}),
}


@pytest.fixture(scope="module")
def exporters(tmp_path_factory):
    reg = project(tmp_path_factory.mktemp("exporters"), {k: (b, s) for k, (b, s, _) in CASES.items()})
    return reg, {
        name: run_model(reg, name, skus=("cpu",) if name == "batch_positions" else ("cpu", "cpu_b3")) for name in CASES
    }


@pytest.mark.parametrize("name", list(CASES))
def test_exporter_model_runs_every_stage(exporters, name):
    reg, runs = exporters
    r = runs[name]
    assert all(v.passed for v in r.validate.values())
    # the signature carries the params' names: no -1, 0 or exporter names on the inputs
    for inp, spec in zip(r.prepare.signature.inputs, reg.model(name).inputs, strict=True):
        assert inp.shape == list(spec.shape)


@pytest.mark.parametrize("name", list(CASES))
def test_exporter_model_batch_axes_detected(exporters, name):
    _, runs = exporters
    assert output_batch_axes(runs[name].prepare) == CASES[name][2]


def test_batched_validation_splits_outputs_along_the_detected_axis(exporters):
    reg, runs = exporters
    out = Layout(reg.root)
    # upsample at batch 3: y[N,2,4H,4W] split back into samples equals the reference's per-sample outputs
    assert runs["upsample"].validate["cpu_b3"].samples["golden"] == 32
    ref = arrays(out.reference_dir("upsample") / "golden.npz")
    assert ref["y"].shape == (32, 2, 24, 20)
    seq = arrays(out.reference_dir("sequence") / "golden.npz")
    assert seq["emb"].shape == (32, 7, 4) and seq["pooled"].shape == (32, 4)


# --- PyTorch exports ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def torch_exports(tmp_path_factory):
    pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
    folder = tmp_path_factory.mktemp("torch_exports")
    files = {"torchscript": models.torch_dense_model(folder / "torchscript.onnx", dynamo=False)}
    try:
        files["dynamo"] = models.torch_dense_model(folder / "dynamo.onnx", dynamo=True)
    except Exception as exc:  # the dynamo exporter needs onnxscript and a traceable model
        files["dynamo"] = exc
    return files


@pytest.mark.parametrize("exporter, names", [("torchscript", ("batch_size", "output_dim_0")), ("dynamo", ("N", "N"))])
def test_pytorch_export_runs_every_stage(torch_exports, tmp_path, exporter, names):
    import onnx

    source = torch_exports[exporter]
    if isinstance(source, Exception):
        pytest.skip(f"torch.onnx.export(dynamo=True) failed here: {source}")
    file = onnx.load(str(source))
    assert file.graph.input[0].type.tensor_type.shape.dim[0].dim_param == names[0]
    assert file.graph.output[0].type.tensor_type.shape.dim[0].dim_param == names[1]
    spec = models.torch_dense_spec("models/torch")
    target = tmp_path / spec["dir"] / spec["source"]
    target.parent.mkdir(parents=True)
    target.write_bytes(source.read_bytes())
    reg = write(tmp_path, {"net": spec})
    r = run_model(reg, "net", skus=("cpu", "cpu_b3"))
    assert output_batch_axes(r.prepare) == {"probs": 0}
    assert r.prepare.signature.outputs[0].shape == ["batch", 3]


# --- stages run at the pinned batch ---------------------------------------------------------------


def test_reference_runs_at_the_model_pin_not_a_large_batch(tmp_path):
    # y = x - mean over the batch is 0 at batch 1; at any other batch it is not
    spec = {"dir": "models/mix", "source": "model.onnx", "inputs": [{"name": "x", "shape": ["batch", 6]}]}
    reg = project(tmp_path, {"mix": (models.batch_mixing_model, spec)})
    # an output that is 0 on every golden sample cannot judge an engine: validate refuses it
    with pytest.raises(InputError, match="the golden set does not exercise it"):
        run_model(reg, "mix")
    golden = arrays(Layout(reg.root).reference_dir("mix") / "golden.npz")["y"]
    assert golden.shape == (32, 6) and not golden.any()
    # a model pin of 4 is what the reference then runs at
    spec["pins"] = {"batch": 4}
    reg = write(tmp_path, {"mix": spec}, {"cpu": models.ort_sku("fp32", shapes={"batch": 4})})
    run_model(reg, "mix")
    assert arrays(Layout(reg.root).reference_dir("mix") / "golden.npz")["y"].any()


def test_a_model_that_runs_only_at_batch_one_passes_with_the_default_pin(tmp_path, caplog):
    # the file says the batch is dynamic (-1) but a Reshape fixes the output to [1, 4]
    reg = project(tmp_path, {"one": (models.batch_one_reshape_model, models.dense_spec("models/one"))})
    r = run_model(reg, "one")
    assert output_batch_axes(r.prepare) == {"y": None}
    assert arrays(Layout(reg.root).reference_dir("one") / "golden.npz")["y"].shape == (32, 1, 4)
    # the probe, asked about it, finds it fails at batch 2: no batch axis, a warning, no error
    spec = reg.model("one")
    data = (tmp_path / "models/one/model.onnx").read_bytes()
    assert probe_batch_axes("one", spec, reg.pins("one"), data, ["y"]) == {"y": None}
    assert "does not run at batch 2" in caplog.text


def test_probe_finds_the_axis_that_follows_the_batch(tmp_path):
    reg = project(tmp_path, {"p": (models.batch_positions_model, models.dense_spec("models/p"))})
    data = (tmp_path / "models/p/model.onnx").read_bytes()
    found = probe_batch_axes("p", reg.model("p"), reg.pins("p"), data, ["y", "t", "r", "rt", "total"])
    assert found == {"y": 0, "t": 1, "r": 0, "rt": 1, "total": None}


# --- data stays inside the declared range ---------------------------------------------------------


def test_generated_data_stays_inside_the_declared_range(tmp_path):
    reg = project(tmp_path, {"d": (models.exporter_dense_model, models.dense_spec("models/d"))})
    prepare(reg, "d")
    report = make_data(reg, "d")
    out = Layout(reg.root)
    for split in report.splits:
        x = arrays(out.split("d", split))["x"]
        assert x.min() >= -1.0 and x.max() <= 1.0, split


def test_edge_cases_add_exactly_what_the_docs_say(tmp_path):
    spec = models.dense_spec("models/d")
    spec["datasets"] = {"golden": {"generate": {"count": 8, "edge_cases": True}}}
    reg = project(tmp_path, {"d": (models.exporter_dense_model, spec)})
    run_model(reg, "d")
    out = Layout(reg.root)
    x = arrays(out.split("d", "golden"))["x"]
    assert (x[-1] == -1.0).all() and (x[-2] == 1.0).all() and (x[-4] == 0.0).all()
    assert 1.0 < np.abs(x[-3]).max() <= 4.0
    assert x[:-4].min() >= -1.0 and x[:-4].max() <= 1.0
    cal = arrays(out.split("d", "calibration"))["x"]
    assert cal.min() >= -1.0 and cal.max() <= 1.0


# --- every hint, followed -------------------------------------------------------------------------


def flow_after(text: str, prefix: str):
    """The YAML flow value (``[...]`` or ``{...}``) right after ``prefix`` in a hint."""
    match = re.search(re.escape(prefix) + r"\s*(\[[^\]]*\]|\{[^}]*\})", text)
    assert match, (prefix, text)
    return yaml.safe_load(match.group(1))


def dense_project(tmp_path: Path, x_shape=None, **extra):
    spec = {**models.dense_spec("models/d", x_shape), **extra}
    models.exporter_dense_model(tmp_path / "models/d/model.onnx", [-1, 6], ["output_dim_0", 4])
    return spec


def test_hint_minus_one_in_params_is_an_axis_name(tmp_path):
    spec = dense_project(tmp_path, [-1, 6])
    with pytest.raises(ConfigError) as info:
        write(tmp_path, {"d": spec})
    text = info.value.message + (info.value.hint or "")
    assert "got -1" in text and "axis name (e.g. batch" in text
    spec["inputs"][0]["shape"] = ["batch", 6]  # as the message says
    run_model(write(tmp_path, {"d": spec}), "d")


@pytest.mark.parametrize("wrong", [["batch", 5], ["batch", 6, 1], ["batch"]])
def test_hint_set_shape_fixes_a_contradicting_shape(tmp_path, wrong):
    spec = dense_project(tmp_path, wrong)
    with pytest.raises(InputError) as info:
        prepare(write(tmp_path, {"d": spec}), "d")
    assert info.value.exit_code == 2
    spec["inputs"][0]["shape"] = flow_after(info.value.hint, "set shape:")
    assert spec["inputs"][0]["shape"] == ["batch", 6]
    run_model(write(tmp_path, {"d": spec}), "d")


def test_hint_set_dtype(tmp_path):
    spec = dense_project(tmp_path)
    spec["inputs"][0]["dtype"] = "float64"
    with pytest.raises(InputError) as info:
        prepare(write(tmp_path, {"d": spec}), "d")
    spec["inputs"][0]["dtype"] = re.search(r"set dtype: (\w+)", info.value.hint).group(1)
    run_model(write(tmp_path, {"d": spec}), "d")


def test_hint_adds_an_undeclared_input(tmp_path):
    spec = models.sequence_spec("models/s")
    models.sequence_model(tmp_path / "models/s/model.onnx")
    spec["inputs"] = spec["inputs"][:1]  # k (an int64 scalar) left out
    with pytest.raises(InputError) as info:
        prepare(write(tmp_path, {"s": spec}), "s")
    entry = flow_after(info.value.hint, "inputs:")
    assert entry == {"name": "k", "dtype": "int64", "shape": []}
    spec["inputs"].append(entry)
    run_model(write(tmp_path, {"s": spec}), "s")


def test_hint_removes_an_input_the_model_lacks(tmp_path):
    spec = dense_project(tmp_path)
    spec["inputs"].append({"name": "mask", "dtype": "bool", "shape": ["batch", 6]})
    with pytest.raises(InputError) as info:
        prepare(write(tmp_path, {"d": spec}), "d")
    assert "remove it" in info.value.hint
    spec["inputs"] = [i for i in spec["inputs"] if i["name"] != "mask"]
    run_model(write(tmp_path, {"d": spec}), "d")


def test_hint_pins_a_dynamic_height_and_width(tmp_path):
    spec = models.upsample_spec("models/u")
    models.upsample_model(tmp_path / "models/u/model.onnx")
    del spec["pins"]
    with pytest.raises(ConfigError) as info:
        write(tmp_path, {"u": spec})
    assert "['height', 'width'] need a value under 'pins'" in info.value.message
    spec["pins"] = {"height": 4, "width": 3}
    r = run_model(write(tmp_path, {"u": spec}), "u")
    assert output_batch_axes(r.prepare) == {"y": 0}


def test_hint_sku_batch_with_an_output_without_batch_axis(tmp_path):
    spec = models.dense_spec("models/p")
    skus = {"b2": models.ort_sku("fp32", shapes={"batch": 2})}
    reg = project(tmp_path, {"p": (models.batch_positions_model, spec)}, skus)
    for stage in (prepare, make_data, reference):
        stage(reg, "p")
    build(reg.pair("p", "b2"))
    with pytest.raises(InputError) as info:
        validate(reg.pair("p", "b2"))
    assert "['total']" in info.value.message and "no batch axis" in info.value.message
    assert "set skus.b2.shapes.batch: 1" in info.value.hint
    skus["b2"]["shapes"]["batch"] = 1
    run_model(write(tmp_path, {"p": spec}, skus), "p", skus=("b2",))


def test_hint_model_pin_with_an_output_without_batch_axis(tmp_path):
    spec = {**models.dense_spec("models/p"), "pins": {"batch": 2}}
    reg = project(tmp_path, {"p": (models.batch_positions_model, spec)})
    prepare(reg, "p")
    make_data(reg, "p")
    with pytest.raises(InputError) as info:
        reference(reg, "p")
    assert "set models.p.pins.batch: 1" in info.value.hint
    spec["pins"]["batch"] = 1
    run_model(write(tmp_path, {"p": spec}), "p")


def test_hint_widen_range_for_a_calibration_file_outside_it(tmp_path):
    spec = dense_project(tmp_path)
    values = np.random.default_rng(0).uniform(-1, 1, (16, 6)).astype(np.float32)
    values[3, 2], values[9, 0] = 1.5, -2.25
    np.save(tmp_path / "models/d/cal.npy", values)
    spec["datasets"] = {"calibration": {"path": "cal.npy"}}
    reg = write(tmp_path, {"d": spec})
    prepare(reg, "d")
    with pytest.raises(InputError) as info:
        make_data(reg, "d")
    assert info.value.exit_code == 2
    assert "cal.npy" in info.value.message and "'x'" in info.value.message and "2 of 96 values" in info.value.message
    assert not Layout(reg.root).split("d", "calibration").exists()
    spec["inputs"][0]["range"] = flow_after(info.value.hint, "inputs[0].range to")
    assert spec["inputs"][0]["range"] == [-2.25, 1.5]
    r = run_model(write(tmp_path, {"d": spec}), "d")
    assert r.calibrate.samples == 16  # calibrated over the file, outliers inside the widened range


def test_hint_calibration_edge_cases_go_to_golden(tmp_path):
    spec = dense_project(tmp_path)
    spec["datasets"] = {"calibration": {"generate": {"count": 16, "edge_cases": True}}}
    with pytest.raises(ConfigError) as info:
        write(tmp_path, {"d": spec})
    assert "put edge cases in golden or hard_tail" in info.value.message
    spec["datasets"] = {
        "calibration": {"generate": {"count": 16}},
        "golden": {"generate": {"count": 16, "edge_cases": True}},
    }
    run_model(write(tmp_path, {"d": spec}), "d")


def test_suggested_shape_keeps_the_users_names_and_fills_the_rest():
    from pipeline.model.graph import suggested_shape

    assert suggested_shape([None, 3, "h"], ["batch", 4, "height"]) == ["batch", 3, "height"]
    assert suggested_shape([None, 3, "output_dim_2", None], ["n"]) == ["batch", 3, "output_dim_2", "dim3"]
    assert suggested_shape([], None) == []
    assert suggested_shape([None], None, None) == ["dim0"]


# --- as a user sees them: the CLI ----------------------------------------------------------------


def test_cli_minus_one_and_an_out_of_range_calibration_file_then_the_fixes(tmp_path):
    from cli_helpers import assert_user_error, skuforge

    spec = dense_project(tmp_path, [-1, 6])
    models.write_project(tmp_path, {"d": spec}, {"cpu": models.ort_sku("fp32")})
    assert_user_error(skuforge("prepare", "--model", "d", cwd=tmp_path), 2, "models.d.inputs", "got -1", "axis name")
    spec["inputs"][0]["shape"] = ["batch", 6]
    np.save(tmp_path / "models/d/cal.npy", np.full((4, 6), 3.0, np.float32))
    spec["datasets"] = {"calibration": {"path": "cal.npy"}}
    models.write_project(tmp_path, {"d": spec}, {"cpu": models.ort_sku("fp32")})
    assert skuforge("prepare", "--model", "d", cwd=tmp_path).returncode == 0
    done = skuforge("data", "--model", "d", cwd=tmp_path)
    assert_user_error(done, 2, "cal.npy", "'x'", "24 of 24 values outside the declared range [-1.0, 1.0]")
    assert "range to [-1.0, 3.0]" in done.stderr
    spec["inputs"][0]["range"] = [-1.0, 3.0]
    models.write_project(tmp_path, {"d": spec}, {"cpu": models.ort_sku("fp32")})
    for stage in ("data", "reference"):
        done = skuforge(stage, "--model", "d", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
