"""The gates as statistical claims (issue 20): each case of the issue held to the one policy of
docs/correctness.md, through the same functions validate and promotion use."""

from __future__ import annotations

import numpy as np
import pytest
from test_compare import _flipped, policy, softmax

from pipeline.results import gatestats
from pipeline.results.reports import Signature, TensorSig
from pipeline.verify.compare import (
    input_problems,
    metric_input_problems,
    metric_result,
    metric_warnings,
    output_error,
    output_problems,
    output_warnings,
    state_outputs,
    top1_correct,
)

RNG = np.random.default_rng(20)


# --- the exact tests ------------------------------------------------------------------------------


def test_one_flip_in_32_is_not_evidence_of_a_bad_engine():
    """The README's example failed on 31 of 32 golden samples at 97%: now the interval is judged."""
    assert not gatestats.agreement_fails(31, 32, 0.97, 0.95)
    low, high = gatestats.bounds(31, 32, 0.95)
    assert low < 0.97 < high
    assert gatestats.agreement_fails(0, 32, 0.97, 0.95)


@pytest.mark.parametrize("minimum, rows", [(0.97, 117), (0.99, 401), (0.95, 71)])
def test_the_smallest_set_that_resolves_an_agreement_threshold(minimum, rows):
    assert gatestats.min_rows_for_agreement(minimum, 0.95) == rows
    # from there on an engine at twice the allowed disagreement fails; just below, one such does not
    for n in (rows, rows + 1, 2 * rows):
        assert gatestats.agreement_fails(int(np.floor(n * (2 * minimum - 1) + 1e-9)), n, minimum, 0.95)
    n = rows - 1
    assert not gatestats.agreement_fails(int(np.floor(n * (2 * minimum - 1) + 1e-9)), n, minimum, 0.95)


def test_the_exact_tests_give_scipy_stats_figures_up_to_millions_of_elements():
    """gatestats calls scipy.special's incomplete beta function (a third of scipy.stats' import);
    its figures are scipy.stats' binomial and beta distributions' to 1e-9, on sets as large as a text
    detector's 6.5 million elements (where scipy.special.bdtr, cephes, is 3e-4 off at p = 0.5)."""
    from scipy.stats import beta, binom

    for n in (1, 2, 64, 450, 65_536, 6_500_000):
        for k in sorted({0, 1, n // 100, n // 2, n - 1, n}):
            for p in (1e-4, 0.01, 0.5, 0.99):
                at_least = 1.0 if k <= 0 else float(binom.sf(k - 1, n, p))
                assert gatestats.p_at_most(k, n, p) == pytest.approx(float(binom.cdf(k, n, p)), rel=1e-9, abs=1e-300)
                assert gatestats.p_at_least(k, n, p) == pytest.approx(at_least, rel=1e-9, abs=1e-300)
            low, high = gatestats.bounds(k, n, 0.95)
            assert low == pytest.approx(0.0 if k == 0 else float(beta.ppf(0.05, k, n - k + 1)), abs=1e-12)
            assert high == pytest.approx(1.0 if k == n else float(beta.ppf(0.95, k + 1, n - k)), abs=1e-12)
        for p in (1e-4, 0.01):
            k = gatestats.max_mismatches(n, p, 0.95)
            assert k == 0 or float(binom.sf(k - 1, n, p)) >= 0.05  # k beyond is not significant
            assert float(binom.sf(k, n, p)) < 0.05  # one more is


def test_mismatch_is_judged_from_its_count():
    assert not gatestats.mismatch_fails(1, 64, 0.001, 0.95)  # one element of 64 at 0.1% allowed
    assert gatestats.mismatch_fails(2, 64, 0.001, 0.95)
    assert gatestats.mismatch_fails(1, 10**6, 0.0, 0.95)  # none allowed: any fails
    assert gatestats.max_mismatches(64, 0.001, 0.95) == 1 and gatestats.max_mismatches(64, 0.0, 0.95) == 0


@pytest.mark.parametrize(
    "worse, better, n, fails",
    [
        (1, 0, 32, False),  # a 3.1% drop on one sample: McNemar p = 0.5, not significant
        (5, 0, 450, True),  # 1.11% > 1% and p = 0.031
        (10, 8, 450, False),  # 0.44%: within the allowed drop
        (6, 2, 450, False),  # 0.89%: within it (and p = 0.14)
        (20, 5, 450, True),  # 3.3%, p = 0.002
    ],
)
def test_mcnemar_decides_a_drop_only_when_significant_and_beyond_the_allowance(worse, better, n, fails):
    assert gatestats.drop_fails(worse, better, n, 0.01, 0.95) == fails


def test_a_set_too_small_for_its_drop_is_named_with_the_size_that_can():
    labels = RNG.integers(0, 10, size=100)
    scores = np.eye(10)[labels]
    m = metric_result("evaluation", top1_correct(scores, labels), top1_correct(scores, labels), 0.01, 0.95)
    assert m.passed and m.samples == 100 and m.worse == m.better == 0 and m.p_value == 1.0
    assert metric_input_problems(m) == [
        "metric on evaluation: 100 samples cannot resolve a drop of 0.01 at 95% "
        "confidence (a drop of twice that would not be significant); it needs 201 "
        "labelled samples"
    ]
    # a labelled golden set that small is reported, not refused: the held-out splits judge the metric
    golden = m.model_copy(update={"split": "golden"})
    assert metric_input_problems(golden) == [] and "the held-out splits judge the metric" in metric_warnings(golden)[0]


def test_a_paired_drop_is_counted_per_sample():
    labels = RNG.integers(0, 10, size=500)
    ref = np.eye(10)[labels]
    engine = ref.copy()
    engine[:30] = np.eye(10)[(labels[:30] + 1) % 10]  # 30 samples the engine now gets wrong
    m = metric_result("evaluation", top1_correct(engine, labels), top1_correct(ref, labels), 0.01, 0.95)
    assert (m.worse, m.better, m.samples) == (30, 0, 500) and not m.passed
    assert m.p_value == pytest.approx(0.5**30) and m.drop_interval[0] > 0.01


# --- error against the signal ----------------------------------------------------------------------


def test_an_int8_engine_that_outputs_zeros_fails_whatever_its_absolute_error():
    """A detector's probability map: nearly zero on noise inputs, the INT8 engine outputs zeros."""
    ref = np.zeros((4, 1, 64, 64), np.float32)
    ref[0, 0, 10:12, 10:14] = [[0.042, 0.01, 0.02, 0.03], [0.01, 0.005, 0.0, 0.04]]
    err = output_error("map", np.zeros_like(ref), ref, policy("int8"))
    assert not err.passed and err.mismatch_count == 0  # atol 0.1 covers every element
    problems = input_problems(err)
    assert len(problems) == 1 and "the golden set does not exercise it" in problems[0]
    # with real inputs the reference varies, and the zeros are a degenerate engine
    real = RNG.uniform(0, 1, size=ref.shape).astype(np.float32)
    zeros = output_error("map", np.zeros_like(real), real, policy("int8"))
    assert zeros.degenerate and any("degenerate" in p for p in output_problems(zeros)) and not zeros.passed


def test_an_output_far_off_the_reference_fails_on_its_signal_to_noise():
    """A voice-activity INT8 output 19x the reference's own maximum (cosine 0.52) passed atol 0.1."""
    ref = RNG.uniform(0.0, 0.004, size=(64, 1)).astype(np.float32)
    engine = (ref + RNG.uniform(0.0, 0.076, size=ref.shape)).astype(np.float32)
    err = output_error("speech_prob", engine, ref, policy("int8"))
    assert err.mismatch_count == 0 and not err.passed
    # on generated noise the reference barely moves: the golden set cannot judge the output
    assert not err.exercised and "does not exercise it" in input_problems(err)[0]
    # on real audio it spans 0..1, and an engine that half-follows it fails on its signal-to-noise
    speech = RNG.uniform(0.0, 1.0, size=(64, 1)).astype(np.float32)
    off = (0.3 * speech + RNG.uniform(0.0, 0.7, size=speech.shape)).astype(np.float32)
    err = output_error("speech_prob", off, speech, policy("int8"))
    assert err.exercised and err.snr_db < 10 and not err.passed
    assert any("signal-to-noise" in p for p in output_problems(err))


def test_an_fp16_classifier_with_one_element_off_passes():
    """100% agreement, cosine 0.9998, max abs error 0.027 on one of 64 elements: the FP16 engine passes."""
    logits = RNG.normal(scale=3.0, size=(8, 8))
    ref = softmax(logits)
    engine = ref + RNG.normal(scale=1e-3, size=ref.shape).astype(np.float32)
    engine[0, np.argmax(ref[0])] -= 0.027
    err = output_error("probs", engine, ref, policy("fp16"))
    assert err.elements == 64 and err.mismatch_count == 1 and err.cosine_similarity > 0.999
    assert not output_problems(err) and err.snr_db > 20
    # the 8 rows cannot resolve 99% agreement: the kind was inferred, so a warning, not a verdict
    assert err.passed and output_warnings(err) and "it needs 401" in output_warnings(err)[0]


def test_a_planted_fp16_overflow_fails():
    ref = softmax(RNG.normal(size=(500, 10)))
    engine = ref.copy()
    engine[7] = np.inf
    err = output_error("probs", engine, ref, policy("fp16"))
    assert not err.passed and err.inf_count == 10


def test_a_planted_int8_defect_fails():
    logits = RNG.normal(scale=4.0, size=(600, 10))
    ref = softmax(logits)
    defect = softmax(logits[:, ::-1].copy())  # a miscompiled layer: classes reversed
    err = output_error("probs", defect, ref, policy("int8"))
    assert not err.passed and len(output_problems(err)) >= 2


# --- ties --------------------------------------------------------------------------------------------


def test_a_nearly_uniform_softmax_is_ties_not_disagreement():
    """A user's model whose reference softmax is nearly uniform: INT8 flips the top class on rounding
    noise. Those rows are ties: left out of agreement, not blamed on any node."""
    ref = softmax(RNG.normal(scale=1e-3, size=(300, 20)))
    engine = (ref + RNG.normal(scale=1e-3, size=ref.shape)).astype(np.float32)
    err = output_error("probs", engine, ref, policy("int8"))
    assert err.top1_ties == 300 and err.top1_rows == 0
    assert not output_problems(err)  # no verdict on ties: no failure to bisect
    # and a golden set that barely moves the output cannot judge it at all: supply real inputs
    assert not err.exercised and "does not exercise it" in input_problems(err)[0]


def test_agreement_joins_the_larger_split_when_golden_cannot_resolve_it():
    gold = softmax(RNG.normal(scale=4.0, size=(64, 10)))
    evaluation = softmax(RNG.normal(scale=4.0, size=(450, 10)))
    engine_eval = evaluation.copy()
    err = output_error(
        "probs", gold, gold, policy("int8", probs="probabilities"), more=[("evaluation", engine_eval, evaluation)]
    )
    assert err.top1_splits == ["golden", "evaluation"] and err.top1_rows + err.top1_ties == 64 + 450
    assert err.passed and not input_problems(err)
    alone = output_error("probs", gold, gold, policy("int8", probs="probabilities"))
    assert not alone.passed and "it needs 117" in input_problems(alone)[0]


# --- kinds ----------------------------------------------------------------------------------------


def test_an_output_fed_back_as_an_input_is_state():
    sig = Signature(
        inputs=[
            TensorSig(name="input", dtype="float32", shape=["batch", 512]),
            TensorSig(name="state", dtype="float32", shape=[2, "batch", 128]),
            TensorSig(name="h0", dtype="float32", shape=[1, 1, 64]),
        ],
        outputs=[
            TensorSig(name="output", dtype="float32", shape=["batch", 1]),
            TensorSig(name="stateN", dtype="float32", shape=[2, "batch", 128]),
            TensorSig(name="hn", dtype="float32", shape=[1, 1, 64]),
        ],
    )
    assert state_outputs(sig) == {"stateN", "hn"}
    ref = RNG.normal(size=(2, 4, 128)).astype(np.float32)
    err = output_error("stateN", ref, ref, policy("int8"), inferred="state")
    assert err.kind == "state" and err.kind_inferred and err.max_mismatch == 0.01


def test_the_flipped_helper_keeps_the_rows():
    assert _flipped(np.array([[0.1, 0.9]]), 1).tolist() == [[0.9, 0.1]]
