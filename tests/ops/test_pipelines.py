"""The per-SKU pipeline files rendered from the registry, the .dvcignore files that hide other
hosts' SKUs from DVC (checked with the real dvc), and the move of a one-file-layout lock."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import models
import pytest
import yaml

from pipeline.engine.matrix import SkuStatus, stage_address
from pipeline.ops.pipelines import HEADER, hide_from_dvc, move_pair_locks, pipeline_files, render_pipelines
from pipeline.project.config import load_registry

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _project(root: Path, selection: dict[str, list[str] | None] | None = None) -> Path:
    """Models a and b, SKUs here, only_build and elsewhere; ``selection``: model -> its ``skus``."""
    selection = selection or {}
    table = {
        m: {**models.conv_bn_spec(f"models/{m}"), **({"skus": selection[m]} if selection.get(m) else {})}
        for m in ("a", "b")
    }
    skus = {name: models.ort_sku("fp32") for name in ("here", "only_build", "elsewhere")}
    return models.write_project(root, table, skus)


def _status(sku: str, buildable: bool, runnable: bool) -> SkuStatus:
    return SkuStatus(sku, "onnxruntime", "fp32", "x86_64/cpu/linux", ["lab"], buildable, runnable, ["not this host"])


def test_each_sku_file_lists_the_models_that_select_it(tmp_path):
    reg = load_registry(_project(tmp_path, {"a": ["here"]}))
    files = pipeline_files(reg)
    assert sorted(files) == sorted(
        f"pipelines/{s}/{part}dvc.yaml" for s in ("here", "only_build", "elsewhere") for part in ("", "run/")
    )
    here = yaml.safe_load(files["pipelines/here/run/dvc.yaml"])["stages"]
    assert list(here) == ["validate", "bench", "manifest", "publish"]
    assert all(s["foreach"] == ["a", "b"] and s["do"]["wdir"] == "../../.." for s in here.values())
    build = yaml.safe_load(files["pipelines/elsewhere/dvc.yaml"])["stages"]["build"]
    assert build["foreach"] == ["b"] and build["do"]["wdir"] == "../.."
    assert build["do"]["cmd"] == "skuforge build --model '${item}' --sku 'elsewhere'"
    assert all(text.startswith(HEADER + "\n") for text in files.values())


def test_render_is_a_no_op_when_current_and_removes_a_dropped_skus_files(tmp_path):
    params = _project(tmp_path)
    reg = load_registry(params)
    first = render_pipelines(reg)
    assert first.differ == first.files and not first.removed
    stamp = (tmp_path / "pipelines/here/dvc.yaml").stat().st_mtime_ns
    again = render_pipelines(reg)
    assert again.current and (tmp_path / "pipelines/here/dvc.yaml").stat().st_mtime_ns == stamp
    # a SKU no model selects any more: its rendered files go, its lock and a hand-written file stay
    (tmp_path / "pipelines/elsewhere/dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    (tmp_path / "pipelines/mine").mkdir()
    (tmp_path / "pipelines/mine/dvc.yaml").write_text("stages: {}\n")
    reg = load_registry(_project(tmp_path, {"a": ["here", "only_build"], "b": ["here"]}))
    check = render_pipelines(reg, check=True)
    assert check.removed == ["pipelines/elsewhere/dvc.yaml", "pipelines/elsewhere/run/dvc.yaml"]
    assert (tmp_path / "pipelines/elsewhere/dvc.yaml").is_file()  # check writes nothing
    assert check.differ == ["pipelines/only_build/dvc.yaml", "pipelines/only_build/run/dvc.yaml"]
    render_pipelines(reg)
    assert not (tmp_path / "pipelines/elsewhere/dvc.yaml").exists()
    assert (tmp_path / "pipelines/elsewhere/dvc.lock").is_file() and (tmp_path / "pipelines/mine/dvc.yaml").is_file()
    assert render_pipelines(reg, check=True).current


def test_config_validate_names_stale_pipeline_files_without_failing(tmp_path, capsys):
    from pipeline.cli import main

    params = _project(tmp_path)
    assert main(["--params", str(params), "config", "validate", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["pipelines_stale"] and "pipelines/" in out.err
    render_pipelines(load_registry(params))
    assert main(["--params", str(params), "config", "validate", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["pipelines_stale"] == [] and "note:" not in out.err
    _project(tmp_path, {"b": ["here"]})
    assert main(["--params", str(params), "config", "validate", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pipelines_stale"]


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE", "DVC_ROOT")}
    env.update(DVC_NO_ANALYTICS="1", PATH=os.pathsep.join([str(BIN), env.get("PATH", "")]))
    return subprocess.run([str(BIN / "dvc"), *args], cwd=root, env=env, capture_output=True, text=True, check=True)


@pytest.mark.slow
def test_dvc_status_leaves_out_what_this_host_does_not_run(tmp_path):
    """The real dvc over the real dvc.yaml and rendered files: every stage, then (hidden) none of
    the SKU this host cannot build and only the build stages of the one it can only build."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    _dvc(tmp_path, "init", "-q")
    shutil.copyfile(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    reg = load_registry(_project(tmp_path))
    render_pipelines(reg)
    for folder in ("metrics/bench", "metrics/latency_cdf", "metrics/timeline", "metrics/sweep", "metrics/compare"):
        (tmp_path / folder).mkdir(parents=True)
    model_stages = {f"{s}@{m}" for s in ("prepare", "data", "reference", "calibrate") for m in ("a", "b")}

    def pair_stages(sku: str, stages: tuple[str, ...]) -> set[str]:
        return {stage_address(s, m, sku) for s in stages for m in ("a", "b")}

    everything = ("build", "validate", "bench", "manifest", "publish")
    stale = set(json.loads(_dvc(tmp_path, "status", "--json").stdout))
    every_stage = {"config", *model_stages, *(a for s in reg.skus for a in pair_stages(s, everything))}
    assert stale == every_stage

    statuses = [_status("here", True, True), _status("only_build", True, False), _status("elsewhere", False, False)]
    hidden, changed = hide_from_dvc(reg, statuses)
    assert hidden == ["pipelines/only_build/run/.dvcignore", "pipelines/elsewhere/.dvcignore"] and changed
    assert hide_from_dvc(reg, statuses) == (hidden, False)  # as they were: nothing for DVC to re-read
    assert "not this host" in (tmp_path / hidden[1]).read_text()
    stale = set(json.loads(_dvc(tmp_path, "status", "--json").stdout))
    assert stale == {"config", *model_stages, *pair_stages("here", everything), *pair_stages("only_build", ("build",))}

    # the host gained the target: the files go, the stages are back
    assert hide_from_dvc(reg, [_status(s, True, True) for s in reg.skus]) == ([], True)
    assert not any((tmp_path / "pipelines").rglob(".dvcignore"))
    assert set(json.loads(_dvc(tmp_path, "status", "--json").stdout)) == every_stage


def test_a_one_file_layout_lock_moves_into_the_sku_locks(tmp_path):
    reg = load_registry(_project(tmp_path, {"b": ["here"]}))
    entry = {"cmd": "x", "deps": [{"path": "build/config/a-here.json", "md5": "0", "size": 1}]}
    (tmp_path / "dvc.lock").write_text(
        yaml.safe_dump(
            {
                "schema": "2.0",
                "stages": {
                    "config": {"cmd": "skuforge config resolve"},
                    "build@a-here": entry,
                    "validate@a-here": {**entry, "cmd": "v"},
                    "publish@b-elsewhere": {"cmd": "not a pair any more"},
                },
            },
            sort_keys=False,
        )
    )
    newer = tmp_path / "pipelines/here/dvc.lock"
    newer.parent.mkdir(parents=True)
    newer.write_text(yaml.safe_dump({"schema": "2.0", "stages": {"build@a": {"cmd": "newer"}}}))
    assert move_pair_locks(reg) == ["build@a-here", "validate@a-here"]
    root = yaml.safe_load((tmp_path / "dvc.lock").read_text())["stages"]
    assert root == {"config": {"cmd": "skuforge config resolve"}, "publish@b-elsewhere": {"cmd": "not a pair any more"}}
    assert yaml.safe_load(newer.read_text())["stages"] == {"build@a": {"cmd": "newer"}}  # the SKU's own wins
    run = yaml.safe_load((tmp_path / "pipelines/here/run/dvc.lock").read_text())
    assert run == {"schema": "2.0", "stages": {"validate@a": {**entry, "cmd": "v"}}}
    assert move_pair_locks(reg) == []
