"""The device's side of the release store (pipeline/rollout/client.py), and issue 37's replays end to
end on S3: a device provisioned after an abort refuses the live state put back; a writer with no
record of its own cannot build on a store whose archive was deleted, and where it cannot tell (only
the archive above the replayed version deleted), the device that trusted the abort and the writer
that committed it refuse the fork until ``release repair`` restores the abort."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from cli_helpers import service_env, skuforge

from pipeline.core.errors import ConfigError
from pipeline.host.probe import host_arch
from pipeline.project.config import Expiry, Wave
from pipeline.results.signing import signing_key
from pipeline.rollout import agent, controller, identity, recovery, trust
from pipeline.rollout.client import Client
from pipeline.rollout.inventory import Device, Inventory
from rollout.conftest import MODEL
from rollout.fleet import Fleet

EVERY = [Wave(name="all", percent=100, bake_minutes=0)]


def provision(store, keys: trust.Keys, folder, device_id: str, floor: bool = True) -> Device:
    """A device set up as docs/rollout.md says: its key, its device file, the store's root and (with
    ``floor``) the store's timestamp now; its inventory row."""
    key = identity.device_key(folder / "state").public_key
    device = {"id": device_id, "sku": "cpu", "models": [MODEL], "arch": host_arch(), "cpu_features": []}
    (folder / "device.yaml").write_text(json.dumps(device))
    (folder / "root.json").write_bytes(trust.root_bytes(store, keys))
    if floor:
        (folder / "timestamp.json").write_bytes(trust.read_state(store, keys).timestamp_data)
    return Device(id=device_id, sku="cpu", arch=host_arch(), key=key)


def run_agent(store, folder, moto_s3):
    """``skuforge agent`` on a provisioned device, against the moto server."""
    env = service_env(
        AWS_ENDPOINT_URL=moto_s3.endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(folder / "none"),
    )
    args = ["--device", "device.yaml", "--state", "state", "--root", "root.json", "--store", store.url]
    if (folder / "timestamp.json").is_file():
        args += ["--timestamp", "timestamp.json"]
    return skuforge("agent", *args, cwd=folder, env=env)


def one_pass(store, folder, device_id: str) -> agent.AgentResult:
    """One agent pass in this process (no CLI start-up)."""
    floor = folder / "timestamp.json"
    dev = agent.Device(device_id, "cpu", host_arch(), agent.installed_runtimes(), frozenset())
    root = (folder / "root.json").read_bytes()
    pinned = floor.read_bytes() if floor.is_file() else None
    return agent.Agent(store, dev, folder / "state", root, timestamp=pinned).run_once(MODEL)


def live_then_aborted(project, store, keys: trust.Keys, fleet: Inventory) -> tuple[bytes, int]:
    """A rollout of r1 to every device, then aborted: the live timestamp and the aborted version."""
    controller.start(project, store, keys, MODEL, inventory=fleet, waves=EVERY, now=datetime.now(timezone.utc))
    live = store.get(trust.TIMESTAMP_KEY).data
    controller.move(project, store, keys, MODEL, "abort", actor="ci", reason="bad canary")
    return live, trust.read_state(store).timestamp.signed.version


# --- issue 37, end to end on S3 ---------------------------------------------------------------------


def test_a_device_provisioned_after_an_abort_refuses_the_live_state_put_back(
    project, published_s3, moto_s3, keys, tmp_path
):
    """Case (a): the writers refuse the replayed timestamp, and so must a device that never ran:
    the timestamp it was provisioned with is its floor."""
    store = published_s3
    live, aborted = live_then_aborted(project, store, keys, Fleet(3).inventory)
    provision(store, keys, tmp_path, "dev-new")
    store.put(trust.TIMESTAMP_KEY, live)

    proc = run_agent(store, tmp_path, moto_s3)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].startswith(
        f"dev-new {MODEL}: verify_failed: the store {store.url} serves timestamp version {aborted - 1}, older "
        f"than version {aborted} this device trusts"
    ), proc.stdout
    assert not (tmp_path / "state/models" / MODEL / "active.json").exists()  # nothing installed

    recovery.repair(store, keys, project.rollout.expiry)
    healed = one_pass(store, tmp_path, "dev-new")
    assert (healed.outcome, healed.active) == ("idle", None) and "aborted" in healed.detail


def test_a_writer_without_a_record_cannot_fork_a_replayed_store(project, published_s3, moto_s3, tmp_path):
    """Case (b): after a replay and a deleted archive, a fresh CI runner (no record) must not sign a
    second history; where it cannot tell (the archive up to the replayed version left in place), the
    device that trusted the abort and the writer that committed it refuse what it signed, and that
    writer's repair restores the abort for every device."""
    store = published_s3
    first = trust.Keys.single(signing_key(), ledger=tmp_path / "ledger")  # a runner with a persistent cache
    fresh = trust.Keys.single(signing_key())  # a runner with no record of its own
    (tmp_path / "dev").mkdir()
    row = provision(store, first, tmp_path / "dev", "dev-b", floor=False)
    live, aborted = live_then_aborted(project, store, first, Inventory([row]))
    assert one_pass(store, tmp_path / "dev", "dev-b").outcome == "idle"  # it trusts the abort
    store.put(trust.TIMESTAMP_KEY, live)
    archive = {k: store.get(k).data for k in store.list(trust.ARCHIVE)}
    for k in archive:
        store.delete(k)
    before = {k: store.get(k).data for k in store.list("metadata")}

    unproven = rf"cannot prove that metadata/timestamp.json \(version {aborted - 1}\) is its newest state"
    with pytest.raises(trust.Unproven, match=unproven) as err:
        controller.move(project, store, fresh, MODEL, "pause", actor="ci", reason="fresh runner")
    assert "release repair" in err.value.hint
    assert {k: store.get(k).data for k in store.list("metadata")} == before

    for k, data in archive.items():  # only what is above the replayed version stays deleted
        if trust._archived_version(k) < aborted:
            store.put(k, data)
    controller.move(project, store, fresh, MODEL, "pause", actor="ci", reason="fresh runner")  # another v{aborted}
    controller.move(project, store, fresh, MODEL, "resume", actor="ci", reason="fresh runner")  # live again
    proc = run_agent(store, tmp_path / "dev", moto_s3)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].startswith(
        f"dev-b {MODEL}: verify_failed: the store {store.url} was forked: its timestamp version {aborted + 1} "
        f"does not follow version {aborted} this device trusts"
    ), proc.stdout
    assert not (tmp_path / "dev/state/models" / MODEL / "active.json").exists()
    with pytest.raises(trust.Forked, match=f"does not follow version {aborted} .* this machine committed or verified"):
        controller.move(project, store, first, MODEL, "rollback", actor="ci", reason="first runner")

    fixed = recovery.repair(store, first, project.rollout.expiry)
    assert (fixed.action, fixed.forked, fixed.kept, fixed.dropped) == (
        "restored",
        True,
        aborted,
        [aborted, aborted + 1],
    )
    assert fixed.timestamp == aborted + 2
    assert controller.status(project, store, MODEL).rollout.status == "aborted"
    healed = one_pass(store, tmp_path / "dev", "dev-b")  # it follows a repair, whatever it trusted
    assert (healed.outcome, healed.active) == ("idle", None) and "aborted" in healed.detail
    assert trust.read_state(store, fresh).timestamp.signed.version == aborted + 2  # the archive vouches again


# --- the device's checks, on a local store ----------------------------------------------------------


@pytest.fixture
def repo(local_store, keys):
    trust.initialise(local_store, keys, Expiry())
    return local_store


def publish(store, keys, path: str) -> bytes:
    """Commit target ``path``; the timestamp it committed."""
    trust.put_blob(store, path.encode())
    trust.commit(store, keys, Expiry(), lambda targets, state: trust.add_target(targets, path, path.encode()) or True)
    return store.get(trust.TIMESTAMP_KEY).data


def fork(store, keys, back_to: bytes, path: str) -> None:
    """Put ``back_to`` back, delete the archive above it, and commit ``path`` as a writer with no record."""
    store.put(trust.TIMESTAMP_KEY, back_to)
    version = json.loads(back_to)["signed"]["version"]
    for key in list(store.list(trust.ARCHIVE)):
        if trust._archived_version(key) > version:
            store.delete(key)
    publish(store, keys, path)


def device(store, tmp_path, timestamp: bytes | None = None) -> Client:
    return Client(store, tmp_path / "dev", trust.root_bytes(store), timestamp)


def test_the_provisioned_timestamp_is_a_floor(repo, keys, tmp_path):
    v2 = publish(repo, keys, "one")
    v3 = publish(repo, keys, "two")
    repo.put(trust.TIMESTAMP_KEY, v2)
    with pytest.raises(trust.Replayed, match="serves timestamp version 2, older than version 3 this device trusts"):
        device(repo, tmp_path, v3).refresh()
    repo.put(trust.TIMESTAMP_KEY, v3)
    dev = device(repo, tmp_path, v2)  # provisioned with an older one than it trusts: ignored
    dev.refresh()
    assert dev.fetch("two") == b"two"
    edited = r"provisioned timestamp \(agent --timestamp\) is unusable: timestamp was signed by 0/1"  # after signing
    with pytest.raises(ConfigError, match=edited) as err:
        Client(repo, tmp_path / "other", trust.root_bytes(repo), v3.replace(b'"version": 3', b'"version": 9'))
    assert "release root --out root.json --timestamp-out" in err.value.hint


def test_another_timestamp_at_the_trusted_version_or_off_its_links_is_a_fork(repo, keys, tmp_path):
    v2 = publish(repo, keys, "one")
    publish(repo, keys, "two")  # v3
    dev = device(repo, tmp_path)
    dev.refresh()
    fork(repo, keys, v2, "other")  # another v3
    with pytest.raises(trust.Forked, match="serves a timestamp version 3 .* other than the version 3 this device"):
        device(repo, tmp_path).refresh()
    publish(repo, keys, "more")  # v4 on the other history
    with pytest.raises(trust.Forked, match="version 4 does not follow version 3 this device trusts"):
        device(repo, tmp_path).refresh()
    assert json.loads((tmp_path / "dev/timestamp.json").read_bytes())["signed"]["version"] == 3  # still trusted
    with pytest.raises(trust.Forked):  # and again on the next pass: it was not taken in
        device(repo, tmp_path).refresh()


def test_a_device_follows_the_links_over_several_versions(repo, keys, tmp_path):
    publish(repo, keys, "one")
    dev = device(repo, tmp_path)
    dev.refresh()  # trusts v2
    for name in ("two", "three", "four"):
        publish(repo, keys, name)  # v5
    gets = repo.requests["get"]
    dev = device(repo, tmp_path)
    dev.refresh()
    assert dev.fetch("four") == b"four"
    assert repo.requests["get"] - gets <= 9  # ngclient's five (root probe, timestamp, snapshot, targets, blob) + v4, v3
    publish(repo, keys, "five")
    publish(repo, keys, "six")  # v7
    repo.delete(trust.archive_key(6))
    with pytest.raises(trust.Unproven, match=r"timestamps/999999999994-6.json, which version 7 follows, is missing"):
        device(repo, tmp_path).refresh()


def test_the_first_writers_record_holds_the_digest(repo, tmp_path, keys):
    """Its record at the store's version, but another file there: the store was forked."""
    mine = trust.Keys.single(keys.online, ledger=tmp_path / "ledger")
    v2 = publish(repo, mine, "one")
    publish(repo, mine, "two")  # v3, recorded
    fork(repo, keys, v2, "other")  # another v3 by a writer with no record
    with pytest.raises(trust.Forked, match="version 3 .* that this machine committed or verified .* sha256"):
        publish(repo, mine, "three")
    fixed = recovery.repair(repo, mine, Expiry())
    assert (fixed.forked, fixed.kept, fixed.dropped, fixed.timestamp) == (True, 3, [3], 4)
    assert set(trust.read_state(repo).targets.signed.targets) == {"one", "two"}
