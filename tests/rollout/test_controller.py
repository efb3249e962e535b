"""Rollouts: start, wave advance on bake time and signed device health, auto-rollback, manual moves
that stop devices, forged and malformed reports, time-outs, rate limits, label targeting, races."""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

import pytest

from pipeline.core.errors import ConfigError, GateFailed, InputError
from pipeline.host.probe import host_arch
from pipeline.results.signing import SigningKey
from pipeline.rollout import agent, controller, identity, inventory, release, trust
from pipeline.rollout import doc as rdoc
from pipeline.rollout.store import LocalStore
from rollout.conftest import MODEL
from rollout.fleet import Fleet

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=timezone.utc)


def minutes(n: float) -> datetime:
    return T0 + timedelta(minutes=n)


@pytest.fixture
def repo(published, tmp_path):
    return LocalStore(shutil.copytree(published, tmp_path / "store"))


@pytest.fixture(scope="module")
def fleet():
    return Fleet(200)


def start(project, repo, keys, fleet, **kw) -> controller.RolloutDoc:
    return controller.start(project, repo, keys, MODEL, inventory=fleet.inventory, **{"now": T0, **kw})


def advance(project, repo, keys, fleet, at: float, **kw) -> controller.RolloutStatus:
    return controller.advance(project, repo, keys, MODEL, inventory=fleet.inventory, now=minutes(at), **kw)


def test_start_needs_a_release_and_an_inventory(project, keys, fleet, repo, tmp_path):
    empty = LocalStore(tmp_path / "empty")
    trust.initialise(empty, keys, project.rollout.expiry)
    with pytest.raises(InputError, match="no release of conv"):
        start(project, empty, keys, fleet)
    with pytest.raises(ConfigError, match="no fleet inventory") as err:
        controller.start(project, repo, keys, MODEL)
    assert "rollout.inventory" in err.value.hint
    keyless = inventory.Inventory([inventory.Device(id=f"d{i}", sku="cpu", arch="x86_64") for i in range(5)])
    with pytest.raises(ConfigError, match="no device the rollout targets has a key") as err:
        controller.start(project, repo, keys, MODEL, inventory=keyless)
    assert "skuforge agent identity" in err.value.hint


def test_start(project, repo, keys, fleet):
    with pytest.raises(InputError, match="r9"):
        start(project, repo, keys, fleet, release="r9")
    doc = start(project, repo, keys, fleet, actor="ci", reason="ship it")
    assert doc.id.startswith("conv-r1-")
    assert (doc.model, doc.release, doc.previous, doc.status, doc.wave) == (MODEL, "r1", None, "active", 0)
    assert doc.started == doc.wave_started == T0.isoformat()
    assert [w.name for w in doc.waves] == [w.name for w in project.rollout.waves] and doc.gates == project.rollout.gates
    assert all(w.timeout_minutes == project.rollout.timeout_minutes for w in doc.waves)  # frozen at start
    assert doc.planned[-1] == 200 and 0 < doc.planned[0] < doc.planned[1] < 200
    assert (doc.max_attempts, doc.health_window_minutes, doc.labels) == (
        project.rollout.max_attempts,
        project.rollout.health_window_minutes,
        [],
    )
    [entry] = doc.log
    assert (entry.actor, entry.action, entry.status, entry.wave, entry.reason) == (
        "ci",
        "start",
        "active",
        0,
        "ship it",
    )
    assert controller.status(project, repo, MODEL, fleet.inventory, now=T0).rollout == doc  # what the store signs

    with pytest.raises(ConfigError, match="is active"):
        start(project, repo, keys, fleet, now=minutes(1))


def test_start_overrides_are_recorded(project, repo, keys, fleet):
    waves = controller.rollout_waves(project, [5, 100], bake_minutes=2)
    doc = start(project, repo, keys, fleet, waves=waves, labels=["lab"], reason="hotfix")
    assert [(w.name, w.percent, w.bake_minutes) for w in doc.waves] == [("wave1", 5, 2), ("wave2", 100, 0)]
    assert doc.labels == ["lab"] and doc.planned == [0, 0]  # nobody in this fleet carries "lab"
    assert "waves wave1 5.0 bake 2 min" in doc.log[-1].reason and "labels lab" in doc.log[-1].reason
    for bad in ([50, 20], [0, 100], [120]):
        with pytest.raises(ConfigError, match="rising percentages"):
            controller.rollout_waves(project, bad)


def test_advance_waits_for_bake_and_evidence_then_completes(project, repo, keys, fleet):
    doc = start(project, repo, keys, fleet, actor="ci")

    waiting = advance(project, repo, keys, fleet, 10, actor="ci")
    assert (waiting.action, waiting.bake_left_minutes) == ("wait", 20)
    assert "canary bakes 20 more minutes" in waiting.reason
    waiting = advance(project, repo, keys, fleet, 31, actor="ci")
    assert waiting.action == "wait" and "0 reports, 3 needed" in waiting.reason
    canary = fleet.first_in(doc, 0, 3)
    for device_id in canary[:2]:
        fleet.report(repo, doc, device_id)
    waiting = advance(project, repo, keys, fleet, 31, actor="ci")
    assert waiting.action == "wait" and "2 reports, 3 needed" in waiting.reason
    fleet.report(repo, doc, canary[2])
    assert controller.status(project, repo, MODEL, fleet.inventory, now=minutes(31)).action == "advance"

    moved = advance(project, repo, keys, fleet, 31, actor="ci")
    assert (moved.action, moved.rollout.wave, moved.rollout.wave_started) == ("advanced", 1, minutes(31).isoformat())
    assert advance(project, repo, keys, fleet, 40, actor="ci").action == "wait"
    assert advance(project, repo, keys, fleet, 62, actor="bot").rollout.wave == 2
    done = advance(project, repo, keys, fleet, 62, actor="bot")  # the last wave bakes 0
    assert (done.action, done.rollout.status) == ("completed", "completed")
    assert advance(project, repo, keys, fleet, 90).action == "none"

    log = controller.status(project, repo, MODEL).rollout.log
    assert [(t.action, t.actor, t.status, t.wave) for t in log] == [
        ("start", "ci", "active", 0),
        ("advance", "ci", "active", 1),
        ("advance", "bot", "active", 2),
        ("complete", "bot", "completed", 2),
    ]
    assert "wave canary healthy" in log[1].reason and "3 reports" in log[3].reason


def _device_fleet(tmp_path, n: int = 60) -> tuple[list[agent.Device], list[str], inventory.Inventory]:
    """Real agent devices: their keys made in their state folders, as at provisioning."""
    devices, dirs, rows = [], [], []
    for i in range(n):
        dev = agent.Device(
            id=f"dev{i}", sku="portable", arch=host_arch(), runtime=agent.installed_runtimes(), cpu_features=frozenset()
        )
        state = tmp_path / "devices" / dev.id
        rows.append(
            inventory.Device(id=dev.id, sku="portable", arch=host_arch(), key=identity.device_key(state).public_key)
        )
        devices.append(dev)
        dirs.append(state)
    return devices, [str(d) for d in dirs], inventory.Inventory(rows)


def test_abort_and_pause_stop_devices_on_their_next_pass(project, repo, keys, tmp_path):
    devices, dirs, inv = _device_fleet(tmp_path)
    root = trust.root_bytes(repo)
    doc = controller.start(project, repo, keys, MODEL, inventory=inv, now=T0)
    canary = [i for i, d in enumerate(devices) if rdoc.desired_release(doc, d.id, None, now=T0)[0] == "r1"]
    assert len(canary) >= 3

    def pass_of(i):
        return agent.Agent(repo, devices[i], tmp_path / "devices" / devices[i].id, root).run_once(MODEL)

    controller.move(project, repo, keys, MODEL, "pause", reason="incident 7", now=minutes(1))
    for i in canary[:3]:
        r = pass_of(i)
        assert (r.outcome, r.active, r.reported) == ("idle", None, None), r.detail
        assert "paused" in r.detail
    controller.move(project, repo, keys, MODEL, "resume", reason="fixed", now=minutes(2))
    installed = pass_of(canary[0])
    assert (installed.outcome, installed.active["release"]) == ("ok", "r1"), installed.detail

    controller.move(project, repo, keys, MODEL, "abort", reason="wrong release", now=minutes(3))
    for i in canary[1:3]:  # reached by the wave, not yet installed: they take nothing now
        r = pass_of(i)
        assert (r.outcome, r.active) == ("idle", None) and "aborted" in r.detail
    kept = pass_of(canary[0])  # what a device took before the abort, it keeps
    assert (kept.outcome, kept.active["release"]) == ("idle", "r1")


def test_failing_canary_rolls_back_on_signed_reports(project, repo, keys, tmp_path):
    devices, _, inv = _device_fleet(tmp_path)
    controller.start(project, repo, keys, MODEL, inventory=inv, now=T0)
    controller.move(project, repo, keys, MODEL, "abort", reason="make way for r2", now=minutes(1))
    assert release.publish_release(project, repo, keys, MODEL, skus=["portable"], allow_partial=["cpu"]).release == "r2"
    doc = controller.start(project, repo, keys, MODEL, inventory=inv, now=minutes(2))
    assert (doc.release, doc.previous) == ("r2", "r1")

    root = trust.root_bytes(repo)
    canary = [d for d in devices if rdoc.in_wave(doc, d.id, None, (), minutes(2))][:2]
    for dev in canary:
        result = agent.Agent(
            repo, dev, tmp_path / "devices" / dev.id, root, smoke=lambda entry, slot: agent.Smoke(False, "injected")
        ).run_once(MODEL)
        assert result.outcome == "smoke_failed", result.detail
        body = identity.open_report(repo.get(result.reported).data, inv[dev.id].key)
        assert (body["device"], body["rollout"], body["outcome"]) == (dev.id, doc.id, "smoke_failed")

    rolled = controller.advance(project, repo, keys, MODEL, inventory=inv, actor="ci", now=minutes(5))
    assert (rolled.action, rolled.rollout.status) == ("rolled_back", "rolled_back")
    last = rolled.rollout.log[-1]
    assert (last.action, last.actor) == ("auto-rollback", "ci")
    assert "gate failed in wave canary" in last.reason and "smoke_tests: 2 smoke-test failures" in last.reason
    assert {rdoc.desired_release(rolled.rollout, d.id, None)[0] for d in devices[:10]} == {"r1"}
    assert controller.advance(project, repo, keys, MODEL, inventory=inv, now=minutes(40)).action == "none"


def test_forged_and_malformed_reports_are_ignored_and_listed(project, repo, keys, fleet):
    doc = start(project, repo, keys, fleet)
    canary, later = fleet.first_in(doc, 0, 4), fleet.first_in(doc, 1)[0]
    for device_id in canary[:3]:
        fleet.report(repo, doc, device_id)
    prefix = controller.report_prefix(MODEL, doc.id)
    stranger = SigningKey.generate("attacker")
    body = fleet.body(doc, canary[3], "smoke_failed")
    forged = {
        f"{prefix}/smoke_failed/intruder.json": identity.sign_report(stranger, {**body, "device": "intruder"}),
        f"{prefix}/smoke_failed/{canary[3]}.json": identity.sign_report(stranger, body),  # not its key
        f"{prefix}/smoke_failed/{later}.json": identity.sign_report(
            fleet.keys[later], fleet.body(doc, later, "smoke_failed")
        ),  # genuine, but its wave has not started
        f"{prefix}/error/{canary[0]}.json": json.dumps({"device": canary[0], "outcome": "error"}).encode(),
        f"{prefix}/ok/{canary[3]}.json": b"[1,2]",
        f"{prefix}/ok/nested/x.json": b"{}",
        f"{prefix}/unknown/{canary[3]}.json": b"{}",
    }
    moved = identity.sign_report(fleet.keys[canary[1]], fleet.body(doc, canary[1], "ok"))
    forged[f"{prefix}/smoke_failed/{canary[1]}.json"] = moved  # an ok report moved under smoke_failed
    other = identity.sign_report(fleet.keys[canary[2]], {**fleet.body(doc, canary[2], "error"), "rollout": "old-one"})
    forged[f"{prefix}/error/{canary[2]}.json"] = other  # replayed from another rollout
    for key, data in forged.items():
        repo.put(key, data)

    h = controller.health(repo, doc, fleet.inventory, now=minutes(31))
    assert h.reports == 3 and {k: v for k, v in h.counts.items() if v} == {"ok": 3}
    assert sum(h.ignored.values()) == len(forged)
    assert h.ignored == {
        "device not in the inventory": 1,
        "signed by another key than the inventory's": 1,
        "device not in wave canary or earlier": 1,
        "not a signed report ({report, signature})": 2,
        "not a report key (reports/<model>/<rollout>/<outcome>/<device>.json)": 2,
        "signed with another outcome than the one it is filed under": 1,
        "signed for another rollout": 1,
    }
    assert any(e.startswith(f"{prefix}/ok/{canary[3]}.json: ") for e in h.ignored_examples)
    st = controller.status(project, repo, MODEL, fleet.inventory, now=minutes(31))
    assert st.action == "advance"  # the forged failures stop nothing, the bad JSON crashes nothing
    assert advance(project, repo, keys, fleet, 31).action == "advanced"


def test_forged_ok_reports_do_not_push_a_release(project, repo, keys, fleet):
    doc = start(project, repo, keys, fleet)
    stranger = SigningKey.generate("attacker")
    for device_id in fleet.first_in(doc, 0, 5):
        repo.put(
            controller.report_key(MODEL, doc.id, "ok", device_id),
            identity.sign_report(stranger, fleet.body(doc, device_id)),
        )
    held = advance(project, repo, keys, fleet, 31)
    assert held.action == "wait" and "0 reports, 3 needed" in held.reason
    assert held.health.ignored == {"signed by another key than the inventory's": 5}


def test_one_report_per_device_the_newest_signed(project, repo, keys, fleet):
    doc = start(project, repo, keys, fleet)
    [device_id] = fleet.first_in(doc, 0)
    fleet.report(repo, doc, device_id, "ok", at=minutes(20))
    fleet.report(repo, doc, device_id, "smoke_failed", at=minutes(10))  # an older report put back
    h = controller.health(repo, doc, fleet.inventory, now=minutes(31))
    assert h.reports == 1 and h.counts["ok"] == 1 and h.counts["smoke_failed"] == 0


def test_a_silent_device_times_out_instead_of_stalling_its_wave(project, repo, keys, monkeypatch):
    small = Fleet(12)
    waves = [w.model_copy(update={"timeout_minutes": 120}) for w in controller.rollout_waves(project)]
    doc = controller.start(project, repo, keys, MODEL, inventory=small.inventory, now=T0, waves=waves)
    canary = small.first_in(doc, 0, doc.planned[0])
    assert 2 <= len(canary) <= 3
    for device_id in canary[:-1]:  # the last one never reports
        small.report(repo, doc, device_id)
    n = len(canary)
    stalled = controller.advance(project, repo, keys, MODEL, inventory=small.inventory, now=minutes(60))
    assert stalled.action == "wait" and f"{n - 1} reports, {n} needed" in stalled.reason
    assert [g.detail for g in stalled.health.gates if g.name == "timeouts"] == [
        f"1 of {n} devices not reported yet; time-out at {minutes(120).isoformat()}"
    ]
    after = controller.advance(project, repo, keys, MODEL, inventory=small.inventory, now=minutes(121))
    assert after.action == "advanced", after.reason
    assert after.health.timed_out == 1 and f"1/{n} devices timed out" in after.rollout.log[-1].reason

    gates = project.rollout.gates.model_copy(update={"max_timeout_rate": 0.0})
    monkeypatch.setitem(project.__dict__, "rollout", project.rollout.model_copy(update={"gates": gates}))
    doc = controller.move(project, repo, keys, MODEL, "abort", reason="next", now=minutes(122))
    release.publish_release(project, repo, keys, MODEL, skus=["portable"], allow_partial=["cpu"])
    doc = controller.start(project, repo, keys, MODEL, inventory=small.inventory, now=minutes(123), waves=waves)
    assert doc.gates.max_timeout_rate == 0
    failed = controller.advance(project, repo, keys, MODEL, inventory=small.inventory, now=minutes(123 + 121))
    assert failed.action == "rolled_back" and "timeouts:" in failed.reason


def test_rate_limit_admits_devices_over_time(project, repo, keys, fleet, monkeypatch):
    monkeypatch.setitem(project.__dict__, "rollout", project.rollout.model_copy(update={"max_per_minute": 2.0}))
    waves = controller.rollout_waves(project, [20, 100], bake_minutes=5)
    doc = start(project, repo, keys, fleet, waves=waves)
    wave0 = [d.id for d in fleet.inventory if rdoc.included(doc.waves, 0, doc.id, d.id, None)]
    ramp = rdoc.ramp_minutes(doc)
    assert ramp == pytest.approx(len(wave0) / 2)

    def taking(at: float) -> int:
        return sum(rdoc.desired_release(doc, i, None, now=minutes(at))[0] == "r1" for i in wave0)

    counts = [taking(t) for t in (0, ramp / 4, ramp / 2, ramp)]
    assert counts[0] == 0 and counts[-1] == len(wave0)
    assert counts == sorted(counts) and 0 < counts[2] < len(wave0)
    assert abs(counts[2] - len(wave0) / 2) <= max(3, len(wave0) // 4)  # about half admitted half-way
    assert controller.advance(project, repo, keys, MODEL, fleet.inventory, now=minutes(ramp + 1)).action == "wait"
    for device_id in wave0[:3]:
        fleet.report(repo, doc, device_id)
    st = controller.status(project, repo, MODEL, fleet.inventory, now=minutes(ramp + 1))
    assert st.action == "wait" and st.bake_left_minutes == pytest.approx(4)  # the bake runs after the ramp
    assert advance(project, repo, keys, fleet, ramp + 5).action == "advanced"


def test_labels_target_a_group(project, repo, keys):
    labelled = Fleet(100, labels={f"dev{i}": ("lab",) for i in range(0, 100, 2)})
    doc = controller.start(project, repo, keys, MODEL, inventory=labelled.inventory, now=T0, labels=["lab"])
    assert doc.planned[-1] == 50
    assert rdoc.desired_release(doc, "dev1", None, labels=())[0] is None  # not targeted: left alone
    outside_wave = [d for d in labelled.inventory if "lab" not in d.labels]
    labelled.report(repo, doc, outside_wave[0].id)
    h = controller.health(repo, doc, labelled.inventory, now=minutes(31))
    assert h.expected == doc.planned[0] and h.ignored == {"device not in wave canary or earlier": 1}


def test_failing_first_release_halts(project, repo, keys, fleet):
    doc = start(project, repo, keys, fleet)
    fleet.report(repo, doc, fleet.first_in(doc, 0)[0], "smoke_failed")
    halted = advance(project, repo, keys, fleet, 5, actor="ci")
    doc = halted.rollout
    assert (halted.action, doc.status, doc.log[-1].action) == ("aborted", "aborted", "auto-abort")
    assert "no previous release" in doc.log[-1].reason and "smoke_tests" in doc.log[-1].reason
    [inside], [outside] = fleet.first_in(doc, 0), fleet.first_in(doc, 1)
    assert rdoc.desired_release(doc, inside, None) == (None, f"rollout {doc.id} is aborted: keeping what runs")
    assert rdoc.desired_release(doc, outside, None)[0] is None

    st = controller.status(project, repo, MODEL, fleet.inventory)
    assert st.action == "none" and "auto-abort by ci" in st.reason  # the last transition is shown


def test_next_rollout_does_not_return_to_a_release_that_failed(project, repo, keys, fleet):
    doc = start(project, repo, keys, fleet)
    fleet.report(repo, doc, fleet.first_in(doc, 0)[0], "smoke_failed")
    advance(project, repo, keys, fleet, 5)
    release.publish_release(project, repo, keys, MODEL, skus=["portable"], allow_partial=["cpu"])
    doc = start(project, repo, keys, fleet, now=minutes(10))
    assert doc.release == "r2"
    assert rdoc.desired_release(doc, fleet.first_in(doc, 1)[0], None)[0] != "r1"


def test_partial_release_is_refused_unless_named(project, repo, keys):
    with pytest.raises(GateFailed, match="would lack 1 of its 2 SKUs: cpu") as err:
        release.publish_release(project, repo, keys, MODEL, skus=["portable"])
    assert "--allow-partial cpu" in err.value.hint
    r = release.publish_release(project, repo, keys, MODEL, skus=["portable"], allow_partial=["cpu"])
    assert (r.release, r.partial) == ("r2", ["cpu"])
    assert release.release_doc(repo, MODEL, "r2")["partial"] == ["cpu"]
    assert release.release_doc(repo, MODEL, "r1")["partial"] == []


def test_concurrent_advances_move_one_wave(project, repo, keys, fleet):
    doc = start(project, repo, keys, fleet)
    for device_id in fleet.first_in(doc, 0, 3):
        fleet.report(repo, doc, device_id)
    jobs = [LocalStore(repo.root) for _ in range(2)]  # two CI jobs, each with its own view of the store
    barrier = threading.Barrier(len(jobs))

    def run(store):
        barrier.wait()
        return controller.advance(
            project, store, keys, MODEL, fleet.inventory, actor=f"job{jobs.index(store)}", now=minutes(31)
        )

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    assert sorted(r.action for r in results) == ["advanced", "wait"]  # the loser finds the new wave baking
    doc = controller.status(project, repo, MODEL).rollout
    assert doc.wave == 1 and [t.action for t in doc.log] == ["start", "advance"]


def test_pause_resume_abort(project, repo, keys, fleet):
    doc = start(project, repo, keys, fleet)
    for device_id in fleet.first_in(doc, 0, 3):
        fleet.report(repo, doc, device_id)
    with pytest.raises(ConfigError, match="needs --reason"):
        controller.move(project, repo, keys, MODEL, "pause", actor="oncall")

    paused = controller.move(project, repo, keys, MODEL, "pause", actor="oncall", reason="incident 42", now=minutes(5))
    assert paused.status == "paused"
    held = advance(project, repo, keys, fleet, 31)
    assert (held.action, held.rollout.wave) == ("none", 0) and "paused" in held.reason

    resumed = controller.move(project, repo, keys, MODEL, "resume", actor="oncall", reason="fixed", now=minutes(40))
    assert (resumed.status, resumed.wave_started) == ("active", minutes(40).isoformat())
    waiting = advance(project, repo, keys, fleet, 41)
    assert waiting.action == "wait" and "29 more minutes" in waiting.reason
    assert advance(project, repo, keys, fleet, 71).action == "advanced"

    aborted = controller.move(
        project, repo, keys, MODEL, "abort", actor="oncall", reason="wrong release", now=minutes(72)
    )
    assert aborted.status == "aborted"
    assert advance(project, repo, keys, fleet, 200).action == "none"
    with pytest.raises(ConfigError, match="it is aborted"):
        controller.move(project, repo, keys, MODEL, "resume", reason="oops")
    assert [(t.action, t.actor, t.reason) for t in aborted.log if t.action != "advance"] == [
        ("start", "unknown", "roll r1 out over 3 waves"),
        ("pause", "oncall", "incident 42"),
        ("resume", "oncall", "fixed"),
        ("abort", "oncall", "wrong release"),
    ]


def test_desired_release(project):
    doc = rdoc.RolloutDoc(
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
    f = Fleet(200)
    [inside], [outside] = f.first_in(doc, 0), f.first_in(doc, 1)
    assert rdoc.desired_release(doc, inside, None)[0] == "r2"
    assert rdoc.desired_release(doc, outside, None) == ("r1", f"not yet in a wave of {doc.id}")
    assert rdoc.desired_release(doc.model_dump(mode="json"), inside, None)[0] == "r2"
    rolled = doc.model_copy(update={"status": "rolled_back"})
    assert {rdoc.desired_release(rolled, i, None)[0] for i in (inside, outside)} == {"r1"}
    for halted in ("paused", "aborted"):
        held = doc.model_copy(update={"status": halted})
        assert rdoc.desired_release(held, inside, None)[0] is None
        assert rdoc.desired_release(held, outside, None)[0] == "r1"
    first = doc.model_copy(update={"previous": None})
    assert rdoc.desired_release(first, outside, None)[0] is None
    assert rdoc.desired_release(None, inside, None) == (None, "no rollout")
    newer = {**doc.model_dump(mode="json"), "a_field_from_a_newer_controller": 1}
    assert rdoc.desired_release(newer, inside, None)[0] == "r2"  # a device reads a newer document


def test_health_reads_reports_in_parallel(project, repo, keys, fleet):
    doc = start(project, repo, keys, fleet, waves=controller.rollout_waves(project, [100]))
    ids = [d.id for d in fleet.inventory]
    for i, device_id in enumerate(ids[:50]):
        fleet.report(repo, doc, device_id, latency_ratio=1 + i / 100)
    fleet.report(repo, doc, ids[50], "fallback")
    fleet.report(repo, doc, ids[51], "fallback")
    fleet.report(repo, doc, ids[52], "error")
    gets, lists = repo.requests["get"], repo.requests["list"]
    h = controller.health(repo, doc, fleet.inventory)
    assert repo.requests["get"] - gets == 53 and repo.requests["list"] - lists == 1
    assert h.reports == 53 and {k: v for k, v in h.counts.items() if v} == {"ok": 50, "fallback": 2, "error": 1}
    assert h.failure_rate == pytest.approx(1 / 53)  # an error fails; a fallback is degraded, not failed
    assert h.latency_samples == 50 and h.latency_ratio_median == pytest.approx(1.25)
    assert h.expected == 200


def test_devices_that_trust_a_newer_timestamp_reveal_a_replayed_store(project, repo, keys, fleet):
    doc = start(project, repo, keys, fleet)
    serving = trust.read_state(repo).timestamp.signed.version
    canary = fleet.first_in(doc, 0, 3)
    for device_id in canary:
        fleet.report(repo, doc, device_id, trusted_timestamp=serving)
    assert advance(project, repo, keys, fleet, 31).action == "advanced"  # what devices saw is what is served
    doc = controller.status(project, repo, MODEL).rollout
    fleet.report(repo, doc, canary[0], trusted_timestamp=serving + 50)  # a device saw a later state
    with pytest.raises(trust.VerificationFailed, match=f"trusting timestamp v{serving + 50}"):
        advance(project, repo, keys, fleet, 70)
