"""The AVX-512 VNNI device class (issue 38): its INT8 SKUs in params.yaml, what a host with and without
the instructions says about them, and the runner class that serves them."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.backends import backend_class
from pipeline.engine.hostcheck import hardware_problems, host_problems
from pipeline.engine.matrix import sku_statuses
from pipeline.host import probe
from pipeline.ops.hostreport import classes_problems, load_classes
from pipeline.project.config import load_registry

ROOT = Path(__file__).resolve().parents[1]
CLASS = "x86-avx512-vnni"
VNNI_SKUS = ["x86_vnni_ort_int8", "x86_vnni_ov_int8", "x86_vnni_litert_int8"]
CROSS_BUILT = {"x86_vnni_litert_int8"}  # a .tflite is built on any host; ORT and OpenVINO build on the target
# /proc/cpuinfo names: the AVX2-only AMD EPYC this was written on, and a Cascade Lake / Zen 4 class CPU
AVX2_HOST = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2"
VNNI_HOST = AVX2_HOST + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"

pytestmark = pytest.mark.skipif(probe.host_arch() != "x86_64", reason="the SKUs target x86-64")


@pytest.fixture(scope="module")
def registry():
    return load_registry(ROOT / "params.yaml")


def test_the_class_has_an_int8_candidate_per_stack(registry):
    assert registry.device_classes()[CLASS] == VNNI_SKUS
    assert {registry.sku(s).backend for s in VNNI_SKUS} == {"onnxruntime", "openvino", "litert"}
    for name in VNNI_SKUS:
        spec = registry.sku(name)
        assert spec.precision == "int8" and spec.target.arch == "x86_64", name
        assert {"avx512f", "avx512_vnni"} <= set(spec.target.cpu_features), name
        assert "cpu-avx512-vnni" in spec.runner_labels and "cpu-avx2" not in spec.runner_labels, name
    # a release requires every SKU it lists, and no host but the VNNI runner builds or runs these
    assert not set(VNNI_SKUS) & set(registry.release_skus())


@pytest.mark.parametrize("vnni, avx2", [("x86_vnni_ort_int8", "x86_ort_int8"), ("x86_vnni_ov_int8", "x86_ov_int8")])
def test_vnni_skus_quantize_weights_to_8_bits_and_their_avx2_siblings_to_7(registry, vnni, avx2):
    def resolved(name):
        spec = registry.sku(name)
        return backend_class(spec.backend).options(spec).for_target(spec.target)

    assert resolved(vnni).reduce_range is False  # VPDPBUSD sums u8 x s8 into int32: no saturation
    assert resolved(avx2).reduce_range is True  # VPMADDUBSW saturates its int16 pair sums
    assert (resolved(vnni).activation_type, resolved(vnni).weight_type) == ("uint8", "int8")


def test_a_host_without_avx512_vnni_cannot_build_or_run_them(registry, monkeypatch):
    monkeypatch.setenv(probe.ENV_FAKE_CPU_FLAGS, AVX2_HOST)
    for name in VNNI_SKUS:
        run = host_problems(registry, name, "run")
        assert run == ["needs CPU features ['avx512f', 'avx512_vnni'] this host lacks"], name
        build = host_problems(registry, name, "build")
        if name in CROSS_BUILT:  # built here, validated and benchmarked on its runner: "built only"
            assert not any("CPU features" in p for p in build), build
        else:
            assert build == run, name
    statuses = {s.sku: s for s in sku_statuses(registry, cached=False) if s.sku in VNNI_SKUS}
    assert not any(s.runnable for s in statuses.values())
    assert not statuses["x86_vnni_ort_int8"].buildable and not statuses["x86_vnni_ov_int8"].buildable
    assert all("avx512_vnni" in " ".join(s.problems) for s in statuses.values())


def test_an_avx512_host_without_vnni_cannot_run_them(registry, monkeypatch):
    monkeypatch.setenv(probe.ENV_FAKE_CPU_FLAGS, VNNI_HOST.replace(" avx512_vnni", ""))
    for name in VNNI_SKUS:
        assert hardware_problems(registry.sku(name)) == ["needs CPU features ['avx512_vnni'] this host lacks"]


def test_a_vnni_host_matches_them_and_their_avx2_siblings(registry, monkeypatch):
    monkeypatch.setenv(probe.ENV_FAKE_CPU_FLAGS, VNNI_HOST)
    for name in [*VNNI_SKUS, "x86_ort_int8", "x86_ov_int8", "x86_litert_int8"]:
        assert hardware_problems(registry.sku(name)) == [], name


def test_the_vnni_runner_class_serves_exactly_the_class(registry):
    classes = load_classes(ROOT / "runners" / "classes.yaml")
    assert classes_problems(registry, classes) == []

    def served(runner_class):
        labels = set(classes[runner_class]["labels"])
        return [s for s, spec in registry.skus.items() if set(spec.runner_labels) <= labels]

    # its own label only: an AVX2 SKU built there would be timed on another CPU than its devices, and
    # ONNX Runtime's level-all engines would hold AVX-512's NCHWc blocks
    assert served("x86-cpu-avx512-vnni") == VNNI_SKUS
    assert not set(VNNI_SKUS) & set(served("x86-cpu-avx2"))
