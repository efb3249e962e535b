"""The build workflow's select job: after the SKU jobs, it chooses each model's engine per device
class from what those jobs uploaded. The SKU job's `run:` step that keeps its failure records is
replayed in a built project, the files its upload step names are copied into a checkout without
build/ (what download-artifact gives), and the select job's `run:` steps are replayed there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from cli_helpers import skuforge
from models import conv_bn_spec, ort_sku, write_project
from registry_helpers import fake_bench
from rollout.conftest import classed_copy

from pipeline.ci.render import select_models
from pipeline.core.paths import Layout
from pipeline.project.config import load_registry
from pipeline.results.outcomes import record_outcome

BIN = Path(sys.executable).parent
CLASS = "x86-test"


def _samples(p50: float, n: int = 200, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    return [float(x) for x in rng.normal(p50, p50 * 0.02, n)]


def _run(step: dict, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """One `run:` step as GitHub runs it (bash -e -o pipefail), with the step's env."""
    script = cwd.parent / "step.sh"
    script.write_text(step["run"])
    full = {**os.environ, "PATH": os.pathsep.join([str(BIN), os.environ["PATH"]]), **env, **step.get("env", {})}
    for var in ("MLFLOW_TRACKING_URI", "GITHUB_ACTIONS"):
        full.pop(var, None)
    return subprocess.run(
        ["bash", "--noprofile", "--norc", "-e", "-o", "pipefail", str(script)],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _upload_paths(job: dict, sku: str) -> list[str]:
    (upload,) = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact")]
    return [
        line.strip().replace("${{ matrix.sku }}", sku) for line in upload["with"]["path"].splitlines() if line.strip()
    ]


@pytest.fixture
def job_project(tmp_path_factory, tmp_path) -> Path:
    """The rollout tests' built project (conv for ``cpu`` and ``portable``), both SKUs of one device
    class, cpu about twice as fast; its workflows rendered."""
    root, _ = classed_copy(tmp_path_factory, tmp_path, CLASS)
    reg = load_registry(root / "params.yaml")
    fake_bench(reg, "conv", "cpu", _samples(1.0))
    fake_bench(reg, "conv", "portable", _samples(2.0, seed=1))
    proc = skuforge("ci", "render", cwd=root)
    assert proc.returncode == 0, proc.stderr
    return root


def _select(root: Path, tmp_path: Path, failed: list[str], event: str = "select") -> tuple[int, str, dict, str]:
    """The SKU jobs (``failed``: the SKUs whose validate gate failed in their job), their artifacts
    merged into a fresh checkout, then the select job ``event``'s steps: (exit code of the select
    step, its output, the record written, the job summary)."""
    workflow = yaml.safe_load((root / ".github/workflows/build.yml").read_text())["jobs"]
    checkout = tmp_path / "checkout"
    shutil.copytree(root, checkout, ignore=shutil.ignore_patterns("build"))  # git ignores build/
    for sku in failed:  # the job's gate failed: its checkout's (older) manifest is what it uploads
        record_outcome(root, "validate", "conv", sku, 1, "output probs: 12.50% of elements beyond tolerance")
    steps = workflow["sku-publish"]["steps"]
    (keep,) = [s for s in steps if s.get("name") == "keep the failure records for the select job"]
    for sku in ("cpu", "portable"):  # each job: keep its records, upload what its step names
        proc = _run(keep, root, {"SKU": sku})
        assert proc.returncode == 0, proc.stderr
        for pattern in _upload_paths(workflow["sku-publish"], sku):
            for found in root.glob(pattern.rstrip("/")):
                dest = checkout / found.relative_to(root)
                if found.is_dir():
                    shutil.copytree(found, dest, dirs_exist_ok=True)
                else:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(found, dest)
        shutil.rmtree(root / "build/ci", ignore_errors=True)  # the next job's runner has none of it
    summary = tmp_path / "summary.md"
    summary.touch()
    code, output = 0, ""
    for step in workflow[event]["steps"]:
        if "uses" in step or step.get("id") == "setup":
            continue
        proc = _run(step, checkout, {"GITHUB_STEP_SUMMARY": str(summary), "GITHUB_PATH": str(tmp_path / "path")})
        if step["name"] == "select":
            code, output = proc.returncode, proc.stdout + proc.stderr
        else:
            assert proc.returncode == 0, proc.stderr
    record = json.loads(Layout(checkout).selection("conv").read_text())
    return code, output, record, summary.read_text()


def test_the_workflow_selects_after_the_sku_jobs(job_project):
    reg = load_registry(job_project / "params.yaml")
    assert select_models(reg) == ["conv"]
    jobs = yaml.safe_load((job_project / ".github/workflows/build.yml").read_text())["jobs"]
    pr, push = jobs["select"], jobs["select-publish"]
    assert pr["needs"] == ["plan", "sku"] and push["needs"] == ["plan", "sku-publish"]
    assert all(j["if"].startswith("${{ !cancelled() &&") for j in (pr, push))  # after failed SKU jobs too
    assert push["environment"] == "publish" and "environment" not in pr
    assert set(push["env"]) == {"MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN"} and "env" not in pr
    (models,) = [s["env"]["MODELS"] for s in push["steps"] if s.get("name") == "select"]
    assert json.loads(models) == ["conv"]
    runs = {name: "\n".join(s.get("run", "") for s in job["steps"]) for name, job in (("pr", pr), ("push", push))}
    assert 'skuforge select --model "$model" --publish' in runs["push"]
    assert "--publish" not in runs["pr"]
    upload = next(s for s in push["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact"))
    assert upload["with"]["name"] == "selection" and "build/.selection/" in upload["with"]["path"]
    assert upload["with"]["include-hidden-files"] is True  # build/.selection is a dot folder


def test_no_select_job_without_device_classes(tmp_path):
    write_project(tmp_path, {"conv": conv_bn_spec()}, {"a": ort_sku()})
    assert skuforge("ci", "render", cwd=tmp_path).returncode == 0
    jobs = yaml.safe_load((tmp_path / ".github/workflows/build.yml").read_text())["jobs"]
    assert "select" not in jobs and "select-publish" not in jobs and "assemble" in jobs


def test_the_select_job_chooses_from_the_sku_jobs_artifacts(job_project, tmp_path):
    code, output, record, summary = _select(job_project, tmp_path, failed=[])
    assert code == 0, output
    (c,) = record["classes"]
    assert (c["device_class"], c["decision"], c["chosen"]) == (CLASS, "separated", "cpu")
    # the artifacts carried each SKU's bench samples, bound to its manifest
    assert [x["evidence"] for x in c["candidates"]] == ["samples", "samples"]
    assert "cpu selected for x86-test" in output
    assert "#### conv" in summary and "cpu selected for x86-test" in summary


def test_a_sku_whose_gate_failed_in_its_job_is_not_chosen(job_project, tmp_path):
    """The failed job uploads the manifest its checkout had; its failure record, carried to the
    select job, makes the matrix's verdict 'gate failed' there, so the other SKU is chosen."""
    code, output, record, _ = _select(job_project, tmp_path, failed=["cpu"])
    assert code == 0, output
    (c,) = record["classes"]
    assert (c["decision"], c["chosen"]) == ("only candidate", "portable")
    assert [x["outcome"] for x in c["candidates"]] == ["gate failed", "passed"]


def test_the_select_step_fails_when_a_class_has_no_passing_engine(job_project, tmp_path):
    code, output, record, summary = _select(job_project, tmp_path, failed=["cpu", "portable"])
    assert code == 1, output
    (c,) = record["classes"]
    assert c["decision"] == "none passed" and c["chosen"] is None
    assert "#### conv" in summary  # said in the summary before the job fails
