"""The one GPU probe (pipeline.host.probe) that `skuforge runner check` and the TensorRT backend
both read, with a faked ``nvidia-smi`` on PATH; the host's real NVML, CUDA runtime and Jetson
device tree are switched off so the fake decides on any host, with or without a GPU."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import models
import pytest

from pipeline.backends import get_backend
from pipeline.engine.hostcheck import hardware_problems
from pipeline.host import probe
from pipeline.host.probe import NO_GPU, GpuInfo
from pipeline.project.config import parse_registry

ROOT = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3, 9.0, 550.54.15, 81559"
ORIN = "Orin (nvgpu), [N/A], 540.4.0, [N/A]"


def fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stdout: str, code: int = 0) -> Path:
    """An nvidia-smi script first on PATH; the other GPU sources report nothing."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    script = bindir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '%s\\n' {shlex.quote(stdout)} | tr '|' '\\n'\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(probe, "_gpus_from_nvml", list)
    monkeypatch.setattr(probe, "_gpu_from_cudart", lambda: None)
    monkeypatch.setattr(probe, "_gpu_from_device_tree", lambda: None)
    return bindir


def gpu_registry():
    trt = {
        "backend": "tensorrt",
        "precision": "fp32",
        "target": {"arch": probe.host_arch(), "device": "gpu", "os": "linux"},
        "runner_labels": ["self-hosted", "linux", "gpu"],
        "shapes": {"batch": 1},
    }
    return parse_registry({"defaults": {}, "examples": {}, "models": {"m": models.conv_bn_spec()}, "skus": {"g": trt}})


def verdicts() -> tuple[bool, bool]:
    """(runner check sees a GPU, TensorRT's environment check sees one)."""
    reg = gpu_registry()
    runner = not any("needs device gpu" in p for p in hardware_problems(reg.sku("g")))
    backend = NO_GPU not in get_backend("tensorrt").environment_problems(reg.sku("g"), "build")
    return runner, backend


def test_nvidia_smi_output_is_parsed_per_gpu():
    gpus = probe.parse_nvidia_smi_all(f"{H100}\n{H100}\n{ORIN}\n")
    assert gpus[0] == GpuInfo("NVIDIA H100 80GB HBM3", "9.0", "550.54.15", "81559") and gpus[0].cc == 9.0
    assert len(gpus) == 3 and gpus[2] == GpuInfo("Orin (nvgpu)", None, "540.4.0", None)
    assert probe.parse_nvidia_smi("NVIDIA A10G, 8.6, 535.1, 23028 MiB") == GpuInfo(
        "NVIDIA A10G", "8.6", "535.1", "23028"
    )
    assert probe.parse_nvidia_smi("") is None and probe.parse_nvidia_smi_all("\n") == []
    assert GpuInfo("x").to_json() == {"name": "x", "driver": None, "compute_capability": None, "memory_mb": None}


def test_a_faked_gpu_is_seen_alike_by_the_runner_check_and_tensorrt(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, f"{H100}|NVIDIA H100 80GB HBM3, 9.0, 550.54.15, 81559")
    assert probe.gpu_info() == GpuInfo("NVIDIA H100 80GB HBM3", "9.0", "550.54.15", "81559")
    report = probe.gpu()
    assert len(report["nvidia"]) == 2 and report["nvidia"][0]["compute_capability"] == "9.0"
    assert probe.gpu_info() is not None and report["nvidia"]
    from pipeline.backends import tensorrt

    assert tensorrt.gpu_info() == probe.gpu_info()  # one probe, not two
    assert verdicts() == (True, True)


def test_no_gpu_is_seen_alike(tmp_path, monkeypatch):
    fake_nvidia_smi(
        tmp_path, monkeypatch, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 9
    )
    assert probe.gpu_info() is None and probe.gpu() == {"nvidia": [], "jetson": probe.jetson()}
    assert verdicts() == (False, False)
    reg = gpu_registry()
    assert f"needs device gpu: {NO_GPU}" in hardware_problems(reg.sku("g"))


def test_a_missing_compute_capability_is_filled_in_from_the_jetson_table(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, ORIN)
    monkeypatch.setattr(
        probe, "_gpu_from_device_tree", lambda: probe.jetson_gpu("NVIDIA Jetson AGX Orin Developer Kit\0")
    )
    assert probe.gpu_info() == GpuInfo("Orin (nvgpu)", "8.7", "540.4.0", None)
    assert verdicts() == (True, True)


def test_the_probe_is_cached_per_path(tmp_path, monkeypatch):
    for name, line in (("one", H100), ("two", "NVIDIA A100-SXM4-40GB, 8.0, 550.54.15, 40960")):
        (tmp_path / name).mkdir()
        fake_nvidia_smi(tmp_path / name, monkeypatch, line)
        assert probe.gpu_info().name == line.split(",")[0]


def test_the_cli_probe_reports_the_faked_gpu(tmp_path, monkeypatch):
    """`skuforge runner probe --json` in a subprocess sees the nvidia-smi on its PATH (its own NVML,
    if any, answers first: then the test says so and skips)."""
    bindir = fake_nvidia_smi(tmp_path, monkeypatch, H100)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    cmd = [
        sys.executable,
        "-c",
        "import sys; from pipeline.cli import main; sys.exit(main(sys.argv[1:]))",
        "runner",
        "probe",
        "--json",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr
    nvidia = json.loads(done.stdout)["gpu"]["nvidia"]
    if nvidia and nvidia[0]["name"] != "NVIDIA H100 80GB HBM3":
        pytest.skip(f"this host's NVML reports {nvidia[0]['name']} before nvidia-smi is asked")
    assert nvidia == [
        {"name": "NVIDIA H100 80GB HBM3", "driver": "550.54.15", "compute_capability": "9.0", "memory_mb": "81559"}
    ]
