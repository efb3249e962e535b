"""params.yaml parsing: typed models, key-path errors with suggestions, override merging."""

from __future__ import annotations

import copy
from pathlib import Path

import models
import pytest

from pipeline.backends import backend_class, known_backends
from pipeline.core.errors import ConfigError
from pipeline.project.config import (
    OUTPUT_KINDS,
    BenchSpec,
    MetricGate,
    Registry,
    Tolerance,
    load_registry,
    parse_registry,
)

REPO = Path(__file__).resolve().parents[1]


def base() -> dict:
    return {
        "defaults": {},
        "examples": {},
        "models": {"conv": models.conv_bn_spec(), "multi": models.multi_io_spec()},
        "skus": {"cpu": models.ort_sku("fp32"), "cpu_int8": models.ort_sku("int8")},
    }


def config_error(data: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_registry(data)
    assert info.value.exit_code == 2
    return info.value


def mutated(path: str, value) -> dict:
    """A copy of base() with the dotted ``path`` set to ``value``."""
    data = copy.deepcopy(base())
    *parents, last = path.split(".")
    node = data
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[last] = value
    return data


# --- a valid registry ---------------------------------------------------------------------------


def test_valid_registry_parses(tmp_path):
    params = models.write_project(tmp_path, base()["models"], base()["skus"])
    reg = load_registry(params)
    assert isinstance(reg, Registry)
    assert reg.root == tmp_path.resolve()
    assert sorted(reg.models) == ["conv", "multi"] and sorted(reg.skus) == ["cpu", "cpu_int8"]
    assert reg.model_file("conv") == tmp_path.resolve() / "models/conv/model.onnx"
    multi = reg.model("multi")
    assert [i.name for i in multi.inputs] == ["x", "ids", "scale"]
    assert multi.input("ids").dtype == "int64" and multi.input("scale").shape == []
    assert multi.input("x").value_range() == (-1.0, 1.0)
    assert reg.model("conv").input("x").value_range() == (0.0, 1.0)
    assert reg.sku("cpu_int8").precision == "int8"
    assert reg.pins("conv") == {"batch": 1}
    assert reg.pins("conv", "cpu") == {"batch": 1}
    assert reg.pairs() == [("conv", "cpu"), ("conv", "cpu_int8"), ("multi", "cpu"), ("multi", "cpu_int8")]
    # datasets default to generated golden and calibration sets
    assert reg.model("conv").datasets.golden.generate.count == 32
    assert reg.model("conv").datasets.evaluation is None


def test_checked_in_registry_parses():
    reg = load_registry(REPO / "params.yaml")
    assert reg.models and reg.skus
    for name, sku in reg.skus.items():
        assert sku.backend in known_backends(), name


def test_sku_profiles_set_pins_to_opt():
    data = base()
    data["skus"]["dyn"] = models.ort_sku("fp32", shapes={}, profiles={"batch": {"min": 1, "opt": 4, "max": 8}})
    reg = parse_registry(data)
    assert reg.pins("conv", "dyn") == {"batch": 4}


def test_fp16_on_a_gpu_provider_is_accepted():
    data = base()
    data["skus"]["gpu"] = models.ort_sku(
        "fp16", options={"providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
    )
    assert parse_registry(data).sku("gpu").precision == "fp16"


# --- unknown keys -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, value, key, suggestion",
    [
        ("modles", {}, "modles", "models"),
        ("models.conv.sorce", "model.onnx", "models.conv.sorce", "source"),
        ("models.conv.inputs.0.dtyp", "float32", "models.conv.inputs.0.dtyp", "dtype"),
        (
            "models.conv.datasets",
            {"golden": {"generate": {"count": 4, "sed": 1}}},
            "models.conv.datasets.golden.generate.sed",
            "seed",
        ),
        ("skus.cpu.target.cpu_feature", ["avx2"], "skus.cpu.target.cpu_feature", "cpu_features"),
        ("skus.cpu.tolerance", {"atl": 0.1}, "skus.cpu.tolerance.atl", "atol"),
        ("skus.cpu.placment", {}, "skus.cpu.placment", "placement"),
    ],
)
def test_unknown_key_names_its_path_and_the_nearest_key(path, value, key, suggestion):
    err = config_error(mutated(path, value))
    assert f"{key}: unknown key" in err.message
    assert f"did you mean {suggestion!r}" in err.message
    assert err.hint


def test_unknown_key_lists_the_valid_keys_there():
    err = config_error(mutated("skus.cpu.target.cpu_feature", ["avx2"]))
    assert "valid keys here: arch, device, os, cpu_features" in err.message


def test_unknown_backend_option_names_its_path_and_the_nearest_key():
    err = config_error(mutated("skus.cpu.options", {"provider": ["CPUExecutionProvider"]}))
    assert "skus.cpu.options.provider: unknown key" in err.message
    assert "did you mean 'providers'" in err.message


def test_bad_backend_option_literal_suggests_the_nearest_value():
    err = config_error(mutated("skus.cpu.options", {"graph_optimization_level": "extnded"}))
    assert "skus.cpu.options.graph_optimization_level" in err.message
    assert "did you mean 'extended'" in err.message


def test_top_level_valid_keys_do_not_offer_internal_fields():
    err = config_error(mutated("modles", {}))
    assert "valid keys here" in err.message
    assert "root" not in err.message.split("valid keys here:")[1]


def test_root_is_not_a_user_key():
    assert "root: unknown key" in config_error(mutated("root", "/elsewhere")).message


def test_every_problem_is_reported_at_once():
    data = mutated("models.conv.sorce", "x")
    data["skus"]["cpu"]["precison"] = "fp32"
    err = config_error(data)
    assert "models.conv.sorce" in err.message and "skus.cpu.precison" in err.message


@pytest.mark.parametrize("key", ["defaults", "examples", "models", "skus"])
def test_top_level_keys_are_required(key):
    data = base()
    del data[key]
    assert f"  - {key}: " in config_error(data).message


def test_missing_required_key():
    data = base()
    del data["skus"]["cpu"]["runner_labels"]
    assert "skus.cpu.runner_labels" in config_error(data).message


# --- backends and literals ----------------------------------------------------------------------


def test_unknown_backend_lists_known_backends():
    err = config_error(mutated("skus.cpu.backend", "onnxrt"))
    assert "skus.cpu.backend" in err.message and "unknown backend 'onnxrt'" in err.message
    assert "did you mean 'onnxruntime'" in err.message
    assert "known backends: " + ", ".join(known_backends()) in err.message


def test_backend_registry_unknown_name():
    with pytest.raises(ConfigError) as info:
        backend_class("tensorflow-lite")
    assert "onnxruntime" in info.value.hint


def test_bad_literal_suggests_the_nearest_value():
    err = config_error(mutated("skus.cpu.precision", "fp33"))
    assert "skus.cpu.precision" in err.message and "'fp33'" in err.message
    assert "did you mean 'fp32'" in err.message


def test_bad_dtype_literal():
    err = config_error(mutated("models.conv.inputs.0.dtype", "flaot32"))
    assert "models.conv.inputs.0.dtype" in err.message and "did you mean 'float32'" in err.message


def test_fp16_on_cpu_provider_is_not_supported():
    err = config_error(mutated("skus.cpu.precision", "fp16"))
    assert "skus.cpu.precision" in err.message
    assert "fp16 is not supported" in err.message and "CPUExecutionProvider" in err.message


def test_unknown_execution_provider():
    err = config_error(mutated("skus.cpu.options", {"providers": ["NoSuchExecutionProvider"]}))
    assert "skus.cpu.options.providers" in err.message and "NoSuchExecutionProvider" in err.message


# --- axes, pins, shapes and profiles ------------------------------------------------------------


def test_unpinned_non_batch_dynamic_axis():
    err = config_error(mutated("models.conv.inputs.0.shape", ["batch", 3, "height", 8]))
    assert "models.conv" in err.message and "'height'" in err.message and "pins" in err.message


def test_pinned_non_batch_dynamic_axis_is_fine():
    data = mutated("models.conv.inputs.0.shape", ["batch", 3, "height", 8])
    data["models"]["conv"]["pins"] = {"height": 8}
    assert parse_registry(data).pins("conv") == {"height": 8, "batch": 1}


def test_pins_for_an_unknown_axis():
    err = config_error(mutated("models.conv.pins", {"seq": 4}))
    assert "pins.seq" in err.message and "no input has an axis named 'seq'" in err.message


def test_shapes_and_profiles_conflict():
    err = config_error(mutated("skus.cpu.profiles", {"batch": {"min": 1, "opt": 2, "max": 4}}))
    assert "skus.cpu" in err.message and "both 'shapes' and 'profiles'" in err.message


def test_profile_must_be_ordered():
    data = mutated("skus.cpu.shapes", {})
    data["skus"]["cpu"]["profiles"] = {"batch": {"min": 4, "opt": 2, "max": 8}}
    assert "min <= opt <= max" in config_error(data).message


def test_sku_shape_for_an_axis_no_model_has():
    err = config_error(mutated("skus.cpu.shapes", {"seq": 4}))
    assert "skus.cpu" in err.message and "'seq' is not a dynamic axis" in err.message


def test_sku_may_not_repin_a_non_batch_axis():
    data = mutated("models.conv.inputs.0.shape", ["batch", 3, "height", 8])
    data["models"]["conv"]["pins"] = {"height": 8}
    data["skus"]["cpu"]["shapes"] = {"batch": 1, "height": 16}
    assert "skus.cpu.shapes.height" in config_error(data).message


def test_fixed_dims_must_be_positive():
    assert (
        "models.conv.inputs.0.shape" in config_error(mutated("models.conv.inputs.0.shape", ["batch", 0, 8, 8])).message
    )


# --- resource limits (pipeline/core/limits.py) -------------------------------------------------------

CONV_X = 3 * 8 * 8  # elements of one conv sample
CONV_MAX_BATCH = 2**30 // CONV_X  # float32: the 4 GiB bound is the tighter one


def test_a_billion_batch_is_refused_naming_the_key_the_size_and_the_limit():
    err = config_error(mutated("skus.cpu.shapes.batch", 10**9))
    lines = err.message.splitlines()[1:]
    conv = next(line for line in lines if "model 'conv'" in line)
    assert conv.startswith(
        "  - skus.cpu.shapes.batch: 1000000000 puts input 'x' of model 'conv' at shape "
        f"[1000000000, 3, 8, 8]: {10**9 * CONV_X} elements, 715.26 GiB of float32"
    )
    assert "above the limit of 2147483647 elements and 4.00 GiB per input tensor" in conv
    assert conv.endswith(f"lower it to at most {CONV_MAX_BATCH}")
    assert all(line.startswith("  - skus.cpu.shapes.batch: ") for line in lines)  # multi's inputs too, nothing else


def test_the_largest_batch_suggested_is_accepted():
    data = mutated("skus.cpu.shapes.batch", CONV_MAX_BATCH)
    del data["models"]["multi"]
    assert parse_registry(data).pins("conv", "cpu")["batch"] == CONV_MAX_BATCH
    data["skus"]["cpu"]["shapes"]["batch"] = CONV_MAX_BATCH + 1
    assert f"lower it to at most {CONV_MAX_BATCH}" in config_error(data).message


PROFILE = {"shapes": {}, "profiles": {"batch": {"min": 1, "opt": 8, "max": 10**8}}}


@pytest.mark.parametrize(
    "model, sku, key",
    [
        ({"pins": {"batch": 10**9}}, {}, "models.conv.pins.batch: 1000000000 puts input 'x'"),
        ({}, PROFILE, "skus.cpu.profiles.batch.max: 100000000 puts input 'x'"),
        (
            {"inputs": [{"name": "x", "dtype": "bool", "shape": ["batch", 3, 8, 8]}]},
            PROFILE,
            (
                "skus.cpu.profiles.batch.max: 100000000 puts input 'x' of model 'conv' at shape [100000000, 3, 8, 8]: "
                "19200000000 elements, 17.88 GiB of bool"
            ),
        ),  # the element limit binds for one-byte types
        ({"inputs": [{"name": "x", "shape": ["batch", 3, 10**5, 10**5]}]}, {}, "models.conv.inputs.0.shape: input 'x'"),
    ],
)
def test_pins_profiles_and_fixed_dims_are_checked(model, sku, key):
    data = base()
    data["models"]["conv"].update(model)
    data["skus"]["cpu"].update(sku)
    message = config_error(data).message
    assert f"  - {key}" in message
    assert message.count("model 'conv'") == 1  # named once: not again per SKU, nor for its generated sets


def test_an_axis_used_twice_gets_a_fitting_suggestion():
    data = mutated("models.conv.inputs.0.shape", ["batch", 3, "side", "side"])
    data["models"]["conv"]["pins"] = {"side": 10**5}
    assert "models.conv.pins.side: 100000 puts" in config_error(data).message
    assert "lower it to at most 18918" in config_error(data).message  # 3 * 18918**2 * 4 bytes <= 4 GiB


def test_generated_set_above_the_dataset_budget():
    err = config_error(mutated("models.conv.datasets", {"golden": {"generate": {"count": 10**8}}}))
    assert (
        "  - models.conv.datasets.golden.generate.count: 100000000 samples of 768 bytes each make 71.53 GiB, "
        "above the limit of 4.00 GiB per dataset"
    ) in err.message
    assert err.message.splitlines()[1].endswith(f"lower it to at most {(4 << 30) // 768}")


def test_a_files_dataset_folder_outside_the_project_is_refused_like_a_dataset_path():
    """The data stage refuses it too; config validate says so first, as for a .npz path."""
    for key in ("path", "files"):
        data = mutated("models.conv.datasets", {"golden": {key: "../../../outside"}})
        if key == "files":
            data["models"]["conv"]["preprocess"] = {"x": {"decode": "image", "resize": {"size": [8, 8]}}}
        assert (
            f"models.conv.datasets.golden.{key}: '../../../outside' (joined with dir: "
            "'models/conv/../../../outside') leaves the project root ('..')" in config_error(data).message
        )


def test_an_audio_input_without_scipy_gets_the_real_reason_only():
    """An entry with decode is checked as the steps alone, one without as the affine map alone: no
    unknown keys of the other form, and the nearest key within the right one."""
    steps = {"decode": "audio", "length": 4}
    problems = config_error(mutated("models.conv.preprocess", {"x": steps})).message.splitlines()[1:]
    assert problems == [
        "  - models.conv.preprocess.x: decode audio: library 'pillow' (the default) cannot read WAV: set library: scipy"
    ]
    typo = config_error(mutated("models.conv.preprocess", {"x": {**steps, "library": "scipy", "lenght": 4}}))
    assert "models.conv.preprocess.x.lenght: unknown key (did you mean 'length'?); valid keys here: decode," in (
        typo.message
    )
    affine = config_error(mutated("models.conv.preprocess", {"x": {"scale": 2.0, "ofset": 1}})).message
    assert "models.conv.preprocess.x.ofset: unknown key (did you mean 'offset'?); valid keys here: scale, offset" in (
        affine
    )


def test_dataset_needs_exactly_one_source():
    err = config_error(mutated("models.conv.datasets", {"golden": {"path": "g.npz", "generate": {"count": 4}}}))
    assert "models.conv.datasets.golden" in err.message and "exactly one" in err.message


def test_metric_needs_an_evaluation_set():
    err = config_error(mutated("models.conv.metric", {"output": "probs"}))
    assert "models.conv" in err.message and "datasets.evaluation" in err.message


def test_metric_output_must_be_checked():
    data = mutated("models.conv.metric", {"output": "probs"})
    data["models"]["conv"]["datasets"] = {"evaluation": {"path": "eval.npz"}}
    data["models"]["conv"]["outputs"] = ["other"]
    assert "models.conv.metric.output" in config_error(data).message


def test_unknown_model_and_sku_lookup():
    reg = parse_registry(base())
    with pytest.raises(ConfigError) as info:
        reg.model("cnov")
    assert "did you mean 'conv'" in info.value.message
    with pytest.raises(ConfigError) as info:
        reg.sku("cpu_int")
    assert "cpu_int8" in info.value.message


def test_a_model_is_built_for_the_skus_it_selects():
    reg = parse_registry(mutated("models.multi.skus", ["cpu_int8"]))
    assert reg.pairs() == [("conv", "cpu"), ("conv", "cpu_int8"), ("multi", "cpu_int8")]
    assert reg.pairs(models=["multi"]) == [("multi", "cpu_int8")]
    assert reg.pairs(skus=["cpu"]) == [("conv", "cpu")]
    assert parse_registry(base()).pairs(skus=["cpu"]) == [("conv", "cpu"), ("multi", "cpu")]


def test_a_models_sku_selection_names_known_skus():
    err = config_error(mutated("models.multi.skus", ["cpu_int"]))
    assert "models.multi.skus: unknown SKU 'cpu_int'" in err.message and "did you mean 'cpu_int8'" in err.message
    err = config_error(mutated("models.multi.skus", []))
    assert "models.multi.skus: empty, so the model is built nowhere" in err.message
    err = config_error(mutated("models.multi.skus", ["cpu", "cpu_int8", "cpu"]))
    assert "models.multi.skus: cpu listed more than once" in err.message


# --- override merging ---------------------------------------------------------------------------


def test_tolerance_overrides_merge_defaults_then_model_then_sku():
    data = base()
    data["defaults"] = {"tolerances": {"int8": {"atol": 0.2, "rtol": 0.3, "max_mismatch": 0.1}}}
    data["models"]["conv"]["tolerances"] = {"int8": {"atol": 0.5}}
    data["skus"]["cpu_int8"]["tolerance"] = {"rtol": 0.7}
    reg = parse_registry(data)
    # keys set in params.yaml win over the built-in default of every output kind
    for kind in OUTPUT_KINDS:
        int8 = reg.tolerance("conv", "cpu_int8").for_kind(kind)
        assert (int8.atol, int8.rtol, int8.max_mismatch) == (0.5, 0.7, 0.1)
        assert reg.tolerance("multi", "cpu_int8").for_kind(kind).atol == 0.2
    # a key no one sets keeps the built-in per-kind default
    assert reg.tolerance("conv", "cpu_int8").for_kind("probabilities").min_top1_agreement == 0.97
    assert reg.tolerance("conv", "cpu_int8").for_kind("regression").min_top1_agreement == 0.0
    # a precision the defaults leave out falls back to the built-in default
    assert reg.tolerance("conv", "cpu").for_kind("regression") == Tolerance(
        atol=1e-4, rtol=1e-3, max_mismatch=1e-5, max_outlier_factor=10.0, min_snr_db=40
    )


def test_tolerance_builtin_defaults_per_precision_and_kind():
    reg = parse_registry(base())
    fp32, int8 = reg.tolerance("conv", "cpu"), reg.tolerance("conv", "cpu_int8")
    assert fp32.precision == "fp32" and set(fp32.kinds) == set(OUTPUT_KINDS)
    assert fp32.for_kind("regression") == Tolerance(
        atol=1e-4, rtol=1e-3, max_mismatch=1e-5, max_outlier_factor=10.0, min_snr_db=40, confidence=0.95
    )
    assert (fp32.task.min_agreement, fp32.task.max_cer, int8.task.min_agreement, int8.task.max_cer) == (
        0.99,
        0.01,
        0.97,
        0.03,
    )
    assert not fp32.enforce and int8.for_kind("regression").max_outlier_factor is None
    assert fp32.for_kind("probabilities").min_top1_agreement == 0.99
    assert int8.for_kind("regression").max_mismatch == 0.05
    assert int8.for_kind("probabilities").atol == 0.05 and int8.for_kind("state").max_mismatch == 0.01


def test_task_keys_and_enforce_resolve_apart_from_the_tensor_keys():
    data = base()
    data["defaults"]["tolerances"] = {"int8": {"max_cer": 0.05, "atol": 0.2}}
    data["skus"]["cpu_int8"]["tolerance"] = {"min_box_f1": 0.8, "enforce": True, "confidence": 0.9}
    policy = parse_registry(data).tolerance("conv", "cpu_int8")
    assert policy.enforce and policy.task.max_cer == 0.05 and policy.task.min_box_f1 == 0.8
    assert policy.task.confidence == 0.9 and policy.for_kind("regression").confidence == 0.9
    assert policy.for_kind("regression").atol == 0.2 and not hasattr(policy.for_kind("regression"), "max_cer")


def test_agreement_minimum_and_output_kinds_are_overridable():
    data = base()
    data["defaults"] = {"tolerances": {"int8": {"min_top1_agreement": 0.9}}}
    data["skus"]["cpu_int8"]["tolerance"] = {"min_top1_agreement": 0.95}
    data["models"]["conv"]["output_kinds"] = {"probs": "logits"}
    data["models"]["conv"]["datasets"] = {"golden": {"generate": {"count": 401}}}  # resolves 99% (fp32)
    reg = parse_registry(data)
    assert reg.tolerance("conv", "cpu_int8").for_kind("logits").min_top1_agreement == 0.95
    assert reg.tolerance("conv", "cpu_int8").declared == {"probs": "logits"}
    assert reg.tolerance("multi", "cpu_int8").declared == {}


def test_output_kinds_are_checked():
    assert "output_kinds.probs" in config_error(mutated("models.conv.output_kinds", {"probs": "softmax"})).message
    data = mutated("models.conv.output_kinds", {"prob": "probabilities"})
    data["models"]["conv"]["outputs"] = ["probs"]
    assert "output_kinds.prob: not in outputs ['probs'] (did you mean 'probs'?)" in config_error(data).message


def test_model_tolerance_for_another_precision_does_not_apply():
    data = base()
    data["models"]["conv"]["tolerances"] = {"int8": {"atol": 0.5}}
    assert parse_registry(data).tolerance("conv", "cpu").for_kind("regression").atol == 1e-4


def test_metric_gate_overrides():
    data = base()
    data["defaults"] = {"metric": {"max_drop": 0.02, "max_drop_hard_tail": 0.04}}
    data["models"]["conv"]["datasets"] = {"evaluation": {"path": "eval.npz"}}
    data["models"]["conv"]["metric"] = {"output": "probs", "gate": {"max_drop_hard_tail": 0.05}}
    data["skus"]["cpu_int8"]["metric"] = {"max_drop": 0.03}
    reg = parse_registry(data)
    assert reg.metric_gate("conv", "cpu_int8") == MetricGate(max_drop=0.03, max_drop_hard_tail=0.05)
    assert reg.metric_gate("conv", "cpu") == MetricGate(max_drop=0.02, max_drop_hard_tail=0.05)
    assert reg.metric_gate("multi", "cpu") == MetricGate(max_drop=0.02, max_drop_hard_tail=0.04)


def test_bench_overrides():
    data = base()
    data["defaults"] = {"bench": {"warmup": 5, "iterations": 50, "min_seconds": 0.25, "concurrency": 2}}
    data["skus"]["cpu"]["bench"] = {"iterations": 7}
    data["skus"]["cpu_int8"].pop("bench")
    reg = parse_registry(data)
    assert reg.bench("cpu") == BenchSpec(warmup=5, iterations=7, min_seconds=0.25, concurrency=2)
    assert reg.bench("cpu_int8") == BenchSpec(warmup=5, iterations=50, min_seconds=0.25, concurrency=2)


def test_bench_bounds_are_checked_across_defaults_and_sku():
    data = base()
    data["defaults"] = {"bench": {"min_seconds": 30.0}}
    data["skus"]["cpu"]["bench"] = {"max_seconds": 5.0}
    err = config_error(data)
    assert "skus.cpu.bench with defaults.bench" in str(err) and "is above max_seconds" in str(err)
    data["skus"]["cpu"]["bench"] = {"sweep": {"batch": [0, 2]}}
    with pytest.raises(ConfigError, match="sweep values must be >= 1"):
        parse_registry(data)


# --- the file itself ----------------------------------------------------------------------------


def test_missing_params_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_registry(tmp_path / "params.yaml")
    assert "no such file" in info.value.message and info.value.hint
    assert info.value.exit_code == 2


def test_invalid_yaml(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("models:\n  conv: {dir: [unclosed\nskus: {}\n")
    with pytest.raises(ConfigError) as info:
        load_registry(path)
    assert "not valid YAML" in info.value.message and str(path) in info.value.message


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_top_level_must_be_a_mapping(tmp_path, text):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_registry(path)
    assert "mapping" in info.value.message


def test_error_message_names_the_file(tmp_path):
    data = mutated("skus.cpu.precision", "fp33")
    path = models.write_project(tmp_path, data["models"], data["skus"])
    with pytest.raises(ConfigError) as info:
        load_registry(path)
    assert info.value.message.startswith(f"{path}: invalid registry")
    assert "hint:" in str(info.value)


def test_a_generated_golden_set_too_small_for_the_agreement_gate_is_refused():
    data = base()
    data["models"]["conv"]["output_kinds"] = {"probs": "probabilities"}
    data["models"]["conv"]["datasets"] = {"golden": {"generate": {"count": 32}}}
    message = config_error(data).message
    assert "models.conv.datasets.golden.generate.count: 32 samples cannot resolve min_top1_agreement" in message
    assert "generate at least 117" in message  # INT8's 0.97; fp32's 0.99 would need 401
    data["models"]["conv"]["datasets"] = {"golden": {"generate": {"count": 401}}}
    parse_registry(data)
