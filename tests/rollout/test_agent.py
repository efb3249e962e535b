"""The device agent: verified install into an A/B slot, smoke test, atomic switch, report."""

from __future__ import annotations

import json
import re
import shutil
import socket
from datetime import datetime, timedelta, timezone

import pytest
import yaml

from pipeline.core.errors import ConfigError
from pipeline.core.io import sha256_bytes
from pipeline.host.probe import host_arch
from pipeline.project.config import load_registry
from pipeline.rollout import agent, controller, release, trust
from pipeline.rollout.store import LocalStore, S3Store
from pipeline.stages.bench import bench
from pipeline.stages.build import build
from pipeline.stages.manifest import write_manifest
from pipeline.stages.validate import validate
from rollout.conftest import MODEL, first_in
from rollout.s3server import s3_client

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=timezone.utc)


class ReadLog(LocalStore):
    """The local store, remembering every key read (to tell a download from a metadata check)."""

    def __init__(self, root):
        super().__init__(root)
        self.read: list[str] = []

    def get(self, key):
        self.read.append(key)
        return super().get(key)


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
        stage(reg, MODEL, "cpu")
    return reg


def device(device_id: str, runtime: dict[str, str] | None = None) -> agent.Device:
    return agent.Device(
        id=device_id,
        sku="cpu",
        arch=host_arch(),
        runtime=runtime or agent.installed_runtimes(),
        cpu_features=frozenset(),
    )


def make_agent(store, tmp_path, dev: agent.Device, **kw) -> agent.Agent:
    return agent.Agent(store, dev, tmp_path / "devices" / dev.id, trust.root_bytes(store), **kw)


def roll_out(registry, store, keys, release_id=None, complete=False) -> controller.RolloutDoc:
    """Start a rollout and advance it to its last wave (or past it) on healthy synthetic reports."""
    doc = controller.start(registry, store, keys, MODEL, release_id, now=T0)
    now = T0
    for n in range(registry.rollout.gates.min_reports):
        store.put(controller.report_key(MODEL, doc.id, "ok", f"sim{n}"), json.dumps({"latency_ratio": 1.0}).encode())
    for wave in doc.waves if complete else doc.waves[:-1]:
        now += timedelta(minutes=wave.bake_minutes + 1)
        doc = controller.advance(registry, store, keys, MODEL, now=now).rollout
    assert doc.status == ("completed" if complete else "active") and doc.wave == len(doc.waves) - 1
    return doc


def release_blobs(store, rid: str) -> set[str]:
    """Blob keys of every file of release ``rid`` (its engines, manifests, golden data)."""
    doc = release.release_doc(store, MODEL, rid)
    return {trust.blob_key(sha) for entry in doc["skus"].values() for sha in entry["sha256"].values()}


def test_first_wave_device_installs_then_stays_current(project, repo, keys, tmp_path):
    doc = controller.start(project, repo, keys, MODEL, now=T0)
    dev = device(first_in(doc, 0)[0])
    a = make_agent(repo, tmp_path, dev)
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
    report = json.loads(repo.get(result.reported).data)
    assert report["release"] == "r1" and report["outcome"] == "ok" and report["latency_ms"] > 0

    rollout_blob = trust.blob_key(
        trust.read_state(repo).targets.signed.targets[controller.rollout_path(MODEL)].hashes["sha256"]
    )
    gets, reads = repo.requests["get"], len(repo.read)
    again = a.run_once(MODEL)
    assert (again.outcome, again.active) == ("current", result.active)
    assert repo.requests["get"] - gets <= 3  # next root version probed, timestamp, rollout document
    assert [k for k in repo.read[reads:] if not k.startswith("metadata/")] == [rollout_blob]

    outside = make_agent(repo, tmp_path, device(first_in(doc, 1)[0]))
    left = outside.run_once(MODEL)
    assert (left.outcome, left.active, left.reported) == ("idle", None, None)


def test_corrupted_engine_is_never_activated(project, repo, keys, tmp_path):
    doc = controller.start(project, repo, keys, MODEL, now=T0)
    entry = release.release_doc(repo, MODEL, "r1")["skus"]["cpu"]
    repo.put(trust.blob_key(entry["sha256"]["engine/model.onnx"]), b"not the engine")
    a = make_agent(repo, tmp_path, device(first_in(doc, 0)[0]))
    result = a.run_once(MODEL)
    assert result.outcome == "verify_failed" and "model.onnx" in result.detail
    assert result.active is None and a.active(MODEL) is None
    slots = a.state_dir / "models" / MODEL / "slots"
    assert not slots.exists() or not any(slots.iterdir()), "a staging slot was left behind"
    assert result.reported == controller.report_key(MODEL, doc.id, "verify_failed", a.device.id)


def test_incompatible_runtime_takes_the_portable_engine(project, repo, keys, tmp_path):
    doc = controller.start(project, repo, keys, MODEL, now=T0)
    dev = device(first_in(doc, 0)[0], runtime={"onnxruntime": "0.1.0"})
    skus = release.release_doc(repo, MODEL, "r1")["skus"]
    assert agent.compatibility(skus["cpu"]["requires"], dev) == [
        f"needs onnxruntime {agent.installed_runtimes()['onnxruntime']} exactly, the device has 0.1.0"
    ]
    assert agent.compatibility(skus["portable"]["requires"], dev) == []

    a = make_agent(repo, tmp_path, dev)
    result = a.run_once(MODEL)
    assert result.outcome == "fallback", result.detail
    assert (result.active["sku"], result.active["kind"], result.active["release"]) == ("portable", "fallback", "r1")
    engine = a.active_engine_dir(MODEL) / "model.onnx"
    assert sha256_bytes(engine.read_bytes()) == skus["portable"]["sha256"]["engine/model.onnx"]
    assert result.reported == controller.report_key(MODEL, doc.id, "fallback", dev.id)


def test_smoke_failure_keeps_the_running_engine(project, project_r2, repo, keys, tmp_path):
    roll_out(project, repo, keys, complete=True)
    dev = device("dev0")
    before = make_agent(repo, tmp_path, dev).run_once(MODEL)
    assert (before.outcome, before.active["release"]) == ("ok", "r1"), before.detail
    assert release.publish_release(project_r2, repo, keys, MODEL).release == "r2"
    doc = roll_out(project, repo, keys, "r2")

    failing = make_agent(repo, tmp_path, dev, smoke=lambda entry, slot: agent.Smoke(False, "injected"))
    result = failing.run_once(MODEL)
    assert result.outcome == "smoke_failed" and "injected" in result.detail
    assert result.active == before.active == failing.active(MODEL)
    assert result.reported == controller.report_key(MODEL, doc.id, "smoke_failed", dev.id)
    r1 = release.release_doc(repo, MODEL, "r1")["skus"]["cpu"]["sha256"]["engine/engine.json"]
    assert sha256_bytes((failing.active_engine_dir(MODEL) / "engine.json").read_bytes()) == r1


@pytest.mark.parametrize("slot_damaged", [False, True], ids=["slot-intact", "slot-damaged"])
def test_rollback_flips_to_the_other_slot(project, project_r2, repo, keys, tmp_path, slot_damaged):
    roll_out(project, repo, keys, complete=True)
    a = make_agent(repo, tmp_path, device("dev0"))
    assert a.run_once(MODEL).active["slot"] == "a"
    release.publish_release(project_r2, repo, keys, MODEL)
    roll_out(project, repo, keys, "r2")
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


def test_interrupted_download_installs_nothing(project, s3_store, proxy, keys, tmp_path):
    trust.initialise(s3_store, keys, project.rollout.expiry)
    release.publish_release(project, s3_store, keys, MODEL)
    doc = controller.start(project, s3_store, keys, MODEL, now=T0)
    dev = device(first_in(doc, 0)[0])
    engine = release.release_doc(s3_store, MODEL, "r1")["skus"]["cpu"]["sha256"]["engine/model.onnx"]
    proxy.fail(method="GET", key_pattern=re.escape(engine) + "$", times=None)
    a = make_agent(s3_store, tmp_path, dev)
    cut = a.run_once(MODEL)
    assert (cut.outcome, cut.active, cut.reported) == ("error", None, None), cut.detail
    slots = tmp_path / "devices" / dev.id / "models" / MODEL / "slots"
    assert not slots.exists() or not any(slots.iterdir()), "a half-staged slot was left behind"

    proxy.clear()
    result = a.run_once(MODEL)
    assert (result.outcome, result.active["slot"]) == ("ok", "a"), result.detail


def test_unreachable_store_keeps_the_active_engine(project, repo, keys, tmp_path):
    doc = controller.start(project, repo, keys, MODEL, now=T0)
    dev = device(first_in(doc, 0)[0])
    installed = make_agent(repo, tmp_path, dev).run_once(MODEL)
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
