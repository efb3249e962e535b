"""The device agent: verified install into an A/B slot, smoke test, atomic switch, signed report,
retries up to the rollout's max_attempts, and a health window that reverts by itself."""

from __future__ import annotations

import json
import re
import shutil
import socket
from datetime import datetime, timedelta, timezone

import pytest
import yaml
from cli_helpers import service_env, skuforge

from pipeline.core.errors import ConfigError, ServiceError
from pipeline.core.io import sha256_bytes
from pipeline.host.probe import host_arch
from pipeline.project.config import load_registry
from pipeline.rollout import agent, controller, identity, release, trust
from pipeline.rollout.store import LocalStore, S3Store
from pipeline.stages.bench import bench
from pipeline.stages.build import build
from pipeline.stages.manifest import write_manifest
from pipeline.stages.validate import validate
from rollout.conftest import MODEL
from rollout.fleet import Fleet
from rollout.s3server import s3_client

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=timezone.utc)


class ReadLog(LocalStore):
    """The local store, remembering every key read (to tell a download from a metadata check);
    ``down`` makes it unreachable."""

    def __init__(self, root):
        super().__init__(root)
        self.read: list[str] = []
        self.down = False

    def get(self, key):
        if self.down:
            raise ServiceError(f"{key}: connection refused", hint="injected")
        self.read.append(key)
        return super().get(key)


@pytest.fixture(scope="module")
def fleet():
    """dev0..dev199 with their keys: the inventory the controller authenticates reports with."""
    return Fleet(200)


@pytest.fixture
def repo(published, tmp_path):
    return ReadLog(shutil.copytree(published, tmp_path / "store"))


@pytest.fixture(scope="module")
def project_r2(project, tmp_path_factory):
    """The project copied with the cpu engine rebuilt under other session options: a second release."""
    root = shutil.copytree(project.root, tmp_path_factory.mktemp("project_r2") / "project")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["skus"]["cpu"].setdefault("options", {})["intra_op_num_threads"] = 1
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    reg = load_registry(root / "params.yaml")
    for stage in (build, validate, bench, write_manifest):
        stage(reg.pair(MODEL, "cpu"))
    return reg


def device(device_id: str, runtime: dict[str, str] | None = None) -> agent.Device:
    """A device of the test fleet (``dev<n>``): the agent signs with the fleet's key for it."""
    return agent.Device(
        id=device_id,
        sku="cpu",
        arch=host_arch(),
        runtime=runtime or agent.installed_runtimes(),
        cpu_features=frozenset(),
    )


def make_agent(store, tmp_path, dev: agent.Device, fleet: Fleet | None = None, **kw) -> agent.Agent:
    key = fleet.keys[dev.id] if fleet is not None else None
    return agent.Agent(store, dev, tmp_path / "devices" / dev.id, trust.root_bytes(store), key=key, **kw)


def start(registry, store, keys, fleet: Fleet, release_id=None) -> controller.RolloutDoc:
    return controller.start(registry, store, keys, MODEL, release_id, inventory=fleet.inventory, now=T0)


def roll_out(registry, store, keys, fleet: Fleet, release_id=None, complete=False) -> controller.RolloutDoc:
    """Start a rollout and advance it to its last wave (or past it) on healthy signed reports of
    canary devices other than the ones a test drives (dev0..dev9)."""
    doc = start(registry, store, keys, fleet, release_id)
    canary = [d for d in fleet.first_in(doc, 0, 20) if int(d[3:]) >= 10]
    for device_id in canary[: registry.rollout.gates.min_reports]:
        fleet.report(store, doc, device_id)
    now = T0
    for wave in doc.waves if complete else doc.waves[:-1]:
        now += timedelta(minutes=wave.bake_minutes + 1)
        doc = controller.advance(registry, store, keys, MODEL, inventory=fleet.inventory, now=now).rollout
    assert doc.status == ("completed" if complete else "active") and doc.wave == len(doc.waves) - 1, doc.log
    return doc


def release_blobs(store, rid: str) -> set[str]:
    """Blob keys of every file of release ``rid`` (its engines, manifests, golden data)."""
    doc = release.release_doc(store, MODEL, rid)
    return {trust.blob_key(sha) for entry in doc["skus"].values() for sha in entry["sha256"].values()}


def test_first_wave_device_installs_then_stays_current(project, repo, keys, fleet, tmp_path):
    doc = start(project, repo, keys, fleet)
    dev = device(fleet.first_in(doc, 0)[0])
    a = make_agent(repo, tmp_path, dev)  # no key given: the device's own, made on its first report
    result = a.run_once(MODEL)
    assert result.outcome == "ok", result.detail
    assert {k: result.active[k] for k in ("slot", "release", "sku", "kind", "rollout")} == {
        "slot": "a",
        "release": "r1",
        "sku": "cpu",
        "kind": "optimized",
        "rollout": doc.id,
    }
    entry = release.release_doc(repo, MODEL, "r1")["skus"]["cpu"]
    engine = a.active_engine_dir(MODEL)
    assert sorted(p.name for p in engine.iterdir()) == ["engine.json", "model.onnx"]
    assert sha256_bytes((engine / "model.onnx").read_bytes()) == entry["sha256"]["engine/model.onnx"]
    assert result.reported == controller.report_key(MODEL, doc.id, "ok", dev.id)
    stored = repo.get(result.reported).data
    report = identity.open_report(stored, identity.device_key(a.state_dir, create=False).public_key)
    assert {k: report[k] for k in ("device", "model", "rollout", "release", "outcome", "attempt", "sku")} == {
        "device": dev.id,
        "model": MODEL,
        "rollout": doc.id,
        "release": "r1",
        "outcome": "ok",
        "attempt": 1,
        "sku": "cpu",
    }
    assert report["latency_ms"] > 0 and report["active"] == result.active
    assert report["trusted_timestamp"] == trust.read_state(repo).timestamp.signed.version
    with pytest.raises(identity.BadReport, match="another key"):
        identity.open_report(stored, fleet.keys[dev.id].public_key)  # not the key the device signed with
    forged = json.loads(stored)
    forged["report"]["outcome"] = "smoke_failed"
    with pytest.raises(identity.BadReport, match="bad signature"):
        identity.open_report(json.dumps(forged).encode(), identity.device_key(a.state_dir, create=False).public_key)

    rollout_blob = trust.blob_key(
        trust.read_state(repo).targets.signed.targets[controller.rollout_path(MODEL)].hashes["sha256"]
    )
    gets, reads = repo.requests["get"], len(repo.read)
    again = a.run_once(MODEL)
    assert (again.outcome, again.active) == ("current", result.active)
    assert repo.requests["get"] - gets <= 3  # next root version probed, timestamp, rollout document
    assert [k for k in repo.read[reads:] if not k.startswith("metadata/")] == [rollout_blob]

    outside = make_agent(repo, tmp_path, device(fleet.first_in(doc, 1)[0]))
    left = outside.run_once(MODEL)
    assert (left.outcome, left.active, left.reported) == ("idle", None, None)


def test_corrupted_engine_is_never_activated(project, repo, keys, fleet, tmp_path):
    doc = start(project, repo, keys, fleet)
    entry = release.release_doc(repo, MODEL, "r1")["skus"]["cpu"]
    repo.put(trust.blob_key(entry["sha256"]["engine/model.onnx"]), b"not the engine")
    a = make_agent(repo, tmp_path, device(fleet.first_in(doc, 0)[0]), fleet)
    result = a.run_once(MODEL)
    assert result.outcome == "verify_failed" and "model.onnx" in result.detail
    assert result.active is None and a.active(MODEL) is None
    slots = a.state_dir / "models" / MODEL / "slots"
    assert not slots.exists() or not any(slots.iterdir()), "a staging slot was left behind"
    assert result.reported == controller.report_key(MODEL, doc.id, "verify_failed", a.device.id)


def test_incompatible_runtime_takes_the_portable_engine(project, repo, keys, fleet, tmp_path):
    doc = start(project, repo, keys, fleet)
    dev = device(fleet.first_in(doc, 0)[0], runtime={"onnxruntime": "0.1.0"})
    skus = release.release_doc(repo, MODEL, "r1")["skus"]
    assert agent.compatibility(skus["cpu"]["requires"], dev) == [
        f"needs onnxruntime {agent.installed_runtimes()['onnxruntime']} exactly, the device has 0.1.0"
    ]
    assert agent.compatibility(skus["portable"]["requires"], dev) == []

    a = make_agent(repo, tmp_path, dev, fleet)
    result = a.run_once(MODEL)
    assert result.outcome == "fallback", result.detail
    assert (result.active["sku"], result.active["kind"], result.active["release"]) == ("portable", "fallback", "r1")
    engine = a.active_engine_dir(MODEL) / "model.onnx"
    assert sha256_bytes(engine.read_bytes()) == skus["portable"]["sha256"]["engine/model.onnx"]
    assert result.reported == controller.report_key(MODEL, doc.id, "fallback", dev.id)


def test_smoke_failure_keeps_the_running_engine(project, project_r2, repo, keys, fleet, tmp_path):
    roll_out(project, repo, keys, fleet, complete=True)
    dev = device("dev0")
    before = make_agent(repo, tmp_path, dev, fleet).run_once(MODEL)
    assert (before.outcome, before.active["release"]) == ("ok", "r1"), before.detail
    assert release.publish_release(project_r2, repo, keys, MODEL).release == "r2"
    doc = roll_out(project, repo, keys, fleet, "r2")

    failing = make_agent(repo, tmp_path, dev, fleet, smoke=lambda entry, slot: agent.Smoke(False, "injected"))
    result = failing.run_once(MODEL)
    assert result.outcome == "smoke_failed" and "injected" in result.detail
    assert result.active == before.active == failing.active(MODEL)
    assert result.reported == controller.report_key(MODEL, doc.id, "smoke_failed", dev.id)
    r1 = release.release_doc(repo, MODEL, "r1")["skus"]["cpu"]["sha256"]["engine/engine.json"]
    assert sha256_bytes((failing.active_engine_dir(MODEL) / "engine.json").read_bytes()) == r1


@pytest.mark.parametrize("slot_damaged", [False, True], ids=["slot-intact", "slot-damaged"])
def test_rollback_flips_to_the_other_slot(project, project_r2, repo, keys, fleet, tmp_path, slot_damaged):
    roll_out(project, repo, keys, fleet, complete=True)
    a = make_agent(repo, tmp_path, device("dev0"), fleet)
    assert a.run_once(MODEL).active["slot"] == "a"
    release.publish_release(project_r2, repo, keys, MODEL)
    roll_out(project, repo, keys, fleet, "r2")
    on_r2 = a.run_once(MODEL)
    assert on_r2.outcome == "ok", on_r2.detail
    assert (on_r2.active["slot"], on_r2.active["release"]) == ("b", "r2")
    assert on_r2.previous_latency_ms is not None  # the r1 engine in slot a was timed too

    if slot_damaged:
        (a.state_dir / "models" / MODEL / "slots" / "a" / "engine" / "model.onnx").write_bytes(b"bit rot")
    controller.move(project, repo, keys, MODEL, "rollback", actor="oncall", reason="r2 misbehaves")
    reads = len(repo.read)
    back = a.run_once(MODEL)
    assert back.outcome == "ok", back.detail
    assert (back.active["slot"], back.active["release"], back.active["sku"]) == ("a", "r1", "cpu")
    assert back.reported is None  # returning to r1 is no evidence about r2
    downloaded = set(repo.read[reads:]) & release_blobs(repo, "r1")
    assert bool(downloaded) is slot_damaged, downloaded


def test_interrupted_download_installs_nothing(project, s3_store, proxy, keys, fleet, tmp_path):
    trust.initialise(s3_store, keys, project.rollout.expiry)
    release.publish_release(project, s3_store, keys, MODEL)
    doc = start(project, s3_store, keys, fleet)
    dev = device(fleet.first_in(doc, 0)[0])
    engine = release.release_doc(s3_store, MODEL, "r1")["skus"]["cpu"]["sha256"]["engine/model.onnx"]
    proxy.fail(method="GET", key_pattern=re.escape(engine) + "$", times=None)
    a = make_agent(s3_store, tmp_path, dev, fleet)
    cut = a.run_once(MODEL)
    assert (cut.outcome, cut.active, cut.reported) == ("error", None, None), cut.detail
    slots = tmp_path / "devices" / dev.id / "models" / MODEL / "slots"
    assert not slots.exists() or not any(slots.iterdir()), "a half-staged slot was left behind"

    proxy.clear()
    result = a.run_once(MODEL)
    assert (result.outcome, result.active["slot"]) == ("ok", "a"), result.detail


def test_unreachable_store_keeps_the_active_engine(project, repo, keys, fleet, tmp_path):
    doc = start(project, repo, keys, fleet)
    dev = device(fleet.first_in(doc, 0)[0])
    installed = make_agent(repo, tmp_path, dev, fleet).run_once(MODEL)
    assert installed.outcome == "ok", installed.detail

    with socket.socket() as s:  # a port nothing listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = S3Store(
        "s3://fleet/store",
        client=s3_client(
            f"http://127.0.0.1:{port}",
            connect_timeout=1,
            read_timeout=1,
            retries={"mode": "standard", "total_max_attempts": 1},
        ),
    )
    result = agent.Agent(dead, dev, tmp_path / "devices" / dev.id).run_once(MODEL)
    assert result.outcome == "error" and result.reported is None
    assert result.active == installed.active


def test_no_trusted_root(repo, tmp_path):
    a = agent.Agent(repo, device("dev0"), tmp_path / "unprovisioned")
    with pytest.raises(ConfigError, match="no trusted root"):
        a.run_once(MODEL)


def test_exact_runtime_versions_compare_their_release_part():
    """OpenVINO's engines record get_version() ('2026.4.1-22982-...'); a device reports the package
    version ('2026.4.1'): the same runtime."""
    requires = {
        "arch": None,
        "cpu_features": [],
        "exact": {"openvino": "2026.4.1-22982-e213a147257-releases/2026/4"},
        "specifiers": {"openvino": ">=2026.0,<2027"},
    }
    dev = agent.Device(id="d", sku="ov", arch=host_arch(), runtime={"openvino": "2026.4.1"}, cpu_features=frozenset())
    assert agent.compatibility(requires, dev) == []
    older = agent.Device(id="d", sku="ov", arch=host_arch(), runtime={"openvino": "2026.3.0"}, cpu_features=frozenset())
    assert agent.compatibility(requires, older) == [
        "needs openvino 2026.4.1-22982-e213a147257-releases/2026/4 exactly, the device has 2026.3.0"
    ]


# --- retries and the health window ------------------------------------------------------------------


def on_r2(project, project_r2, repo, keys, fleet, tmp_path, **kw) -> tuple[agent.Agent, controller.RolloutDoc]:
    """dev0 running r1 (slot a), then a rollout of r2 at its last wave: the agent not yet run on it."""
    roll_out(project, repo, keys, fleet, complete=True)
    a = make_agent(repo, tmp_path, device("dev0"), fleet, **kw)
    assert a.run_once(MODEL).active["release"] == "r1"
    assert release.publish_release(project_r2, repo, keys, MODEL).release == "r2"
    return a, roll_out(project, repo, keys, fleet, "r2")


def opened(repo, fleet, key: str) -> dict:
    return identity.open_report(repo.get(key).data, fleet.keys["dev0"].public_key)


def test_retries_stop_at_max_attempts(project, project_r2, repo, keys, fleet, tmp_path):
    a, doc = on_r2(project, project_r2, repo, keys, fleet, tmp_path)
    assert doc.max_attempts == project.rollout.max_attempts == 3
    failing = make_agent(repo, tmp_path, a.device, fleet, smoke=lambda entry, slot: agent.Smoke(False, "injected"))
    key = controller.report_key(MODEL, doc.id, "smoke_failed", "dev0")
    for attempt in (1, 2, 3):
        r = failing.run_once(MODEL)
        assert (r.outcome, r.attempt, r.reported, r.active["release"]) == ("smoke_failed", attempt, key, "r1"), r.detail
        assert opened(repo, fleet, key)["attempt"] == attempt

    puts, gets = repo.requests["put"], len(repo.read)
    stopped = failing.run_once(MODEL)
    assert (stopped.outcome, stopped.reported, stopped.active["release"]) == ("smoke_failed", None, "r1")
    assert "gave up on r2 after 3 failed install(s) (max_attempts 3); last: injected" in stopped.detail
    assert repo.requests["put"] == puts  # no report
    rollout_blob = trust.blob_key(
        trust.read_state(repo).targets.signed.targets[controller.rollout_path(MODEL)].hashes["sha256"]
    )
    assert [k for k in repo.read[gets:] if not k.startswith("metadata/")] == [rollout_blob]  # nothing downloaded
    assert opened(repo, fleet, key)["attempt"] == 3  # the last report stands

    # a healthy engine does not help either: this rollout's release is given up on this device
    assert make_agent(repo, tmp_path, a.device, fleet).run_once(MODEL).outcome == "smoke_failed"


@pytest.mark.parametrize("fault", ["unhealthy-marker", "corrupted-slot"])
def test_health_window_reverts_by_itself(project, project_r2, repo, keys, fleet, tmp_path, fault):
    a, doc = on_r2(project, project_r2, repo, keys, fleet, tmp_path)
    assert doc.health_window_minutes == project.rollout.health_window_minutes > 0
    now = datetime.now(timezone.utc).replace(microsecond=0)
    installed = a.run_once(MODEL, now=now)
    assert (installed.outcome, installed.active["slot"], installed.active["release"]) == ("ok", "b", "r2")
    window = timedelta(minutes=doc.health_window_minutes)
    assert installed.active["health_until"] == (now + window).isoformat()
    assert {k: installed.active["previous"][k] for k in ("slot", "release")} == {"slot": "a", "release": "r1"}
    healthy = a.run_once(MODEL, now=now + timedelta(minutes=1))
    assert (healthy.outcome, healthy.active) == ("current", installed.active)  # checked, still in the window

    model_dir = a.state_dir / "models" / MODEL
    if fault == "unhealthy-marker":
        (model_dir / agent.UNHEALTHY).write_text("inference raised: CUDA error 700\n")
        reason = "the application marked it unhealthy: inference raised: CUDA error 700"
    else:
        (model_dir / "slots" / "b" / "engine" / "model.onnx").write_bytes(b"bit rot")
        reason = "slot b no longer holds the files the signed release names"
    gets = len(repo.read)
    back = a.run_once(MODEL, now=now + timedelta(minutes=2))
    assert back.outcome == "reverted" and reason in back.detail and "back on r1" in back.detail, back.detail
    assert back.active == a.active(MODEL) == installed.active["previous"]
    assert "health_until" not in back.active and not (model_dir / agent.UNHEALTHY).exists()
    assert not set(repo.read[gets:]) & release_blobs(repo, "r1"), "slot a was downloaded again"
    assert back.reported == controller.report_key(MODEL, doc.id, "reverted", "dev0")
    body = opened(repo, fleet, back.reported)
    assert (body["outcome"], body["attempt"], body["release"]) == ("reverted", 1, "r2")
    assert repo.get(installed.reported) is None  # one report per device: the newest outcome

    # attempts remain (1 of 3 failed): the next pass installs r2 again, a new window
    again = a.run_once(MODEL, now=now + timedelta(minutes=3))
    assert (again.outcome, again.attempt, again.active["release"], again.active["slot"]) == ("ok", 2, "r2", "b")
    committed = a.run_once(MODEL, now=now + timedelta(minutes=3) + window)
    assert committed.outcome == "current"
    assert committed.active == {k: v for k, v in again.active.items() if k not in ("previous", "health_until")}
    (model_dir / agent.UNHEALTHY).write_text("too late")
    assert a.run_once(MODEL, now=now + 2 * window).outcome == "current"  # committed: nothing to go back to


def test_health_window_with_no_intact_previous_slot_keeps_the_engine(project, project_r2, repo, keys, fleet, tmp_path):
    a, doc = on_r2(project, project_r2, repo, keys, fleet, tmp_path)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    assert a.run_once(MODEL, now=now).outcome == "ok"
    model_dir = a.state_dir / "models" / MODEL
    (model_dir / "slots" / "a" / "engine" / "model.onnx").write_bytes(b"bit rot")
    (model_dir / agent.UNHEALTHY).write_text("")
    r = a.run_once(MODEL, now=now + timedelta(minutes=1))
    assert (r.outcome, r.active["release"], r.active["slot"]) == ("error", "r2", "b"), r.detail
    assert "(no reason given)" in r.detail and "previous slot a no longer verifies" in r.detail
    assert "health_until" not in a.active(MODEL)
    assert opened(repo, fleet, r.reported)["outcome"] == "error"


def test_a_revert_while_the_store_is_down_is_reported_later(project, project_r2, repo, keys, fleet, tmp_path):
    a, doc = on_r2(project, project_r2, repo, keys, fleet, tmp_path)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    assert a.run_once(MODEL, now=now).outcome == "ok"
    (a.state_dir / "models" / MODEL / agent.UNHEALTHY).write_text("segfault in the app")
    repo.down = True
    offline = a.run_once(MODEL, now=now + timedelta(minutes=1))
    assert (offline.outcome, offline.active["release"], offline.reported) == ("reverted", "r1", None)
    assert a.active(MODEL)["release"] == "r1"  # reverted without the store

    repo.down = False
    later = a.run_once(MODEL, now=now + timedelta(minutes=2))
    assert (later.outcome, later.attempt) == ("ok", 2), later.detail  # then its second attempt
    reverted = controller.report_key(MODEL, doc.id, "reverted", "dev0")
    assert repo.get(reverted) is None  # sent, then replaced by the newer outcome
    assert opened(repo, fleet, later.reported)["attempt"] == 2


# --- the command line ---------------------------------------------------------------------------------


def test_cli_identity_and_exit_0_on_the_fallback(project, repo, keys, fleet, tmp_path):
    doc = start(project, repo, keys, fleet)
    state = tmp_path / "state"
    printed = skuforge("agent", "identity", "--state", str(state), cwd=tmp_path, env=service_env())
    assert printed.returncode == 0, printed.stderr
    public = printed.stdout.strip()
    assert public == identity.device_key(state, create=False).public_key
    again = skuforge("agent", "identity", "--state", str(state), "--json", cwd=tmp_path, env=service_env())
    assert json.loads(again.stdout)["key"] == public  # made once, then read

    (tmp_path / "root.json").write_bytes(trust.root_bytes(repo))
    (tmp_path / "device.yaml").write_text(
        yaml.safe_dump(
            {
                "id": fleet.first_in(doc, 0)[0],
                "sku": "cpu",
                "models": [MODEL],
                "arch": host_arch(),
                "cpu_features": [],
                "runtime": {"onnxruntime": "0.1.0"},  # too old for the cpu engine: the portable one
            }
        )
    )
    argv = ["agent", "--device", "device.yaml", "--state", str(state), "--store", str(repo.root), "--json"]
    proc = skuforge(*argv, "--root", "root.json", cwd=tmp_path, env=service_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert (result["outcome"], result["active"]["kind"]) == ("fallback", "fallback")
    assert identity.open_report(repo.get(result["reported"]).data, public)["outcome"] == "fallback"

    missing = skuforge("agent", "--state", str(state), cwd=tmp_path, env=service_env())
    assert missing.returncode == 2 and "--device" in missing.stderr
