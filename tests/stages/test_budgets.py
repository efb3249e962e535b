"""Time budgets of validate and bench (skus.<sku>.max_seconds), the bench's end-to-end sanity
check, and what the matrix shows of both and of a precision gate that warns."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import models
import pytest
from cli_helpers import skuforge

from pipeline.core.budget import Budget, on_hard_stop
from pipeline.core.errors import GateFailed, TimedOut
from pipeline.core.paths import Layout
from pipeline.engine.matrix import matrix
from pipeline.project.config import load_registry
from pipeline.results.benchstats import e2e_below_engine
from pipeline.results.manifest import LatencySummary, digest
from pipeline.results.outcomes import outcome_path
from pipeline.stages.bench import bench
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.manifest import write_manifest
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate

LOG = logging.getLogger("test")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# --- the budget ----------------------------------------------------------------------------------


def test_a_budget_stops_between_calls_and_names_the_sample_and_pace():
    clock = Clock()
    budget = Budget(600, "validate", "skus.gpu.max_seconds", LOG, clock=clock)

    def slow_sample(_):
        clock.now += 279

    infer = budget.calls(slow_sample, "validate golden", 32)
    infer(None)
    infer(None)
    infer(None)  # starts at 558 s, inside the budget; ends at 837 s
    with pytest.raises(TimedOut) as err:
        infer(None)
    assert isinstance(err.value, GateFailed) and err.value.exit_code == 1
    assert err.value.message == "timed out after 600 s at validate golden sample 4/32 (279 s per call over 3)"
    assert "raise skus.gpu.max_seconds (now 600 s)" in err.value.hint
    assert err.value.stage == "validate" and err.value.seconds == 600


def test_no_budget_never_runs_out():
    clock = Clock()
    budget = Budget(None, "bench", "skus.x.max_seconds", LOG, clock=clock)
    clock.now = 1e9
    budget.check("anything")
    assert budget.cap(60.0, 0.5) == 60.0


def test_the_watchdog_hands_a_call_that_outlasts_the_budget_to_the_hard_stop():
    stopped: list[TimedOut] = []
    released = threading.Event()  # the CLI's hard stop exits the process; this one lets the call return

    def hard_stop(exc: TimedOut) -> None:
        stopped.append(exc)
        released.set()

    previous = on_hard_stop(hard_stop)
    try:
        budget = Budget(0.05, "validate", "skus.x.max_seconds", LOG)
        with budget.watch():
            assert budget.calls(lambda _: released.wait(60.0), "validate golden", 32)(None)  # not its own timeout
    finally:
        on_hard_stop(previous)
    assert stopped[0].message.startswith(
        "timed out after 0.05 s at validate golden sample 1/32; its first call has run"
    )


def test_without_a_hard_stop_the_stage_fails_when_the_call_returns(caplog):
    budget = Budget(0.05, "validate", "skus.x.max_seconds", LOG)
    infer = budget.calls(lambda _: time.sleep(0.3), "validate golden", 2)
    with caplog.at_level(logging.ERROR), budget.watch(), pytest.raises(TimedOut, match="sample 2/2"):
        infer(None)
        infer(None)
    assert "is still running; the stage fails when it returns" in caplog.text


# --- the stages ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    root = tmp_path_factory.mktemp("budgets")
    models.multi_io_model(root / "models/multi/model.onnx")
    skus = {
        # ONNX Runtime's QDQ quantizer leaves ReduceSum in FP32: the precision gate warns
        "int8": models.ort_sku("int8"),
        "tiny": models.ort_sku("fp32", max_seconds=0.001),
        "short": models.ort_sku("fp32", max_seconds=2.0, bench={"iterations": 10**8, "max_seconds": 60}),
    }
    reg = load_registry(models.write_project(root, {"multi": models.multi_io_spec()}, skus))
    for stage in (prepare, make_data, reference, calibrate):
        stage(reg, "multi")
    for sku in skus:
        build(reg.pair("multi", sku))
    return reg


def test_a_validate_past_its_budget_fails_as_timed_out_in_the_matrix(proj):
    env = {**os.environ, "DVC_STAGE": "validate@multi-tiny"}  # as dvc runs it: the failure is recorded
    done = skuforge("validate", "--model", "multi", "--sku", "tiny", cwd=proj.root, env=env)
    assert done.returncode == 1, done.stderr
    assert "skuforge: error: timed out after 0.001 s at validate" in done.stderr, done.stderr
    assert "skus.tiny.max_seconds" in done.stderr
    record = json.loads(outcome_path(proj.root, "validate", "multi", "tiny").read_text())
    assert record["exit_code"] == 1 and record["timed_out"] == {"stage": "validate", "seconds": 0.001}
    row = matrix(proj, skus=["tiny"])[0]
    assert (row.outcome, row.exit_code) == ("gate failed", 1)
    assert row.detail.startswith("validate: timed out after 0.001 s at validate")


def test_bench_cuts_its_phases_to_the_budget_and_says_how_many_calls(proj):
    validate(proj.pair("multi", "short"))
    rep = bench(proj.pair("multi", "short"))
    assert rep.stopped == "budget" and 0 < rep.engine_only.iterations < 10**8
    assert any(
        f"cut the engine-only phase to n={rep.engine_only.iterations} of 100000000" in w for w in rep.warnings
    ), rep.warnings
    assert any(f"cut the end-to-end phase to n={rep.end_to_end.iterations}" in w for w in rep.warnings)


def test_a_warning_precision_gate_and_an_impossible_e2e_show_in_the_matrix(proj):
    assert validate(proj.pair("multi", "int8")).passed
    bench(proj.pair("multi", "int8"))
    write_manifest(proj.pair("multi", "int8"))
    row = matrix(proj, skus=["int8"])[0]
    assert row.outcome == "passed"
    assert row.label.startswith("passed (warn: 1 fp32 layer")
    assert "skus.int8.precision_gate.policy: warn" in row.detail
    # a manifest whose end to end is faster than its engine alone (as reported on real models)
    path = Layout(proj.root).manifest("multi", "int8")
    doc = json.loads(path.read_text())
    engine = doc["benchmark"]["engine_only"]
    doc["benchmark"]["end_to_end"].update(
        p50_ms=engine["p50_ms"] / 2, p50_ci_ms=[engine["p50_ms"] / 3, engine["p50_ms"] / 2.5]
    )
    doc["digest"] = digest(doc)
    path.write_text(json.dumps(doc))
    row = matrix(proj, skus=["int8"])[0]
    assert row.outcome == "passed" and row.label.endswith("; e2e p50 below engine p50)"), row.label
    assert "a measurement error; rerun `skuforge bench --model multi --sku int8`" in row.detail


def test_e2e_below_engine_needs_apart_intervals():
    def s(p50: float, ci: tuple[float, float] | None) -> LatencySummary:
        return LatencySummary(p50_ms=p50, p50_ci_ms=ci, p99_ms=p50 * 2, p99_ci_ms=None)

    assert e2e_below_engine(s(180, (170, 190)), s(110, (100, 120)))
    assert not e2e_below_engine(s(180, (170, 190)), s(175, (160, 185)))  # overlapping: noise
    assert not e2e_below_engine(s(180, (170, 190)), s(200, (190, 210)))
    assert e2e_below_engine(s(180, None), s(110, None)) and not e2e_below_engine(s(180, None), s(176, None))
