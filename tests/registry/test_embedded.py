"""Publish and promote against the embedded store (no server): where it lives, crashes that a
re-run completes, inputs that do not belong together, and the commands' arguments."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import pytest
from cli_helpers import assert_user_error, service_env, skuforge
from registry_helpers import make_project, sku

from pipeline.core.errors import InputError
from pipeline.core.io import read_json
from pipeline.core.paths import Layout
from pipeline.results.manifest import load_manifest
from pipeline.stages.publish import publish
from pipeline.tracking.client import EMBEDDED_ARTIFACTS, EMBEDDED_DB, TAG_DIGEST, connect
from pipeline.tracking.promotion import promote, rollback
from pipeline.tracking.publish import ci_tags, flatten, manifest_metrics

REPO = Path(__file__).resolve().parents[2]


class Crash(Exception):
    """Stands for the process dying at a chosen step."""


def crash_at(step: str):
    def progress(label: str, fraction: float) -> None:
        if label == step:
            raise Crash(step)

    return progress


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield make_project(tmp_path_factory.mktemp("embedded"), {s: sku("fp32", iterations=40) for s in "abcdef"})
    mp.undo()


def one_run_one_version(proj, result):
    client = connect(proj).client
    runs = client.search_runs([result.experiment_id], f"tags.`{TAG_DIGEST}` = '{result.digest}'")
    versions = client.search_model_versions(
        f"name = '{result.registered_model}' and tags.`{TAG_DIGEST}` = '{result.digest}'"
    )
    assert [r.info.run_id for r in runs] == [result.run_id]
    assert [str(v.version) for v in versions] == [result.version]
    return runs[0]


def test_the_embedded_store_lives_at_the_project_root(proj):
    (Layout(proj.root).sku_dir("conv", "a") / "report.html").write_text("<html><body>conv on a</body></html>")
    result = publish(proj.pair("conv", "a"))
    root = proj.root.resolve()
    assert (root / EMBEDDED_DB).is_file()
    assert result.artifact_uri.startswith((root / EMBEDDED_ARTIFACTS).as_uri())
    assert (root / EMBEDDED_ARTIFACTS).is_dir() and list((root / EMBEDDED_ARTIFACTS).rglob("model.onnx"))
    assert read_json(Layout(proj.root).report("conv", "a", "publish")) == result.receipt()
    assert result.created_run and result.created_version and result.version == "1"
    names = [f.path for f in connect(proj).client.list_artifacts(result.run_id, "reports")]
    assert names == [
        f"reports/{n}"
        for n in (
            "bench.json",
            "build.json",
            "golden.npz",
            "latency.csv",
            "outputs.npz",
            "report.html",
            "timeline.csv",
            "validate.json",
        )
    ]


def test_tags_name_the_commit_runner_and_ci_run(proj):
    manifest = load_manifest(Layout(proj.root).manifest("conv", "a"))
    manifest = manifest.model_copy(
        update={"provenance": manifest.provenance.model_copy(update={"git_commit": "abc123"})}
    )
    tags = ci_tags(
        manifest,
        {
            "GITHUB_SERVER_URL": "https://github.com",
            "GITHUB_REPOSITORY": "acme/engines",
            "GITHUB_RUN_ID": "42",
            "GITHUB_RUN_ATTEMPT": "2",
            "RUNNER_NAME": "jetson-07",
        },
    )
    assert tags == {
        "skuforge.runner": "jetson-07",
        "mlflow.source.git.commit": "abc123",
        "skuforge.git_commit": "abc123",
        "skuforge.ci_run_url": "https://github.com/acme/engines/actions/runs/42/attempts/2",
    }
    assert ci_tags(manifest, {})["skuforge.runner"] == manifest.provenance.host
    assert "skuforge.ci_run_url" not in ci_tags(manifest, {})
    metrics = manifest_metrics(manifest)
    assert metrics["latency.engine_only.p50_ms"] == manifest.benchmark.engine_only.p50_ms
    assert metrics["gate.placement_passed"] == 1.0 and metrics["layers"] == len(manifest.layers)
    assert flatten({"a": {"b": [1, 2], "c": None, "d": "x"}, "e": {}}) == {
        "a.b": "[1, 2]",
        "a.c": "null",
        "a.d": "x",
        "e": "{}",
    }


def test_a_crash_mid_upload_is_resumed(proj):
    with pytest.raises(Crash):
        publish(proj.pair("conv", "b"), progress=crash_at("publish: artifacts"))
    assert not Layout(proj.root).report("conv", "b", "publish").exists()
    result = publish(proj.pair("conv", "b"))
    assert result.resumed and not result.created_run and result.created_version
    run = one_run_one_version(proj, result)
    assert run.info.status == "FINISHED" and run.data.metrics["bench.engine_only.iterations"] == 40.0


def test_a_crash_between_run_and_version_registers_on_rerun(proj):
    with pytest.raises(Crash):
        publish(proj.pair("conv", "c"), progress=crash_at("publish: register"))
    assert connect(proj).client.search_model_versions("name = 'conv.c'") == []
    result = publish(proj.pair("conv", "c"))
    assert not result.created_run and not result.resumed and result.created_version
    one_run_one_version(proj, result)


def _refused_after(proj, path, edit, match: str, hint: str) -> None:
    """Publish refuses the pair while ``path`` holds ``edit(its bytes)``; the file is put back after."""
    saved = path.read_bytes()
    path.write_bytes(edit(saved))
    try:
        with pytest.raises(InputError, match=match) as info:
            publish(proj.pair("conv", "d"))
        assert hint in info.value.hint
    finally:
        path.write_bytes(saved)


def _json_edit(change):
    def edit(data: bytes) -> bytes:
        doc = json.loads(data)
        change(doc)
        return json.dumps(doc).encode()

    return edit


def test_reports_that_do_not_match_the_manifest_are_refused(proj):
    out = Layout(proj.root)
    # edited: no longer the figures of its samples
    _refused_after(
        proj,
        out.report("conv", "d", "bench"),
        _json_edit(lambda d: d["engine_only"].update(p50_ms=d["engine_only"]["p50_ms"] * 2)),
        "engine-only figures are not those of its samples",
        "skuforge bench",
    )
    # build ran again, the manifest was not rewritten
    _refused_after(
        proj,
        out.report("conv", "d", "build"),
        _json_edit(lambda d: d.update(warnings=["rebuilt with other settings"])),
        "build.json of conv/d are missing or are not the reports",
        "skuforge manifest",
    )
    _refused_after(
        proj,
        out.engine_dir("conv", "d") / "model.onnx",
        lambda b: b[:-1] + bytes([b[-1] ^ 1]),
        "differs from",
        "rebuild",
    )
    assert publish(proj.pair("conv", "d")).created_version


@contextlib.contextmanager
def _unwritable_artifacts(root: Path, how: str):
    """``mlartifacts/`` unwritable even for root while inside (tests run as root, whom chmod does not
    stop): a file in its place, or a read-only bind mount of it. The store's folder is put back after."""
    artifacts, saved = root / EMBEDDED_ARTIFACTS, root / f"{EMBEDDED_ARTIFACTS}.saved"
    artifacts.mkdir(exist_ok=True)  # no publish before this test in its process (run alone, or on its own worker)
    try:
        artifacts.rename(saved)
    except FileNotFoundError:  # seen once under xdist: the empty folder gone before the rename; nothing to keep
        saved.mkdir()
    try:
        if how == "a file in its place":
            artifacts.write_text("not a folder\n")
            yield
            return
        artifacts.mkdir()
        mount = subprocess.run(
            ["mount", "--bind", str(artifacts), str(artifacts)], capture_output=True, text=True, check=False
        )
        if mount.returncode != 0:
            pytest.skip(f"a read-only bind mount needs root with CAP_SYS_ADMIN: {mount.stderr.strip()}")
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(artifacts)], check=True, capture_output=True)
            yield
        finally:
            subprocess.run(["umount", str(artifacts)], check=True, capture_output=True)
    finally:
        if artifacts.is_dir():
            artifacts.rmdir()
        else:
            artifacts.unlink(missing_ok=True)
        saved.rename(artifacts)


@pytest.mark.parametrize("how, pair", [("a file in its place", "e"), ("a read-only mount", "f")])
def test_an_unwritable_artifact_folder_is_named_and_its_run_marked_failed(proj, how, pair):
    root = proj.root.resolve()
    with _unwritable_artifacts(root, how):
        proc = run(root, "publish", "--model", "conv", "--sku", pair)
        assert_user_error(
            proc,
            3,
            f"upload model.onnx failed: the artifact folder {root / EMBEDDED_ARTIFACTS} cannot be written",
            "hint: ",
        )
        assert "database" not in proc.stderr  # it was blamed on mlflow.db
    client = connect(proj).client
    experiment = client.get_experiment_by_name("conv").experiment_id
    runs = client.search_runs([experiment], f"tags.`skuforge.sku` = '{pair}'")
    assert [r.info.status for r in runs] == ["FAILED"]  # not left RUNNING
    result = publish(proj.pair("conv", pair))  # the folder is back: the run is resumed and finished
    assert result.resumed and result.created_version
    assert one_run_one_version(proj, result).info.status == "FINISHED"


def test_promote_and_roll_back_on_the_embedded_store(proj):
    publish(proj.pair("conv", "a"))
    report = promote(proj, "conv", "candidate", ["a"])
    assert report.passed and report.moves[0].moved
    back = rollback(proj, "conv", "candidate", ["a"])
    assert back.moves[0].version is None and back.moves[0].previous == "1"
    assert "candidate" not in connect(proj).client.get_registered_model("conv.a").aliases


# --- the commands -------------------------------------------------------------------------------


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return skuforge(*args, cwd=root, env=service_env())


@pytest.mark.parametrize(
    "args, words",
    [
        (("publish",), ["--model M --sku S, or --all"]),
        (("publish", "--all", "--sku", "a"), ["--all"]),
        (
            ("promote", "--model", "conv", "--sku", "a", "--to", "prod"),
            ["unknown alias 'prod'", "did you mean 'production'", "candidate -> staging -> production"],
        ),
        (("promote", "--model", "conv", "--sku", "a", "--to", "production"), ["needs a reason", "--reason"]),
        (("promote", "--model", "conv", "--sku", "zz", "--to", "candidate"), ["unknown SKU 'zz'"]),
        (
            ("promote", "--model", "conv", "--sku", "a", "--to", "candidate", "--rollback", "--version", "1"),
            ["--rollback"],
        ),
        (("releases", "--model", "nope"), ["unknown model 'nope'"]),
    ],
)
def test_argument_errors_exit_2_before_touching_the_store(proj, args, words):
    proc = run(proj.root, *args)
    assert proc.returncode == 2, proc.stderr
    assert "hint:" in proc.stderr and "Traceback" not in proc.stderr
    for word in words:
        assert word in proc.stderr, (word, proc.stderr)
