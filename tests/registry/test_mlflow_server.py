"""Publish and promote through a real `mlflow server` over HTTP (SQLite backend, served artifacts).

One project is built once (tiny conv model, ONNX Runtime). The promotion story runs in a fixed
order inside one module fixture that records each step's outcome; the tests check those records,
so they hold in any order and on any xdist worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from registry_helpers import FAST_RETRIES, fake_bench, make_project, sku

from pipeline.core.errors import ConfigError, ServiceError, SkuforgeError
from pipeline.core.io import read_json, sha256_file
from pipeline.core.paths import Layout
from pipeline.project.config import load_registry
from pipeline.results.manifest import load_manifest
from pipeline.stages.publish import publish
from pipeline.tracking.client import TAG_COMPLETE, TAG_DIGEST, TAG_HISTORY, connect
from pipeline.tracking.evidence import collect
from pipeline.tracking.promotion import PromotionBlocked, promote, rollback
from pipeline.tracking.publish import expected_artifacts
from pipeline.tracking.releases import list_releases

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
SKUS = {
    "cpu_fp32": sku("fp32"),
    "cpu_int8": sku("int8"),
    "strict": sku("int8", tolerance={"atol": 0, "rtol": 0, "max_mismatch": 0}),
    "elsewhere": sku("fp32", placement={"allowed": ["SomeOtherEP"]}),
    "tamper": sku("fp32"),
    "perf": sku("fp32"),
    "down": sku("fp32"),
}
RELEASE = {
    "skus": ["cpu_fp32", "cpu_int8"],
    "tracking": FAST_RETRIES,
    "performance": {"max_regression": 0.1, "min_samples": 30},
}


def latencies() -> dict[str, np.ndarray]:
    """Chosen latency samples (ms) for four versions of one engine."""
    rng = np.random.default_rng(7)
    base = rng.lognormal(np.log(0.1), 0.05, 200)
    z = np.random.default_rng(0).normal(0.0, 1.0, 200)
    return {
        "base": base,
        "slow": base * 1.5,
        "noisy": 0.11 * np.exp(z - np.median(z)),
        "equal": rng.lognormal(np.log(0.1), 0.05, 200),
    }


def cli(root: Path, *args: str, uri: str) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.Popen(
        [str(BIN / "skuforge"), *args], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except SkuforgeError as exc:
        return exc


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("registry_project"), SKUS, RELEASE, failing=("strict", "elsewhere"))


@pytest.fixture()
def tracking(proj, server):
    return connect(proj, uri=server.uri)


@pytest.fixture(scope="module")
def published(proj, server):
    """Two `skuforge publish` processes for two SKUs at the same time (the first publishes of
    this model: both race to create its experiment), then the others in-process."""
    procs = [
        cli(proj.root, "publish", "--model", "conv", "--sku", s, "--json", uri=server.uri)
        for s in ("cpu_fp32", "cpu_int8")
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        done.append((p.returncode, out, err))
    tracking = connect(proj, uri=server.uri)
    fake_bench(proj, "conv", "perf", latencies()["base"])
    results = {s: publish(proj.pair("conv", s), tracking=tracking) for s in ("strict", "elsewhere", "tamper", "perf")}
    return done, results


@pytest.fixture(scope="module")
def story(proj, server, published):
    """The promotion steps in order; each entry is the report or the SkuforgeError raised."""
    tracking = connect(proj, uri=server.uri)
    client = tracking.client
    steps: dict[str, object] = {}
    steps["staging_before_candidate"] = outcome(promote, proj, "conv", "staging", ["cpu_fp32"], tracking=tracking)
    steps["candidate"] = outcome(promote, proj, "conv", "candidate", ["cpu_fp32"], tracking=tracking, who="alice")
    steps["candidate_again"] = outcome(promote, proj, "conv", "candidate", ["cpu_fp32"], tracking=tracking)
    steps["staging"] = outcome(promote, proj, "conv", "staging", ["cpu_fp32"], tracking=tracking)
    steps["production_no_reason"] = outcome(promote, proj, "conv", "production", ["cpu_fp32"], tracking=tracking)
    steps["strict"] = outcome(promote, proj, "conv", "candidate", ["strict"], tracking=tracking)
    steps["elsewhere"] = outcome(promote, proj, "conv", "candidate", ["elsewhere"], tracking=tracking)

    # replace the tamper version's manifest artifact by an edited one
    run_id = published[1]["tamper"].run_id
    doc = read_json(client.download_artifacts(run_id, "manifest.json", tempfile.mkdtemp()))
    doc["precision"] = "fp16"
    edited = Path(tempfile.mkdtemp()) / "manifest.json"
    edited.write_text(json.dumps(doc))
    client.log_artifact(run_id, str(edited))
    steps["tamper"] = outcome(promote, proj, "conv", "candidate", ["tamper"], tracking=tracking)

    # performance: versions of one engine with chosen latencies, each promoted to candidate
    lat = latencies()
    steps["perf_base"] = outcome(promote, proj, "conv", "candidate", ["perf"], tracking=tracking)
    for name in ("slow", "noisy", "equal"):
        fake_bench(proj, "conv", "perf", lat[name])
        steps[f"perf_{name}_published"] = publish(proj.pair("conv", "perf"), tracking=tracking)
        steps[f"perf_{name}"] = outcome(
            promote, proj, "conv", "candidate", ["perf"], tracking=tracking, reason=f"{name} engine"
        )
    steps["rollback"] = outcome(rollback, proj, "conv", "candidate", ["perf"], tracking=tracking, reason="bad canary")
    steps["rollback_again"] = outcome(rollback, proj, "conv", "candidate", ["perf"], tracking=tracking)
    steps["rollback_nothing_left"] = outcome(rollback, proj, "conv", "candidate", ["perf"], tracking=tracking)

    # a later alias straight from nothing: the chain gate
    steps["int8_skipping_candidate"] = outcome(
        promote, proj, "conv", "staging", ["cpu_int8"], version="1", tracking=tracking
    )

    # a release: all SKUs it requires, all gates before any alias moves
    bigger = proj.root / "params-release.yaml"
    data = __import__("yaml").safe_load((proj.root / "params.yaml").read_text())
    data["release"]["skus"] = ["cpu_int8", "cpu_fp32", "strict_never_built"]
    data["skus"]["strict_never_built"] = sku("fp32")
    bigger.write_text(__import__("yaml").safe_dump(data))
    steps["release_missing_sku"] = outcome(promote, load_registry(bigger), "conv", "candidate", tracking=tracking)
    steps["int8_after_blocked_release"] = dict(client.get_registered_model("conv.cpu_int8").aliases)
    steps["release"] = outcome(promote, proj, "conv", "candidate", tracking=tracking)
    steps["listing"] = list_releases(proj, "conv", tracking=tracking, with_history=True)
    return steps


def gate(report_or_move, name):
    return next(g for g in report_or_move.gates if g.name == name)


# --- publish -----------------------------------------------------------------------------------


def test_two_publishes_of_different_skus_at_the_same_time_both_succeed(proj, published):
    for rc, _out, err in published[0]:
        assert rc == 0, err
        assert "Traceback" not in err
    results = [json.loads(out) for _, out, _ in published[0]]
    assert {(r["sku"], r["version"]) for r in results} == {("cpu_fp32", "1"), ("cpu_int8", "1")}
    assert results[0]["experiment_id"] == results[1]["experiment_id"]
    for r in results:  # the stage's receipt
        receipt = read_json(Layout(proj.root).report("conv", r["sku"], "publish"))
        assert receipt["run_id"] == r["run_id"] and receipt["version"] == r["version"]


def test_run_holds_params_metrics_tags_inputs_and_artifacts(proj, published, tracking):
    receipt = read_json(Layout(proj.root).report("conv", "cpu_fp32", "publish"))
    manifest = load_manifest(Layout(proj.root).manifest("conv", "cpu_fp32"))
    client = tracking.client
    run = client.get_run(receipt["run_id"])
    assert run.info.status == "FINISHED"
    p = run.data.params
    assert p["sku.backend"] == "onnxruntime" and p["sku.precision"] == "fp32"
    assert p["toolchain.onnxruntime"] == manifest.toolchain["onnxruntime"]
    assert p["tolerance.kinds.probabilities.atol"] == "0.0001" and p["bench.iterations"] == "60"
    m = run.data.metrics
    assert m["latency.engine_only.p50_ms"] == pytest.approx(manifest.benchmark.engine_only.p50_ms)
    assert m["throughput_per_s"] == pytest.approx(manifest.benchmark.throughput_per_s)
    assert m["error.probs.max_abs_error"] == pytest.approx(manifest.correctness.outputs[0].max_abs_error)
    assert m["gate.correctness_passed"] == 1.0 and "memory.peak_rss_mb" in m
    t = run.data.tags
    assert t[TAG_DIGEST] == manifest.digest and t["skuforge.sku"] == "cpu_fp32"
    assert t["skuforge.runner"] and t[TAG_COMPLETE] == "true"
    inputs = {d.dataset.name: json.loads(d.dataset.profile)["sha256"] for d in run.inputs.dataset_inputs}
    assert inputs == {f"conv.{split}": sha for split, sha in manifest.datasets.items()}
    listed = {}

    def walk(path=None):
        for f in client.list_artifacts(run.info.run_id, path):
            walk(f.path) if f.is_dir else listed.__setitem__(f.path, f.file_size)

    walk()
    assert listed == expected_artifacts(collect(proj.pair("conv", "cpu_fp32")))
    # the registered version points at the engine files the manifest describes
    version = client.get_model_version("conv.cpu_fp32", receipt["version"])
    assert version.tags[TAG_DIGEST] == manifest.digest and version.run_id == run.info.run_id
    import mlflow.artifacts

    local = Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri=version.source, dst_path=tempfile.mkdtemp(), tracking_uri=tracking.uri
        )
    )
    assert {r.path: r.sha256 for r in manifest.engine} == {r.path: sha256_file(local / r.path) for r in manifest.engine}


def test_publishing_the_same_manifest_again_returns_the_existing_version(proj, published, tracking):
    first = read_json(Layout(proj.root).report("conv", "cpu_int8", "publish"))
    again = publish(proj.pair("conv", "cpu_int8"), tracking=tracking)
    assert (again.run_id, again.version) == (first["run_id"], first["version"])
    assert not again.created_run and not again.created_version
    assert again.receipt() == first
    client = tracking.client
    digest = first["digest"]
    assert len(client.search_runs([first["experiment_id"]], f"tags.`{TAG_DIGEST}` = '{digest}'")) == 1
    assert len(client.search_model_versions(f"name = 'conv.cpu_int8' and tags.`{TAG_DIGEST}` = '{digest}'")) == 1


def test_server_down_mid_publish_exits_4_and_a_rerun_converges(proj, server):
    stopped = []

    def stop_during_upload(label: str, fraction: float) -> None:
        if label == "publish: artifacts" and not stopped:
            server.stop()
            stopped.append(fraction)

    try:
        with pytest.raises(ServiceError) as info:
            publish(proj.pair("conv", "down"), progress=stop_during_upload, tracking=connect(proj, uri=server.uri))
        assert stopped, "the publish never reached the upload"
        assert info.value.exit_code == 4
        assert server.uri in info.value.message and "upload" in info.value.message
        assert "after 3 attempts" in info.value.message, info.value.message
        # the command while the server is still down: exit 4 naming the URI and the operation
        proc = cli(proj.root, "publish", "--model", "conv", "--sku", "down", uri=server.uri)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 4, err
        assert f"skuforge: error: MLflow at {server.uri}:" in err and "failed after 3 attempts" in err, err
        assert "hint:" in err and "Traceback" not in err, err
    finally:
        if server.proc is None:
            server.start()
    tracking = connect(proj, uri=server.uri)
    result = publish(proj.pair("conv", "down"), tracking=tracking)
    assert result.resumed and not result.created_run and result.created_version
    client = tracking.client
    runs = client.search_runs([result.experiment_id], f"tags.`{TAG_DIGEST}` = '{result.digest}'")
    versions = client.search_model_versions(f"name = 'conv.down' and tags.`{TAG_DIGEST}` = '{result.digest}'")
    assert [r.info.run_id for r in runs] == [result.run_id]
    assert [str(v.version) for v in versions] == [result.version]
    assert runs[0].info.status == "FINISHED" and runs[0].data.tags[TAG_COMPLETE] == "true"


# --- promotion ---------------------------------------------------------------------------------


def test_first_alias_takes_the_newest_version_when_every_gate_passes(story, tracking):
    report = story["candidate"]
    assert report.passed and report.who == "alice" and report.why == "promote to candidate with skuforge"
    move = report.moves[0]
    assert (move.version, move.previous, move.moved) == ("1", None, True)
    assert [g.name for g in move.gates] == [
        "chain",
        "manifest",
        "signature",
        "correctness",
        "placement",
        "engine",
        "performance",
    ]
    assert all(g.passed for g in move.gates), move.gates
    assert "nothing to compare" in gate(move, "performance").detail
    assert story["candidate_again"].moves[0].already and not story["candidate_again"].moves[0].moved


def test_a_later_alias_takes_the_holder_of_the_alias_before(story, tracking):
    blocked = story["staging_before_candidate"]
    assert isinstance(blocked, PromotionBlocked) and blocked.exit_code == 1
    assert "no version holds 'candidate'" in gate(blocked.report, "release_skus").detail
    report = story["staging"]
    assert report.passed and report.moves[0].version == "1"
    assert "holds 'candidate'" in gate(report.moves[0], "chain").detail
    rm = tracking.client.get_registered_model("conv.cpu_fp32")
    assert rm.aliases.get("candidate") == "1" and rm.aliases.get("staging") == "1"
    moves = json.loads(rm.tags[TAG_HISTORY + "staging"])
    assert moves[-1]["version"] == "1" and moves[-1]["previous"] is None and moves[-1]["who"]
    tag = json.loads(tracking.client.get_model_version("conv.cpu_fp32", "1").tags["skuforge.promote.staging"])
    assert set(tag) == {"who", "when", "why", "previous"}


def test_production_needs_a_reason(story):
    exc = story["production_no_reason"]
    assert isinstance(exc, ConfigError) and "--reason" in exc.hint


@pytest.mark.parametrize(
    "step, sku_name, alias, failing",
    [
        ("strict", "strict", "candidate", "correctness"),
        ("elsewhere", "elsewhere", "candidate", "placement"),
        ("tamper", "tamper", "candidate", "manifest"),
        ("int8_skipping_candidate", "cpu_int8", "staging", "chain"),
    ],
)
def test_a_failing_gate_blocks_and_moves_nothing(story, tracking, step, sku_name, alias, failing):
    exc = story[step]
    assert isinstance(exc, PromotionBlocked), exc
    move = exc.report.moves[0]
    failed = [g.name for g in move.gates if not g.passed]
    # gates that read the same evidence fail with the expected one (a failed placement is also a
    # failed validation; an untrusted manifest fails every gate after it), the others pass
    assert failing in failed and (failing == "chain") == ("chain" in failed), move.gates
    assert not move.moved and failing in exc.message
    assert alias not in tracking.client.get_registered_model(f"conv.{sku_name}").aliases


def test_tampered_manifest_is_named(story):
    detail = gate(story["tamper"].report.moves[0], "manifest").detail
    assert "digest" in detail and "edited" in detail


def test_performance_gate_on_latency_samples(story, tracking):
    assert story["perf_base"].passed
    slow = story["perf_slow"]
    assert isinstance(slow, PromotionBlocked)
    g = gate(slow.report.moves[0], "performance")
    assert not g.passed and g.data["outcome"] == "regressed" and g.data["incumbent"] == "1"
    assert g.data["ratio"] == pytest.approx(1.5, rel=0.01) and g.data["ci_low"] > 1.1 and g.data["p_value"] < 0.05
    noisy = story["perf_noisy"]
    assert isinstance(noisy, PromotionBlocked)
    g = gate(noisy.report.moves[0], "performance")
    assert not g.passed and g.data["outcome"] == "too_noisy" and "too noisy to decide" in g.detail
    assert g.data["ci_low"] < 1.1 < g.data["ci_high"]
    equal = story["perf_equal"]
    assert equal.passed, equal
    move = equal.moves[0]
    assert (move.version, move.previous) == (story["perf_equal_published"].version, "1")
    assert gate(move, "performance").data["outcome"] == "not_regressed"


def test_rollback_walks_back_the_recorded_moves(story, tracking):
    first = story["rollback"]
    equal_version = story["perf_equal_published"].version
    assert (first.moves[0].version, first.moves[0].previous) == ("1", equal_version) and first.why == "bad canary"
    second = story["rollback_again"]
    assert (second.moves[0].version, second.moves[0].previous) == (None, "1")
    assert "candidate" not in tracking.client.get_registered_model("conv.perf").aliases
    nothing = story["rollback_nothing_left"]
    assert isinstance(nothing, SkuforgeError) and nothing.exit_code == 2 and "no recorded move" in nothing.message
    entries = json.loads(tracking.client.get_registered_model("conv.perf").tags[TAG_HISTORY + "candidate"])
    assert [(e["action"], e["version"], e["previous"], e["reverts"]) for e in entries] == [
        ("promote", "1", None, None),
        ("promote", equal_version, "1", None),
        ("rollback", "1", equal_version, 2),
        ("rollback", None, "1", 1),
    ]


def test_a_release_needs_every_sku_and_checks_all_gates_before_moving(story):
    blocked = story["release_missing_sku"]
    assert isinstance(blocked, PromotionBlocked)
    assert "strict_never_built (never published)" in gate(blocked.report, "release_skus").detail
    ok = {m.sku: m for m in blocked.report.moves if m.sku != "strict_never_built"}
    assert ok["cpu_int8"].passed and not ok["cpu_int8"].moved
    assert "candidate" not in story["int8_after_blocked_release"]
    release = story["release"]
    assert release.passed
    assert {m.sku: (m.version, m.moved or m.already) for m in release.moves} == {
        "cpu_int8": ("1", True),
        "cpu_fp32": ("1", True),
    }


def test_releases_lists_versions_and_aliases_per_sku(story, proj, server):
    listing = story["listing"]
    by_sku = {s.sku: s for s in listing.skus}
    assert {"cpu_fp32", "cpu_int8", "perf", "strict", "elsewhere", "tamper"} <= set(by_sku)
    assert by_sku["cpu_fp32"].aliases == {"candidate": "1", "staging": "1"}
    assert [v.version for v in by_sku["perf"].versions] == ["4", "3", "2", "1"]
    assert by_sku["strict"].versions[0].correctness == "failed"
    assert by_sku["perf"].history["candidate"][-1].action == "rollback"
    assert listing.missing == []
    proc = cli(proj.root, "releases", "--model", "conv", "--json", uri=server.uri)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    data = json.loads(out)
    assert {s["sku"]: s["aliases"] for s in data["skus"]}["cpu_fp32"] == {"candidate": "1", "staging": "1"}
    proc = cli(proj.root, "promote", "--model", "conv", "--sku", "strict", "--to", "candidate", uri=server.uri)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "FAIL  correctness" in out and "blocked" in err and "Traceback" not in err
