"""The rendered rollout workflow: its triggers, environment and serialisation, inputs that reach the
shell only through `env:`, and its `rollout` step's script run under bash with a recording
`skuforge` on PATH (the validators run over it in test_render.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline.ci.render import HOSTED, render, workflows  # noqa: E402
from pipeline.project.config import load_registry  # noqa: E402

PASTED = re.compile(r"\$\{\{(.*?)\}\}", re.S)  # what GitHub evaluates, `format('{0}', inputs.x)` included
HOSTILE = '$(touch pwned); "x" `touch pwned`'  # a reason is text, never a script
ACTIONS = ["advance", "status", "pause", "resume", "abort", "rollback"]


@pytest.fixture(scope="module")
def registry():
    return load_registry(REPO / "params.yaml")


@pytest.fixture(scope="module")
def texts(registry) -> dict[str, str]:
    return workflows(registry)


@pytest.fixture(scope="module")
def rollout(texts) -> dict:
    return yaml.safe_load(texts["rollout.yml"])


def _step(job: dict, name: str) -> dict:
    return next(s for s in job["steps"] if s.get("name") == name)


def test_rollout_triggers(rollout):
    on = rollout[True]  # YAML 1.1 reads the key `on` as True
    assert set(on) == {"schedule", "workflow_dispatch"}
    assert on["schedule"] == [{"cron": "*/30 * * * *"}]
    inputs = on["workflow_dispatch"]["inputs"]
    assert inputs["action"] == {
        "description": inputs["action"]["description"],
        "required": True,
        "default": "advance",
        "type": "choice",
        "options": ACTIONS,
    }
    for name in ("model", "reason"):
        assert inputs[name]["type"] == "string" and inputs[name]["required"] is False


def test_rollout_job_environment_permissions_and_concurrency(rollout):
    assert rollout["permissions"] == {}
    # one group per trigger: a scheduled advance never cancels a queued manual abort
    assert rollout["concurrency"] == {"group": "skuforge-rollout-${{ github.event_name }}", "cancel-in-progress": False}
    [job] = rollout["jobs"].values()
    assert job["environment"] == "rollout"
    assert job["permissions"] == {"contents": "read"}
    assert job["runs-on"] in HOSTED.values()  # no hardware: a GitHub-hosted runner
    assert job["env"] == {
        "SKUFORGE_SIGNING_KEY": "${{ secrets.SKUFORGE_SIGNING_KEY }}",
        "SKUFORGE_STORE": "${{ vars.SKUFORGE_STORE }}",
        "AWS_ENDPOINT_URL": "${{ vars.AWS_ENDPOINT_URL }}",
        "AWS_ACCESS_KEY_ID": "${{ secrets.AWS_ACCESS_KEY_ID }}",
        "AWS_SECRET_ACCESS_KEY": "${{ secrets.AWS_SECRET_ACCESS_KEY }}",
    }
    assert job["steps"][0] == {"uses": "actions/checkout@v6", "with": {"persist-credentials": False}}
    summary = _step(job, "job summary")
    assert summary["if"] == "always()"
    assert summary["run"] == 'skuforge rollout status --all --markdown >> "$GITHUB_STEP_SUMMARY"'


def test_no_workflow_pastes_an_input_into_a_script(texts):
    """Inputs reach `run:` only through `env:`: an expression in a script is pasted into its text."""
    for name, text in texts.items():
        for job_id, job in yaml.safe_load(text)["jobs"].items():
            for step in job["steps"]:
                pasted = [e for e in PASTED.findall(step.get("run", "")) if "inputs" in e]
                assert pasted == [], f"{name} job {job_id} step {step.get('name')!r} pastes {pasted}"
    [job] = yaml.safe_load(texts["rollout.yml"])["jobs"].values()
    assert all("${{" not in step.get("run", "") for step in job["steps"])


def test_render_is_idempotent(registry, tmp_path):
    first = render(registry, tmp_path)
    assert sorted(first.differ) == sorted(first.files) and len(first.files) == 3
    written = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    again = render(registry, tmp_path)
    assert again.differ == []
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == written
    assert {k: v.encode() for k, v in workflows(registry).items()} == written


# --- the `rollout` step's script ---------------------------------------------------------------


@pytest.fixture
def run_step(rollout, tmp_path):
    """Run the step's script as GitHub would (`bash -e`), with its env; return (rc, output, skuforge args)."""
    [job] = rollout["jobs"].values()
    step = _step(job, "rollout")
    script = tmp_path / "step.sh"
    script.write_text(step["run"])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "skuforge"  # records its arguments, one per NUL-terminated field, per call
    fake.write_text(f"#!/bin/bash\nprintf '%s\\0' \"$@\" >> '{calls}'\nprintf '\\n' >> '{calls}'\n")
    fake.chmod(0o755)

    def run(event: str, action: str = "", model: str = "", reason: str = ""):
        env = {
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "GITHUB_EVENT_NAME": event,
            "ACTION": action,
            "MODEL": model,
            "REASON": reason,
            "MODEL_RULE": step["env"]["MODEL_RULE"],
        }
        assert set(step["env"]) == {"ACTION", "MODEL", "REASON", "MODEL_RULE"}
        calls.unlink(missing_ok=True)
        proc = subprocess.run(
            ["bash", "--noprofile", "--norc", "-e", str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        args = [line.split("\0")[:-1] for line in calls.read_text().splitlines()] if calls.exists() else []
        return proc.returncode, proc.stdout + proc.stderr, args

    return run


def test_schedule_advances_every_rollout(run_step):
    # A scheduled run has no inputs; stale ones in the environment must not steer it either.
    assert run_step("schedule")[::2] == (0, [["rollout", "advance", "--all"]])
    assert run_step("schedule", "abort", "resnet", "x")[::2] == (0, [["rollout", "advance", "--all"]])


@pytest.mark.parametrize(
    "action, model, reason, expected",
    [
        ("advance", "", "", ["advance", "--all"]),
        ("advance", "resnet", "a reason advance does not take", ["advance", "--model", "resnet"]),
        ("status", "", "", ["status", "--all"]),
        ("pause", "resnet", "canary looks slow", ["pause", "--model", "resnet", "--reason", "canary looks slow"]),
        ("rollback", "", "bad build", ["rollback", "--all", "--reason", "bad build"]),
        ("abort", "a" * 64, HOSTILE, ["abort", "--model", "a" * 64, "--reason", HOSTILE]),
    ],
)
def test_dispatch_passes_inputs_as_arguments(run_step, tmp_path, action, model, reason, expected):
    rc, out, calls = run_step("workflow_dispatch", action, model, reason)
    assert rc == 0, out
    assert calls == [["rollout", *expected]]
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("action", ["pause", "resume", "abort", "rollback"])
def test_dispatch_refuses_a_move_without_a_reason(run_step, action):
    rc, out, calls = run_step("workflow_dispatch", action, "resnet", "")
    assert rc == 1 and calls == []
    assert f"::error::{action} needs a reason" in out


@pytest.mark.parametrize("action", ["deploy", "", "advance --all", "ADVANCE"])
def test_dispatch_refuses_an_unknown_action(run_step, action):
    rc, out, calls = run_step("workflow_dispatch", action)
    assert rc == 1 and calls == []
    assert "::error::action" in out and "advance status pause resume abort rollback" in out


@pytest.mark.parametrize("model", ["ResNet", "1model", "a;b", "a b", "ok\nbad", "-all", "a" * 65, "résnet"])
def test_dispatch_refuses_a_model_that_breaks_the_name_rule(run_step, model):
    rc, out, calls = run_step("workflow_dispatch", "advance", model)
    assert rc == 1 and calls == []
    assert "::error::model" in out and "^[a-z][a-z0-9_]{0,63}$" in out and "leave it empty" in out
    assert "\n" not in out.strip()  # %q keeps the name on the error line: no second workflow command
