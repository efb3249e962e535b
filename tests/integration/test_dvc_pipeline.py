"""The real dvc.yaml driven by real DVC in a throwaway git repository: a user project with a tiny
model and three SKUs (two this host can build, one for an aarch64 runner it cannot). One model:
the stages per model and per pair are what DVC runs here; several models under one `dvc repro`
(its foreach over models) are tests/test_matrix.py's, and the multi-input model's stages are
tests/stages' (two models here made this module's chain of repros the suite's longest item).

The steps build on each other, so each is a module-scoped fixture that depends on the previous
one and returns what it saw (exit code, output, file snapshots); the tests only check those
results. Run in any order (or spread over xdist workers) the steps still happen in sequence.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `tests.models` without relying on how pytest was started
    sys.path.insert(0, str(REPO))

from pipeline.engine.matrix import stage_address  # noqa: E402
from pipeline.ops.pipelines import render_pipelines  # noqa: E402
from pipeline.project.config import load_registry  # noqa: E402
from pipeline.results.manifest import validate_document  # noqa: E402
from tests.models import conv_bn_model, conv_bn_spec, ort_sku, write_project  # noqa: E402

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
MODELS = ("conv",)
BUILDABLE = ("cpu_fp32", "cpu_int8")
FAR_LABELS = ["self-hosted", "arm64", "jetson"]
RUNNING = re.compile(r"^Running stage '([^']+)'", re.M)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])  # dvc runs `skuforge ...` from PATH
    env["DVC_NO_ANALYTICS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    for var in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "DVC_ROOT"):  # never touch the enclosing checkout
        env.pop(var, None)
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):  # publish into the project's embedded store
        env.pop(var, None)
    return env


@dataclass
class Run:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    files: dict[str, Any] = field(default_factory=dict)
    after: dict[str, str] = field(default_factory=dict)  # command -> its stdout, run right after this one

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def stages(self) -> list[str]:
        return RUNNING.findall(self.output)

    def __str__(self) -> str:  # what a failed assert shows
        return f"$ {' '.join(self.args)}  -> exit {self.returncode} in {self.seconds:.1f}s\n{self.output[-6000:]}"


def run(root: Path, *args: str, timeout: float = 300) -> Run:
    exe = {"skuforge": str(BIN / "skuforge"), "dvc": str(BIN / "dvc")}.get(args[0], args[0])
    started = time.perf_counter()
    proc = subprocess.run([exe, *args[1:]], cwd=root, env=_env(), capture_output=True, text=True, timeout=timeout)
    return Run(list(args), proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - started)


def must(result: Run) -> Run:
    assert result.returncode == 0, str(result)
    return result


def store_state(root: Path) -> dict[str, dict[str, Any]]:
    """Per pair, what the project's embedded MLflow store holds: runs, versions, metrics, artifacts."""
    from pipeline.project.config import load_registry
    from pipeline.tracking.client import connect, embedded_uri

    client = connect(load_registry(root / "params.yaml"), uri=embedded_uri(root)).client
    state = {}
    for m in MODELS:
        exp = client.get_experiment_by_name(m)
        for s in (*BUILDABLE, "far"):
            runs = client.search_runs([exp.experiment_id], f"tags.`skuforge.sku` = '{s}'") if exp else []
            versions = client.search_model_versions(f"name = '{m}.{s}'")
            state[f"{m}/{s}"] = {
                "runs": len(runs),
                "versions": sorted(int(v.version) for v in versions),
                "metrics": all("latency.engine_only.p50_ms" in r.data.metrics for r in runs),
                "artifacts": sorted({f.path for r in runs for f in client.list_artifacts(r.info.run_id)}),
            }
    return state


def snapshot(root: Path, pattern: str) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.glob(pattern)) if p.is_file()}


def edit_params(root: Path, edit) -> None:
    path = root / "params.yaml"
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def skus() -> dict:
    return {
        "cpu_fp32": ort_sku("fp32"),
        "cpu_int8": ort_sku("int8"),
        "far": ort_sku("fp32", target={"arch": "aarch64", "device": "cpu", "os": "linux"}, runner_labels=FAR_LABELS),
    }


def make_project(
    root: Path,
    models: tuple[str, ...] = MODELS,
    sku_table: dict | None = None,
    defaults: bool = True,
    examples: bool = True,
) -> Path:
    """git init, the real dvc.yaml verbatim, dvc init, models and params.yaml."""
    root.mkdir(parents=True, exist_ok=True)
    must(run(root, "git", "init", "-q"))
    shutil.copyfile(REPO / "dvc.yaml", root / "dvc.yaml")
    must(run(root, "dvc", "init", "-q"))
    builders = {"conv": (conv_bn_model, conv_bn_spec)}
    specs = {}
    for name in models:
        model, spec = builders[name]
        model(root / "models" / name / "model.onnx")
        specs[name] = spec(f"models/{name}")
    params = write_project(root, specs, sku_table if sku_table is not None else skus())
    if not (defaults and examples):  # leave out keys dvc.yaml needs, to test the error
        doc = yaml.safe_load(params.read_text())
        for key, keep in (("defaults", defaults), ("examples", examples)):
            if not keep:
                doc.pop(key)
        params.write_text(yaml.safe_dump(doc, sort_keys=False))
    return root


# --- the sequence: each step is a fixture over the previous one -------------------------------


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return make_project(tmp_path_factory.mktemp("skuforge_project"))


@pytest.fixture(scope="module")
def first(project) -> Run:
    """1. `skuforge repro` in a fresh project."""
    result = run(project, "skuforge", "repro")
    result.files = snapshot(project, "manifests/**/*.json")
    result.files["mlflow"] = store_state(project) if result.returncode == 0 else {}
    # the wide matrix (its last column: the MLflow version this checkout published), as it was then
    result.after["summary --wide"] = run(project, "skuforge", "summary", "--wide").stdout
    print(f"first skuforge repro: {result.seconds:.1f}s")
    return result


@pytest.fixture(scope="module")
def noop(project, first) -> tuple[Run, Run]:
    """2. `skuforge repro` again with nothing changed, and plain `dvc status` of the whole project:
    the SKU this host cannot build is hidden from DVC here (pipelines/far/.dvcignore)."""
    must(first)
    again = run(project, "skuforge", "repro")
    print(f"no-op skuforge repro: {again.seconds:.1f}s")
    status = run(project, "dvc", "status")
    return again, status


@pytest.fixture(scope="module")
def sku_edit(project, noop) -> Run:
    """3. One SKU's settings change; `skuforge repro` again.

    The edit changes the engine's build options but not its numbers: `per_channel: false` (the
    obvious edit) legitimately fails the default INT8 gate on the multi-output test model (6.25% of
    `cls` flip > 5%).
    """
    before = snapshot(project, "manifests/*/cpu_fp32.json")
    edit_params(project, lambda d: d["skus"]["cpu_int8"].update(options={"intra_op_num_threads": 1}))
    result = run(project, "skuforge", "repro")
    result.files = {
        "before": before,
        "after": snapshot(project, "manifests/*/cpu_fp32.json"),
        "int8": snapshot(project, "manifests/*/cpu_int8.json"),
        "builds": snapshot(project, "build/*/cpu_int8/build.json"),
        "mlflow": store_state(project) if result.returncode == 0 else {},
    }
    return result


@pytest.fixture(scope="module")
def far_by_dvc(project, sku_edit) -> Run:
    """4. Plain `dvc repro` of the build stage of the SKU this host cannot build: refused while
    `skuforge repro` hides it, and run (to fail) once the .dvcignore is gone (a fresh clone)."""
    hidden = run(project, "dvc", "repro", "pipelines/far/dvc.yaml:build@conv")
    assert hidden.returncode != 0 and "is dvc-ignored" in hidden.output, str(hidden)
    (project / "pipelines/far/.dvcignore").unlink()
    return run(project, "dvc", "repro", "pipelines/far/dvc.yaml:build@conv")


@pytest.fixture(scope="module")
def gate_fail(project, far_by_dvc) -> Run:
    """5. cpu_int8 with zero tolerance: the validate stage fails its gate under dvc."""
    edit_params(
        project, lambda d: d["skus"]["cpu_int8"].update(tolerance={"atol": 0.0, "rtol": 0.0, "max_mismatch": 0.0})
    )
    result = run(project, "skuforge", "repro", "--sku", "cpu_int8")
    result.files = snapshot(project, "build/*/cpu_int8/validate.json")
    return result


# --- the checks ---------------------------------------------------------------------------------


def test_empty_examples_foreach_is_accepted(project):
    render_pipelines(load_registry(project / "params.yaml"))  # as `skuforge repro` does first
    listed = must(run(project, "dvc", "stage", "list", "--all"))
    names = {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}
    assert not any(n.startswith("export") for n in names)
    assert {f"prepare@{m}" for m in MODELS} <= names
    assert {
        stage_address(stage, m, s)
        for stage in ("build", "validate", "bench", "manifest", "publish")
        for m in MODELS
        for s in (*BUILDABLE, "far")
    } <= names


def test_repro_builds_every_buildable_pair(project, first):
    assert first.returncode == 0, str(first)
    assert re.search(r"skipping SKU far: .*needs a runner with labels \[self-hosted, arm64, jetson\]", first.stderr), (
        str(first)
    )
    expected = {f"manifests/{m}/{s}.json" for m in MODELS for s in BUILDABLE}
    assert set(first.files) - {"mlflow"} == expected
    for path, raw in first.files.items():
        if path == "mlflow":
            continue
        doc = json.loads(raw)
        validate_document(doc, path)
        model, sku = Path(path).parent.name, Path(path).stem
        assert (doc["model"], doc["sku"]) == (model, sku)
        assert doc["correctness"]["passed"] is True
    assert not list(project.glob("manifests/*/far.json"))
    assert not [p for p in project.glob("build/*/far/**/*") if p.is_file()]
    # the summary table names every pair built
    for m in MODELS:
        for s in BUILDABLE:
            assert re.search(rf"^{m}\s+{s}\s", first.stdout, re.M), first.stdout


def test_repro_records_every_pair_in_the_embedded_mlflow_store(project, first):
    assert first.returncode == 0, str(first)
    assert (project / "mlflow.db").is_file() and (project / "mlartifacts").is_dir()
    for m in MODELS:
        for s in BUILDABLE:
            assert first.files["mlflow"][f"{m}/{s}"] == {
                "runs": 1,
                "versions": [1],
                "metrics": True,
                "artifacts": ["engine", "manifest.json", "reports"],
            }, (m, s)
        assert first.files["mlflow"][f"{m}/far"]["runs"] == 0
    wide = first.after["summary --wide"]
    assert re.search(r"^conv\s+cpu_fp32\s.*\sv1\s*$", wide, re.M), wide


def test_noop_rerun_runs_no_stage(noop):
    again, status = noop
    assert again.returncode == 0, str(again)
    assert again.stages == [], str(again)
    assert "Running stage" not in again.output
    assert status.returncode == 0, str(status)
    assert "Data and pipelines are up to date." in status.output, str(status)


def test_sku_edit_reruns_only_that_sku(sku_edit):
    assert sku_edit.returncode == 0, str(sku_edit)
    ran = sku_edit.stages
    assert ran, str(sku_edit)
    # the config stage re-resolves the registry; only cpu_int8's resolved files change
    assert ran[0] == "config" and all(name.startswith("pipelines/cpu_int8/") for name in ran[1:]), ran
    assert {
        stage_address(stage, m, "cpu_int8") for stage in ("build", "validate", "manifest", "publish") for m in MODELS
    } <= set(ran), ran
    files = sku_edit.files
    assert files["after"] == files["before"] and len(files["after"]) == len(MODELS)  # byte for byte
    assert len(files["builds"]) == len(MODELS)
    for path, raw in files["builds"].items():
        assert json.loads(raw)["options"]["intra_op_num_threads"] == 1, path
    for path, raw in files["int8"].items():
        validate_document(json.loads(raw), path)
    # a new engine is a new version; the untouched SKU keeps its one version
    for m in MODELS:
        assert files["mlflow"][f"{m}/cpu_int8"]["versions"] == [1, 2], files["mlflow"]
        assert files["mlflow"][f"{m}/cpu_fp32"]["versions"] == [1], files["mlflow"]


def test_plain_dvc_repro_of_far_sku_exits_3_with_labels(far_by_dvc):
    assert far_by_dvc.returncode != 0, str(far_by_dvc)
    out = far_by_dvc.output
    assert "cannot build SKU far" in out, str(far_by_dvc)
    assert "self-hosted, arm64, jetson" in out, str(far_by_dvc)
    assert re.search(r"skuforge build --model 'conv' --sku 'far'.*exited with 3", out), str(far_by_dvc)


def test_failing_gate_under_dvc_exits_1_and_keeps_report(gate_fail):
    assert gate_fail.returncode == 1, str(gate_fail)
    assert "failed validation" in gate_fail.output, str(gate_fail)
    # dvc keeps going: one line names every stage that failed
    failed = re.findall(r"'pipelines/cpu_int8/run/dvc.yaml:validate@(\w+)'", gate_fail.output)
    assert failed, str(gate_fail)
    assert re.search(rf"^{failed[0]}\s+cpu_int8\s+gate failed", gate_fail.stdout, re.M), str(gate_fail)
    report = json.loads(gate_fail.files[f"build/{failed[0]}/cpu_int8/validate.json"])
    assert report["passed"] is False
    assert report["failures"]
    assert all(o["atol"] == 0.0 and o["rtol"] == 0.0 and o["max_mismatch"] == 0.0 for o in report["outputs"])
    assert not all(o["passed"] for o in report["outputs"])
    # only cpu_int8 was asked for (and the registry re-resolved)
    assert all(name.startswith("pipelines/cpu_int8/") for name in gate_fail.stages if name != "config"), (
        gate_fail.stages
    )


# --- a user project that leaves optional registry sections out ------------------------------------


@pytest.mark.parametrize("left_out", ["examples", "defaults"])
def test_registry_without_a_key_dvc_yaml_names_is_a_config_error(tmp_path, left_out):
    # dvc.yaml iterates over `examples` and tracks `defaults`; DVC has no default for a missing
    # key, so the registry requires both and says how to write them empty.
    root = make_project(tmp_path / "p", models=("conv",), sku_table={"cpu_fp32": ort_sku("fp32")}, **{left_out: False})
    result = run(root, "skuforge", "config", "validate")
    assert result.returncode == 2, str(result)
    assert f"{left_out}: missing" in result.output and f"`{left_out}: {{}}`" in result.output
    assert "Traceback" not in result.output


def test_dry_run_in_fresh_project(tmp_path):
    root = make_project(tmp_path / "p", models=("conv",), sku_table={"cpu_fp32": ort_sku("fp32")})
    result = run(root, "skuforge", "repro", "--dry")
    assert result.returncode == 0, str(result)
    assert "pipelines/cpu_fp32/dvc.yaml:build@conv" in result.output
    assert not (root / "build").exists()
