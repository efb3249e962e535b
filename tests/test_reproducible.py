"""Reproducibility check: the engine built twice and compared (pipeline/verify/reproducible.py).

Real builds of the conv_bn model on every CPU backend here. The second build runs in a new
process; the bitwise cases go through `skuforge build --check-reproducible`, so the first build is
in a fresh process too (OpenVINO names the nodes it makes with a counter per process: two builds
in one process never match). Differences are planted faults: a stamp written into the engine
file (bytes differ, the engine does not), or a weight perturbed on the second build.
"""

from __future__ import annotations

import importlib.util
import json
import os
import textwrap
from pathlib import Path
from types import SimpleNamespace

import models
import numpy as np
import onnx
import pytest
from cli_helpers import skuforge
from onnx import numpy_helper

from pipeline.backends.onnxruntime import OnnxRuntimeBackend
from pipeline.core.errors import ConfigError, EnvironmentProblem, GateFailed
from pipeline.core.io import read_json
from pipeline.core.paths import Layout
from pipeline.engine.build import build_engine
from pipeline.project.config import load_registry, parse_registry
from pipeline.results.manifest import validate_document
from pipeline.results.reports import BuildReport, LayerInfo
from pipeline.stages.bench import bench
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.manifest import write_manifest
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate
from pipeline.verify import reproducible
from pipeline.verify.reproducible import layer_changes

IREE_CPU = "x86-64-v3" if models.ort_sku()["target"]["arch"] == "x86_64" else "host"
SKUS = {
    "ort_fp32": models.ort_sku("fp32", reproducibility={"check": True}),
    "ort_int8": models.ort_sku("int8", reproducibility={"require": "bitwise"}),
    "ov_fp32": models.ort_sku("fp32", backend="openvino", options={"device": "CPU"}),
    "ov_int8": models.ort_sku("int8", backend="openvino", options={"device": "CPU", "per_channel": True}),
    "iree_fp32": models.ort_sku("fp32", backend="iree", options={"target_device": "local", "target_cpu": IREE_CPU}),
    "iree_fp16": models.ort_sku("fp16", backend="iree", options={"target_device": "local", "target_cpu": IREE_CPU}),
    "unchecked": models.ort_sku("fp32"),
    "stamped": models.ort_sku("fp32", reproducibility={"require": "bitwise"}),
    "equivalent_ok": models.ort_sku("fp32", reproducibility={"require": "equivalent"}),
}
SDK = {"onnxruntime": "onnxruntime", "openvino": "openvino", "iree": "iree.compiler"}
STAMP = "skuforge-test-stamp"  # planted into model.onnx's doc_string: a timestamp as some compilers write one


def _has(module: str) -> bool:
    return importlib.util.find_spec(module.split(".")[0]) is not None and importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    root = tmp_path_factory.mktemp("repro")
    models.conv_bn_model(root / "models/conv/model.onnx")
    reg = load_registry(models.write_project(root, {"conv": models.conv_bn_spec()}, SKUS))
    for stage in (prepare, make_data, reference, calibrate):
        stage(reg, "conv")
    return SimpleNamespace(registry=reg, root=root, out=Layout(reg.root))


def _cli_build(proj, sku: str, *flags: str, env: dict | None = None):
    return skuforge("build", "--model", "conv", "--sku", sku, *flags, "--json", cwd=proj.root, env=env, timeout=300)


# --- every backend here: a rebuild is the same engine, byte for byte ---------------------------


@pytest.mark.parametrize("sku", ["ort_fp32", "ort_int8", "ov_fp32", "ov_int8", "iree_fp32", "iree_fp16"])
def test_rebuild_is_bitwise_identical(proj, sku):
    if not _has(SDK[SKUS[sku]["backend"]]):
        pytest.skip(f"{SKUS[sku]['backend']} is not installed")
    proc = _cli_build(proj, sku, "--check-reproducible")
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    report = BuildReport.model_validate(read_json(proj.out.report("conv", sku, "build")))
    assert printed == report.to_json()
    r = report.reproducibility
    assert r.verdict == "bitwise" and r.passed, r
    assert r.differing_files == [] and r.outputs == [] and r.samples == 0
    assert not (r.layers_added or r.layers_removed or r.layers_changed)


def test_sku_option_checks_without_the_flag_and_unchecked_builds_say_nothing(proj):
    reg = proj.registry
    assert build(reg.pair("conv", "ort_fp32")).reproducibility.verdict == "bitwise"  # reproducibility.check: true
    report = build(reg.pair("conv", "unchecked"))
    assert report.reproducibility is None
    assert "reproducibility" not in read_json(proj.out.report("conv", "unchecked", "build"))


def test_the_check_leaves_the_engine_hash_and_the_cache_alone(proj):
    reg = proj.registry
    plain = build(reg.pair("conv", "unchecked"))
    checked = build(reg.pair("conv", "unchecked"), check_reproducible=True)
    assert checked.reproducibility.verdict == "bitwise"
    assert (checked.engine_sha256, checked.build_config_sha256) == (plain.engine_sha256, plain.build_config_sha256)
    cache = proj.out.cache_dir("conv", "unchecked")
    assert sorted(p.name for p in cache.iterdir()) == ["cache.json"]


# --- planted differences -------------------------------------------------------------------------


def _second_build_planted(monkeypatch, plant) -> None:
    """The second build in this process, with ``plant(engine_dir)`` applied to what it wrote."""
    original = OnnxRuntimeBackend.build

    def planted(self, ctx):
        outcome = original(self, ctx)
        plant(ctx.engine_dir / "model.onnx")
        return outcome

    def in_process(pair, keep_precise=None):
        def rebuild(engine_dir, cache_dir):
            with monkeypatch.context() as m:
                m.setattr(OnnxRuntimeBackend, "build", planted)
                return build_engine(pair, engine_dir, cache_dir=cache_dir, keep_precise=keep_precise)

        return rebuild

    monkeypatch.setattr(reproducible, "in_new_process", in_process)


def _stamp(path: Path) -> None:
    model = onnx.load(str(path))
    model.doc_string = f"{STAMP} {os.getpid()}"
    onnx.save(model, str(path))


def _perturb_weight(path: Path) -> None:
    model = onnx.load(str(path))
    tensor = next(t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and t.dims)
    array = numpy_helper.to_array(tensor).copy()
    array.flat[0] += 0.25
    tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
    onnx.save(model, str(path))


def test_stamp_in_the_file_is_equivalent(proj, monkeypatch):
    _second_build_planted(monkeypatch, _stamp)
    report = build(proj.registry.pair("conv", "equivalent_ok"))
    r = report.reproducibility
    assert r.verdict == "equivalent" and r.passed and r.required == "equivalent"
    assert r.differing_files == ["model.onnx"]
    assert r.outputs == [] and r.samples == 32  # the whole default golden set, bit for bit
    assert not (r.layers_added or r.layers_removed or r.layers_changed)


def test_perturbed_weight_differs_with_the_outputs_named(proj, monkeypatch):
    _second_build_planted(monkeypatch, _perturb_weight)
    r = build(proj.registry.pair("conv", "unchecked"), check_reproducible=True).reproducibility
    assert r.verdict == "differs" and r.passed  # required none: recorded, not a failure
    assert r.differing_files == ["model.onnx"]
    assert [o.output for o in r.outputs] == ["probs"]
    assert 0 < r.outputs[0].max_abs_diff < 1 and 0 < r.outputs[0].differing <= 1
    assert any("output probs" in line and "max abs diff" in line for line in reproducible.describe(r))


def test_below_the_required_level_fails_after_writing_the_report(proj, monkeypatch):
    _second_build_planted(monkeypatch, _perturb_weight)
    with pytest.raises(GateFailed) as exc:
        build(proj.registry.pair("conv", "equivalent_ok"))
    assert exc.value.exit_code == 1
    assert "'equivalent'" in exc.value.message and "output probs" in exc.value.message
    r = BuildReport.model_validate(read_json(proj.out.report("conv", "equivalent_ok", "build"))).reproducibility
    assert r.verdict == "differs" and not r.passed


def test_unverified_where_this_host_cannot_run_the_engine(proj, monkeypatch):
    _second_build_planted(monkeypatch, _stamp)
    monkeypatch.setattr(reproducible, "sku_host_problems", lambda *a: ["needs device gpu (planted)"])
    with pytest.raises(GateFailed, match="outputs not compared"):
        build(proj.registry.pair("conv", "equivalent_ok"))
    r = BuildReport.model_validate(read_json(proj.out.report("conv", "equivalent_ok", "build"))).reproducibility
    assert r.verdict == "unverified" and r.samples == 0 and r.not_run == ["needs device gpu (planted)"]


def _plant_in_every_process(tmp_path: Path, wrapper: str) -> str:
    """A folder to put first on PYTHONPATH: its sitecustomize wraps the ONNX Runtime backend's build
    in every process started with it (the CLI's, and the new one the second build runs in).
    ``wrapper`` is the body of ``build(self, ctx)``; ``original`` is the real one."""
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(
        "import multiprocessing, os, time\n"
        "import onnx\n"
        "from pipeline.backends.onnxruntime import OnnxRuntimeBackend\n"
        "from pipeline.core.errors import UnsupportedOp\n"
        "original = OnnxRuntimeBackend.build\n"
        "def build(self, ctx):\n"
        + textwrap.indent(textwrap.dedent(wrapper), "    ")
        + "OnnxRuntimeBackend.build = build\n"
    )
    return os.pathsep.join([str(plant), os.environ.get("PYTHONPATH", "")])


def test_cli_exits_1_below_the_required_level_and_writes_the_report(proj, tmp_path):
    """A compiler that stamps each engine it writes: the SKU requires bitwise, the verdict is equivalent."""
    path = _plant_in_every_process(
        tmp_path,
        f"""
        outcome = original(self, ctx)
        model = onnx.load(str(ctx.engine_dir / "model.onnx"))
        model.doc_string = "{STAMP} " + str(time.time_ns())
        onnx.save(model, str(ctx.engine_dir / "model.onnx"))
        return outcome
    """,
    )
    proc = _cli_build(proj, "stamped", env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "skuforge: error:" in proc.stderr and "hint:" in proc.stderr and "Traceback" not in proc.stderr
    assert "'bitwise'" in proc.stderr and "model.onnx" in proc.stderr
    assert "identical bit for bit" in proc.stderr
    report = BuildReport.model_validate(read_json(proj.out.report("conv", "stamped", "build")))
    assert report.reproducibility.verdict == "equivalent" and not report.reproducibility.passed
    assert report.reproducibility.differing_files == ["model.onnx"]


def test_a_failing_second_build_keeps_its_exit_code(proj, tmp_path, monkeypatch):
    """UnsupportedOp does not survive pickling: the failure travels as data and comes back as exit 3."""
    monkeypatch.setenv(
        "PYTHONPATH",
        _plant_in_every_process(
            tmp_path,
            """
        if multiprocessing.parent_process() is not None:  # only in the second build's process
            raise UnsupportedOp("onnxruntime", "Conv", "conv", "planted in the rebuild")
        return original(self, ctx)
    """,
        ),
    )
    with pytest.raises(
        EnvironmentProblem, match="second build failed where the first passed.*planted in the rebuild"
    ) as exc:
        build(proj.registry.pair("conv", "unchecked"), check_reproducible=True)
    assert exc.value.exit_code == 3 and exc.value.hint


# --- the manifest ---------------------------------------------------------------------------------


def test_manifest_carries_the_verdict(proj):
    reg = proj.registry
    for sku in ("ort_fp32", "unchecked"):
        build(reg.pair("conv", sku))
        validate(reg.pair("conv", sku))
        bench(reg.pair("conv", sku))
    checked = write_manifest(reg.pair("conv", "ort_fp32"))
    assert checked.build.reproducibility.verdict == "bitwise"
    doc = read_json(proj.out.manifest("conv", "ort_fp32"))
    validate_document(doc)
    assert doc["build"]["reproducibility"]["verdict"] == "bitwise"
    write_manifest(reg.pair("conv", "unchecked"))
    assert "reproducibility" not in read_json(proj.out.manifest("conv", "unchecked"))["build"]


# --- the comparison and the option ------------------------------------------------------------


def _layer(name: str, **kw) -> LayerInfo:
    return LayerInfo(name=name, op_type=kw.pop("op_type", "Conv"), **kw)


def test_layer_changes_match_by_name_and_occurrence():
    first = [_layer("a", kernel="k1"), _layer("b"), _layer(""), _layer(""), _layer("gone")]
    second = [_layer("a", kernel="k2"), _layer("b"), _layer(""), _layer("", precision="fp16"), _layer("new")]
    added, removed, changed = layer_changes(first, second)
    assert (added, removed) == (["new"], ["gone"])
    assert changed == ["a: kernel 'k1' -> 'k2'", "#2: precision None -> 'fp16'"]
    assert layer_changes(first, first) == ([], [], [])
    assert layer_changes(first[:2], first[1::-1])[2] == ["(order): the same layers in another order"]


def test_output_diff_is_bitwise():
    same = np.array([1.0, np.nan, -0.0], np.float32)
    assert reproducible.output_diff("y", same, same.copy()) is None
    signed_zero = reproducible.output_diff("y", same, np.array([1.0, np.nan, 0.0], np.float32))
    assert signed_zero.max_abs_diff == 0.0 and signed_zero.differing == pytest.approx(1 / 3)
    one_nan = reproducible.output_diff("y", same, np.array([1.0, 2.0, -0.0], np.float32))
    assert one_nan.max_abs_diff == reproducible.FLOAT_MAX
    assert reproducible.output_diff("y", same, same[:2]).differing == 1.0


def test_require_implies_check_and_a_bad_level_names_the_key():
    def registry(option):
        return parse_registry(
            {
                "defaults": {},
                "examples": {},
                "models": {"m": models.conv_bn_spec()},
                "skus": {"s": models.ort_sku("fp32", reproducibility=option)},
            }
        )

    assert reproducible.wanted(registry({"require": "equivalent"}).sku("s"))
    assert not reproducible.wanted(registry({}).sku("s"))
    assert reproducible.wanted(registry({}).sku("s"), asked=True)
    with pytest.raises(ConfigError, match=r"skus\.s\.reproducibility\.require.*bitwise"):
        registry({"require": "exact"})
