"""The ``skuforge`` command as users run it: exit codes, messages with hints, no tracebacks, and a
parser that starts without importing any heavy library."""

from __future__ import annotations

import argparse
import ast
import json
import logging
import subprocess
import sys
from pathlib import Path

import models
import numpy as np
import pytest
from cli_helpers import assert_user_error, project, service_env, skuforge

from pipeline.cli import build_parser, handler, main
from pipeline.host.probe import host_arch
from pipeline.project.artifacts import RESULT_ATTR
from pipeline.project.config import load_registry
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.prepare import prepare

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("onnx", "onnxruntime", "numpy", "torch", "dvc", "pydantic", "jsonschema", "mlflow", "openvino", "iree")
OTHER_ARCH = "aarch64" if host_arch() == "x86_64" else "x86_64"


# --- bad inputs ---------------------------------------------------------------------------------


def test_malformed_onnx(tmp_path):
    project(tmp_path)
    (tmp_path / "models/conv/model.onnx").write_bytes(b"\x08\x07garbage that is not a protobuf \xff\xff")
    assert_user_error(skuforge("prepare", "--model", "m", cwd=tmp_path), 2, "model.onnx")


def test_truncated_onnx(tmp_path):
    project(tmp_path)
    path = tmp_path / "models/conv/model.onnx"
    path.write_bytes(path.read_bytes()[:200])
    assert_user_error(skuforge("prepare", "--model", "m", cwd=tmp_path), 2, "model.onnx")


def test_missing_model_file(tmp_path):
    project(tmp_path)
    (tmp_path / "models/conv/model.onnx").unlink()
    assert_user_error(skuforge("prepare", "--model", "m", cwd=tmp_path), 2, "does not exist")


def test_unknown_key_in_params(tmp_path):
    spec = {**models.conv_bn_spec(), "sorce": "model.onnx"}
    project(tmp_path, spec)
    proc = skuforge("config", "validate", cwd=tmp_path)
    assert_user_error(proc, 2, "models.m.sorce", "did you mean 'source'")


def test_unknown_key_fails_every_command(tmp_path):
    project(tmp_path, skus={"cpu": models.ort_sku("fp32", optoins={})})
    assert_user_error(skuforge("build", "--model", "m", "--sku", "cpu", cwd=tmp_path), 2, "skus.cpu.optoins")


def test_unknown_backend(tmp_path):
    project(tmp_path, skus={"cpu": models.ort_sku("fp32", backend="tensorrtx")})
    assert_user_error(skuforge("config", "validate", cwd=tmp_path), 2, "unknown backend 'tensorrtx'", "known backends")


def test_missing_params_file(tmp_path):
    assert_user_error(skuforge("--params", "nope.yaml", "skus", cwd=tmp_path), 2, "nope.yaml")


def test_unknown_model_name(tmp_path):
    project(tmp_path)
    assert_user_error(skuforge("prepare", "--model", "n", cwd=tmp_path), 2, "unknown model 'n'")


def test_input_shape_contradicting_the_model(tmp_path):
    spec = models.conv_bn_spec()
    spec["inputs"][0]["shape"] = ["batch", 3, 16, 16]
    project(tmp_path, spec)
    assert_user_error(skuforge("prepare", "--model", "m", cwd=tmp_path), 2, "'x'", "fixed to 8")


def test_input_dtype_contradicting_the_model(tmp_path):
    spec = models.conv_bn_spec()
    spec["inputs"][0]["dtype"] = "int64"
    project(tmp_path, spec)
    assert_user_error(skuforge("prepare", "--model", "m", cwd=tmp_path), 2, "'x'", "float32")


def test_empty_calibration_set(tmp_path):
    spec = {**models.conv_bn_spec(), "datasets": {"calibration": {"path": "cal.npz"}}}
    project(tmp_path, spec)
    np.savez(tmp_path / "models/conv/cal.npz", x=np.zeros((0, 3, 8, 8), np.float32))
    assert_user_error(skuforge("data", "--model", "m", cwd=tmp_path), 2, "empty")


def test_nan_reference(tmp_path):
    spec = {"dir": "models/nan", "source": "model.onnx", "inputs": [{"name": "x", "shape": ["batch", 4]}]}
    params = project(tmp_path, spec, builder=models.nan_model)
    reg = load_registry(params)
    prepare(reg, "m")
    make_data(reg, "m")
    assert_user_error(skuforge("reference", "--model", "m", cwd=tmp_path), 2, "NaN")


def test_sku_for_another_host(tmp_path):
    foreign = models.ort_sku("fp32", target={"arch": OTHER_ARCH}, runner_labels=["self-hosted", "far-away"])
    project(tmp_path, skus={"foreign": foreign})
    assert_user_error(skuforge("build", "--model", "m", "--sku", "foreign", cwd=tmp_path), 3, "far-away")


def test_repro_of_a_named_sku_this_host_cannot_build_exits_3(tmp_path):
    """A CI job for one SKU on the wrong runner must not pass having built nothing."""
    foreign = models.ort_sku("fp32", target={"arch": OTHER_ARCH}, runner_labels=["self-hosted", "far-away"])
    project(tmp_path, skus={"foreign": foreign})
    (tmp_path / ".dvc").mkdir()
    assert_user_error(skuforge("repro", "--sku", "foreign", cwd=tmp_path), 3, "foreign", "far-away")


def test_failed_gate_exits_1(tmp_path):
    strict = models.ort_sku("int8", tolerance={"atol": 0, "rtol": 0, "max_mismatch": 0})
    reg = load_registry(project(tmp_path, skus={"strict": strict}))
    for stage in (prepare, make_data, calibrate):
        stage(reg, "m")
    from pipeline.stages.reference import reference

    reference(reg, "m")
    build(reg.pair("m", "strict"))
    assert_user_error(skuforge("validate", "--model", "m", "--sku", "strict", cwd=tmp_path), 1, "failed validation")
    assert json.loads((tmp_path / "build/m/strict/validate.json").read_text())["passed"] is False


def test_argument_errors_exit_2(tmp_path):
    proc = skuforge("build", "--model", "m", cwd=tmp_path)  # --sku missing
    assert proc.returncode == 2 and "--sku" in proc.stderr and "Traceback" not in proc.stderr


# --- working commands ---------------------------------------------------------------------------


def test_help(tmp_path):
    proc = skuforge("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: skuforge")
    for command in ("config", "skus", "prepare", "build", "validate", "bench", "manifest", "repro", "exit codes"):
        assert command in proc.stdout


def test_skus_json(tmp_path):
    foreign = models.ort_sku("fp32", target={"arch": OTHER_ARCH}, runner_labels=["self-hosted", "far-away"])
    project(tmp_path, skus={"cpu": models.ort_sku("fp32"), "foreign": foreign})
    proc = skuforge("skus", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {row["sku"]: row for row in json.loads(proc.stdout)}
    assert rows["cpu"]["buildable"] is True and rows["cpu"]["problems"] == []
    assert rows["foreign"]["buildable"] is False and rows["foreign"]["runner_labels"] == ["self-hosted", "far-away"]
    assert any(OTHER_ARCH in p for p in rows["foreign"]["problems"])
    here = json.loads(skuforge("skus", "--json", "--buildable-here", cwd=tmp_path).stdout)
    assert [row["sku"] for row in here] == ["cpu"]


def test_skus_table(tmp_path):
    project(tmp_path)
    proc = skuforge("skus", cwd=tmp_path)
    assert proc.returncode == 0 and "runner labels" in proc.stdout.splitlines()[0] and "cpu" in proc.stdout


def test_version(tmp_path):
    from importlib.metadata import version

    proc = skuforge("--version", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == f"skuforge {version('skuforge')}\n", proc


@pytest.mark.parametrize("command", [("promote", "m", "--sku", "cpu", "--to", "candidate"), ("releases", "m")])
def test_a_positional_model_is_refused_with_a_hint(tmp_path, command):
    proc = skuforge(*command, cwd=tmp_path)
    assert proc.returncode == 2 and "hint: name the model with --model" in proc.stderr, proc.stderr


def test_summary_filters(tmp_path):
    foreign = models.ort_sku("fp32", target={"arch": OTHER_ARCH}, runner_labels=["self-hosted", "far-away"])
    project(tmp_path, skus={"cpu": models.ort_sku("fp32"), "foreign": foreign})

    def pairs(*args: str) -> list[tuple[str, str, str]]:
        proc = skuforge("summary", "--json", *args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        return [(r["model"], r["sku"], r["outcome"]) for r in json.loads(proc.stdout)]

    assert pairs() == [("m", "cpu", "not run"), ("m", "foreign", "not buildable here")]
    assert pairs("--sku", "foreign") == [("m", "foreign", "not buildable here")]
    assert pairs("--outcome", "not run", "--model", "m") == [("m", "cpu", "not run")]
    assert pairs("--outcome", "passed") == []
    assert_user_error(skuforge("summary", "--outcome", "bogus", cwd=tmp_path), 2, "bogus", "not buildable here")
    assert_user_error(skuforge("summary", "--sku", "nope", cwd=tmp_path), 2, "nope", "foreign")
    text = skuforge("summary", "--sku", "foreign", cwd=tmp_path).stdout.splitlines()
    assert text[0].split()[:3] == ["model", "sku", "outcome"] and text[1].split()[:2] == ["m", "foreign"]
    assert "far-away" in text[2] and text[-1] == "1 not buildable here"


def test_a_stage_prints_its_result_once(tmp_path):
    project(tmp_path)
    proc = skuforge("prepare", "--model", "m", cwd=tmp_path, env=service_env(DVC_STAGE="prepare@m"))
    assert proc.returncode == 0, proc.stderr
    both = proc.stdout + proc.stderr
    assert proc.stdout.startswith("prepared m:") and both.count("prepared") == 1, both
    verbose = skuforge("-v", "prepare", "--model", "m", cwd=tmp_path)  # -v: the library's line too
    assert "[m] prepared: " in verbose.stderr and verbose.stdout.startswith("prepared m:"), verbose.stderr


def test_every_stage_prints_its_result_once_and_v_keeps_the_librarys_line(tmp_path, capsys, caplog):
    """Each stage logs its result with the RESULT marker; the command drops that record and prints
    the result itself, once (in this process: the marker, not the wording, decides)."""
    params = str(project(tmp_path, skus={"cpu": models.ort_sku("fp32", bench={"iterations": 20, "roofline": False})}))
    steps = [
        (["prepare", "--model", "m"], "prepared: "),
        (["data", "--model", "m"], "data: "),
        (["reference", "--model", "m"], "reference: "),
        (["build", "--model", "m", "--sku", "cpu"], "built in "),
        (["validate", "--model", "m", "--sku", "cpu"], None),
        (["bench", "--model", "m", "--sku", "cpu"], "bench: p50 "),
        (["manifest", "--model", "m", "--sku", "cpu"], "manifest "),
    ]
    caplog.set_level(logging.INFO, logger="pipeline.stages")

    def result_lines() -> list[str]:
        lines = [r.getMessage() for r in caplog.records if getattr(r, RESULT_ATTR, False)]
        caplog.clear()
        return lines

    for argv, library_line in steps:
        assert main(["--params", params, *argv]) == 0
        assert capsys.readouterr().out.strip(), argv  # the command's own summary
        assert result_lines() == [], argv  # the library's result line dropped
        if library_line is not None:
            assert main(["--params", params, "-v", *argv]) == 0
            assert [line.split("] ", 1)[1][: len(library_line)] for line in result_lines()] == [library_line], argv


def test_ci_render_check_json():
    proc = skuforge("ci", "render", "--check", "--json", cwd=REPO)
    doc = json.loads(proc.stdout)
    assert proc.returncode == (0 if doc["current"] else 1) and doc["check"] is True, proc.stderr
    assert ".github/workflows/build.yml" in doc["files"]


def test_config_validate_json(tmp_path):
    params = project(tmp_path)
    proc = skuforge("--params", str(params), "config", "validate", "--json", cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "params": str(params),
        "models": ["m"],
        "skus": ["cpu"],
        "valid": True,
        "pipelines_stale": ["pipelines/cpu/dvc.yaml", "pipelines/cpu/run/dvc.yaml"],  # never rendered here
    }


def test_prepare_json(tmp_path):
    project(tmp_path)
    proc = skuforge("prepare", "--model", "m", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["model"] == "m" and [p["changed"] for p in report["passes"]] == [True] * 4
    assert report == json.loads((tmp_path / "build/m/prepared/prepare.json").read_text())


# --- start-up cost ------------------------------------------------------------------------------


def _heavy_after(code: str) -> list[str]:
    probe = f"""
import json, sys
{code}
heavy = {HEAVY!r}
print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules if m.split('.')[0] in heavy}})))
"""
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_building_the_parser_imports_nothing_heavy():
    assert _heavy_after("from pipeline.cli import build_parser\nbuild_parser()") == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["build", "--help"],
        ["config", "validate", "--help"],
        ["publish", "--help"],
        ["promote", "--help"],
        ["releases", "--help"],
        ["ci", "render", "--help"],
        ["runner", "check", "--help"],
    ],
)
def test_help_imports_nothing_heavy(argv):
    code = f"""
import contextlib, io
from pipeline.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main({argv!r})
    except SystemExit as exc:
        assert exc.code == 0, exc.code
"""
    assert _heavy_after(code) == []


def test_cli_modules_import_no_heavy_library_at_module_level():
    """Read the syntax trees: only function bodies may import the library or an SDK."""
    light_relative = {"errors", "commands", "progress", ""}
    for path in sorted((REPO / "pipeline" / "cli").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    assert node.level == 1 or (node.module or "").split(".")[0] in light_relative, (
                        f"{path.name}: module-level import of ..{node.module}"
                    )
                    continue
                names = [(node.module or "").split(".")[0]]
            else:
                continue
            assert not set(names) & set(HEAVY), f"{path.name}: module-level import of {names}"


def test_every_command_names_a_handler_that_loads():
    """The parser (pipeline/cli/parser/) names each command's handler by string: each must resolve."""
    found = []

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))
        ref = parser._defaults.get("handler")
        if ref is not None:
            assert callable(handler(ref)), (path, ref)
            found.append(path)
        else:
            assert any(isinstance(a, argparse._SubParsersAction) for a in parser._actions), f"{path}: no handler"

    walk(build_parser(), ())
    assert ("build",) in found and ("rollout", "advance") in found and len(found) > 30


def test_a_build_command_on_an_agent_only_install_names_the_extra(monkeypatch, capsys):
    """`pip install skuforge[agent]` leaves the build toolchain out: a build command says what to install."""
    import pipeline.cli as cli

    def needs_mlflow(args):
        raise ModuleNotFoundError("No module named 'mlflow'", name="mlflow")

    def needs_a_typo(args):
        raise ModuleNotFoundError("No module named 'pipeline.nope'", name="pipeline.nope")

    monkeypatch.setattr(cli, "handler", lambda name: needs_mlflow)
    assert cli.main(["keys", "show"]) == 3
    err = capsys.readouterr().err
    assert "needs mlflow" in err and "pip install 'skuforge[pipeline]'" in err and "Traceback" not in err
    monkeypatch.setattr(cli, "handler", lambda name: needs_a_typo)
    assert cli.main(["keys", "show"]) == 70  # not a missing extra: a bug, reported as one
