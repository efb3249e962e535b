"""The rendered GitHub workflows: current in the repository, schema-valid, lint-clean, and the
build job's `run:` steps for a CPU SKU replayed in a clone of a tiny project."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline.backends.tvm import TvmOptions  # noqa: E402
from pipeline.ci.render import TUNE_RUNNER, matrix, render, runs_on, tune_matrix  # noqa: E402
from pipeline.project.config import load_registry  # noqa: E402
from pipeline.results.manifest import validate_document  # noqa: E402
from tests.models import conv_bn_model, conv_bn_spec, ort_sku, write_project  # noqa: E402

BIN = Path(sys.executable).parent
EXPR = re.compile(r"\$\{\{\s*([^}]*?)\s*\}\}")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env["DVC_NO_ANALYTICS"] = "1"
    for var in (
        "GIT_DIR",
        "GIT_WORK_TREE",
        "GIT_INDEX_FILE",
        "DVC_ROOT",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_REGISTRY_URI",
        "GITHUB_ACTIONS",
        "GITHUB_STEP_SUMMARY",
    ):
        env.pop(var, None)
    env.update(extra)
    return env


def sh(cwd: Path, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        pytest.fail(f"$ {' '.join(args)} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def skuforge(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh(cwd, str(BIN / "skuforge"), *args, check=check)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    """The repository's registry rendered into a scratch folder."""
    out = tmp_path_factory.mktemp("workflows")
    skuforge(REPO, "ci", "render", "--out", str(out))
    return out


# --- current -----------------------------------------------------------------------------------


def test_committed_workflows_are_current():
    proc = skuforge(REPO, "ci", "render", "--check", check=False)
    assert proc.returncode == 0, proc.stderr


def test_check_fails_naming_the_stale_file_after_a_registry_edit(tmp_path):
    shutil.copytree(REPO / ".github" / "workflows", tmp_path / ".github" / "workflows")
    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert skuforge(tmp_path, "--params", str(params), "ci", "render", "--check", check=False).returncode == 0

    sku = next(iter(doc["skus"]))
    doc["skus"][sku]["runner_labels"] = [*doc["skus"][sku]["runner_labels"], "new-label"]
    params.write_text(yaml.safe_dump(doc, sort_keys=False))
    before = (tmp_path / ".github/workflows/build.yml").read_bytes()
    proc = skuforge(tmp_path, "--params", str(params), "ci", "render", "--check", check=False)
    assert proc.returncode == 1, proc.stderr
    assert ".github/workflows/build.yml" in proc.stderr
    assert "promote.yml" not in proc.stderr  # unaffected by runner labels
    assert (tmp_path / ".github/workflows/build.yml").read_bytes() == before  # --check writes nothing

    proc = skuforge(tmp_path, "--params", str(params), "ci", "render")
    assert "wrote .github/workflows/build.yml" in proc.stdout
    assert '\\"new-label\\"' in (tmp_path / ".github/workflows/build.yml").read_text()  # in the plan's JSON
    assert skuforge(tmp_path, "--params", str(params), "ci", "render", "--check", check=False).returncode == 0


def test_matrix_and_hosted_runner_rule(tmp_path):
    write_project(
        tmp_path,
        {"conv": conv_bn_spec()},
        {
            "hw": ort_sku(runner_labels=["self-hosted", "linux", "x64", "cpu-avx2"]),
            "hosted": ort_sku(runner_labels=["linux"], target={"arch": "x86_64", "device": "cpu", "os": "linux"}),
            "gpu": ort_sku(runner_labels=["gpu-box"], target={"arch": "x86_64", "device": "gpu", "os": "linux"}),
        },
    )
    reg = load_registry(tmp_path / "params.yaml")
    assert runs_on(reg.skus["hw"]) == ["self-hosted", "linux", "x64", "cpu-avx2"]
    assert runs_on(reg.skus["hosted"]) == ["ubuntu-24.04"]
    assert runs_on(reg.skus["gpu"]) == ["gpu-box"]  # never a hosted runner for a GPU SKU
    assert [e["sku"] for e in matrix(reg)] == ["hw", "hosted", "gpu"]


def test_a_sku_with_ci_false_gets_no_job(tmp_path):
    write_project(tmp_path, {"conv": conv_bn_spec()}, {"a": ort_sku(), "b": ort_sku(ci=False)})
    reg = load_registry(tmp_path / "params.yaml")
    assert reg.skus["a"].ci and not reg.skus["b"].ci
    assert [e["sku"] for e in matrix(reg)] == ["a"]
    skuforge(tmp_path, "ci", "render")
    plan = yaml.safe_load((tmp_path / ".github/workflows/build.yml").read_text())["jobs"]["plan"]
    listed = json.loads(next(s for s in plan["steps"] if s.get("id") == "matrix")["env"]["MATRIX"])
    assert [e["sku"] for e in listed] == ["a"]


def test_build_workflow_shape(rendered):
    reg = load_registry(REPO / "params.yaml")
    doc = yaml.safe_load((rendered / "build.yml").read_text())
    matrix_step = next(s for s in doc["jobs"]["plan"]["steps"] if s.get("id") == "matrix")
    assert json.loads(matrix_step["env"]["MATRIX"]) == matrix(reg)
    job = doc["jobs"]["sku-publish"]
    assert job["strategy"]["fail-fast"] is False
    assert job["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    assert "${{ matrix.sku }}" in job["concurrency"]["group"]
    assert doc["permissions"] == {}
    runs = "\n".join(s.get("run", "") for s in job["steps"])
    for needle in (
        "skuforge runner check",
        "dvc pull --run-cache",
        "skuforge repro --sku",
        "dvc push --run-cache",
        "GITHUB_STEP_SUMMARY",
    ):
        assert needle in runs
    promote = yaml.safe_load((rendered / "promote.yml").read_text())
    assert promote["jobs"]["promote"]["environment"] == "release"
    inputs = promote[True]["workflow_dispatch"]["inputs"]  # YAML 1.1 reads the key `on` as True
    assert inputs["alias"]["options"] == reg.release.aliases
    assert inputs["model"]["options"] == sorted(reg.models)


# --- validation --------------------------------------------------------------------------------


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]' installs it)")
    return path


def test_workflows_pass_the_github_workflow_schema(rendered):
    files = sorted(rendered.glob("*.yml"))
    assert [f.name for f in files] == ["build.yml", "promote.yml", "rollout.yml"]
    proc = sh(
        REPO, _tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", *map(str, files), check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_schema_check_rejects_a_broken_workflow(tmp_path, rendered):
    """The schema check can fail: a job without runs-on is not a workflow."""
    doc = yaml.safe_load((rendered / "build.yml").read_text())
    del doc["jobs"]["plan"]["runs-on"]
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump(doc))
    proc = sh(REPO, _tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(bad), check=False)
    assert proc.returncode != 0


def _zizmor(*files: Path) -> subprocess.CompletedProcess:
    return sh(
        REPO,
        _tool("zizmor"),
        "--offline",
        "--no-progress",
        "--persona",
        "auditor",
        "--config",
        str(REPO / ".github/zizmor.yml"),
        *map(str, files),
        check=False,
    )


def test_workflows_pass_zizmor(rendered):
    proc = _zizmor(*sorted(rendered.glob("*.yml")))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_zizmor_flags_an_injection(tmp_path, rendered):
    """The linter can fail: a pull request title expanded into a shell script is an injection."""
    doc = yaml.safe_load((rendered / "build.yml").read_text())
    doc["jobs"]["plan"]["steps"].append({"name": "echo", "run": "echo ${{ github.event.pull_request.title }}"})
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump(doc).replace("true:", "on:"))
    proc = _zizmor(bad)
    assert proc.returncode != 0 and "template-injection" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def _actionlint(*files: Path) -> list[dict]:
    """actionlint's findings, every kind kept: the binary is current (ubuntu-24.04, `vars`, node24
    actions). ShellCheck and pyflakes stay off so the result does not depend on what else is installed."""
    proc = sh(
        REPO, _tool("actionlint"), "-shellcheck=", "-pyflakes=", "-format", "{{json .}}", *map(str, files), check=False
    )
    assert proc.returncode in (0, 1), proc.stderr  # 1: findings; anything else: it did not run
    return json.loads(proc.stdout)


def test_workflows_pass_actionlint(rendered):
    assert _actionlint(*sorted(rendered.glob("*.yml"))) == []


def test_actionlint_flags_a_bad_expression(tmp_path, rendered):
    """The linter can fail: an output the plan job does not declare."""
    bad = tmp_path / "bad.yml"
    text = (rendered / "build.yml").read_text()
    assert "needs.plan.outputs.any" in text
    bad.write_text(text.replace("needs.plan.outputs.any", "needs.plan.outputs.anny"))
    findings = _actionlint(bad)
    assert any("anny" in f["message"] for f in findings), findings


def test_actionlint_flags_an_old_runtime(tmp_path, rendered):
    """Its action metadata is current: a node20 action (checkout v4) is reported as deprecated."""
    bad = tmp_path / "bad.yml"
    bad.write_text((rendered / "rollout.yml").read_text().replace("actions/checkout@v6", "actions/checkout@v4"))
    assert any("node20" in f["message"] for f in _actionlint(bad))


def test_a_sku_with_a_tracker_key_gets_the_tuning_workflow_and_loses_it_without(tmp_path):
    """tune.yml exists only while a SKU names options.rpc.key: its matrix and dispatch choices list
    that SKU (an arm64 one installs the cross GCC on the x86 tuning runner), and it lints clean."""
    reg = load_registry(REPO / "params.yaml")
    assert not tune_matrix(reg)  # the example names no tracker key: no tuning workflow
    spec = reg.skus["rpi5_tvm_fp32"]
    options = {**spec.options, "rpc": {"key": "rpi5"}}
    TvmOptions.model_validate(options)  # the key as the backend reads it
    reg.skus["rpi5_tvm_fp32"] = spec.model_copy(update={"options": options})
    result = render(reg, output=tmp_path)
    assert "tune.yml" in {Path(f).name for f in result.files}
    doc = yaml.safe_load((tmp_path / "tune.yml").read_text())
    assert doc[True]["workflow_dispatch"]["inputs"]["sku"]["options"] == ["all", "rpi5_tvm_fp32"]
    assert doc[True]["schedule"]
    listed = json.loads(doc["jobs"]["plan"]["steps"][0]["env"]["MATRIX"])
    assert listed == [
        {"sku": "rpi5_tvm_fp32", "runs-on": TUNE_RUNNER, "extras": "pipeline,examples,tvm", "with": "cross-aarch64"}
    ]
    tune = doc["jobs"]["tune"]
    assert (
        tune["environment"] == "publish" and tune["env"]["SKUFORGE_TVM_TRACKER"] == "${{ vars.SKUFORGE_TVM_TRACKER }}"
    )
    run = "\n".join(step.get("run", "") for step in tune["steps"])
    assert 'skuforge cache refresh --sku "$SKU"' in run and "gh pr create" in run
    files = sorted(tmp_path.glob("*.yml"))
    proc = sh(
        REPO, _tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", *map(str, files), check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _zizmor(*files)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _actionlint(*files) == []
    again = render(load_registry(REPO / "params.yaml"), output=tmp_path)  # the key removed: so is the workflow
    assert not (tmp_path / "tune.yml").exists() and any(f.endswith("tune.yml") for f in again.differ)


# --- step replay -------------------------------------------------------------------------------


def _substitute(text: str, context: dict[str, dict[str, str]]) -> str:
    def one(m: re.Match) -> str:
        scope, _, key = m.group(1).partition(".")
        if scope == "secrets":
            return ""  # an unset secret is empty on GitHub too
        if scope in context and key in context[scope]:
            return context[scope][key]
        pytest.fail(f"the replay cannot evaluate ${{{{ {m.group(1)} }}}}")

    return EXPR.sub(one, str(text))


@pytest.mark.slow
def test_build_job_steps_replay_for_a_cpu_sku(tmp_path):
    """Render the workflow in a tiny project, clone it, and run the SKU job's `run:` steps in order.

    Skipped: `uses:` steps (GitHub infrastructure: checkout is the clone, artifacts stay on disk)
    and the step with `id: setup` (it creates the venv; the test's venv is on PATH instead).
    """
    started = time.perf_counter()
    origin = tmp_path / "origin"
    origin.mkdir()
    sh(origin, "git", "init", "-q")
    shutil.copyfile(REPO / "dvc.yaml", origin / "dvc.yaml")
    sh(origin, str(BIN / "dvc"), "init", "-q")
    conv_bn_model(origin / "models/conv/model.onnx")
    write_project(origin, {"conv": conv_bn_spec("models/conv")}, {"cpu_fp32": ort_sku("fp32")})
    skuforge(origin, "ci", "render")
    remote = tmp_path / "dvc-remote"  # a local DVC remote: the pull and push steps really move data
    remote.mkdir()
    sh(origin, str(BIN / "dvc"), "remote", "add", "-q", "-d", "store", str(remote))
    (origin / ".gitignore").write_text("/build/\n/mlflow.db\n/mlartifacts/\n")
    sh(origin, "git", "add", "-A")
    sh(origin, "git", "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "project")
    work = tmp_path / "work"
    sh(tmp_path, "git", "clone", "-q", str(origin), str(work))

    doc = yaml.safe_load((work / ".github/workflows/build.yml").read_text())
    job = doc["jobs"]["sku-publish"]  # a push: the job that publishes
    plan = next(s for s in doc["jobs"]["plan"]["steps"] if s.get("id") == "matrix")
    entry = next(e for e in json.loads(plan["env"]["MATRIX"]) if e["sku"] == "cpu_fp32")
    # a push: no dispatch inputs (GitHub gives empty values)
    context = {"matrix": {k: str(v) for k, v in entry.items()}, "inputs": {"require_cache": "", "refresh_caches": ""}}
    gh = tmp_path / "gh"
    gh.mkdir()
    files = {name: gh / name for name in ("GITHUB_STEP_SUMMARY", "GITHUB_PATH", "GITHUB_OUTPUT", "GITHUB_ENV")}
    for f in files.values():
        f.touch()
    base = {
        **{k: str(v) for k, v in files.items()},
        "CI": "true",
        "GITHUB_WORKSPACE": str(work),
        "GITHUB_RUN_ID": "1",
        "RUNNER_TEMP": str(gh),
    }
    base.update({k: _substitute(v, context) for k, v in job.get("env", {}).items()})

    ran, skipped = [], []
    for step in job["steps"]:
        name = step.get("name") or step.get("uses")
        if "uses" in step or step.get("id") == "setup":
            skipped.append(name)
            continue
        if "if" in step and _substitute(step["if"], context) in ("", "false"):  # a dispatch-only step
            skipped.append(name)
            continue
        script = gh / "step.sh"
        script.write_text(_substitute(step["run"], context))
        env = {**base, **{k: _substitute(v, context) for k, v in step.get("env", {}).items()}}
        proc = sh(work, "bash", "--noprofile", "--norc", "-e", "-o", "pipefail", str(script), check=False, **env)
        assert proc.returncode == 0, (
            f"step {name!r} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
        ran.append(name)

    assert skipped == [
        "actions/checkout@v6",
        "pip's download cache",
        "setup",
        "refresh the compiler caches",
        "actions/upload-artifact@v6",
    ]
    assert {"runner matches the SKU", "dvc pull", "stages", "cache status", "dvc push", "job summary"} <= set(ran)
    assert json.loads((work / "build/ci/cpu_fp32/cache-status.json").read_text()) == []  # ORT keeps no cache
    manifest = work / "manifests/conv/cpu_fp32.json"
    validate_document(json.loads(manifest.read_text()))
    assert (work / "build/ci/cpu_fp32/dvc.lock").is_file()
    assert (work / "build/ci/cpu_fp32/pipelines/cpu_fp32/run/dvc.lock").is_file()
    summary = files["GITHUB_STEP_SUMMARY"].read_text()
    assert "### skuforge: cpu_fp32" in summary and "| conv | yes |" in summary
    assert any((remote / "runs").rglob("*")), "dvc push --run-cache pushed no run cache"
    assert any((remote / "files").rglob("*")), "dvc push pushed no outputs"
    assert (work / "mlflow.db").is_file()  # no tracking server: the embedded store got the run

    # The assemble job's merge, over the lock this job kept: the same stages, nothing lost.
    lock = yaml.safe_load((work / "dvc.lock").read_text())
    (work / "dvc.lock").unlink()
    skuforge(work, "ci", "assemble", "build/ci")
    assert yaml.safe_load((work / "dvc.lock").read_text())["stages"] == dict(sorted(lock["stages"].items()))
    print(f"the build job's steps took {time.perf_counter() - started:.0f} s")  # a figure, never a bound


# --- assemble ----------------------------------------------------------------------------------


def test_assemble_takes_each_skus_stages_from_its_own_job(tmp_path):
    write_project(tmp_path, {"conv": conv_bn_spec()}, {"a": ort_sku(), "b": ort_sku()})
    reg = load_registry(tmp_path / "params.yaml")

    def write(path: Path, stages: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump({"schema": "2.0", "stages": stages}))

    def job(sku: str, tag: str) -> None:
        """What SKU ``sku``'s job keeps: its root lock and its own two locks."""
        kept = tmp_path / "locks" / sku
        write(kept / "dvc.lock", {"prepare@conv": {"cmd": f"prepare {tag}"}})
        write(kept / f"pipelines/{sku}/dvc.lock", {"build@conv": {"cmd": f"build {sku} {tag}"}})
        write(kept / f"pipelines/{sku}/run/dvc.lock", {"validate@conv": {"cmd": f"validate {sku} {tag}"}})

    from pipeline.ci.assemble import assemble
    from pipeline.core.errors import InputError

    with pytest.raises(InputError, match="no <sku>/dvc.lock"):
        assemble(reg, tmp_path / "locks")
    # a lock of the one-file layout: its (model, SKU) entries now live in the SKU's own locks
    write(tmp_path / "dvc.lock", {"config": {"cmd": "old"}, "build@conv-a": {"cmd": "old layout"}})
    job("b", "from-b")
    job("a", "from-a")
    result = assemble(reg, tmp_path / "locks")
    assert result["skus"] == ["a", "b"] and result["changed"]
    assert result["written"] == [
        "dvc.lock",
        "pipelines/a/dvc.lock",
        "pipelines/a/run/dvc.lock",
        "pipelines/b/dvc.lock",
        "pipelines/b/run/dvc.lock",
    ]
    stages = yaml.safe_load((tmp_path / "dvc.lock").read_text())["stages"]
    assert stages == {"config": {"cmd": "old"}, "prepare@conv": {"cmd": "prepare from-a"}}
    for sku in ("a", "b"):  # each SKU's own locks as its job wrote them
        for name in (f"pipelines/{sku}/dvc.lock", f"pipelines/{sku}/run/dvc.lock"):
            assert (tmp_path / name).read_bytes() == (tmp_path / "locks" / sku / name).read_bytes()
    assert assemble(reg, tmp_path / "locks")["changed"] is False
