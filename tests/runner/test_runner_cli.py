"""`skuforge runner probe/check/labels`, the runner classes against params.yaml, the runner scripts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnxruntime
import pytest
import yaml
from cli_helpers import skuforge as run_skuforge

from pipeline.host import probe
from pipeline.ops.hostreport import class_labels, classes_problems, load_classes
from pipeline.project.config import load_registry

ROOT = Path(__file__).resolve().parents[2]


def skuforge(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    done = run_skuforge(*args, cwd=cwd)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    return done


def planted(tmp_path: Path, **changes) -> Path:
    """A copy of params.yaml whose x86_ort_fp32 SKU has ``changes`` merged in."""
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data["skus"]["x86_ort_fp32"].update(changes)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    for sub in ("examples", "models"):  # the registry's paths must stay inside the project: a copy, not a symlink
        if (ROOT / sub).exists() and not (tmp_path / sub).exists():
            shutil.copytree(ROOT / sub, tmp_path / sub, ignore=shutil.ignore_patterns(".dvc", "__pycache__"))
    return path


def test_probe_json():
    done = skuforge("runner", "probe", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["host"]["arch"] == probe.host_arch()
    assert report["toolchain"]["onnxruntime"] == onnxruntime.__version__
    assert report["backends"]["onnxruntime"]["onnxruntime"] == onnxruntime.__version__
    assert "x86_ort_fp32" in report["skus"]["runnable"] or probe.host_arch() != "x86_64"
    assert {"governor", "load_average"} <= set(report["device_state"]) and {"nvidia", "jetson"} <= set(report["gpu"])


def test_check_matches_here():
    if probe.host_arch() != "x86_64" or "avx2" not in probe.cpu_info()["flags"]:
        pytest.skip("x86_ort_fp32 needs an x86-64 AVX2 host")
    done = skuforge("runner", "check", "--sku", "x86_ort_fp32")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "host matches SKU x86_ort_fp32"


def test_check_refuses_planted_version_mismatch(tmp_path):
    params = planted(tmp_path, toolchain={"onnxruntime": "==0.0.1"})
    done = skuforge("--params", str(params), "runner", "check", "--sku", "x86_ort_fp32")
    assert done.returncode == 3
    assert f"onnxruntime {onnxruntime.__version__} is installed, the SKU pins ==0.0.1" in done.stderr
    done = skuforge("--params", str(params), "runner", "check", "--sku", "x86_ort_fp32", "--json")
    assert done.returncode == 3
    report = json.loads(done.stdout)
    assert report["matches"] is False and any("==0.0.1" in p for p in report["problems"])


def test_check_refuses_other_arch(tmp_path):
    other = "aarch64" if probe.host_arch() == "x86_64" else "x86_64"
    params = planted(tmp_path, target={"arch": other, "device": "cpu", "os": "linux"})
    done = skuforge("--params", str(params), "runner", "check", "--sku", "x86_ort_fp32")
    assert done.returncode == 3
    assert f"needs arch {other}, this host is {probe.host_arch()}" in done.stderr


def test_check_unknown_sku_is_a_config_error():
    done = skuforge("runner", "check", "--sku", "no_such_sku")
    assert done.returncode == 2 and "no_such_sku" in done.stderr


def test_runner_classes_cover_the_registry():
    registry = load_registry(ROOT / "params.yaml")
    classes = load_classes(ROOT / "runners" / "classes.yaml")
    assert classes_problems(registry, classes) == []
    assert {"x86-cpu-avx2", "x86-cpu-avx512-vnni", "x86-nvidia-gpu", "jetson-orin-jp61", "rpi5"} <= set(classes)


def test_runner_classes_catch_a_disagreeing_pin():
    registry = load_registry(ROOT / "params.yaml")
    classes = load_classes(ROOT / "runners" / "classes.yaml")
    classes["jetson-orin-jp61"]["toolchain"]["tensorrt"] = "10.7.0"
    problems = classes_problems(registry, classes)
    assert "SKU jetson_orin_trt_fp16 / class jetson-orin-jp61: pins tensorrt 10.7.0, the SKU wants ==10.3.*" in problems
    del classes["rpi5"]
    assert any(p.startswith("SKU rpi5_ort_int8: no runner class") for p in classes_problems(registry, classes))


def test_labels_command():
    done = skuforge("runner", "labels", "--class", "jetson-orin-jp61")
    assert done.returncode == 0 and "jetson-orin" in done.stdout.strip().split(",")
    done = skuforge("runner", "labels", "--class", "no-such-class")
    assert done.returncode == 2 and "unknown runner class" in done.stderr


def test_scripts_parse():
    for script in ("setup-runner.sh", "pin-device-state.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "runners" / script)], check=True)
    if shutil.which("shellcheck"):
        done = subprocess.run(
            ["shellcheck", *(str(p) for p in (ROOT / "runners").glob("*.sh"))],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stdout


def test_setup_runner_refuses_without_token():
    done = subprocess.run(
        ["bash", str(ROOT / "runners" / "setup-runner.sh"), "--class", "rpi5"],
        env={},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode != 0 and "RUNNER_TOKEN is not set" in done.stderr


def test_setup_runner_configures_an_ephemeral_runner(tmp_path):
    # The GitHub runner cannot register here: a runner folder whose config.sh records its arguments.
    (tmp_path / "config.sh").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$(dirname "$0")/args"\n')
    (tmp_path / "run.sh").write_text('#!/bin/sh\necho ran > "$(dirname "$0")/ran"\n')
    for f in ("config.sh", "run.sh"):
        (tmp_path / f).chmod(0o755)
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "RUNNER_TOKEN": "tok123",
        "REPO_URL": "https://github.com/org/repo",
        "HOME": str(tmp_path),
    }
    done = subprocess.run(
        ["bash", str(ROOT / "runners" / "setup-runner.sh"), "--class", "x86-nvidia-gpu", "--runner-dir", str(tmp_path)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "args").read_text().split("\n")
    assert {"--ephemeral", "--unattended"} <= set(args)
    labels = load_classes(ROOT / "runners" / "classes.yaml")
    assert args[args.index("--labels") + 1] == ",".join(class_labels(labels, "x86-nvidia-gpu"))
    assert args[args.index("--url") + 1] == "https://github.com/org/repo" and (tmp_path / "ran").exists()
    assert not any("tok123" in p.read_text() for p in tmp_path.iterdir() if p.name != "args")


def test_pin_device_state_reports_and_probes():
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        ["bash", str(ROOT / "runners" / "pin-device-state.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "step(s) not pinned" in done.stderr
    state = json.loads(done.stdout)
    assert state["host"]["arch"] == probe.host_arch() and "governor" in state["device_state"]
