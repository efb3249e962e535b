"""A TVM SKU for another architecture (aarch64 on this x86 host): compiled for the device's triple,
linked by Debian's cross GCC, and checked for what can be checked without the device - the library
is aarch64 code, the build report is complete, the cache key carries the triple, and this host calls
the SKU buildable but not runnable (the matrix's "built only")."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
from tvm_helpers import tvm_or_skip

tvm_or_skip()

import models  # noqa: E402

from pipeline.backends import get_backend  # noqa: E402
from pipeline.backends.tvm import LIBRARY, elf_machine_problem  # noqa: E402
from pipeline.core.errors import EnvironmentProblem  # noqa: E402
from pipeline.core.paths import Layout  # noqa: E402
from pipeline.engine.hostcheck import host_problems, runs_emulated  # noqa: E402
from pipeline.host.probe import host_arch  # noqa: E402
from pipeline.project.config import SkuSpec, load_registry  # noqa: E402
from pipeline.stages.build import build  # noqa: E402
from pipeline.stages.data import make_data  # noqa: E402
from pipeline.stages.prepare import prepare  # noqa: E402

CROSS_CC = "aarch64-linux-gnu-gcc"
EM_AARCH64 = 183
pytestmark = [
    pytest.mark.skipif(
        host_arch() != "x86_64", reason=f"this host is {host_arch()}: the aarch64 SKU is no cross build"
    ),
    pytest.mark.skipif(
        not shutil.which(CROSS_CC),
        reason=f"no {CROSS_CC}: apt-get install gcc-aarch64-linux-gnu (scripts/setup.sh --with cross-aarch64)",
    ),
]


def arm_sku(**options) -> dict:
    return {
        "backend": "tvm",
        "precision": "fp32",
        "target": {"arch": "aarch64", "device": "cpu", "os": "linux", "cpu_features": ["asimddp"]},
        "runner_labels": ["self-hosted", "linux", "arm64", "rpi5"],
        "shapes": {"batch": 1},
        "options": {
            "target_cpu": "cortex-a76",
            "target_cpu_features": ["+neon", "+dotprod"],
            "num_cores": 4,
            **options,
        },
        "placement": {"allowed": ["cpu"]},
    }


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    root = tmp_path_factory.mktemp("tvm-cross")
    models.conv_bn_model(root / "models/conv/model.onnx")
    skus = {"arm": arm_sku(), "arm_tuned": arm_sku(trials=2)}
    reg = load_registry(models.write_project(root, {"conv": models.conv_bn_spec()}, skus))
    prepare(reg, "conv")
    make_data(reg, "conv")
    return reg


def e_machine(path) -> int:
    head = path.read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and head[5] == 1  # little-endian ELF
    return struct.unpack_from("<H", head, 18)[0]


def test_the_library_is_aarch64_and_the_build_report_is_complete(proj):
    rep = build(proj.pair("conv", "arm"))
    engine = Layout(proj.root).engine_dir("conv", "arm") / LIBRARY
    assert e_machine(engine) == EM_AARCH64
    assert elf_machine_problem(engine, "aarch64") is None and "not x86_64" in elf_machine_problem(engine, "x86_64")
    doc = json.loads(Layout(proj.root).report("conv", "arm", "build").read_text())
    assert doc["precision"] == "fp32" and doc["backend"] == "tvm"
    assert doc["options"]["target"] == {
        "kind": "llvm",
        "mtriple": "aarch64-linux-gnu",
        "mcpu": "cortex-a76",
        "mattr": ["+neon", "+dotprod"],
        "num-cores": 4,
    }
    assert [f["path"] for f in doc["engine_files"]] == [LIBRARY] and doc["engine_files"][0]["sha256"]
    assert doc["layers"] and all(layer["precision"] == "fp32" and layer["device"] == "cpu" for layer in doc["layers"])
    assert any(layer["op_type"] == "conv2d" and layer["fused_from"] for layer in doc["layers"])
    assert not rep.hardware_specific


def test_this_host_builds_the_sku_and_runs_it_only_under_emulation(proj, monkeypatch, tmp_path):
    assert host_problems(proj, "arm", "build") == []
    assert runs_emulated(proj.sku("arm"))  # tests/backends/test_emulated.py runs it so
    monkeypatch.setenv("PATH", str(tmp_path))  # no qemu-aarch64-static: not runnable, and says what to install
    [problem] = host_problems(proj, "arm", "run")
    assert problem.startswith("needs arch aarch64") and "(cannot emulate it: needs qemu-user-static" in problem


def test_with_a_bench_key_and_the_tracker_set_it_runs_on_the_bench(tmp_path, monkeypatch):
    """Validate and bench go to a device registered under the key: this host's arch does not decide."""
    skus = {"arm": arm_sku(rpc={"key": "rpi5"})}
    reg = load_registry(models.write_project(tmp_path, {"conv": models.conv_bn_spec()}, skus))
    monkeypatch.delenv("SKUFORGE_TVM_TRACKER", raising=False)
    assert runs_emulated(reg.sku("arm"))  # no bench: an emulated device under the key, where QEMU is here
    monkeypatch.setenv("SKUFORGE_TVM_TRACKER", "127.0.0.1:9190")
    assert host_problems(reg, "arm", "run") == []
    assert not runs_emulated(reg.sku("arm"))  # the bench's devices, not an emulated one


def test_the_cache_key_carries_the_target_triple():
    backend = get_backend("tvm")
    key = backend.cache_key(SkuSpec.model_validate(arm_sku()))
    target = json.loads(key["target"])
    assert target["mtriple"] == "aarch64-linux-gnu" and target["mcpu"] == "cortex-a76"
    native = {**arm_sku(), "target": {"arch": "x86_64", "device": "cpu", "os": "linux"}}
    native["options"] = {"target_cpu": "cortex-a76", "target_cpu_features": ["+neon", "+dotprod"], "num_cores": 4}
    assert backend.cache_key(SkuSpec.model_validate(native))["target"] != key["target"]


def test_without_the_cross_compiler_the_sku_is_not_buildable_and_names_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no compiler of any kind
    spec = SkuSpec.model_validate(arm_sku(target_cpu="host", num_cores=None))
    problems = get_backend("tvm").environment_problems(spec, "build")
    assert any(CROSS_CC in p and "gcc-aarch64-linux-gnu" in p for p in problems), problems
    assert any(p.startswith("options.target_cpu: host") for p in problems)
    assert any(p.startswith("options.num_cores") for p in problems)
    assert os.environ["PATH"] == str(tmp_path)


def test_tuning_a_cross_target_on_this_host_is_refused(proj, monkeypatch):
    monkeypatch.setenv("SKUFORGE_TUNE", "1")
    with pytest.raises(EnvironmentProblem, match="cannot be measured on this x86_64 host"):
        build(proj.pair("conv", "arm_tuned"))
