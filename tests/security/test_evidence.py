"""Evidence bound to one engine, gates that recompute and fail closed, signed provenance.

Each case tampers with what a careless or hostile user can reach (the workspace, the artifact
store, the registry's tags) and asserts the tampered build is refused: by the manifest stage, by
publish, or by a promotion gate, with a message naming what was wrong and nothing moved.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
from cli_helpers import assert_user_error, service_env, skuforge
from registry_helpers import FAST_RETRIES, make_project, sku

from pipeline.core.errors import GateFailed, InputError
from pipeline.core.io import atomic_write_json, read_json, sha256_file
from pipeline.core.paths import Layout
from pipeline.project.config import load_registry
from pipeline.results.manifest import digest, load_manifest
from pipeline.results.reports import BenchReport, ValidationReport
from pipeline.results.signing import SigningKey
from pipeline.stages.bench import bench
from pipeline.stages.manifest import write_manifest
from pipeline.stages.publish import publish
from pipeline.stages.validate import validate
from pipeline.tracking.client import TAG_CORRECTNESS, TAG_DIGEST, TAG_SIGNATURE, connect
from pipeline.tracking.evidence import collect
from pipeline.tracking.promotion import PromotionBlocked, promote
from pipeline.tracking.publish import publish_engine

pytestmark = pytest.mark.slow

CI_KEY = SigningKey.generate("test CI key")


def _ci_env(monkeypatch) -> None:
    raw = CI_KEY._private.private_bytes_raw()
    monkeypatch.setenv("SKUFORGE_SIGNING_KEY", base64.b64encode(raw).decode())


SKUS = {
    "good": sku("fp32"),
    "bad": sku("int8", tolerance={"atol": 0, "rtol": 0, "max_mismatch": 0}),
    "engine": sku("fp32"),
    "lat": sku("fp32"),
    "lat2": sku("fp32"),
    "store": sku("fp32"),
    "falsified": sku("fp32", toolchain={"onnxruntime": ">=1.20"}),
    "trusted": sku("fp32"),
    "host": sku("fp32"),
}
RELEASE = {
    "tracking": FAST_RETRIES,
    "skus": ["good"],
    "signing": {
        "keys": {"ci": CI_KEY.public_key},
        "trust": {"candidate": ["*"], "staging": ["ci"], "production": ["ci"]},
    },
}


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("evidence"), SKUS, RELEASE, failing=("bad",))


def _blocked(reg, alias: str, sku_name: str, **kw) -> PromotionBlocked:
    with pytest.raises(PromotionBlocked) as info:
        promote(reg, "conv", alias, [sku_name], **kw)
    return info.value


def _gate(exc: PromotionBlocked, name: str):
    return next(g for g in exc.report.moves[0].gates if g.name == name)


def _artifacts(reg, run_id: str) -> Path:
    return reg.root / "mlartifacts" / run_id / "artifacts"


def _redigest(path: Path, edit) -> dict:
    doc = read_json(path)
    edit(doc)
    doc["digest"] = digest(doc)
    atomic_write_json(path, doc)
    return doc


def _scaled(csv: Path, factor: float = 0.2) -> None:
    """latency.csv with every sample multiplied by ``factor`` (a faster engine than measured)."""
    lines = csv.read_text().splitlines()
    rows = (line.split(",") for line in lines[1:])
    csv.write_text("\n".join([lines[0]] + [f"{i},{float(v) * factor:.4f}" for i, v in rows]) + "\n")


def _claim_passed(doc: dict) -> None:
    c = doc["correctness"]
    c["passed"], c["failures"] = True, []
    for o in c["outputs"]:
        o["passed"] = True


def test_a_redigested_failing_manifest_is_refused_by_publish(proj):
    path = Layout(proj.root).manifest("conv", "bad")
    saved = path.read_bytes()
    try:
        _redigest(path, _claim_passed)
        with pytest.raises(InputError, match="says other things than the reports"):
            publish(proj.pair("conv", "bad"))
    finally:
        path.write_bytes(saved)


def test_a_redigested_failing_manifest_published_anyway_is_refused_by_promotion(proj):
    """A client that skips publish's own checks: the version's correctness tag and the gate
    recompute the verdict from the figures, and refuse."""
    inputs = collect(proj.pair("conv", "bad"))
    path = Layout(proj.root).manifest("conv", "bad")
    saved = path.read_bytes()
    try:
        _redigest(path, _claim_passed)
        from pipeline.results.manifest import load_manifest

        inputs = type(inputs)(**{**inputs.__dict__, "manifest": load_manifest(path)})
        result = publish_engine(connect(proj), proj, inputs)
    finally:
        path.write_bytes(saved)
    version = connect(proj).client.get_model_version(result.registered_model, result.version)
    assert version.tags[TAG_CORRECTNESS] == "failed"
    exc = _blocked(proj, "candidate", "bad")
    detail = _gate(exc, "correctness").detail
    assert "elements (100.00%, at least" in detail and "beyond atol=0.0 rtol=0.0" in detail
    assert "tagged correctness=failed" in detail
    assert not connect(proj).client.get_registered_model(result.registered_model).aliases


def test_faked_reports_signed_by_an_untrusted_key_reach_only_aliases_that_accept_any_signer(proj, monkeypatch):
    """Reports and manifest edited consistently (a workspace writer can): publish accepts them,
    signed by the developer key; candidate accepts any signer, staging only the CI key."""
    out = Layout(proj.root)
    val_path = out.report("conv", "bad", "validate")
    saved = {p: p.read_bytes() for p in (val_path, out.manifest("conv", "bad"))}
    try:
        val = ValidationReport.model_validate(read_json(val_path))
        fake = val.model_copy(
            update={
                "passed": True,
                "failures": [],
                "outputs": [
                    o.model_copy(
                        update={
                            "passed": True,
                            "mismatch_fraction": 0.0,
                            "mismatch_count": 0,
                            "max_abs_error": 0.0,
                            "min_passing_atol": 0.0,
                            "snr_db": None,
                            "top1_agreement": 1.0,
                            "top1_agree": o.top1_rows,
                        }
                    )
                    for o in val.outputs
                ],
            }
        )
        atomic_write_json(val_path, fake.to_json())
        write_manifest(proj.pair("conv", "bad"))
        publish(proj.pair("conv", "bad"))
        promote(proj, "conv", "candidate", ["bad"])  # "*": integrity only
        exc = _blocked(proj, "staging", "bad")
        assert not _gate(exc, "signature").passed
        assert "'staging' trusts only ci" in _gate(exc, "signature").detail
    finally:
        for p, data in saved.items():
            p.write_bytes(data)


def test_the_ci_key_reaches_the_aliases_that_trust_it(proj, monkeypatch):
    _ci_env(monkeypatch)
    publish(proj.pair("conv", "trusted"))
    promote(proj, "conv", "candidate", ["trusted"])
    report = promote(proj, "conv", "staging", ["trusted"])
    assert next(g for g in report.moves[0].gates if g.name == "signature").data == {"key": "ci"}


def test_a_replaced_engine_in_the_store_is_refused(proj):
    result = publish(proj.pair("conv", "engine"))
    (_artifacts(proj, result.run_id) / "engine" / "model.onnx").write_text("x\n")
    exc = _blocked(proj, "candidate", "engine")
    assert "model.onnx differs from the manifest" in _gate(exc, "engine").detail
    assert not connect(proj).client.get_registered_model(result.registered_model).aliases


def test_scaled_latency_samples_in_the_store_are_refused(proj):
    result = publish(proj.pair("conv", "lat"))
    _scaled(_artifacts(proj, result.run_id) / "reports" / "latency.csv")
    exc = _blocked(proj, "candidate", "lat")
    detail = _gate(exc, "performance").detail
    assert "latency samples" in detail and "not the ones its bench report and manifest recorded" in detail


def test_scaled_samples_with_a_matching_bench_report_in_the_store_are_refused(proj):
    """The writer rewrites bench.json to name the scaled samples: the gate recomputes their median
    and finds it outside the signed manifest's p50 interval."""
    result = publish(proj.pair("conv", "lat2"))
    reports = _artifacts(proj, result.run_id) / "reports"
    _scaled(reports / "latency.csv")
    doc = read_json(reports / "bench.json")
    doc["latency_sha256"] = sha256_file(reports / "latency.csv")
    (reports / "bench.json").write_text(json.dumps(doc))
    detail = _gate(_blocked(proj, "candidate", "lat2"), "performance").detail
    assert "p50" in detail and "is not the manifest's" in detail


def test_scaled_latency_samples_in_the_workspace_are_refused_by_publish(proj):
    csv = Layout(proj.root).latency_csv("conv", "good")
    saved = csv.read_bytes()
    try:
        _scaled(csv)
        with pytest.raises(InputError, match="latency.csv is not the samples bench.json was written with"):
            publish(proj.pair("conv", "good"))
    finally:
        csv.write_bytes(saved)


def test_edited_bench_figures_are_refused_by_publish(proj):
    path = Layout(proj.root).report("conv", "good", "bench")
    saved = path.read_bytes()
    try:
        doc = json.loads(saved)
        doc["engine_only"]["p50_ms"] /= 5
        path.write_text(json.dumps(doc))
        with pytest.raises(InputError, match="engine-only figures are not those of its samples"):
            publish(proj.pair("conv", "good"))
    finally:
        path.write_bytes(saved)


def test_a_manifest_replaced_and_retagged_in_the_store_fails_its_signature(proj):
    result = publish(proj.pair("conv", "store"))
    art = _artifacts(proj, result.run_id) / "manifest.json"
    doc = read_json(art)
    doc["benchmark"]["engine_only"]["p50_ms"] /= 5
    doc["digest"] = digest(doc)
    art.write_text(json.dumps(doc))
    connect(proj).client.set_model_version_tag(result.registered_model, result.version, TAG_DIGEST, doc["digest"])
    exc = _blocked(proj, "candidate", "store")
    assert _gate(exc, "manifest").passed
    assert "does not match" in _gate(exc, "signature").detail or "digest" in _gate(exc, "signature").detail


def test_a_garbage_signature_tag_fails_closed(proj):
    result = publish(proj.pair("conv", "good"))
    client = connect(proj).client
    client.set_model_version_tag(result.registered_model, result.version, TAG_SIGNATURE, "{not json")
    try:
        exc = _blocked(proj, "candidate", "good")
        assert not _gate(exc, "signature").passed
    finally:
        client.delete_model_version_tag(result.registered_model, result.version, TAG_SIGNATURE)
    exc = _blocked(proj, "candidate", "good")
    assert "the manifest is unsigned" in _gate(exc, "signature").detail
    publish(proj.pair("conv", "good"))  # the hint: re-publish signs the version
    assert TAG_SIGNATURE in client.get_model_version(result.registered_model, result.version).tags
    promote(proj, "conv", "candidate", ["good"])


def test_a_falsified_toolchain_and_host_are_refused(proj):
    path = Layout(proj.root).manifest("conv", "falsified")
    reg = load_registry(proj.root / "params.yaml")
    doc = read_json(path)
    doc["toolchain"]["onnxruntime"] = "0.1.0"
    doc["host"]["arch"] = "riscv64"
    doc["digest"] = digest(doc)
    from pipeline.tracking.gates import manifest_gate

    gate = manifest_gate(doc, doc["digest"], reg)
    assert not gate.passed
    assert "toolchain onnxruntime: 0.1.0 does not satisfy" in gate.detail and "riscv64" in gate.detail
    assert "the run's bench.json is missing or unreadable: nothing vouches for the manifest's host" in gate.detail
    bench_report = BenchReport.model_validate(read_json(Layout(proj.root).report("conv", "falsified", "bench")))
    gate = manifest_gate(doc, doc["digest"], reg, bench_report)
    assert "host.arch 'riscv64' is not the host the run's bench.json was timed on" in gate.detail


FORGED_CPU = "Forged CPU 9000 @ 9.9GHz"


def _forged_host(doc: dict) -> None:
    doc["host"]["cpu_model"] = FORGED_CPU
    doc["host"]["cpu_features"] = ["avx512_forged"]


def test_an_edited_host_is_refused_by_publish_naming_the_fields(proj):
    """The host block is the one bench.json was timed on: a re-digested manifest naming another
    CPU is not published (so never signed)."""
    path = Layout(proj.root).manifest("conv", "host")
    saved = path.read_bytes()
    try:
        _redigest(path, _forged_host)
        with pytest.raises(InputError) as info:
            publish(proj.pair("conv", "host"))
        assert info.value.exit_code == 2
        assert f"host.cpu_model '{FORGED_CPU}' is not the host bench.json was timed on" in info.value.message
        assert "host.cpu_features ['avx512_forged'] is not the host" in info.value.message
        assert "skuforge manifest --model conv --sku host" in info.value.hint
        proc = skuforge("publish", "--model", "conv", "--sku", "host", cwd=proj.root, env=service_env())
        assert_user_error(proc, 2, f"host.cpu_model '{FORGED_CPU}'")
    finally:
        path.write_bytes(saved)
    assert connect(proj).client.search_model_versions("name = 'conv.host'") == []


def test_an_edited_host_published_anyway_is_refused_by_promotion(proj):
    """A client that skips publish's checks uploads the forged manifest beside the run's true
    bench.json: the manifest gate compares them, and nothing moves."""
    inputs = collect(proj.pair("conv", "host"))
    path = Layout(proj.root).manifest("conv", "host")
    saved = path.read_bytes()
    try:
        _redigest(path, _forged_host)
        result = publish_engine(
            connect(proj), proj, type(inputs)(**{**inputs.__dict__, "manifest": load_manifest(path)})
        )
    finally:
        path.write_bytes(saved)
    exc = _blocked(proj, "candidate", "host")
    assert exc.exit_code == 1
    gate = _gate(exc, "manifest")
    assert not gate.passed and f"host.cpu_model '{FORGED_CPU}' is not the host the run's bench.json" in gate.detail
    assert not _gate(exc, "signature").passed  # every evidence gate fails with it
    assert not connect(proj).client.get_registered_model(result.registered_model).aliases


def test_a_bench_report_naming_no_host_vouches_for_none(proj):
    """An older bench.json says nothing about the host: the manifest stage and publish refuse it."""
    path = Layout(proj.root).report("conv", "good", "bench")
    saved = path.read_bytes()
    try:
        doc = json.loads(saved)
        del doc["host"]
        path.write_text(json.dumps(doc))
        with pytest.raises(InputError, match="does not say which host the engine was timed on") as info:
            write_manifest(proj.pair("conv", "good"))
        assert "skuforge bench --model conv --sku good" in info.value.hint
        with pytest.raises(InputError, match="bench.json records no host .*nothing vouches for the manifest's host"):
            publish(proj.pair("conv", "good"))
    finally:
        path.write_bytes(saved)


def test_a_bench_report_of_another_build_is_refused_by_the_manifest_stage(proj):
    out = Layout(proj.root)
    path = out.report("conv", "good", "bench")
    saved = path.read_bytes()
    try:
        report = BenchReport.model_validate(read_json(path))
        atomic_write_json(path, report.model_copy(update={"engine_sha256": "0" * 64}).to_json())
        with pytest.raises(InputError, match="bench.json of conv/good describe another build"):
            write_manifest(proj.pair("conv", "good"))
        proc = skuforge("manifest", "--model", "conv", "--sku", "good", cwd=proj.root)
        assert_user_error(proc, 2, "bench.json", "another build")
    finally:
        path.write_bytes(saved)


def test_latency_samples_not_the_bench_reports_are_refused_by_the_manifest_stage(proj):
    csv = Layout(proj.root).latency_csv("conv", "good")
    saved = csv.read_bytes()
    try:
        csv.write_bytes(saved + b"999,0.0001\n")
        with pytest.raises(InputError, match="not the samples bench.json was written with"):
            write_manifest(proj.pair("conv", "good"))
    finally:
        csv.write_bytes(saved)


def test_an_engine_replaced_after_the_build_is_refused_by_validate_and_bench(tmp_path):
    reg = make_project(tmp_path, {"e": sku("fp32")}, {"tracking": FAST_RETRIES})
    out = Layout(reg.root)
    other = tmp_path / "other"
    shutil.copytree(out.engine_dir("conv", "e"), other)
    meta = read_json(other / "engine.json")
    import onnx

    engine = onnx.load(str(other / "model.onnx"))
    engine.doc_string = "an engine of another build"
    onnx.save(engine, str(other / "model.onnx"))
    meta["files"][0].update(sha256=sha256_file(other / "model.onnx"), bytes=(other / "model.onnx").stat().st_size)
    atomic_write_json(other / "engine.json", meta)  # a whole, self-consistent engine, just not this build's
    shutil.rmtree(out.engine_dir("conv", "e"))
    shutil.copytree(other, out.engine_dir("conv", "e"))
    for stage in (validate, bench):
        with pytest.raises(InputError, match="is not the engine build.json describes"):
            stage(reg.pair("conv", "e"))


def test_failing_validation_still_exits_1(proj):
    with pytest.raises(GateFailed):
        validate(proj.pair("conv", "bad"))
