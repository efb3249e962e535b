"""TVM tuning reports its progress inside the build step (trials of the budget, tasks done, elapsed,
time left), and a build that is about to tune says so first with what it will cost and how to skip
it (pipeline/backends/tvm/tuning.py: TuningProgress, tuning_budget_warning)."""

from __future__ import annotations

import json
import re
import threading
import time
from types import SimpleNamespace

import models
import numpy as np
import pytest
from tvm_helpers import tvm_or_skip

tvm = tvm_or_skip()
from tvm.support.popen_pool import PopenPoolExecutor  # noqa: E402

from pipeline.backends.caches import INDEX, seconds_per_trial  # noqa: E402
from pipeline.backends.tvm import (  # noqa: E402
    TuningProgress,
    TvmOptions,
    extract_tasks,
    import_onnx,
    lower,
    target_of,
    tune_run,
    tuning_budget,
    tuning_budget_warning,
)
from pipeline.backends.tvm.common import SECONDS_PER_TRIAL  # noqa: E402
from pipeline.model.graph import pin_axes  # noqa: E402

LABEL = re.compile(r"tvm tune trials (\d+)/(\d+), tasks (\d+)/(\d+) done, \d+m\d\ds")


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []
        self.threads: set[str] = set()

    def __call__(self, label: str, fraction: float) -> None:
        self.calls.append((label, fraction))
        self.threads.add(threading.current_thread().name)


def test_the_label_counts_trials_and_tasks_and_says_what_is_left():
    now = [100.0]
    seen = Recorder()
    report = TuningProgress(seen, tasks=3, budget=6, per_task=2, tick=0, clock=lambda: now[0])
    with report:
        now[0] += 30
        report.measured(0, 2, terminated=0)  # task 0 reached its cap of 2
        assert report.label() == "tvm tune trials 2/6, tasks 1/3 done, 0m30s, about 1m00s left"
        now[0] += 60
        report.measured(1, 1, terminated=2)  # MetaSchedule ended a task early (its space exhausted)
        assert report.label() == "tvm tune trials 3/6, tasks 2/3 done, 1m30s, about 1m30s left"
        report.finished()  # MetaSchedule returned: the budget was not spent, every task is done
        assert report.label() == "tvm tune trials 3/6, tasks 3/3 done, 1m30s"
    assert [f for _, f in seen.calls] == sorted(f for _, f in seen.calls)  # the build's fraction only moves on
    assert seen.calls[0][1] == pytest.approx(0.2) and seen.calls[-1][1] == pytest.approx(0.2 + 0.5 * 3 / 6)


def test_the_clock_moves_between_batches():
    """A batch is minutes of candidates built in new processes: the line is redrawn meanwhile."""
    seen = Recorder()
    with TuningProgress(seen, tasks=2, budget=4, per_task=2, tick=0.05):
        time.sleep(0.5)
    assert len(seen.calls) >= 4 and "tvm-tune-progress" in seen.threads


def test_the_budget_is_what_the_task_caps_allow():
    assert tuning_budget(64, None, 12) == 64
    assert tuning_budget(64, 2, 12) == 24
    assert tuning_budget(5, None, 12) == 5  # the global budget stops MetaSchedule first


def test_the_warning_names_model_sku_tasks_trials_time_and_the_way_out():
    ctx = SimpleNamespace(model="mine", sku="x86_tvm_fp32", tuning_trials=None, cache_refresh=False)
    text = tuning_budget_warning(ctx, TvmOptions(trials=64), missing=12, tasks=12, trials=64)
    assert "tuning 12 of 12 tasks the tuning database caches/x86_tvm_fp32/mine lacks: 64 trials" in text
    minutes = 64 * SECONDS_PER_TRIAL / 60  # no tuning of the SKU recorded: the constant
    assert "skus.x86_tvm_fp32.options.trials" in text
    assert f"expect about {minutes:.0f} min (~{SECONDS_PER_TRIAL:g} s a trial" in text
    assert "SKUFORGE_TUNE" in text and "skuforge cache refresh --sku x86_tvm_fp32 --model mine" in text
    # a cache refresh asked for the tuning: no way out to suggest but a smaller budget
    refresh = SimpleNamespace(model="mine", sku="x86_tvm_fp32", tuning_trials=8, cache_refresh=True)
    text = tuning_budget_warning(refresh, TvmOptions(trials=64), missing=12, tasks=12, trials=8)
    assert ": 8 trials (--trials)" in text and "a smaller --trials" in text and "SKUFORGE_TUNE" not in text


def test_the_estimate_is_what_a_trial_cost_in_the_skus_last_tuning(tmp_path):
    """The recorded seconds per trial of the SKU's newest tuning (any model: the same devices) beat
    the constant; a cap in max_minutes is said."""
    ctx = SimpleNamespace(model="mine", sku="x86_tvm_fp32", tuning_trials=None, cache_refresh=False)
    assert seconds_per_trial(tmp_path) is None
    for model, when, trials, seconds in (
        ("old", "2026-01-01T00:00:00Z", 10, 300.0),
        ("new", "2026-06-01T00:00:00Z", 20, 60.0),
    ):
        (tmp_path / model).mkdir()
        index = {"files": [], "tuned_at": when, "last_tuning": {"trials": trials, "seconds": seconds}}
        (tmp_path / model / INDEX).write_text(json.dumps(index))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / INDEX).write_text('{"files": [], "last_tuning": {"trials": "x"}}')
    assert seconds_per_trial(tmp_path) == 3.0  # the newest: 60 s over 20 trials
    text = tuning_budget_warning(
        ctx, TvmOptions(trials=64, max_minutes=2), 12, 12, 64, per_trial=seconds_per_trial(tmp_path)
    )
    assert "expect about 3 min (3 s a trial in this SKU's last tuning)" in text
    assert "stopped at options.max_minutes (2 min)" in text


def test_a_tiny_models_tuning_reports_trials_and_tasks_as_it_goes(tmp_path, monkeypatch):
    """Real MetaSchedule on the two smallest tasks of the conv model, one trial each (what
    test_tvm's tuned SKU spends per task): the progress reaches every trial and every task, and the
    two batches are built by one builder process."""
    import onnx

    model = pin_axes(onnx.load(str(models.conv_bn_model(tmp_path / "model.onnx"))), {"batch": 1}, tmp_path)
    probe = {"x": np.random.default_rng(0).random((1, 3, 8, 8), dtype=np.float32)}
    options = TvmOptions(target_cpu="x86-64-v3", num_cores=1, trials=2)
    target = tvm.target.Target(target_of(options, "x86_64"))
    imported = import_onnx(model, probe)
    mod, _ = lower(imported.mod, target, imported.node_of)
    tasks = extract_tasks(mod, target)[:2]
    seen = Recorder()
    work = tmp_path / "tuning"
    work.mkdir()
    pools = []  # the worker processes MetaSchedule starts: per batch unless the builder keeps its own
    started = PopenPoolExecutor.__init__

    def counted(self, *args, **kwargs):
        pools.append(self)
        started(self, *args, **kwargs)

    monkeypatch.setattr(PopenPoolExecutor, "__init__", counted)
    spent = tune_run(tasks, target, work, trials=2, per_task=1, progress=seen).trials
    assert len(pools) == 2  # one builder for both batches (and its sanity check), one runner
    counts = [tuple(map(int, m.groups())) for m in (LABEL.match(label) for label, _ in seen.calls) if m]
    assert counts and counts[0] == (0, 2, 0, 2)  # said before the first candidate
    assert counts[-1] == (2, 2, 2, 2) and spent >= 1  # the end: every task done
    assert any(0 < done < 2 for _, _, done, _ in counts) or len({c[0] for c in counts}) == 3
