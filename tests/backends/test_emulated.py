"""aarch64 SKUs validated on this x86-64 host under QEMU user-mode emulation (issue 40): the engine
built here runs in the SKU's runtime built for its CPU (PyPI's aarch64 wheels at the host's
versions, in an aarch64 Python under qemu-aarch64-static as a Cortex-A76), the gates judge its outputs
as for any engine, the report records the emulation, bench refuses, and the matrix says "validated
under emulation". An engine built for this host's CPU (ONNX Runtime's NCHWc blocks) is caught.

One project for the module: the conv model, an ONNX Runtime INT8 and a LiteRT INT8 SKU for the
Raspberry Pi 5's CPU (each engine built and validated once: an emulated validation of this model takes
seconds; ONNX Runtime's import under QEMU is most of it)."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import models
import numpy as np
import pytest
from cli_helpers import skuforge

from pipeline.backends import emulated, get_backend
from pipeline.core.errors import EnvironmentProblem, InputError
from pipeline.core.paths import Layout
from pipeline.engine.build import require_emulation
from pipeline.engine.hostcheck import runs_emulated, sku_host_problems
from pipeline.engine.matrix import matrix, sku_statuses
from pipeline.host import emulation
from pipeline.host.probe import host_arch
from pipeline.project.config import SkuSpec, load_registry
from pipeline.stages.bench import bench
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import emulate, validate
from pipeline.verify.consistency import consistency

ON_X86 = pytest.mark.skipif(host_arch() != "x86_64", reason=f"this host is {host_arch()}: nothing to emulate")
EMULATION = pytest.mark.skipif(
    bool(emulated.problems()), reason="; ".join(emulated.problems()) or "emulation is available"
)
CROSS_CC = pytest.mark.skipif(
    not shutil.which("aarch64-linux-gnu-gcc"),
    reason="no aarch64-linux-gnu-gcc: apt-get install gcc-aarch64-linux-gnu (scripts/setup.sh --with cross-aarch64)",
)
ARM = {"arch": "aarch64", "device": "cpu", "os": "linux", "cpu_features": ["asimddp"]}


def arm_sku(backend: str, options: dict) -> dict:
    return {
        "backend": backend,
        "precision": "int8",
        "target": ARM,
        "runner_labels": ["self-hosted", "linux", "arm64", "rpi5"],
        "shapes": {"batch": 1},
        "options": options,
        "bench": models.FAST_BENCH,
    }


SKUS = {
    "arm_ort": arm_sku(
        "onnxruntime", {"per_channel": True, "graph_optimization_level": "extended", "load_optimization_level": "all"}
    ),
    "arm_litert": arm_sku("litert", {"delegate": "xnnpack", "per_channel": True, "int8_io": True})
    | {"placement": {"allowed": ["xnnpack", "cpu"]}},  # as rpi5_litert_int8: XNNPACK has no INT8 softmax
    "arm_tvm": arm_sku(
        "tvm", {"target_cpu": "cortex-a76", "target_cpu_features": ["+neon", "+dotprod"], "num_cores": 4}
    )
    | {"precision": "fp32", "placement": {"allowed": ["cpu"]}},
    # saved at level "all": ONNX Runtime lays the convolutions out in this CPU's NCHWc blocks
    "x86_nchwc": models.cpu_sku("onnxruntime", "fp32", {"graph_optimization_level": "all"}),
}


@pytest.fixture(scope="module")
def proj(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("emulated")
    models.conv_bn_model(root / "models/conv/model.onnx")
    reg = load_registry(models.write_project(root, {"conv": models.conv_bn_spec()}, SKUS))
    for stage in (prepare, make_data, reference, calibrate):
        stage(reg, "conv")
    return SimpleNamespace(registry=reg, out=Layout(reg.root))


@ON_X86
def test_without_the_emulator_an_arm_sku_is_not_runnable_and_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no qemu-aarch64-static on it
    spec = SkuSpec.model_validate(SKUS["arm_ort"])
    assert runs_emulated(spec)
    [problem] = sku_host_problems(spec, "run")
    assert problem.startswith("needs arch aarch64, this host is x86_64")
    assert "(cannot emulate it: needs qemu-user-static (scripts/setup.sh --with emulation)" in problem
    with pytest.raises(EnvironmentProblem, match="does not validate SKU arm under emulation: needs qemu-user-static"):
        require_emulation("arm", spec)
    assert sku_host_problems(spec, "build") == []  # saved below level "all": built on any host


@ON_X86
def test_an_engine_saved_at_level_all_is_not_cross_built():
    spec = SkuSpec.model_validate(SKUS["arm_ort"] | {"options": {"graph_optimization_level": "all"}})
    assert not get_backend("onnxruntime").cross_compiles(spec)
    assert sku_host_problems(spec, "build")[0].startswith("needs arch aarch64")


@ON_X86
@EMULATION
@pytest.mark.parametrize("sku", ["arm_ort", "arm_litert", pytest.param("arm_tvm", marks=CROSS_CC)])
def test_an_arm_engine_is_validated_under_emulation_and_never_benchmarked(proj, sku):
    reg = proj.registry
    status = {s.sku: s for s in sku_statuses(reg, cached=False)}[sku]
    assert status.buildable and not status.runnable and status.emulated
    assert status.problems[0].endswith("(its engines are validated under emulation here)")
    pair = reg.pair("conv", sku)
    build(pair)
    report = emulate(pair)
    assert report.passed, report.failures
    assert (proj.out.sku_dir("conv", sku) / "emulate.json").is_file()
    assert not (proj.out.sku_dir("conv", sku) / "validate.json").exists()  # the device's, never this
    runtime = {"arm_ort": "onnxruntime", "arm_litert": "ai-edge-litert", "arm_tvm": "apache-tvm"}[sku]
    assert report.emulation is not None
    assert report.emulation["cpu"] == "cortex-a76" and report.emulation["emulator"] == "qemu-aarch64-static"
    assert report.emulation["runtime"] == {runtime: emulated.packages()[runtime]}
    assert report.emulation["environment"]["sysroot"]["packages"]  # the Debian arm64 packages it ran on
    for stage in (validate, bench):  # the target's stages stay its runner's
        with pytest.raises(EnvironmentProblem, match=f"this host cannot run SKU {sku}: needs arch aarch64"):
            stage(pair)
    entry = {e.sku: e for e in consistency(reg, "conv").skus}[sku]  # its golden outputs, marked emulated
    assert entry.emulated and entry.outputs_sha256 == report.outputs_sha256
    [row] = matrix(reg, ["conv"], [sku])
    assert row.outcome == "built only" and row.exit_code == 0
    assert row.detail.startswith("validated under emulation (qemu-aarch64-static, cortex-a76; not benchmarked")
    assert row.detail.endswith("its runner benches and publishes it")


@ON_X86
@EMULATION
def test_the_emulated_runtime_is_aarch64_and_agrees_with_the_native_one(proj):
    """The same portable engine through the aarch64 ONNX Runtime and through this host's: close, not
    the same call (the worker says it runs on aarch64)."""
    build(proj.registry.pair("conv", "arm_ort"))
    engine = proj.out.engine_dir("conv", "arm_ort")
    spec = proj.registry.sku("arm_ort")
    backend = get_backend("onnxruntime")
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    with backend.load_emulated(engine, spec) as arm, backend.load(engine, spec) as native:
        assert arm.emulation is not None and native.emulation is None
        got, want = arm.infer({"x": x}), native.infer({"x": x})
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].shape == want[name].shape
        np.testing.assert_allclose(got[name], want[name], atol=0.05)


@ON_X86
@EMULATION
def test_an_engine_built_for_this_cpu_fails_under_emulation_with_the_runtime_s_words(proj):
    """A planted arm64-only defect: the x86 engine with NCHWc layout ops (blocks of this CPU's vector
    width) shipped to the arm SKU. Natively it runs; on the aarch64 runtime it cannot."""
    build(proj.registry.pair("conv", "x86_nchwc"))
    engine = proj.out.engine_dir("conv", "x86_nchwc")
    assert "com.microsoft.nchwc" in (engine / "model.onnx").read_bytes().decode("latin-1")
    with pytest.raises(InputError, match="under emulation \\(cortex-a76\\) the aarch64 runtime failed"):
        get_backend("onnxruntime").load_emulated(engine, proj.registry.sku("arm_ort")).close()


def test_the_worker_imports_nothing_of_skuforge():
    text = (emulated.WORKER).read_text()
    assert "pipeline" not in "".join(line for line in text.splitlines() if line.startswith(("import", "from")))


@ON_X86
@EMULATION
@CROSS_CC
def test_a_tvm_library_with_instructions_the_device_lacks_kills_the_emulated_device_and_says_so(proj, tmp_path):
    """A planted arm64-only defect: the SKU's library compiled for an SVE CPU (Neoverse V1), the
    device a Cortex-A76 without SVE. The x86 host cannot tell; the emulated device dies of SIGILL."""
    spec = SKUS["arm_tvm"] | {
        "options": SKUS["arm_tvm"]["options"] | {"target_cpu": "neoverse-v1", "target_cpu_features": ["+neon", "+sve"]}
    }
    reg = load_registry(models.write_project(tmp_path, {"conv": models.conv_bn_spec()}, {"sve": spec}))
    shutil.copytree(proj.registry.root / "models", tmp_path / "models", dirs_exist_ok=True)
    for stage in (prepare, make_data, reference):
        stage(reg, "conv")
    build(reg.pair("conv", "sve"))
    with pytest.raises(InputError) as caught:
        emulate(reg.pair("conv", "sve"))
    assert "killed the device emulated-aarch64@127.0.0.1" in caught.value.message
    assert "died of SIGILL (an instruction the emulated cortex-a76 lacks)" in caught.value.message
    assert "target_cpu" in caught.value.hint


@ON_X86
def test_a_tvm_library_built_for_this_host_is_refused_before_it_reaches_a_device(proj, tmp_path):
    x86 = models.cpu_sku("tvm", "fp32", {"target_cpu": "x86-64"})
    reg = load_registry(models.write_project(tmp_path, {"conv": models.conv_bn_spec()}, {"x86": x86}))
    shutil.copytree(proj.registry.root / "models", tmp_path / "models", dirs_exist_ok=True)
    for stage in (prepare, make_data):
        stage(reg, "conv")
    build(reg.pair("conv", "x86"))
    engine = Layout(reg.root).engine_dir("conv", "x86")
    arm = SkuSpec.model_validate(SKUS["arm_tvm"])
    with pytest.raises(InputError, match="is not code for the SKU's aarch64 devices: model.so has ELF machine 62"):
        get_backend("tvm").load_emulated(engine, arm).close()


@ON_X86
@EMULATION
def test_the_emulate_command_says_so_and_the_skus_table_shows_it(proj):
    build(proj.registry.pair("conv", "arm_ort"))
    res = skuforge("emulate", "--model", "conv", "--sku", "arm_ort", cwd=proj.registry.root)
    assert res.returncode == 0, res.stderr
    assert "validated conv/arm_ort under emulation: passed (not benchmarked)" in res.stdout
    res = skuforge("emulate", "--model", "conv", "--sku", "x86_nchwc", cwd=proj.registry.root)
    assert res.returncode == 3 and "does not validate SKU x86_nchwc under emulation" in res.stderr
    res = skuforge("skus", cwd=proj.registry.root)
    assert res.returncode == 0
    [row] = [line for line in res.stdout.splitlines() if line.startswith("arm_ort ")]
    assert "build+emulated" in row
    res = skuforge("runner", "check", "--sku", "arm_ort", "--json", cwd=proj.registry.root)
    assert res.returncode == 3  # an emulating host is no runner for the SKU: its bench needs the device
    assert "(its engines are validated under emulation here)" in res.stderr


@ON_X86
@pytest.mark.skipif(
    not shutil.which("qemu-aarch64-static"), reason="no qemu-aarch64-static (scripts/setup.sh --with emulation)"
)
def test_a_runtime_without_an_aarch64_wheel_is_named_and_the_sku_check_says_so(tmp_path, monkeypatch):
    """numpy 1.21.0 has no cp311 wheel for aarch64 on PyPI: the environment is not made (nothing
    half-made is left as whole) and the host check names the package and version, not "missing"."""
    monkeypatch.setenv("SKUFORGE_EMULATION_DIR", str(tmp_path))
    wanted = {"numpy": "1.21.0"}
    with pytest.raises(EnvironmentProblem, match="numpy 1.21.0: no manylinux aarch64 wheel for cp311 on PyPI"):
        emulation.prepare(wanted)
    assert not emulation.env_dir(wanted).exists()
    [problem] = emulation.problems(wanted)
    assert problem.startswith("the aarch64 environment could not be made: ")
    assert "numpy 1.21.0: no manylinux aarch64 wheel for cp311 on PyPI" in problem
