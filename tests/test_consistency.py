"""The cross-SKU consistency matrix: a tiny project with ONNX Runtime FP32 and INT8 and OpenVINO FP32
engines, validated (which writes their golden outputs), then set against the reference and each
other; outputs that cannot be trusted are skipped with a reason; `skuforge compare` and the files
it writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import models
import numpy as np
import pytest
from cli_helpers import assert_user_error, skuforge

from pipeline.core.io import atomic_savez, read_json, sha256_arrays
from pipeline.core.paths import Layout
from pipeline.project.config import load_registry
from pipeline.results.reports import ValidationReport
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate
from pipeline.verify.consistency import (
    REFERENCE,
    consistency,
    pair_stats,
    refresh_reports,
    write_report,
)

SKUS = {
    "ort_fp32": models.ort_sku("fp32"),
    "ort_int8": models.ort_sku("int8"),
    "ov_fp32": models.ort_sku("fp32", backend="openvino", options={"device": "CPU"}),
    "tamper": models.ort_sku("fp32"),
    "unbuilt": models.ort_sku("fp32"),
}
COMPARED = ("ort_fp32", "ort_int8", "ov_fp32", "tamper")


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    pytest.importorskip("openvino", reason="the OpenVINO SKU needs the openvino package (pip install openvino)")
    root = tmp_path_factory.mktemp("consistency")
    models.conv_bn_model(root / "models/conv/model.onnx")
    reg = load_registry(models.write_project(root, {"conv": models.conv_bn_spec()}, SKUS))
    prepare(reg, "conv")
    make_data(reg, "conv")
    reference(reg, "conv")
    calibrate(reg, "conv")
    for sku in COMPARED:
        build(reg.pair("conv", sku))
        validate(reg.pair("conv", sku))
    return SimpleNamespace(registry=reg, root=root, out=Layout(root), report=consistency(reg, "conv"))


def _matrix(proj):
    (m,) = proj.report.outputs
    return m


def test_validate_writes_the_golden_outputs_it_records(proj):
    for sku in COMPARED:
        val = ValidationReport.model_validate(read_json(proj.out.report("conv", sku, "validate")))
        with np.load(proj.out.engine_outputs("conv", sku)) as f:
            arrays = {k: f[k] for k in f.files}
        assert list(arrays) == ["probs"] and arrays["probs"].shape == (32, 4)
        assert val.outputs_sha256 == sha256_arrays(arrays)


def test_matrix_is_symmetric_with_a_zero_diagonal(proj):
    m = _matrix(proj)
    assert m.labels == [REFERENCE, *COMPARED]
    assert m.kind == "probabilities" and m.shape == [32, 4] and m.dtype == "float32"  # softmax: inferred
    for metric in ("max_abs_error", "mean_abs_error", "nonfinite_mismatch", "top1_agreement"):
        table = np.array(getattr(m, metric))
        assert table.shape == (5, 5)
        assert (table == table.T).all(), metric
    assert (np.diag(m.max_abs_error) == 0).all() and (np.diag(m.mean_abs_error) == 0).all()
    assert (np.diag(m.top1_agreement) == 1).all()
    agreement = np.array(m.top1_agreement)
    assert ((agreement >= 0) & (agreement <= 1)).all()
    assert (np.array(m.mean_abs_error) <= np.array(m.max_abs_error)).all()
    assert all(v.nan == 0 and v.inf == 0 for v in m.nonfinite.values()) and not np.any(m.nonfinite_mismatch)


def test_fp32_engines_agree_closely_and_int8_less(proj):
    m = _matrix(proj)
    assert m.cell("max_abs_error", REFERENCE, "ort_fp32") <= 1e-5
    assert m.cell("max_abs_error", "ort_fp32", "ov_fp32") <= 1e-4  # two compiler stacks, same FP32 function
    assert m.cell("top1_agreement", "ort_fp32", "ov_fp32") == 1.0
    int8 = m.cell("max_abs_error", REFERENCE, "ort_int8")
    assert int8 > 10 * max(m.cell("max_abs_error", REFERENCE, "ort_fp32"), 1e-7)
    assert m.cell("max_abs_error", "ov_fp32", "ort_int8") > m.cell("max_abs_error", "ov_fp32", "ort_fp32")
    # the matrix agrees with validate's own comparison against the reference
    val = ValidationReport.model_validate(read_json(proj.out.report("conv", "ort_int8", "validate")))
    assert int8 == pytest.approx(val.outputs[0].max_abs_error)


def test_skus_are_listed_with_their_engine_and_the_unbuilt_one_is_skipped(proj):
    assert [s.sku for s in proj.report.skus] == list(COMPARED)
    ov = next(s for s in proj.report.skus if s.sku == "ov_fp32")
    assert ov.backend == "openvino" and ov.precision == "fp32" and ov.validate_passed
    assert [(s.sku, s.reason) for s in proj.report.skipped] == [
        ("unbuilt", "not validated in this checkout (no validate.json)")
    ]
    assert proj.report.samples == 32


@pytest.fixture()
def restore(proj):
    """Put back the files a test damages."""
    saved = {}

    def keep(path: Path) -> Path:
        saved[path] = path.read_bytes()
        return path

    yield keep
    for path, data in saved.items():
        path.write_bytes(data)


def test_tampered_outputs_are_skipped_with_the_reason(proj, restore):
    path = restore(proj.out.engine_outputs("conv", "tamper"))
    with np.load(path) as f:
        probs = f["probs"].copy()
    probs[0, 0] += 0.5
    atomic_savez(path, probs=probs)
    report = consistency(proj.registry, "conv")
    assert "tamper" not in [s.sku for s in report.skus]
    reason = {s.sku: s.reason for s in report.skipped}["tamper"]
    assert "sha256" in reason and "validate.json records" in reason and "skuforge validate" in reason, reason
    assert "tamper" not in report.outputs[0].labels


@pytest.mark.parametrize("damage", ["deleted", "garbage"])
def test_missing_or_damaged_outputs_are_skipped(proj, restore, damage):
    path = restore(proj.out.engine_outputs("conv", "tamper"))
    if damage == "deleted":
        path.unlink()
    else:
        path.write_bytes(b"not a zip")
    reason = {s.sku: s.reason for s in consistency(proj.registry, "conv").skipped}["tamper"]
    assert ("does not exist" if damage == "deleted" else "damaged") in reason, reason
    assert str(proj.root) not in reason  # relative paths: the checked-in report does not depend on the checkout


def test_report_of_another_engine_is_skipped(proj, restore):
    path = restore(proj.out.report("conv", "tamper", "validate"))
    doc = read_json(path)
    doc["engine_sha256"] = "0" * 64
    path.write_text(json.dumps(doc))
    reason = {s.sku: s.reason for s in consistency(proj.registry, "conv").skipped}["tamper"]
    assert "validate.json is about engine 000000000000" in reason and "build.json describes" in reason, reason


def test_report_without_recorded_outputs_is_skipped(proj, restore):
    path = restore(proj.out.report("conv", "tamper", "validate"))
    doc = read_json(path)
    doc.pop("outputs_sha256")
    path.write_text(json.dumps(doc))
    reason = {s.sku: s.reason for s in consistency(proj.registry, "conv").skipped}["tamper"]
    assert "records no golden outputs" in reason, reason


def test_written_report_is_stable_and_readable(proj, tmp_path):
    files = write_report(proj.registry, proj.report)
    assert files == ["reports/consistency/conv.json", "reports/consistency/conv.md"]
    first = {f: (proj.root / f).read_bytes() for f in files}
    assert refresh_reports(proj.registry) == {"conv": files}  # recomputed from the files: the same bytes
    assert {f: (proj.root / f).read_bytes() for f in files} == first
    doc = json.loads(first["reports/consistency/conv.json"])
    assert doc == proj.report.to_json()
    text = first["reports/consistency/conv.md"].decode()
    assert str(proj.root) not in text and "created" not in text
    assert "| ort_int8 |" in text and "- unbuilt: not validated" in text
    assert "## output `probs` float32 [32, 4], probabilities: max abs error (top-1 agreement)" in text


def test_refresh_keeps_an_older_report_when_nothing_can_be_compared(tmp_path):
    models.conv_bn_model(tmp_path / "models/conv/model.onnx")
    reg = load_registry(models.write_project(tmp_path, {"conv": models.conv_bn_spec()}, {"cpu": models.ort_sku()}))
    assert "reference" in refresh_reports(reg)["conv"]  # no reference yet: nothing written
    assert not (tmp_path / "reports").exists()


def test_cli_compare_json_and_text(proj):
    proc = skuforge("compare", "--model", "conv", "--json", cwd=proj.root)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["model"] == "conv" and [s["sku"] for s in doc["skus"]] == list(COMPARED)
    assert doc["outputs"][0]["labels"] == [REFERENCE, *COMPARED]
    proc = skuforge("compare", "--model", "conv", cwd=proj.root)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("conv: 32 golden samples; 4 SKUs compared: ort_fp32 (onnxruntime fp32)"), proc.stdout
    assert "not compared: unbuilt: not validated" in proc.stdout
    header = next(x for x in lines if x.split()[:1] == [REFERENCE] and "ort_fp32" in x)
    assert header.split() == [REFERENCE, *COMPARED]
    row = next(x for x in lines if x.split()[:1] == ["ort_int8"])
    assert "%)" in row  # top-1 agreement next to each error


def test_cli_compare_unknown_model_exits_2(proj):
    assert_user_error(skuforge("compare", "--model", "nope", cwd=proj.root), 2, "nope")


def test_cli_compare_without_reference_exits_2(tmp_path):
    models.conv_bn_model(tmp_path / "models/conv/model.onnx")
    models.write_project(tmp_path, {"conv": models.conv_bn_spec()}, {"cpu": models.ort_sku()})
    assert_user_error(
        skuforge("compare", "--model", "conv", cwd=tmp_path), 2, "build/conv/reference", "skuforge reference"
    )


def test_cli_compare_write(proj, tmp_path):
    copy = tmp_path / "p"
    shutil.copytree(proj.root, copy)
    proc = skuforge("compare", "--model", "conv", "--write", cwd=copy)
    assert proc.returncode == 0, proc.stderr
    assert "wrote reports/consistency/conv.md" in proc.stderr
    assert json.loads((copy / "reports/consistency/conv.json").read_text())["model"] == "conv"


@pytest.mark.slow
def test_repro_refreshes_the_checked_in_matrix(tmp_path):
    from test_matrix import dvc_project, good_model, run

    root = dvc_project(tmp_path, good_model(tmp_path), {"fp32": models.ort_sku("fp32"), "int8": models.ort_sku("int8")})
    proc = run(root, "repro", "--no-publish")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "consistency good: wrote reports/consistency/good.json, reports/consistency/good.md" in proc.stderr
    doc = json.loads((root / "reports/consistency/good.json").read_text())
    assert [s["sku"] for s in doc["skus"]] == ["fp32", "int8"] and doc["skipped"] == []
    # DVC caches (and pushes) the golden outputs with validate.json
    lock = (root / "pipelines/int8/run/dvc.lock").read_text() + (root / "pipelines/fp32/run/dvc.lock").read_text()
    assert "build/good/int8/outputs.npz" in lock and "build/good/fp32/outputs.npz" in lock
    before = (root / "reports/consistency/good.md").read_bytes()
    again = run(root, "repro", "--no-publish", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["consistency"] == {
        "good": ["reports/consistency/good.json", "reports/consistency/good.md"]
    }
    assert (root / "reports/consistency/good.md").read_bytes() == before


# --- the metrics on their own ---------------------------------------------------------------------


def test_pair_stats_take_errors_over_finite_elements_and_count_non_finite_apart():
    a = np.array([[0.1, 0.9], [np.nan, 1.0]], np.float32)
    assert pair_stats(a, a.copy(), True) == (0.0, 0.0, 0, 1.0)  # NaN against NaN agrees
    b = np.array([[0.8, 0.2], [0.5, 0.5]], np.float32)
    mx, mean, mismatch, top1 = pair_stats(a, b, True)
    assert mx == pytest.approx(0.7) and mean == pytest.approx((0.7 + 0.7 + 0.5) / 3) and mismatch == 1
    assert top1 == 0.0  # row 0 disagrees; row 1 has a NaN on one side only
    assert pair_stats(b, a, True) == (mx, mean, mismatch, top1)  # symmetric
    assert pair_stats(np.full(3, np.nan), np.zeros(3), False) == (None, None, 3, None)


def test_top1_ties_on_either_side_agree():
    tie = np.array([[0.5, 0.5]], np.float32)
    assert pair_stats(tie, np.array([[0.4, 0.6]], np.float32), True)[3] == 1.0
    assert pair_stats(np.array([[0.4, 0.6]], np.float32), np.array([[0.6, 0.4]], np.float32), True)[3] == 0.0


def test_declared_logits_get_top1_agreement(tmp_path):
    from pipeline.verify.consistency import _matrix

    logits = np.array([[2.0, -1.0], [0.5, 3.0]], np.float32)
    assert _matrix("y", logits, {"s": logits}, None).top1_agreement is None  # values alone say regression
    m = _matrix("y", logits, {"s": logits[:, ::-1].copy()}, "logits")
    assert m.kind == "logits" and m.cell("top1_agreement", REFERENCE, "s") == 0.0
