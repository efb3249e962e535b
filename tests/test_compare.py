"""Correctness metrics: element-wise error against the reference, task metrics."""

from __future__ import annotations

import json

import numpy as np

from pipeline.compare import output_error, top1_accuracy
from pipeline.config import Tolerance

TOL = Tolerance(atol=0.01, rtol=0.1, max_mismatch=0.0)


def test_within_tolerance_passes():
    ref = np.array([1.0, -2.0, 0.0], np.float32)
    err = output_error("y", ref + np.array([0.05, -0.1, 0.005], np.float32), ref, TOL)
    assert err.passed and err.mismatch_fraction == 0.0
    assert np.isclose(err.max_abs_error, 0.1, atol=1e-6) and err.atol == 0.01 and err.rtol == 0.1


def test_beyond_tolerance_counts_the_mismatching_fraction():
    ref = np.zeros(10, np.float32)
    engine = ref.copy()
    engine[:3] = 1.0
    err = output_error("y", engine, ref, TOL)
    assert not err.passed and err.mismatch_fraction == 0.3
    relaxed = output_error("y", engine, ref, TOL.model_copy(update={"max_mismatch": 0.3}))
    assert relaxed.passed


def test_non_finite_engine_output_fails_and_stays_json():
    ref = np.ones(4, np.float32)
    err = output_error("y", np.array([1, np.nan, np.inf, 1], np.float32), ref, TOL.model_copy(update={"max_mismatch": 1.0}))
    assert not err.passed and err.mismatch_fraction == 0.5
    json.dumps(err.to_json(), allow_nan=False)  # JSON has no NaN or infinity


def test_shape_mismatch_fails():
    err = output_error("y", np.zeros((2, 3)), np.zeros((3, 2)), TOL)
    assert not err.passed and err.mismatch_fraction == 1.0


def test_integer_outputs_compare_exactly():
    assert output_error("cls", np.array([1, 2, 3]), np.array([1, 2, 3]), Tolerance(atol=0, rtol=0)).passed
    assert not output_error("cls", np.array([1, 2, 4]), np.array([1, 2, 3]), Tolerance(atol=0, rtol=0)).passed


def test_empty_output():
    assert output_error("y", np.zeros((0, 4)), np.zeros((0, 4)), TOL).passed


def test_top1_accuracy():
    scores = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    assert top1_accuracy(scores, np.array([1, 0, 0, 0])) == 0.75
    assert top1_accuracy(scores.reshape(4, 1, 2), np.array([1, 0, 1, 0])) == 1.0
