"""Rollouts: start, wave advance on bake time and device health, auto-rollback, manual moves, races."""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

import pytest

from pipeline.core.errors import ConfigError, InputError
from pipeline.host.probe import host_arch
from pipeline.rollout import agent, controller, inventory, release, trust
from pipeline.rollout.store import LocalStore
from rollout.conftest import MODEL, first_in

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=timezone.utc)


def minutes(n: float) -> datetime:
    return T0 + timedelta(minutes=n)


@pytest.fixture
def repo(published, tmp_path):
    return LocalStore(shutil.copytree(published, tmp_path / "store"))


def report(store, doc: controller.RolloutDoc, device_id: str, outcome: str = "ok", latency_ratio: float = 1.0) -> None:
    """A device report as the agent writes it (the fields the gates read)."""
    body = {"device": device_id, "outcome": outcome, "release": doc.release, "latency_ratio": latency_ratio}
    store.put(controller.report_key(MODEL, doc.id, outcome, device_id), json.dumps(body).encode())


def test_start_needs_a_release(project, local_store, keys):
    trust.initialise(local_store, keys, project.rollout.expiry)
    with pytest.raises(InputError, match="no release of conv"):
        controller.start(project, local_store, keys, MODEL)


def test_start(project, repo, keys):
    with pytest.raises(InputError, match="r9"):
        controller.start(project, repo, keys, MODEL, "r9")
    doc = controller.start(project, repo, keys, MODEL, actor="ci", reason="ship it", now=T0)
    assert doc.id.startswith("conv-r1-")
    assert (doc.model, doc.release, doc.previous, doc.status, doc.wave) == (MODEL, "r1", None, "active", 0)
    assert doc.started == doc.wave_started == T0.isoformat()
    assert (doc.waves, doc.gates) == (project.rollout.waves, project.rollout.gates)
    [entry] = doc.log
    assert (entry.actor, entry.action, entry.status, entry.wave, entry.reason) == (
        "ci",
        "start",
        "active",
        0,
        "ship it",
    )
    assert controller.status(project, repo, MODEL, now=T0).rollout == doc  # what the store signs

    with pytest.raises(ConfigError, match="is active"):
        controller.start(project, repo, keys, MODEL, now=minutes(1))


def test_advance_waits_for_bake_and_evidence_then_completes(project, repo, keys):
    doc = controller.start(project, repo, keys, MODEL, actor="ci", now=T0)

    waiting = controller.advance(project, repo, keys, MODEL, actor="ci", now=minutes(10))
    assert (waiting.action, waiting.bake_left_minutes) == ("wait", 20)
    assert "canary bakes 20 more minutes" in waiting.reason
    waiting = controller.advance(project, repo, keys, MODEL, actor="ci", now=minutes(31))
    assert waiting.action == "wait" and "0 reports, 3 needed" in waiting.reason
    for device_id in ("d1", "d2"):
        report(repo, doc, device_id)
    waiting = controller.advance(project, repo, keys, MODEL, actor="ci", now=minutes(31))
    assert waiting.action == "wait" and "2 reports, 3 needed" in waiting.reason
    report(repo, doc, "d3")
    assert controller.status(project, repo, MODEL, now=minutes(31)).action == "advance"

    moved = controller.advance(project, repo, keys, MODEL, actor="ci", now=minutes(31))
    assert (moved.action, moved.rollout.wave, moved.rollout.wave_started) == ("advanced", 1, minutes(31).isoformat())
    assert controller.advance(project, repo, keys, MODEL, actor="ci", now=minutes(40)).action == "wait"
    assert controller.advance(project, repo, keys, MODEL, actor="bot", now=minutes(62)).rollout.wave == 2
    done = controller.advance(project, repo, keys, MODEL, actor="bot", now=minutes(62))  # the last wave bakes 0
    assert (done.action, done.rollout.status) == ("completed", "completed")
    assert controller.advance(project, repo, keys, MODEL, now=minutes(90)).action == "none"

    log = controller.status(project, repo, MODEL).rollout.log
    assert [(t.action, t.actor, t.status, t.wave) for t in log] == [
        ("start", "ci", "active", 0),
        ("advance", "ci", "active", 1),
        ("advance", "bot", "active", 2),
        ("complete", "bot", "completed", 2),
    ]
    assert [t.at for t in log] == [
        T0.isoformat(),
        minutes(31).isoformat(),
        minutes(62).isoformat(),
        minutes(62).isoformat(),
    ]
    assert "wave canary healthy" in log[1].reason and "3 reports" in log[3].reason


def test_failing_canary_rolls_back(project, repo, keys, tmp_path):
    controller.start(project, repo, keys, MODEL, now=T0)
    controller.move(project, repo, keys, MODEL, "abort", reason="make way for r2", now=minutes(1))
    assert release.publish_release(project, repo, keys, MODEL, skus=["portable"]).release == "r2"
    doc = controller.start(project, repo, keys, MODEL, now=minutes(2))
    assert (doc.release, doc.previous) == ("r2", "r1")

    root = trust.root_bytes(repo)
    devices = [
        agent.Device(
            id=i, sku="portable", arch=host_arch(), runtime=agent.installed_runtimes(), cpu_features=frozenset()
        )
        for i in first_in(doc, 0, 2)
    ]
    for dev in devices:
        result = agent.Agent(
            repo, dev, tmp_path / dev.id, root, smoke=lambda entry, slot: agent.Smoke(False, "injected")
        ).run_once(MODEL)
        assert result.outcome == "smoke_failed", result.detail

    rolled = controller.advance(project, repo, keys, MODEL, actor="ci", now=minutes(5))  # within the bake time
    assert (rolled.action, rolled.rollout.status) == ("rolled_back", "rolled_back")
    last = rolled.rollout.log[-1]
    assert (last.action, last.actor) == ("auto-rollback", "ci")
    assert "gate failed in wave canary" in last.reason and "smoke_tests: 2 smoke-test failures" in last.reason
    assert {controller.desired_release(rolled.rollout, i, None)[0] for i in ["dev0", *first_in(doc, 0)]} == {"r1"}

    back = agent.Agent(repo, devices[0], tmp_path / devices[0].id).run_once(MODEL)
    assert (back.outcome, back.active["release"], back.reported) == ("ok", "r1", None)
    assert controller.advance(project, repo, keys, MODEL, now=minutes(40)).action == "none"


def test_a_wave_planned_empty_advances_after_its_bake(project, repo, keys):
    fleet = [inventory.Device(id=f"d{i}", sku="cpu", arch="x86_64") for i in range(2)]
    doc = controller.start(project, repo, keys, MODEL, inventory=fleet, now=T0)
    assert doc.planned[0] == 0 < doc.planned[-1] == 2  # a small fleet: 20% of it is nobody
    moved = controller.advance(project, repo, keys, MODEL, now=minutes(31))
    assert (moved.action, moved.rollout.wave) == ("advanced", 1)


def abort_on_failing_canary(project, repo, keys) -> controller.RolloutStatus:
    doc = controller.start(project, repo, keys, MODEL, now=T0)
    report(repo, doc, first_in(doc, 0)[0], "smoke_failed")
    return controller.advance(project, repo, keys, MODEL, actor="ci", now=minutes(5))


def test_failing_first_release_halts(project, repo, keys):
    halted = abort_on_failing_canary(project, repo, keys)
    doc = halted.rollout
    assert (halted.action, doc.status, doc.log[-1].action) == ("aborted", "aborted", "auto-abort")
    assert "no previous release" in doc.log[-1].reason and "smoke_tests" in doc.log[-1].reason
    [inside], [outside] = first_in(doc, 0), first_in(doc, 1)
    assert controller.desired_release(doc, inside, None)[0] == "r1"  # halted: devices keep what they run
    assert controller.desired_release(doc, outside, None)[0] is None


def test_next_rollout_does_not_return_to_a_release_that_failed(project, repo, keys):
    abort_on_failing_canary(project, repo, keys)
    release.publish_release(project, repo, keys, MODEL, skus=["portable"])
    doc = controller.start(project, repo, keys, MODEL, now=minutes(10))
    assert doc.release == "r2"
    assert controller.desired_release(doc, first_in(doc, 1)[0], None)[0] != "r1"


def test_concurrent_advances_move_one_wave(project, repo, keys):
    doc = controller.start(project, repo, keys, MODEL, now=T0)
    for device_id in ("d1", "d2", "d3"):
        report(repo, doc, device_id)
    jobs = [LocalStore(repo.root) for _ in range(2)]  # two CI jobs, each with its own view of the store
    barrier = threading.Barrier(len(jobs))

    def advance(store):
        barrier.wait()
        return controller.advance(project, store, keys, MODEL, actor=f"job{jobs.index(store)}", now=minutes(31))

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(advance, jobs))
    assert sorted(r.action for r in results) == ["advanced", "wait"]  # the loser finds the new wave baking
    doc = controller.status(project, repo, MODEL).rollout
    assert doc.wave == 1 and [t.action for t in doc.log] == ["start", "advance"]


def test_pause_resume_abort(project, repo, keys):
    doc = controller.start(project, repo, keys, MODEL, now=T0)
    for device_id in ("d1", "d2", "d3"):
        report(repo, doc, device_id)
    with pytest.raises(ConfigError, match="needs --reason"):
        controller.move(project, repo, keys, MODEL, "pause", actor="oncall")

    paused = controller.move(project, repo, keys, MODEL, "pause", actor="oncall", reason="incident 42", now=minutes(5))
    assert paused.status == "paused"
    held = controller.advance(project, repo, keys, MODEL, now=minutes(31))
    assert (held.action, held.rollout.wave) == ("none", 0) and "paused" in held.reason

    resumed = controller.move(project, repo, keys, MODEL, "resume", actor="oncall", reason="fixed", now=minutes(40))
    assert (resumed.status, resumed.wave_started) == ("active", minutes(40).isoformat())
    waiting = controller.advance(project, repo, keys, MODEL, now=minutes(41))
    assert waiting.action == "wait" and "29 more minutes" in waiting.reason
    assert controller.advance(project, repo, keys, MODEL, now=minutes(71)).action == "advanced"

    aborted = controller.move(
        project, repo, keys, MODEL, "abort", actor="oncall", reason="wrong release", now=minutes(72)
    )
    assert aborted.status == "aborted"
    assert controller.advance(project, repo, keys, MODEL, now=minutes(200)).action == "none"
    with pytest.raises(ConfigError, match="it is aborted"):
        controller.move(project, repo, keys, MODEL, "resume", reason="oops")
    assert [(t.action, t.actor, t.reason) for t in aborted.log if t.action != "advance"] == [
        ("start", "unknown", "roll r1 out over 3 waves"),
        ("pause", "oncall", "incident 42"),
        ("resume", "oncall", "fixed"),
        ("abort", "oncall", "wrong release"),
    ]


def test_desired_release(project):
    doc = controller.RolloutDoc(
        id="conv-r2-20260105120000-1",
        model=MODEL,
        release="r2",
        previous="r1",
        status="active",
        wave=0,
        wave_started=T0.isoformat(),
        started=T0.isoformat(),
        waves=project.rollout.waves,
        gates=project.rollout.gates,
    )
    [inside], [outside] = first_in(doc, 0), first_in(doc, 1)
    assert controller.desired_release(doc, inside, None)[0] == "r2"
    assert controller.desired_release(doc, outside, None) == ("r1", f"not yet in a wave of {doc.id}")
    assert controller.desired_release(doc.model_dump(mode="json"), inside, None)[0] == "r2"
    rolled = doc.model_copy(update={"status": "rolled_back"})
    assert {controller.desired_release(rolled, i, None)[0] for i in (inside, outside)} == {"r1"}
    first = doc.model_copy(update={"previous": None})
    assert controller.desired_release(first, outside, None)[0] is None
    assert controller.desired_release(None, inside, None) == (None, "no rollout")


def test_health_counts_by_listing(project, repo, keys, monkeypatch):
    monkeypatch.setattr(controller, "LATENCY_SAMPLE", 10)
    doc = controller.start(project, repo, keys, MODEL, now=T0)
    for i in range(50):
        report(repo, doc, f"ok{i}", latency_ratio=1 + i / 100)
    report(repo, doc, "f1", "fallback")
    report(repo, doc, "f2", "fallback")
    report(repo, doc, "e1", "error")
    prefix = controller.report_prefix(MODEL, doc.id)
    repo.put(f"{prefix}/unknown/x.json", b"{}")  # not an outcome, and not a report's shape: ignored
    repo.put(f"{prefix}/ok/nested/x.json", b"{}")

    gets, lists = repo.requests["get"], repo.requests["list"]
    h = controller.health(repo, doc)
    assert repo.requests["get"] - gets == controller.LATENCY_SAMPLE and repo.requests["list"] - lists == 1
    assert h.reports == 53 and {k: v for k, v in h.counts.items() if v} == {"ok": 50, "fallback": 2, "error": 1}
    assert h.failure_rate == pytest.approx(1 / 53)  # an error fails; a fallback is degraded, not failed
    assert h.latency_samples == 10 and 1.0 <= h.latency_ratio_median <= 1.49
    assert all(g.passed for g in h.gates), h.gates
