"""What each rendered job installs and which secrets it can read: every job's setup step is run as
GitHub would (bash, its env, the SKU's matrix entry) with SKUFORGE_SETUP_DRY_RUN=1, so scripts/setup.sh
prints its install commands; the plan job's matrix step is run to check what a fork gets."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline.ci.render import workflows  # noqa: E402
from pipeline.project.config import load_registry  # noqa: E402
from tests.models import conv_bn_spec, ort_sku, write_project  # noqa: E402

EXPR = re.compile(r"\$\{\{\s*([^}]*?)\s*\}\}")
# The compiler stacks' extras (pyproject.toml), and which one each backend needs: the test's own
# table, so a render that drops or adds one fails here.
COMPILERS = {"openvino", "iree", "tvm", "litert", "tensorrt"}
NEEDS = {"onnxruntime": set(), "openvino": {"openvino"}, "iree": {"iree"}, "tvm": {"tvm"}, "litert": {"litert"}}
NEEDS["tensorrt"] = {"tensorrt"}
# The jobs that build nothing: what they run (config validate, ci render/assemble, cache status,
# promote, rollout) was tried in a fresh venv with these extras only (docs/ci.md).
OTHER_JOBS = {
    ("build.yml", "plan"): {"pipeline"},
    ("build.yml", "assemble"): {"pipeline"},
    ("promote.yml", "promote"): {"pipeline"},
    ("rollout.yml", "rollout"): {"agent"},
}


@pytest.fixture(scope="module")
def registry():
    return load_registry(REPO / "params.yaml")


@pytest.fixture(scope="module")
def docs(registry) -> dict[str, dict]:
    return {name: yaml.safe_load(text) for name, text in workflows(registry).items()}


def _substitute(text: str, context: dict[str, dict[str, str]]) -> str:
    def one(m: re.Match) -> str:
        scope, _, key = m.group(1).partition(".")
        if scope in context and key in context[scope]:
            return context[scope][key]
        pytest.fail(f"the replay cannot evaluate ${{{{ {m.group(1)} }}}}")

    return EXPR.sub(one, str(text))


def _run_step(step: dict, context: dict, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, **env, **{k: _substitute(v, context) for k, v in step.get("env", {}).items()}}
    return subprocess.run(
        ["bash", "--noprofile", "--norc", "-e", "-o", "pipefail", "-c", _substitute(step["run"], context)],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _installs(step: dict, context: dict) -> dict:
    """The setup step's commands, dry: the extras pip installs and the other installs."""
    proc = _run_step(step, context, SKUFORGE_SETUP_DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    lines = [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]
    extras = [m.group(1) for line in lines if (m := re.search(r"pip install --quiet -e \.\[([^\]]*)\]", line))]
    assert len(extras) == 1, lines
    return {
        "extras": set(extras[0].split(",")),
        "apt": {line.split()[-1] for line in lines if line.startswith("apt-get install")},
        "cpu_torch": any("download.pytorch.org/whl/cpu" in line for line in lines),
        "converter": any("pipeline.backends.litert_converter" in line for line in lines),
        "system_site": any("--system-site-packages" in line for line in lines),
    }


def _setup(job: dict) -> dict:
    return next(s for s in job["steps"] if s.get("id") == "setup")


def _entries(doc: dict) -> list[dict]:
    step = next(s for s in doc["jobs"]["plan"]["steps"] if s.get("id") == "matrix")
    return json.loads(step["env"]["MATRIX"])


def test_jobs_that_build_nothing_install_no_compiler(docs):
    for (name, job_id), expected in OTHER_JOBS.items():
        got = _installs(_setup(docs[name]["jobs"][job_id]), {})
        assert got == {
            "extras": expected,
            "apt": set(),
            "cpu_torch": False,
            "converter": False,
            "system_site": False,
        }, (
            name,
            job_id,
        )


@pytest.mark.parametrize("job_id", ["sku", "sku-publish"])
def test_each_sku_job_installs_its_backend_only(docs, registry, job_id):
    job = docs["build.yml"]["jobs"][job_id]
    entries = _entries(docs["build.yml"])
    assert [e["sku"] for e in entries] == [s for s, spec in registry.skus.items() if spec.ci]
    for entry in entries:
        sku = registry.skus[entry["sku"]]
        got = _installs(_setup(job), {"matrix": {k: str(v) for k, v in entry.items()}})
        assert got["extras"] & COMPILERS == NEEDS[sku.backend], entry
        assert got["extras"] - COMPILERS == {"pipeline", "examples"}, entry  # the example project trains with torch
        assert got["cpu_torch"], entry  # before pip could take the CUDA build
        assert got["converter"] == (sku.backend == "litert"), entry
        vulkan = sku.backend == "iree" and sku.options.get("target_device") == "vulkan"
        assert got["apt"] == ({"mesa-vulkan-drivers"} if vulkan else set()), entry
        assert got["system_site"] == (sku.backend == "tensorrt" and sku.target.arch == "aarch64"), entry


def test_setup_refuses_an_unknown_part():
    proc = subprocess.run(
        ["bash", "scripts/setup.sh", "--extras", "pipeline", "--with", "vulcan"],
        cwd=REPO,
        env={**os.environ, "SKUFORGE_SETUP_DRY_RUN": "1"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "unknown --with part 'vulcan'" in proc.stderr


def test_secrets_only_in_protected_environments(docs):
    """No job without an environment reads a secret; the pull-request job publishes nothing."""
    for name, doc in docs.items():
        for job_id, job in doc["jobs"].items():
            uses_secrets = "secrets." in json.dumps(job)
            assert not uses_secrets or job.get("environment") in ("publish", "release", "rollout"), (name, job_id)
    jobs = docs["build.yml"]["jobs"]
    assert "secrets." not in json.dumps(jobs["sku"]) and "environment" not in jobs["sku"]
    assert jobs["sku"]["if"] == "${{ github.event_name == 'pull_request' && needs.plan.outputs.any == 'true' }}"
    assert "pull_request" in jobs["sku-publish"]["if"] and "!=" in jobs["sku-publish"]["if"]
    assert jobs["sku-publish"]["environment"] == "publish"
    assert "SKUFORGE_SIGNING_KEY" in jobs["sku-publish"]["env"]
    stages = {s["name"]: s["run"] for s in jobs["sku"]["steps"] if "run" in s}["stages"]
    assert stages.endswith("--no-publish")
    assert jobs["assemble"]["environment"] == "publish" and "pull_request" in jobs["assemble"]["if"]


def _plan(tmp_path: Path, self_hosted: str) -> tuple[dict, str]:
    write_project(
        tmp_path,
        {"conv": conv_bn_spec()},
        {
            "box": ort_sku(runner_labels=["self-hosted", "linux", "x64"]),
            "hosted": ort_sku(runner_labels=["linux"], target={"arch": "x86_64", "device": "cpu", "os": "linux"}),
            "off": ort_sku(
                runner_labels=["linux"], target={"arch": "x86_64", "device": "cpu", "os": "linux"}, ci=False
            ),
        },
    )
    doc = yaml.safe_load(workflows(load_registry(tmp_path / "params.yaml"))["build.yml"])
    step = next(s for s in doc["jobs"]["plan"]["steps"] if s.get("id") == "matrix")
    out = tmp_path / "github_output"
    out.write_text("")
    proc = _run_step(step, {"vars": {"SKUFORGE_SELF_HOSTED": self_hosted}}, GITHUB_OUTPUT=str(out))
    assert proc.returncode == 0, proc.stderr
    outputs = dict(line.split("=", 1) for line in out.read_text().splitlines())
    return {"skus": [e["sku"] for e in json.loads(outputs["matrix"])["include"]], "any": outputs["any"]}, proc.stdout


def test_a_fork_without_the_self_hosted_runners_gets_the_hosted_jobs(tmp_path):
    got, log = _plan(tmp_path, "")
    assert got == {"skus": ["hosted"], "any": "true"}
    assert "::notice::no job for the self-hosted SKUs box" in log


def test_self_hosted_jobs_where_the_repository_says_it_has_the_runners(tmp_path):
    got, log = _plan(tmp_path, "true")
    assert got == {"skus": ["box", "hosted"], "any": "true"}
    assert "::notice::" not in log


def test_assemble_warns_when_its_pull_request_runs_no_checks(docs):
    steps = docs["build.yml"]["jobs"]["assemble"]["steps"]
    app = next(s for s in steps if s.get("id") == "app-token")
    assert app["uses"].startswith("actions/create-github-app-token@")
    assert app["with"]["permission-contents"] == "write"
    opened = next(s for s in steps if s.get("name") == "open a pull request")
    assert opened["env"]["APP_TOKEN"] == "${{ steps.app-token.outputs.token }}"
    assert opened["env"]["PR_TOKEN"] == "${{ secrets.SKUFORGE_PR_TOKEN }}"
    assert "::warning::the pull request is opened with GITHUB_TOKEN, so GitHub runs no checks" in opened["run"]
