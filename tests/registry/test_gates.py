"""The correctness gate recomputed from a manifest's figures against params.yaml: per-kind
tolerances, the agreement gate, non-finite counts, and figures that are missing or contradict
each other (fail closed). The figures come from real comparisons of numpy arrays."""

from __future__ import annotations

import models
import numpy as np
import pytest

from pipeline.project.config import parse_registry
from pipeline.results.manifest import Correctness, Evidence, Manifest, PlacementSummary, PrecisionSummary, TargetInfo
from pipeline.results.reports import HostInfo, OutputError, Signature, TensorSig, engine_digest
from pipeline.tracking.gates import correctness_gate, correctness_problems, sku_mismatches
from pipeline.verify.compare import output_error
from pipeline.verify.task import task_agreement

RNG = np.random.default_rng(0)
LOGITS = RNG.normal(scale=3.0, size=(600, 4))
REFERENCE = (np.exp(LOGITS) / np.exp(LOGITS).sum(axis=1, keepdims=True)).astype(np.float32)


def registry(sku_tolerance: dict | None = None, **model_keys):
    spec = {**models.conv_bn_spec(), "datasets": {"golden": {"generate": {"count": 401}}}, **model_keys}
    return parse_registry(
        {
            "defaults": {},
            "examples": {},
            "models": {"conv": spec},
            "skus": {"cpu_int8": models.ort_sku("int8", tolerance=sku_tolerance or {})},
        }
    )


def flipped(rows: int) -> np.ndarray:
    """The reference with the top two classes swapped in the first ``rows`` rows."""
    out = REFERENCE.copy()
    for i in range(rows):
        a, b = np.argsort(out[i])[-2:]
        out[i, [a, b]] = out[i, [b, a]]
    return out


def manifest(*outputs: OutputError) -> Manifest:
    """The parts of a manifest the correctness gate reads, as the manifest stage writes them."""
    passed = all(o.passed for o in outputs)
    c = Correctness(
        passed=passed,
        failures=[] if passed else ["output failed"],
        outputs=list(outputs),
        metrics=[],
        placement=PlacementSummary(passed=True, allowed=["CPUExecutionProvider"], offending=0, partition_boundaries=0),
        precision=PrecisionSummary(passed=True, requested="int8", policy="warn", mismatched_layers=0),
        warnings=[],
    )
    sig = Signature(
        inputs=[TensorSig(name="x", dtype="float32", shape=["batch", 3, 8, 8])],
        outputs=[TensorSig(name="probs", dtype="float32", shape=["batch", 4])],
    )
    return Manifest.model_construct(model="conv", sku="cpu_int8", correctness=c, signature=sig)


def measured(engine: np.ndarray, reg=None) -> OutputError:
    reg = reg or registry()
    return output_error("probs", engine, REFERENCE, reg.tolerance("conv", "cpu_int8"))


def test_a_good_engine_passes():
    reg = registry()
    m = manifest(measured(flipped(2), reg))  # 99% agreement, INT8 asks for 97%
    assert correctness_problems(m, reg) == []
    assert correctness_gate(m, reg, "passed").passed


def test_agreement_below_the_configured_minimum_fails_even_when_recorded_as_passed():
    loose = registry(tolerances={"int8": {"min_top1_agreement": 0.5}})
    o = measured(flipped(36), loose)  # 94% agreement on 600 rows
    assert o.passed
    bad = correctness_problems(manifest(o), registry())
    assert len(bad) == 1 and bad[0].startswith("output probs: top-1 agreement ")
    assert bad[0].endswith("is below 97.00% at 95% confidence (probabilities)")


def test_the_agreement_minimum_is_overridable_per_sku():
    strict = registry({"min_top1_agreement": 0.99})
    o = measured(flipped(18))  # 97%: passes INT8's default, not this SKU's 99%
    assert correctness_problems(manifest(o), registry()) == []
    assert any("is below 99.00% at 95% confidence" in p for p in correctness_problems(manifest(o), strict))


def test_nan_in_the_engine_output_fails():
    engine = REFERENCE.copy()
    engine[7, 2] = np.nan
    bad = correctness_problems(manifest(measured(engine)), registry())
    assert "output probs: 1 NaN where the reference is finite, first at [7, 2]" in bad
    assert "output probs: recorded as failed" in bad


def test_a_missing_agreement_figure_fails_closed():
    o = measured(REFERENCE.copy()).model_copy(update={"top1_agreement": None, "top1_agree": None, "top1_rows": None})
    assert any("no top-1 agreement" in p for p in correctness_problems(manifest(o), registry()))
    o = measured(REFERENCE.copy()).model_copy(update={"top1_agree": 3})
    assert any("top-1 counts (3 of" in p for p in correctness_problems(manifest(o), registry()))


@pytest.mark.parametrize(
    "update, words",
    [
        ({"nan_count": 3}, "non-finite counts (3 NaN, 0 Inf) contradict"),
        ({"min_passing_atol": 0.2}, "contradicts the smallest passing atol 0.2"),
        ({"min_passing_atol": None}, "contradicts the smallest passing atol None"),
        ({"max_abs_error": None}, "no error figures for its finite elements"),
        ({"top1_agreement": 1.5}, "error figures out of range"),
        ({"cosine_similarity": float("nan")}, "non-finite error figures"),
        ({"shape_mismatch": "engine [1] vs reference [2]"}, "a shape mismatch recorded with elements within tolerance"),
        ({"atol": 0.5}, "measured with atol=0.5 rtol=0.1, looser than the SKU's atol=0.05 rtol=0.1 for probabilities"),
    ],
)
def test_contradictory_or_loosened_figures_fail_closed(update, words):
    o = measured(flipped(1)).model_copy(update=update)
    bad = correctness_problems(manifest(o), registry())
    assert any(words in p for p in bad), bad


def test_a_stricter_params_yaml_after_validation_fails():
    o = measured(flipped(1) * np.float32(0.9))  # every probability 10% low: within INT8's rtol
    assert o.passed and correctness_problems(manifest(o), registry()) == []
    stricter = registry(tolerances={"int8": {"atol": 0.01, "rtol": 0.01}})
    assert any("looser than the SKU's atol=0.01 rtol=0.01" in p for p in correctness_problems(manifest(o), stricter))


def test_the_kind_must_be_the_declared_one():
    inferred = measured(flipped(1))
    assert inferred.kind == "probabilities" and inferred.kind_inferred
    bad = correctness_problems(manifest(inferred), registry(output_kinds={"probs": "logits"}))
    assert "output probs: judged as probabilities (inferred), params.yaml declares logits" in bad
    declared = measured(flipped(1), registry(output_kinds={"probs": "regression"}))
    assert declared.kind == "regression" and declared.top1_agreement is None
    assert "output probs: judged as regression (declared), params.yaml declares no kind for it" in correctness_problems(
        manifest(declared), registry()
    )
    assert correctness_problems(manifest(declared), registry(output_kinds={"probs": "regression"})) == []


def test_a_missing_output_fails_closed():
    m = manifest()
    assert correctness_problems(m, registry()) == ["output probs: no error figures in the manifest"]


# --- the manifest gate's SKU check: recorded toolchain versions against the SKU's pins --------------


def ov_manifest(toolchain: dict[str, str]) -> tuple[Manifest, object]:
    """An OpenVINO engine's manifest, as far as the manifest gate's SKU check reads it, and its registry."""
    reg = parse_registry(
        {
            "defaults": {},
            "examples": {},
            "models": {"conv": models.conv_bn_spec()},
            "skus": {
                "ov": {
                    **models.cpu_sku("openvino", "fp32", {"device": "CPU"}),
                    "toolchain": {"openvino": ">=2026.0,<2027"},
                }
            },
        }
    )
    target = reg.sku("ov").target
    m = Manifest.model_construct(
        model="conv",
        sku="ov",
        backend="openvino",
        precision="fp32",
        toolchain=toolchain,
        engine=[],
        target=TargetInfo(arch=target.arch, device="cpu", os="linux", cpu_features=[], runner_labels=["self-hosted"]),
        host=HostInfo(arch=target.arch, os="linux", cpu_model=None, cpu_cores=None, cpu_features=[], python="3.12"),
        evidence=Evidence(engine_sha256=engine_digest([]), files={}),
    )
    return m, reg


def test_an_openvino_build_version_satisfies_the_skus_pin():
    """OpenVINO records get_version()'s '2026.4.1-22982-<commit>-releases/2026/4': read as 2026.4.1
    (pipeline.core.versions), it meets '>=2026.0,<2027' (a strict PEP 440 parse refused every OpenVINO engine)."""
    m, reg = ov_manifest({"openvino": "2026.4.1-22982-e213a147257-releases/2026/4", "onnx": "1.20.0"})
    assert sku_mismatches(m, reg) == []
    older, _ = ov_manifest({"openvino": "2025.3.0-19807-44526285f24-releases/2025/3"})
    assert sku_mismatches(older, reg) == [
        (
            "toolchain openvino: 2025.3.0-19807-44526285f24-releases/2025/3 "
            "(read as 2025.3.0+19807.44526285f24) does not satisfy >=2026.0,<2027"
        )
    ]


@pytest.mark.parametrize(
    "recorded, words",
    [
        ({"openvino": "custom build"}, "'custom build' is not a version skuforge can read"),
        ({}, "no version recorded (needs >=2026.0,<2027)"),
    ],
)
def test_an_unreadable_or_missing_toolchain_version_fails_closed(recorded, words):
    m, reg = ov_manifest(recorded)
    (problem,) = sku_mismatches(m, reg)
    assert problem.startswith("toolchain openvino: ") and words in problem, problem


def test_the_gate_judges_at_todays_confidence_not_the_manifests():
    """A manifest claiming a higher confidence would need more evidence to fail: the gate uses params.yaml's."""
    loose = registry(tolerances={"int8": {"min_top1_agreement": 0.5}})
    o = measured(flipped(28), loose)  # 95.1% of 550 decisive rows: below 97% at 95%, not at 99.99%
    claimed = o.model_copy(update={"confidence": 0.9999})
    assert any("is below 97.00% at 95% confidence" in p for p in correctness_problems(manifest(claimed), registry()))


# --- the task agreement decides beside a postprocess, recomputed from its evidence ---------------------


def _task_manifest(reg, engine: np.ndarray, tamper: dict | None = None) -> Manifest:
    """A manifest of a model with ``postprocess: argmax`` as validate writes it: the task agreement
    over 600 samples, the tensor figures as diagnostics."""
    spec = reg.model("conv")
    policy = reg.tolerance("conv", "cpu_int8")
    (task,) = task_agreement(spec, policy.task, {"golden": {"probs": engine}}, {"golden": {"probs": REFERENCE}})
    task = task.model_copy(update=tamper or {})
    o = measured(engine, reg).model_copy(update={"gating": not task.judgeable})
    m = manifest(o)
    passed = task.passed and (o.passed or not o.gating)
    c = m.correctness.model_copy(update={"task": [task], "passed": passed, "failures": [] if passed else ["failed"]})
    return Manifest.model_construct(model="conv", sku="cpu_int8", correctness=c, signature=m.signature)


def test_with_a_postprocess_the_task_agreement_decides_and_is_recomputed():
    strict = {"atol": 0.0, "rtol": 0.0, "max_mismatch": 0.0}
    reg = registry(postprocess="argmax", tolerances={"int8": strict})
    m = _task_manifest(reg, flipped(3))  # every element beyond atol 0: the tensor figures fail, 597/600 labels agree
    assert not m.correctness.outputs[0].passed and m.correctness.passed
    assert correctness_problems(m, reg) == []
    # the same evidence under enforce: the tensor gates decide again
    enforced = registry(postprocess="argmax", tolerances={"int8": strict | {"enforce": True}})
    assert any("gating=False" in p for p in correctness_problems(m, enforced))


@pytest.mark.parametrize(
    "tamper, words",
    [
        ({"agree": 700}, "do not add up"),
        ({"value": 1.0}, "contradicts its evidence"),
        ({"passed": False}, "recorded as failed"),
    ],
)
def test_task_evidence_that_contradicts_itself_fails_closed(tamper, words):
    reg = registry(postprocess="argmax")
    problems = correctness_problems(_task_manifest(reg, flipped(3), tamper), reg)
    assert any(words in p for p in problems), problems


def test_a_task_agreement_below_todays_threshold_fails():
    loose = registry(postprocess="argmax", tolerances={"int8": {"min_agreement": 0.9}})
    m = _task_manifest(loose, flipped(30))  # 570/600 = 95%: passes 0.9, not INT8's default 0.97
    assert correctness_problems(m, loose) == []
    problems = correctness_problems(m, registry(postprocess="argmax"))
    assert any("top-1 labels agree on 570/600 samples" in p and "below 97.00%" in p for p in problems), problems
