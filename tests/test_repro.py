"""Which (model, SKU) pairs this host builds, and the refusals of ``dvc repro`` around it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import models
import pytest

from pipeline.core.errors import ConfigError, EnvironmentProblem, InputError
from pipeline.engine.matrix import sku_statuses
from pipeline.host.probe import host_arch
from pipeline.ops.repro import (
    STATUS_MEMO,
    DvcFailed,
    ProjectStatus,
    drop_torn_rwlock,
    run_dvc_repro,
    targets,
    workspace_state,
)
from pipeline.ops.reproduce import reproduce
from pipeline.project.config import parse_registry

OTHER_ARCH = "aarch64" if host_arch() == "x86_64" else "x86_64"


@pytest.fixture()
def registry(tmp_path):
    data = {
        "defaults": {},
        "examples": {},
        "models": {"a": models.conv_bn_spec("models/a"), "b": models.conv_bn_spec("models/b")},
        "skus": {
            "here": models.ort_sku("fp32"),
            "here_int8": models.ort_sku("int8"),
            "there": models.ort_sku("fp32", target={"arch": OTHER_ARCH}, runner_labels=["arm-box"]),
        },
    }
    return parse_registry(data, root=tmp_path)


def test_sku_statuses(registry):
    statuses = {s.sku: s for s in sku_statuses(registry)}
    assert statuses["here"].buildable and statuses["here"].problems == []
    there = statuses["there"]
    assert not there.buildable and there.runner_labels == ["arm-box"]
    assert there.problems == [f"needs arch {OTHER_ARCH}, this host is {host_arch()}"]
    assert there.to_json()["target"] == f"{OTHER_ARCH}/cpu/linux"


def test_targets_are_the_buildable_pairs(registry):
    built, skipped = targets(registry, None, None)
    assert built == [
        "pipelines/here/run/dvc.yaml:publish@a",
        "pipelines/here_int8/run/dvc.yaml:publish@a",
        "pipelines/here/run/dvc.yaml:publish@b",
        "pipelines/here_int8/run/dvc.yaml:publish@b",
    ]
    assert [s.sku for s in skipped] == ["there"]
    built, skipped = targets(registry, ["b"], ["here", "there"])
    assert built == ["pipelines/here/run/dvc.yaml:publish@b"] and [s.sku for s in skipped] == ["there"]
    built, _ = targets(registry, ["b"], ["here"], publish=False)
    assert built == ["pipelines/here/run/dvc.yaml:manifest@b"]


def test_a_sku_this_host_only_builds_is_targeted_at_its_build_stage(registry):
    statuses = sku_statuses(registry)
    for s in statuses:
        if s.sku == "here_int8":
            s.runnable = False
    built, skipped = targets(registry, ["a"], None, statuses=statuses)
    assert built == ["pipelines/here/run/dvc.yaml:publish@a", "pipelines/here_int8/dvc.yaml:build@a"]
    assert [s.sku for s in skipped] == ["here_int8", "there"]


def test_targets_follow_the_models_sku_selection(tmp_path):
    data = {
        "defaults": {},
        "examples": {},
        "models": {
            "a": {**models.conv_bn_spec("models/a"), "skus": ["here_int8"]},
            "b": models.conv_bn_spec("models/b"),
        },
        "skus": {"here": models.ort_sku("fp32"), "here_int8": models.ort_sku("int8")},
    }
    registry = parse_registry(data, root=tmp_path)
    assert registry.pairs() == [("a", "here_int8"), ("b", "here"), ("b", "here_int8")]
    built, _ = targets(registry, None, None)
    assert built == [
        "pipelines/here_int8/run/dvc.yaml:publish@a",
        "pipelines/here/run/dvc.yaml:publish@b",
        "pipelines/here_int8/run/dvc.yaml:publish@b",
    ]
    with pytest.raises(ConfigError, match="model a is built for none of the SKUs asked for: here") as info:
        targets(registry, ["a"], ["here"])
    assert "models.a.skus" in info.value.hint


def test_upstream_of_a_publish_target_is_the_whole_chain(registry):
    from pipeline.ops.repro import upstream_stages

    names = upstream_stages(registry, ["pipelines/here/run/dvc.yaml:publish@a"])
    assert names == {
        "config",
        *(f"{s}@a" for s in ("prepare", "data", "reference", "calibrate")),
        "pipelines/here/dvc.yaml:build@a",
        *(f"pipelines/here/run/dvc.yaml:{s}@a" for s in ("validate", "bench", "manifest", "publish")),
    }
    assert upstream_stages(registry, ["pipelines/here/dvc.yaml:build@b"]) == {
        "config",
        *(f"{s}@b" for s in ("prepare", "data", "reference", "calibrate")),
        "pipelines/here/dvc.yaml:build@b",
    }


def test_targets_refuse_unknown_names(registry):
    with pytest.raises(ConfigError, match="did you mean 'here'"):
        targets(registry, None, ["hree"])
    with pytest.raises(ConfigError, match="unknown model 'c'"):
        targets(registry, ["c"], None)


def test_repro_outside_a_dvc_repository(tmp_path):
    with pytest.raises(InputError) as info:
        run_dvc_repro(tmp_path, ["pipelines/here/run/dvc.yaml:manifest@a"])
    assert "not a DVC repository" in info.value.message and "dvc init" in info.value.hint


def test_dvc_failure_without_an_error_line_quotes_dvc(tmp_path):
    from pipeline.ops.repro import dvc_failure

    err = dvc_failure(
        tmp_path,
        255,
        "\x1b[31mERROR\x1b[39m: failed to reproduce 'build@m-cpu': failed to run: skuforge build, exited with 3\n",
    )
    assert err.stage_failed and err.exit_code == 3 and "failed to reproduce 'build@m-cpu'" in err.message
    err = dvc_failure(tmp_path, 255, "ERROR: './dvc.yaml' is invalid.\nwhile parsing a flow sequence\n  in line 3\n")
    assert err.exit_code == 2 and "is invalid" in err.message and "while parsing a flow sequence" in err.message
    assert not err.stage_failed
    # several stages failed (--keep-going): the worst exit code
    err = dvc_failure(tmp_path, 255, "x, exited with 1\ny, exited with 3\nz, exited with 2\nERROR: failed\n")
    assert err.exit_code == 3 and err.stage_failed


def test_a_stage_that_failed_early_in_a_long_run_is_still_a_stage_failure(tmp_path, monkeypatch):
    """dvc --keep-going names a failed stage's exit code where it failed, maybe hundreds of lines
    before its last words: the outcome is that stage's (exit 1, the matrix), not 'fix dvc.yaml'."""
    (tmp_path / ".dvc").mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "dvc"
    fake.write_text(
        "#!/bin/sh\n"
        "echo \"WARNING: failed to run: skuforge validate --model 'm' --sku 'int8', exited with 1\"\n"
        "i=0; while [ $i -lt 200 ]; do echo \"Running stage 'other@$i'\"; i=$((i+1)); done\n"
        "echo \"ERROR: failed to reproduce stages: 'validate@m-int8'\"\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    with pytest.raises(DvcFailed) as info:
        run_dvc_repro(tmp_path, ["publish@m-int8"], keep_going=True)
    assert info.value.stage_failed and info.value.exit_code == 1, info.value.message


# --- a merge left conflict markers in a file dvc reads --------------------------------------------

CONFLICTED_LOCK = """schema: '2.0'
stages:
  config:
    cmd: skuforge config resolve
    outs:
    - path: build/config
<<<<<<< HEAD
      md5: 0a1b2c3d4e5f60718293a4b5c6d7e8f9.dir
=======
      md5: 9f8e7d6c5b4a39281706f5e4d3c2b1a0.dir
>>>>>>> feature/new-sku
"""


def test_a_conflicted_dvc_lock_is_refused_before_dvc_runs(tmp_path):
    """dvc would fail on the markers with a YAML error and a hint about dvc.yaml; this names the
    file, the line and both ways out."""
    from pipeline.core.errors import MalformedFile

    (tmp_path / ".dvc").mkdir()
    (tmp_path / "dvc.lock").write_text(CONFLICTED_LOCK)
    with pytest.raises(MalformedFile) as info:
        run_dvc_repro(tmp_path, ["publish@a-here"])
    err = info.value
    assert err.exit_code == 2
    assert (
        f"{tmp_path / 'dvc.lock'} has an unresolved git merge conflict: line 7 is the marker '<<<<<<< HEAD'"
        == err.message
    )
    assert "resolve the merge conflict" in err.hint and "delete dvc.lock" in err.hint


@pytest.mark.parametrize("name, line", [("dvc.yaml", 3), ("params.yaml", 2)])
def test_conflict_markers_in_dvc_yaml_or_params_are_refused(tmp_path, name, line):
    from pipeline.core.errors import MalformedFile

    (tmp_path / ".dvc").mkdir()
    (tmp_path / name).write_text(
        "stages:\n  a:\n=======\n    cmd: x\n" if name == "dvc.yaml" else "a: 1\n>>>>>>> theirs\n"
    )
    with pytest.raises(MalformedFile) as info:
        run_dvc_repro(tmp_path, ["publish@a-here"], dry=True)
    assert f"{name} has an unresolved git merge conflict: line {line}" in info.value.message
    assert "resolve the merge conflict" in info.value.hint and "dvc.lock" not in info.value.hint


def test_skuforge_repro_names_the_conflicted_file(tmp_path):
    """Through the CLI as a user runs it: exit 2, the file and line, the fix; dvc is never started."""
    from cli_helpers import assert_user_error, project, skuforge

    root = tmp_path / "proj"
    params = project(root)
    (root / ".dvc").mkdir()
    (root / "dvc.lock").write_text(CONFLICTED_LOCK)
    proc = skuforge("repro", cwd=root)
    assert_user_error(proc, 2, "dvc.lock has an unresolved git merge conflict: line 7", "delete dvc.lock")
    assert "dvc.yaml" not in proc.stderr

    (root / "dvc.lock").unlink()
    params.write_text("<<<<<<< HEAD\n" + params.read_text() + "=======\nskus: {}\n>>>>>>> other\n")
    proc = skuforge("repro", cwd=root)
    assert_user_error(
        proc,
        2,
        "params.yaml has an unresolved git merge conflict: line 1 is the marker '<<<<<<< HEAD'",
        "resolve the merge conflict",
    )


def test_dvc_refusing_its_lock_file_says_how_to_rebuild_it(tmp_path):
    from pipeline.ops.repro import dvc_failure

    # dvc 3's own words for a damaged dvc.lock (no ERROR prefix)
    err = dvc_failure(tmp_path, 255, "'./dvc.lock' is invalid.\n\nWhile parsing a flow node, in line 4, column 1\n")
    assert err.exit_code == 2 and "delete it" in err.hint and "dvc.yaml" not in err.hint
    err = dvc_failure(tmp_path, 255, "ERROR: './dvc.yaml' is invalid.\n")
    assert err.hint == "fix dvc.yaml / params.yaml as dvc says"


def test_a_conflicted_per_sku_lock_is_refused_naming_it(tmp_path):
    from pipeline.core.errors import MalformedFile

    (tmp_path / ".dvc").mkdir()
    lock = tmp_path / "pipelines" / "here" / "run" / "dvc.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(CONFLICTED_LOCK)
    with pytest.raises(MalformedFile) as info:
        run_dvc_repro(tmp_path, ["pipelines/here/run/dvc.yaml:publish@a"])
    assert info.value.message.startswith(f"{lock} has an unresolved git merge conflict: line 7")
    assert "delete dvc.lock" in info.value.hint


def _dvc_project(root: Path) -> None:
    """A real DVC project with one stage run once: `b` copied from `a`."""
    dvc = str(Path(sys.executable).parent / "dvc")
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    (root / "a").write_text("one\n")
    (root / "dvc.yaml").write_text("stages:\n  copy:\n    cmd: cp a b\n    deps: [a]\n    outs: [b]\n")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([dvc, "init", "-q"], cwd=root, check=True, env=env)
    subprocess.run([dvc, "repro", "-q"], cwd=root, check=True, env=env, capture_output=True)


@pytest.mark.slow
def test_an_unchanged_workspace_reuses_dvc_status_and_any_change_asks_again(tmp_path):
    """The status memo (repro --dry, a no-op repro in well under a second) answers only for the
    exact workspace dvc answered for: an edited dependency, a deleted output or a new stage asks dvc."""
    _dvc_project(tmp_path)
    first = ProjectStatus(tmp_path)
    assert not first.reused and first.changes() == {}
    assert (tmp_path / STATUS_MEMO).is_file()
    again = ProjectStatus(tmp_path)
    assert again.reused and again.proc is None and again.stale({"copy"}) == []

    (tmp_path / "a").write_text("two\n")  # same size, new content and mtime
    edited = ProjectStatus(tmp_path)
    assert not edited.reused and edited.stale({"copy"}) == ["copy"]
    assert ProjectStatus(tmp_path).reused and ProjectStatus(tmp_path).stale({"copy"}) == ["copy"]

    (tmp_path / "a").write_text("one\n")
    assert ProjectStatus(tmp_path).stale({"copy"}) == []  # dvc's own answer: back as it was
    (tmp_path / "b").unlink()
    assert ProjectStatus(tmp_path).stale({"copy"}) == ["copy"]
    (tmp_path / "b").write_text("one\n")
    with (tmp_path / "dvc.yaml").open("a") as f:
        f.write("  more:\n    cmd: cp b c\n    deps: [b]\n    outs: [c]\n")
    assert ProjectStatus(tmp_path).stale({"copy", "more"}) == ["more"]


def test_a_lock_that_is_not_yaml_never_reuses_an_answer(tmp_path):
    (tmp_path / "dvc.lock").write_text("stages: [unclosed\n")
    assert workspace_state(tmp_path) is None


@pytest.mark.parametrize("path", ["../outside", "/etc", "linked"])
def test_a_lock_naming_a_path_outside_or_through_a_link_never_reuses_an_answer(tmp_path, path):
    """Their content can change while nothing under the project does: dvc is asked every time."""
    (tmp_path / "real").write_text("x")
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    (tmp_path / "dvc.lock").write_text(f"schema: '2.0'\nstages:\n  s:\n    deps:\n    - path: {path}\n")
    assert workspace_state(tmp_path) is None
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages:\n  s:\n    deps:\n    - path: real\n")
    assert workspace_state(tmp_path) is not None


def test_reproduce_is_one_library_call_and_says_what_it_skips(registry):
    """`skuforge repro` is ``pipeline.ops.reproduce.reproduce``: called from Python it says through
    ``say`` what the CLI prints as it runs, and refuses SKUs asked for by name that this host cannot
    build before DVC runs (nothing half-done: no outcome record, no dvc call)."""
    said: list[str] = []
    with pytest.raises(EnvironmentProblem) as info:
        reproduce(registry, skus=["there"], force=True, say=said.append)
    assert "none of the SKUs asked for: there" in info.value.message
    assert "labels [arm-box] for there" in info.value.hint  # said in the error too: a library caller may print nothing
    assert said == [
        f"skipping SKU there: needs arch {OTHER_ARCH}, this host is {host_arch()}; needs a runner with labels [arm-box]"
    ]
    assert not (registry.root / "build").exists()  # nothing ran

    only_there = parse_registry(
        {
            "defaults": {},
            "examples": {},
            "models": {"a": models.conv_bn_spec("models/a")},
            "skus": {"there": models.ort_sku("fp32", target={"arch": OTHER_ARCH}, runner_labels=["arm-box"])},
        },
        root=registry.root,
    )
    said.clear()
    result = reproduce(only_there, force=True, say=said.append)
    assert result.targets == [] and [s.sku for s in result.skipped] == ["there"] and result.exit_code == 0
    assert said[-1] == "nothing this host can build"


@pytest.mark.slow
def test_a_cancelled_status_leaves_dvc_usable_though_it_died_mid_write(tmp_path):
    """`skuforge repro` cancels its first `dvc status` when it hides another set of SKUs from DVC (every
    fresh clone). DVC rewrites `.dvc/tmp/rwlock` in place, so a status stopped mid-write leaves it
    empty, and every later dvc call refuses it as corrupted (a fresh clone's first run failed so).
    Planted here as the torn file such a stop leaves; a readable rwlock is never touched."""
    _dvc_project(tmp_path)
    rwlock = tmp_path / ".dvc" / "tmp" / "rwlock"
    rwlock.write_text("")
    status = ProjectStatus(tmp_path)
    status.cancel()
    assert not rwlock.exists()
    assert ProjectStatus(tmp_path).stale({"copy"}) == []  # dvc answers again
    rwlock.write_text('{"read": {}, "write": {}}')
    assert not drop_torn_rwlock(tmp_path) and rwlock.is_file()
