"""IREE backend: CPU (llvm-cpu) FP32 and FP16, Vulkan on lavapipe, CUDA cross-compiled here and
validated only where a GPU is; the dispatch report; IREE's own refusals (inconsistent options, an
unknown compiler flag, an engine for CPU features this host lacks). What every backend must do
(INT8 refused, an unsupported op named, a damaged or foreign engine refused) is
tests/backends/test_contract.py. Each (model, SKU) is compiled once, in a module-scoped project."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest

pytest.importorskip("iree.compiler", reason="iree-base-compiler is not installed (pip install iree-base-compiler)")
pytest.importorskip("iree.runtime", reason="iree-base-runtime is not installed (pip install iree-base-runtime)")

import models  # noqa: E402

from pipeline.backends import get_backend, quantize  # noqa: E402
from pipeline.backends.contract import ENGINE_META  # noqa: E402
from pipeline.backends.iree import (  # noqa: E402
    ImportRefused,
    IreeBackend,
    compile_flags,
    dispatch_op_type,
    dispatch_precision,
    import_failure,
    missing_cpu_features,
    to_mlir,
)
from pipeline.core.errors import ConfigError, EnvironmentProblem, UnsupportedOp  # noqa: E402
from pipeline.core.paths import Layout  # noqa: E402
from pipeline.host.probe import ENV_FAKE_CPU_FLAGS, cpu_features, host_arch, llvm_cpu_target  # noqa: E402
from pipeline.project.config import SkuSpec, load_registry  # noqa: E402
from pipeline.stages.bench import bench  # noqa: E402
from pipeline.stages.build import build  # noqa: E402
from pipeline.stages.data import make_data  # noqa: E402
from pipeline.stages.prepare import prepare  # noqa: E402
from pipeline.stages.reference import reference  # noqa: E402
from pipeline.stages.validate import validate  # noqa: E402

if host_arch() != "x86_64":
    pytest.skip("the IREE test SKUs target x86-64 hosts", allow_module_level=True)


def iree_sku(
    precision: str = "fp32", device: str = "cpu", labels: tuple[str, ...] = ("self-hosted", "linux", "x64"), **options
) -> dict:
    return {
        "backend": "iree",
        "precision": precision,
        "target": {"arch": "x86_64", "device": device, "os": "linux"},
        "runner_labels": list(labels),
        "shapes": {"batch": 1},
        "options": options,
        "bench": dict(models.FAST_BENCH),
    }


CUDA_LABELS = ("self-hosted", "linux", "x64", "gpu", "cuda", "sm80")
SKUS = {
    "cpu_fp32": iree_sku("fp32"),
    "cpu_fp16": iree_sku("fp16"),
    "v3_fp32": iree_sku("fp32", target_cpu="x86-64-v3"),
    "vk_fp32": iree_sku(
        "fp32", labels=("self-hosted", "linux", "x64", "vulkan"), target_device="vulkan", vulkan_target="llvmpipe"
    ),
    "cuda_fp32": iree_sku("fp32", device="gpu", labels=CUDA_LABELS, target_device="cuda"),
    "bad_flag": iree_sku("fp32", target_cpu="x86-64-v3", extra_flags=["--iree-no-such-flag"]),
}
MODELS = ("conv", "multi")
CPU_SKUS = ("cpu_fp32", "cpu_fp16")
DRIVER = {
    "cpu_fp32": "local-task",
    "cpu_fp16": "local-task",
    "v3_fp32": "local-task",
    "vk_fp32": "vulkan",
    "cuda_fp32": "cuda",
}
# the fusions IREE makes of these graphs (prepare folded BatchNorm into the Conv)
FUSED = {"conv": {"conv", "relu", "gap"}, "multi": {"matmul", "scale", "add"}}


def vulkan_problems(reg) -> list[str]:
    return IreeBackend().environment_problems(reg.sku("vk_fp32"), "run")


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    root = tmp_path_factory.mktemp("iree")
    models.conv_bn_model(root / "models/conv/model.onnx")
    models.multi_io_model(root / "models/multi/model.onnx")
    reg = load_registry(
        models.write_project(root, {"conv": models.conv_bn_spec(), "multi": models.multi_io_spec()}, SKUS)
    )
    r = SimpleNamespace(
        registry=reg, out=Layout(reg.root), build={}, validate={}, bench={}, graph={}, vulkan=vulkan_problems(reg)
    )
    runnable = CPU_SKUS + (() if r.vulkan else ("vk_fp32",))
    for m in MODELS:
        prepare(reg, m)
        make_data(reg, m)
        reference(reg, m)
        r.graph[m] = {n.name for n in onnx.load(str(r.out.prepared_model(m))).graph.node}
        for s in (*CPU_SKUS, "vk_fp32", "cuda_fp32"):
            r.build[m, s] = build(reg.pair(m, s))
        for s in runnable:
            r.validate[m, s] = validate(reg.pair(m, s))
            r.bench[m, s] = bench(reg.pair(m, s))
    r.build["conv", "v3_fp32"] = build(reg.pair("conv", "v3_fp32"))
    return r


# --- the dispatch report ------------------------------------------------------------------------


@pytest.mark.parametrize("sku", [*CPU_SKUS, "vk_fp32", "cuda_fp32"])
@pytest.mark.parametrize("model", MODELS)
def test_dispatches_are_reported_with_their_fused_onnx_nodes(proj, model, sku):
    rep = proj.build[model, sku]
    assert rep.backend == "iree" and rep.requested_devices == [DRIVER[sku]]
    assert rep.layers and rep.placement == {DRIVER[sku]: len(rep.layers)}
    for layer in rep.layers:
        assert "$async_dispatch_" in layer.name and layer.kernel == layer.name
        assert layer.op_type and layer.op_type in layer.name
    ops = {layer.op_type for layer in rep.layers}
    assert "matmul" in ops and (model != "conv" or "conv" in ops)
    fused = [set(layer.fused_from) for layer in rep.layers if len(layer.fused_from) > 1]
    assert any(FUSED[model] <= f for f in fused), [layer.fused_from for layer in rep.layers]
    if sku != "cpu_fp16":  # FP16 adds the converter's Cast nodes
        assert set().union(*(layer.fused_from for layer in rep.layers)) <= proj.graph[model]
    assert rep.options["fused_dispatches"] == len(fused) and rep.options["dispatches"] == len(rep.layers)
    assert rep.versions["iree-base-runtime"] and rep.versions["iree-base-compiler"]
    engine = proj.out.engine_dir(model, sku)
    assert [f.path for f in rep.engine_files] == ["module.vmfb"]
    meta = json.loads((engine / ENGINE_META).read_text())
    assert meta["entry"] == {"conv": "conv_bn", "multi": "multi_io"}[model] and meta["driver"] == DRIVER[sku]
    assert [i["name"] for i in meta["inputs"]] == {"conv": ["x"], "multi": ["x", "ids", "scale"]}[model]
    assert [o["name"] for o in meta["outputs"]] == {"conv": ["probs"], "multi": ["y", "cls"]}[model]


def test_host_cpu_target_is_resolved_and_recorded(proj):
    """target_cpu host: a generic CPU plus the features /proc/cpuinfo reports, never LLVM's CPU name
    (which implies features a VM may hide); the request and the resolution are both recorded."""
    rep = proj.build["conv", "cpu_fp32"]
    host = llvm_cpu_target()
    assert "--iree-llvmcpu-target-cpu=x86-64" in rep.options["compile_flags"]
    assert f"--iree-llvmcpu-target-cpu-features={','.join(host['cpu_features'])}" in rep.options["compile_flags"]
    assert rep.options["target_cpu"] == "host" and rep.options["requested_target"] == {
        "cpu": "host",
        "cpu_features": [],
    }
    target = rep.options["resolved_target"]
    assert target["backend"] == "llvm-cpu" and target["cpu"] == "x86-64"
    assert set(host["cpu_features"]) <= set(target["cpu_features"])
    host_flags = cpu_features()
    for flag, feature in (("avx2", "avx2"), ("fma", "fma"), ("avx512f", "avx512f"), ("amx_tile", "amx-tile")):
        assert (f"+{feature}" in target["cpu_features"]) == (flag in host_flags)
    assert rep.hardware_specific and any("target_cpu host resolved to" in w for w in rep.warnings)
    assert not IreeBackend().cross_compiles(proj.registry.sku("cpu_fp32"))


def test_a_named_cpu_target_cross_compiles_and_is_portable(proj):
    rep = proj.build["conv", "v3_fp32"]
    target = rep.options["resolved_target"]
    assert (
        target["cpu"] == "x86-64-v3" and "+avx2" in target["cpu_features"] and "+avx512f" not in target["cpu_features"]
    )
    assert not rep.hardware_specific and IreeBackend().cross_compiles(proj.registry.sku("v3_fp32"))
    assert "--iree-llvmcpu-target-triple=x86_64-unknown-unknown-eabi-elf" in rep.options["compile_flags"]


@pytest.mark.parametrize("model", MODELS)
def test_fp16_dispatches_compute_in_fp16(proj, model):
    rep = proj.build[model, "cpu_fp16"]
    contractions = [layer for layer in rep.layers if layer.op_type in ("conv", "matmul")]
    assert contractions and all(layer.precision == "fp16" and "f16" in layer.name for layer in contractions)
    # the FP32 inputs and outputs are converted in dispatches of their own, which compute nothing
    casts = [
        layer
        for layer in rep.layers
        if any(n.startswith("graph_input_cast") or n.startswith("graph_output_cast") for n in layer.fused_from)
        and len(layer.fused_from) == 1
    ]
    assert casts and all(layer.precision == "n/a" for layer in casts)
    assert rep.precision_counts.get("fp16", 0) >= len(contractions)
    assert "fp16" not in proj.build[model, "cpu_fp32"].precision_counts


def test_fp16_softmax_runs_in_fp32_and_the_gate_says_so(proj):
    # IREE's ONNX lowering upcasts an f16 Softmax to f32: the precision gate (warn) names it
    softmax = [layer for layer in proj.build["conv", "cpu_fp16"].layers if layer.op_type == "softmax"]
    assert [layer.precision for layer in softmax] == ["fp32"]
    gate = proj.validate["conv", "cpu_fp16"].precision_gate
    assert [layer.name for layer in gate.mismatched] == [softmax[0].name] and gate.passed


def test_dispatch_names_parse():
    assert dispatch_op_type("m$async_dispatch_1_conv_8x8x8x3x3x3_f16xf16xf32") == "conv"
    assert dispatch_op_type("m$async_dispatch_0_slow_memcpy") == "slow_memcpy"
    assert dispatch_op_type("m$async_dispatch_3_arg_compare_1x4xf16_dispatch_tensor_store") == "arg_compare"
    assert dispatch_op_type("m$async_dispatch_2_matmul_like_Dx4x8_f32") == "matmul_like"
    assert dispatch_precision("m$async_dispatch_1_conv_8x8_f16xf16xf32", ["linalg.conv_2d_nchw_fchw"], []) == "fp16"
    assert dispatch_precision("m$async_dispatch_2_reduction_8x64_f32xf32xf16", ["arith.addf"], []) == "fp16"
    assert dispatch_precision("m$async_dispatch_4_softmax_4xf32_generic", ["linalg.softmax"], []) == "fp32"
    assert (
        dispatch_precision("m$async_dispatch_0_elementwise_3_f32xf16", ["linalg.generic", "arith.truncf"], []) == "n/a"
    )
    assert dispatch_precision("m$async_dispatch_0_elementwise_3_i64", ["arith.addi"], []) == "n/a"


# --- validate and bench -------------------------------------------------------------------------


@pytest.mark.parametrize("sku", CPU_SKUS)
@pytest.mark.parametrize("model", MODELS)
def test_cpu_engines_pass_validation_and_bench(proj, model, sku):
    rep = proj.validate[model, sku]
    assert rep.passed and rep.placement.passed and rep.samples == {"golden": 32}
    limit = 1e-4 if sku == "cpu_fp32" else 5e-2
    assert all(e.max_abs_error <= limit for e in rep.outputs), [(e.output, e.max_abs_error) for e in rep.outputs]
    if model == "multi":  # argmax ids are exact
        assert next(e for e in rep.outputs if e.output == "cls").max_abs_error == 0
    stats = proj.bench[model, sku].engine_only
    assert stats.iterations >= 10 and 0 < stats.p50_ms <= stats.p99_ms


@pytest.mark.parametrize("model", MODELS)
def test_vulkan_engine_on_lavapipe(proj, model):
    if proj.vulkan:
        pytest.skip(f"no Vulkan device: {'; '.join(proj.vulkan)}")
    rep = proj.validate[model, "vk_fp32"]
    assert rep.passed and all(e.max_abs_error <= 1e-4 for e in rep.outputs)
    assert proj.build[model, "vk_fp32"].options["resolved_target"]["gpu_arch"] == "llvmpipe"
    assert proj.bench[model, "vk_fp32"].engine_only.p50_ms > 0


def test_cuda_engine_is_built_here_and_validated_only_on_a_gpu(proj):
    rep = proj.build["conv", "cuda_fp32"]
    assert rep.options["resolved_target"]["gpu_arch"] == "sm_80"
    assert IreeBackend().cross_compiles(proj.registry.sku("cuda_fp32"))
    if not IreeBackend().environment_problems(proj.registry.sku("cuda_fp32"), "run"):
        pytest.skip("this host has a CUDA device: test_cuda_engine_on_a_gpu covers it")
    with pytest.raises(EnvironmentProblem) as info:
        validate(proj.registry.pair("conv", "cuda_fp32"))
    assert info.value.exit_code == 3 and "cannot run SKU cuda_fp32" in info.value.message
    assert f"[{', '.join(CUDA_LABELS)}]" in info.value.hint


@pytest.mark.gpu
def test_cuda_engine_on_a_gpu(proj):
    problems = IreeBackend().environment_problems(proj.registry.sku("cuda_fp32"), "run")
    if problems:
        pytest.skip(f"no CUDA device for IREE: {'; '.join(problems)}")
    for m in MODELS:
        rep = validate(proj.registry.pair(m, "cuda_fp32"))
        assert rep.passed and all(e.max_abs_error <= 1e-4 for e in rep.outputs)
        assert bench(proj.registry.pair(m, "cuda_fp32")).engine_only.p50_ms > 0


# --- refusals -----------------------------------------------------------------------------------


def test_inconsistent_options_are_config_errors():
    """(INT8, which IREE's capabilities leave out, is refused in tests/backends/test_contract.py.)"""

    def problems(**sku) -> list[str]:
        return IreeBackend.check_sku(SkuSpec.model_validate(sku))

    assert "vulkan_target: required" in problems(**iree_sku(target_device="vulkan"))[0]
    assert "driver: vulkan cannot run a local engine" in problems(**iree_sku(driver="vulkan"))[0]
    assert "target.device: a cuda engine runs on a GPU" in problems(**iree_sku(target_device="cuda"))[0]
    assert (
        "target_cpu: only applies" in problems(**iree_sku(device="gpu", target_device="cuda", target_cpu="znver3"))[0]
    )
    assert "is set from the other options" in problems(**iree_sku(extra_flags=["--iree-hal-target-device=cuda"]))[0]
    assert "unknown key" in problems(**iree_sku(target_cpus="host"))[0]


def test_compile_flags_follow_the_options():
    assert compile_flags(IreeBackend.Options(target_device="vulkan", vulkan_target="valhall"), "x86_64") == [
        "--iree-hal-target-device=vulkan",
        "--iree-vulkan-target=valhall",
    ]
    local = compile_flags(
        IreeBackend.Options(
            target_cpu="cortex-a76", target_cpu_features=["dotprod", "+fp16"], extra_flags=["--iree-opt-level=O3"]
        ),
        "aarch64",
    )
    assert local == [
        "--iree-hal-target-device=local",
        "--iree-hal-local-target-device-backends=llvm-cpu",
        "--iree-llvmcpu-target-cpu=cortex-a76",
        "--iree-llvmcpu-target-triple=aarch64-unknown-unknown-eabi-elf",
        "--iree-llvmcpu-target-cpu-features=+dotprod,+fp16",
        "--iree-opt-level=O3",
    ]


def test_a_flag_iree_compile_does_not_know_is_a_config_error(proj):
    """(An op IREE cannot lower, UnsupportedOp: tests/backends/test_contract.py.)"""
    with pytest.raises(ConfigError, match="--iree-no-such-flag"):
        build(proj.registry.pair("conv", "bad_flag"))
    assert not proj.out.engine_dir("conv", "bad_flag").exists()  # nothing half-built is left


@pytest.fixture
def engine_copy(proj, tmp_path) -> Path:
    dst = tmp_path / "engine"
    shutil.copytree(proj.out.engine_dir("conv", "v3_fp32"), dst)
    return dst


def test_an_engine_for_cpu_features_this_host_lacks_is_refused(proj, engine_copy, monkeypatch):
    # a faked x86-64-v2 host (no AVX): the x86-64-v3 engine needs avx, avx2, bmi, bmi2, f16c, fma, ...
    monkeypatch.setenv(ENV_FAKE_CPU_FLAGS, "sse sse2 pni ssse3 sse4_1 sse4_2 popcnt cx16 lahf_lm")
    assert missing_cpu_features(["+amx-tile", "+sse2", "-avx", "+evex512", "+crc32"]) == ["amx-tile"]
    with pytest.raises(
        EnvironmentProblem, match=r"compiled for CPU x86-64-v3 with features this CPU lacks: .*\bavx2\b"
    ):
        get_backend("iree").load(engine_copy, proj.registry.sku("v3_fp32"))
    monkeypatch.delenv(ENV_FAKE_CPU_FLAGS)
    with get_backend("iree").load(engine_copy, proj.registry.sku("v3_fp32")):
        pass


def test_a_rebuild_gives_the_same_engine_bytes(proj):
    first = proj.build["conv", "v3_fp32"]
    again = build(proj.registry.pair("conv", "v3_fp32"))
    assert [f.sha256 for f in again.engine_files] == [f.sha256 for f in first.engine_files]
    assert again.options["dispatch_sites"] >= again.options["dispatches"] == len(again.layers)


def test_compiler_diagnostics_become_errors_the_user_can_act_on():
    from pipeline.backends.iree import compile_error

    nodes = {"spectrum": "DFT", "act": "Relu"}
    cmd = ["iree-compile", "input.mlir", "--iree-hal-target-device=local"]
    legalize = (
        "<unknown>:0: error: loc(\"spectrum\"): failed to legalize operation 'torch.operator' that was explicitly "
        'marked illegal: %1 = "torch.operator"(%arg0) <{name = "onnx.DFT"}> : (!torch.vtensor<[1,8,1],f32>) -> '
        '!torch.vtensor<[1,8,2],f32>\n<unknown>:0: note: loc("spectrum"): see current operation'
    )
    err = compile_error(1, legalize, nodes, cmd)
    assert isinstance(err, UnsupportedOp) and (err.op_type, err.node) == ("DFT", "spectrum")
    assert "no lowering for onnx.DFT" in err.message
    crash = (
        "Please report issues to https://github.com/iree-org/iree/issues\n"
        "Stack dump:\n0.\tProgram arguments: iree-compile"
    )
    err = compile_error(-11, crash, nodes, cmd)
    assert isinstance(err, UnsupportedOp) and err.exit_code == 3 and "crashed (exit -11)" in err.message
    assert isinstance(compile_error(1, "<unknown>:0: error: Unknown Vulkan target 'cpu'", nodes, cmd), ConfigError)
    other = compile_error(1, "<unknown>:0: error: something else", nodes, cmd)
    assert type(other) is EnvironmentProblem and "something else" in other.message


# --- flags a model does not build with; conversions that break the import --------------------

IM2COL = "--iree-global-opt-use-im2col-for-convs"


def se_block_model(path: Path, seed: int = 0) -> Path:
    """x[batch,3,8,8] -> Conv 3x3 -> squeeze-excite (GlobalAveragePool -> Conv 1x1 -> Relu -> Conv 1x1 ->
    HardSigmoid -> Mul), as in MobileNetV3 (PaddleOCR's detector backbone). At batch 1, IREE 3.13 with
    im2col fails on the 1x1 convolutions of the 1x1 map ('linalg.generic' op write affecting
    operations on global resources are restricted to workgroup distributed contexts)."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(seed)
    init = [
        numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)
        for name, shape in (
            ("W0", (8, 3, 3, 3)),
            ("W1", (2, 8, 1, 1)),
            ("B1", (2,)),
            ("W2", (8, 2, 1, 1)),
            ("B2", (8,)),
        )
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W0"], ["f"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("GlobalAveragePool", ["f"], ["g"], name="squeeze"),
        helper.make_node("Conv", ["g", "W1", "B1"], ["r"], name="reduce"),
        helper.make_node("Relu", ["r"], ["rr"], name="relu"),
        helper.make_node("Conv", ["rr", "W2", "B2"], ["e"], name="expand"),
        helper.make_node("HardSigmoid", ["e"], ["s"], alpha=1 / 6, beta=0.5, name="gate"),
        helper.make_node("Mul", ["f", "s"], ["y"], name="excite"),
    ]
    graph = helper.make_graph(
        nodes,
        "se_block",
        [models.value_info("x", ["batch", 3, 8, 8])],
        [models.value_info("y", ["batch", 8, 8, 8])],
        init,
    )
    return models.save_graph(graph, path)


def resize_roi_model(path: Path, seed: int = 0) -> Path:
    """x[batch,3,4,4] -> Conv 3x3 -> Resize x2 (nearest) -> y[batch,4,8,8] at opset 11, with ``roi`` an
    empty float tensor (dims [0]) that has no data field, as Paddle and PyTorch exporters write it."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    init = [
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32), "W"),
        helper.make_tensor("roi", TensorProto.FLOAT, [0], []),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Resize", ["c", "roi", "scales"], ["y"], mode="nearest", name="resize"),
    ]
    graph = helper.make_graph(
        nodes,
        "resize_roi",
        [models.value_info("x", ["batch", 3, 4, 4])],
        [models.value_info("y", ["batch", 4, 8, 8])],
        init,
    )
    return models.save_graph(graph, path, opset=11)


def spec(dir_: str, shape: list) -> dict:
    return {"dir": dir_, "source": "model.onnx", "inputs": [{"name": "x", "dtype": "float32", "shape": shape}]}


V3 = {"target_cpu": "x86-64-v3"}
FLAG_SKUS = {
    # the params.yaml CPU SKUs' options
    "im2col_fp32": iree_sku("fp32", extra_flags=[IM2COL], **V3),
    "im2col_fp16": iree_sku("fp16", extra_flags=[IM2COL], **V3),
    "strict": iree_sku("fp32", extra_flags=[IM2COL], strict_flags=True, **V3),
    "optional": iree_sku("fp32", optional_flags=[IM2COL, "--iree-llvmcpu-enable-ukernels=all"], **V3),
}


@pytest.fixture(scope="module")
def flags_proj(tmp_path_factory):
    root = tmp_path_factory.mktemp("iree_flags")
    se_block_model(root / "models/se/model.onnx")
    resize_roi_model(root / "models/resize/model.onnx")
    specs = {"se": spec("models/se", ["batch", 3, 8, 8]), "resize": spec("models/resize", ["batch", 3, 4, 4])}
    reg = load_registry(models.write_project(root, specs, FLAG_SKUS))
    for m in specs:
        prepare(reg, m)
        make_data(reg, m)
        reference(reg, m)
    return SimpleNamespace(registry=reg, out=Layout(reg.root))


def test_im2col_breaks_the_squeeze_excite_block_and_is_dropped_with_the_reason(flags_proj):
    """The bug report's failure, real: the SKU's default im2col flag does not build this model, so it
    is dropped, and the build report, engine.json and the warnings say which flag and why."""
    rep = build(flags_proj.registry.pair("se", "im2col_fp32"))
    assert IM2COL not in rep.options["compile_flags"] and rep.options["extra_flags"] == [IM2COL]
    [dropped] = rep.options["dropped_flags"]
    assert dropped["flag"] == IM2COL
    assert "write affecting operations on global resources are restricted" in dropped["error"]
    assert any(f"iree-compile failed with {IM2COL}" in w and "strict_flags" in w for w in rep.warnings)
    meta = json.loads((flags_proj.out.engine_dir("se", "im2col_fp32") / ENGINE_META).read_text())
    assert meta["dropped_flags"] == [dropped] and IM2COL not in meta["compile_flags"]
    assert validate(flags_proj.registry.pair("se", "im2col_fp32")).passed


def test_strict_flags_make_a_flag_the_model_does_not_build_with_a_failure(flags_proj):
    with pytest.raises(EnvironmentProblem, match="write affecting operations on global resources") as info:
        build(flags_proj.registry.pair("se", "strict"))
    assert not isinstance(info.value, (UnsupportedOp, ConfigError))
    assert not flags_proj.out.engine_dir("se", "strict").exists()


def test_optional_flags_are_kept_where_the_model_builds_with_them(flags_proj):
    rep = build(flags_proj.registry.pair("se", "optional"))
    assert [d["flag"] for d in rep.options["dropped_flags"]] == [IM2COL]
    assert rep.options["compile_flags"][-1] == "--iree-llvmcpu-enable-ukernels=all"
    # the resize model builds with im2col: nothing is dropped
    rep = build(flags_proj.registry.pair("resize", "optional"))
    assert (
        rep.options["dropped_flags"] == []
        and rep.options["compile_flags"][-2:] == FLAG_SKUS["optional"]["options"]["optional_flags"]
    )


def test_flag_lists_are_checked_at_config_time():
    def problems(**options) -> list[str]:
        return IreeBackend.check_sku(SkuSpec.model_validate(iree_sku(**options)))

    assert "optional_flags: 'im2col' is not a flag" in problems(optional_flags=["im2col"])[0]
    assert "is set from the other options" in problems(optional_flags=["--iree-llvmcpu-target-cpu=znver3"])[0]
    assert "in extra_flags too" in problems(extra_flags=[IM2COL], optional_flags=[IM2COL])[0]
    opts = IreeBackend.Options(extra_flags=[IM2COL, "--iree-opt-strip-assertions"], optional_flags=["--iree-x=1"])
    assert opts.droppable_flags == [IM2COL, "--iree-x=1"]  # a flag that is not a known speed flag stays required
    assert IreeBackend.Options(extra_flags=[IM2COL], strict_flags=True).droppable_flags == []


@pytest.mark.parametrize("sku", ["im2col_fp32", "im2col_fp16"])
def test_resize_with_an_empty_roi_builds_and_passes_in_fp32_and_fp16(flags_proj, sku):
    """The FP16 converter turned the empty roi into an FP16 tensor with no data field, which IREE's
    importer refused ("Unhandled ONNX TensorProto data: dims: 0") though FP32 imported it."""
    rep = build(flags_proj.registry.pair("resize", sku))
    assert rep.options["opset_conversion"]["from_opset"] == 11 and rep.options["dropped_flags"] == []
    assert validate(flags_proj.registry.pair("resize", sku)).passed


def test_a_conversion_that_breaks_the_import_is_named_not_the_op(flags_proj, monkeypatch):
    """The FP16 graph fails to import, the FP32 graph it came from imports: the conversion is the
    culprit (not UnsupportedOp with "replace the op"). The converter's old output, re-created by
    skipping the empty-tensor fix, against the real importer."""
    monkeypatch.setattr(quantize, "_empty_tensors_to_raw", lambda model: 0)
    with pytest.raises(EnvironmentProblem) as info:
        build(flags_proj.registry.pair("resize", "im2col_fp16"))
    err = info.value
    assert not isinstance(err, UnsupportedOp) and err.exit_code == 3
    assert err.message.startswith("the FP16 conversion broke the model for IREE's ONNX importer")
    assert "at node 'resize' (Resize, its input 'roi')" in err.message and "Unhandled ONNX TensorProto" in err.message
    assert "keep 'resize' precise" in err.hint and "fp32" in err.hint
    assert "models.resize.higher_precision.im2col_fp16: [resize]" in err.hint  # the key to set, as written


def test_an_import_failure_before_the_conversion_still_blames_the_node(tmp_path):
    """When the graph before the conversion fails to import too, the conversion is not blamed."""
    broken = onnx.load(str(resize_roi_model(tmp_path / "m.onnx")))
    broken.graph.initializer[1].data_type = onnx.TensorProto.FLOAT16  # no data field, no importer handler
    onnx.save(broken, str(tmp_path / "broken.onnx"))
    with pytest.raises(ImportRefused) as refused:
        to_mlir(tmp_path / "broken.onnx", tmp_path / "out.mlir")
    nodes = {"conv": "Conv", "resize": "Resize"}
    err = import_failure(refused.value, nodes, [("FP16 conversion", tmp_path / "broken.onnx")], tmp_path)
    assert isinstance(err, UnsupportedOp) and (err.op_type, err.node) == ("Resize", "resize")
    assert quantize._empty_tensors_to_raw(broken) == 1  # the fix gives it an (empty) raw_data
    onnx.save(broken, str(tmp_path / "fixed.onnx"))
    to_mlir(tmp_path / "fixed.onnx", tmp_path / "out.mlir")
