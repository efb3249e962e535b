"""The CLI's one table printer: numbers read alike in every column, the default fits 120 columns,
and nothing but text reaches a pipe."""

from __future__ import annotations

import io
import re

import pytest

from pipeline.cli.commands import MATRIX_COLUMNS, WIDE_COLUMNS, matrix_text
from pipeline.cli.tables import Column, number, render
from pipeline.engine.matrix import PairOutcome

ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (18234.5, "18,234"),  # never 1.8e+04
        (7000, "7,000"),
        (7000.0, "7,000"),
        (1.234, "1.23"),
        (12.34, "12.3"),
        (0.02401, "0.0240"),
        (0.000123, "0.000123"),
        (6.6e-07, "6.6e-07"),  # an fp32 engine's max error: the only exponent
        (0.0, "0"),
        (-0.00222, "-0.00222"),
    ],
)
def test_numbers_have_three_significant_digits_and_grouped_thousands(value, text):
    assert number(value) == text


def test_a_delta_carries_its_sign():
    assert number(0.0822, signed=True) == "+0.0822" and number(-0.01, signed=True) == "-0.0100"


def _pair(model: str, sku: str, outcome: str = "passed", detail: str = "", **manifest) -> PairOutcome:
    figures = {
        "precision": "int8",
        "backend": "onnxruntime",
        "max_abs_error": 0.927,
        "evaluation_reference": 0.9977777,
        "evaluation_delta": -0.0022222,
        "hard_tail_delta": 0.08222,
        "build_s": 0.5461,
        "layers": 15,
        "fused_layers": 0,
        "p50_ms": 0.02,
        "p99_ms": 0.05,
        "e2e_p50_ms": 0.038,
        "throughput_per_s": 18234.5,
        "digest": "8d376ad0280d",
        "mlflow": "v12",
        **manifest,
    }
    return PairOutcome(model, sku, outcome, detail=detail, manifest=figures if outcome == "passed" else None)


ROWS = [
    _pair("digits_transformer", "x86_iree_vulkan_fp32"),
    _pair("digits_transformer", "jetson_orin_trt_int8", "not buildable here", "needs arch aarch64 " * 20),
    _pair("digits_cnn", "x86_ort_int8", throughput_per_s=7000.0),
]


def test_the_default_matrix_fits_120_columns_and_keeps_the_reason():
    text = matrix_text(ROWS, stream=io.StringIO())
    lines = text.splitlines()
    assert max(len(x) for x in lines if not x.startswith("    ")) <= 120, text
    assert lines[0].split()[:3] == ["model", "sku", "outcome"]
    assert "18,234" in text and "7,000" in text and "e+" not in text
    assert lines[3] == "    " + "needs arch aarch64 " * 20  # a log: one greppable line
    assert lines[-1] == "2 passed, 1 not buildable here"
    assert "digest" not in lines[0] and "8d376ad0280d" not in text  # a --wide column


def test_on_a_terminal_the_reason_is_wrapped_to_the_width():
    text = ANSI.sub("", matrix_text(ROWS, stream=Terminal(), width=120))
    lines = text.splitlines()
    assert max(len(x) for x in lines) <= 120, text
    reason = [x for x in lines if x.startswith("    ")]
    assert len(reason) > 1 and " ".join(" ".join(reason).split()) == " ".join(("needs arch aarch64 " * 20).split())


def test_wide_shows_every_column():
    text = matrix_text(ROWS, wide=True)
    header = text.splitlines()[0]
    for column in WIDE_COLUMNS:
        assert column.title in header
    assert "8d376ad0280d" in text and "v12" in text
    assert len(header) > 120 and {c.key for c in MATRIX_COLUMNS} <= {c.key for c in WIDE_COLUMNS}


def test_no_colour_or_rules_without_a_terminal_and_both_on_one():
    columns = [Column("model"), Column("p50_ms", "p50 ms", numeric=True)]
    rows = [{"model": "m", "p50_ms": 0.5}]
    plain = render(columns, rows, [["why"]], stream=io.StringIO())
    assert "\x1b[" not in plain and "─" not in plain
    assert plain.splitlines() == ["model  p50 ms", "m       0.500", "    why"]
    styled = render(columns, rows, [["why"]], stream=Terminal())
    assert "\x1b[" in styled and "─" in styled


def test_text_is_cut_to_fit_but_numbers_never_are():
    columns = [Column("name"), Column("value", numeric=True)]
    rows = [{"name": "x" * 200, "value": 123456789}]
    lines = render(columns, rows, width=40).splitlines()
    assert max(len(x) for x in lines) <= 40
    assert lines[1].endswith("123,456,789") and "…" in lines[1]


def test_end_to_end_steps_drift_and_energy_follow_the_matrix():
    steps = {"e2e_decode_ms": 0.056, "e2e_preprocess_ms": 0.055, "e2e_infer_ms": 0.039, "e2e_postprocess_ms": 0.021}
    drift = {
        "device": "opencv 5.1.0",
        "differing_steps": ["decode", "color", "resize"],
        "max_abs_input_diff": 0.258,
        "samples_differing": 450,
        "samples": 450,
        "metric_drop": 0.00667,
        "culprit": "color+resize",
        "gated": True,
        "passed": False,
    }
    same = {**drift, "differing_steps": [], "samples_differing": 0, "metric_drop": 0.0, "culprit": None, "passed": True}
    reason = "unavailable: rapl: no /sys/class/powercap"
    rows = [
        _pair("digits_cnn", "x86_ov_fp32", **steps, energy_j=None, energy=reason, preprocessing={"image": drift}),
        _pair("digits_cnn", "x86_ort_fp32", **steps, energy_j=0.0123, energy="rapl", preprocessing={"image": same}),
    ]
    text = matrix_text(rows, stream=io.StringIO())
    lines = text.splitlines()
    assert max(len(x) for x in lines) <= 120, text
    e2e = lines.index(next(x for x in lines if x.startswith("End to end as the device runs it")))
    assert lines[e2e + 1].split()[:6] == ["model", "sku", "decode", "preprocess", "infer", "postprocess"]
    assert "0.0560" in lines[e2e + 2] and "0.0123" in lines[e2e + 3]
    assert f"energy: {reason}" in lines  # said once, never a 0
    drift_at = lines.index(next(x for x in lines if x.startswith("Preprocessing drift")))
    row = lines[drift_at + 2]
    assert "x86_ov_fp32" in row and "decode,color,resize" in row and "color+resize" in row and row.endswith("FAIL")
    assert lines[-1] == "1 other pair(s): the device runs the training side's steps, model inputs identical"
