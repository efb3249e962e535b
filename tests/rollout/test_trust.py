"""The TUF repository in the release store and the device client, on a local folder and on S3."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time

import pytest
import time_machine

from pipeline.core.errors import ConfigError, ServiceError, StorageError
from pipeline.project.config import Expiry
from pipeline.results.signing import SigningKey
from pipeline.rollout import controller, recovery, release, trust
from pipeline.rollout.client import Client
from pipeline.rollout.store import LocalStore
from pipeline.rollout.trust import VerificationFailed
from rollout.conftest import MODEL
from rollout.fleet import Fleet

ENGINE = "releases/m/r1/cpu/engine/model.onnx"


@pytest.fixture
def wait():
    """``wait(seconds)`` lets ``seconds`` pass on this process's clock (time-machine: time.time and
    datetime.now, which the writer's and TUF's expiry checks read; not time.monotonic, which timeouts
    use), as a sleep would: the clock keeps running from there. The S3 server, another process, is a
    few seconds behind, well inside SigV4's 15 minutes. The clock is back at the test's end."""
    with contextlib.ExitStack() as travels:
        yield lambda seconds: travels.enter_context(time_machine.travel(time.time() + seconds, tick=True))


@pytest.fixture(scope="module")
def keys() -> trust.Keys:
    return trust.Keys.single(SigningKey.generate())


@pytest.fixture
def repo(store, keys):
    assert trust.initialise(store, keys, Expiry())
    return store


@pytest.fixture
def s3_repo(s3_store, keys):
    """A repository on S3 only: for faults the proxy injects."""
    assert trust.initialise(s3_store, keys, Expiry())
    return s3_store


def publish(
    store, keys, path: str, data: bytes, custom: dict | None = None, expiry: Expiry | None = None
) -> trust.State:
    """Upload ``data`` and commit it as target ``path``: what a release does for each file."""
    trust.put_blob(store, data)

    def change(targets, state):
        trust.add_target(targets, path, data, custom)
        return True

    state = trust.commit(store, keys, expiry or Expiry(), change, what=f"add {path}")
    assert state is not None
    return state


def client(store, tmp_path, name: str = "dev") -> Client:
    """A device: a new one gets the store's root; one that exists keeps its trusted metadata."""
    folder = tmp_path / name
    return Client(store, folder, None if (folder / "root.json").is_file() else trust.root_bytes(store))


# --- publishing and fetching ------------------------------------------------------------------------


def test_initialise_creates_the_four_roles_once(store, keys):
    assert trust.initialise(store, keys, Expiry()) == "created"
    for name in ("1.root.json", "root.json", "1.targets.json", "1.snapshot.json", "timestamp.json"):
        assert store.exists(f"metadata/{name}"), name
    assert store.exists(trust.archive_key(1))
    state = trust.read_state(store)
    assert [md.signed.version for md in (state.root, state.targets, state.snapshot, state.timestamp)] == [1, 1, 1, 1]
    assert state.targets.signed.targets == {}
    before = sorted((k, store.get(k)) for k in store.list("metadata"))
    assert trust.initialise(store, keys, Expiry()) == "existing"
    assert sorted((k, store.get(k)) for k in store.list("metadata")) == before


def test_commit_then_a_device_fetches_the_target(repo, keys, tmp_path):
    data = b"engine bytes \x00\x01"
    state = publish(repo, keys, ENGINE, data, {"model": "m", "sku": "cpu"})
    assert state.timestamp.signed.version == 2
    assert trust.read_target(repo, trust.read_state(repo), ENGINE) == data
    dev = client(repo, tmp_path)
    dev.refresh()
    assert dev.fetch(ENGINE) == data
    assert dev.custom(ENGINE) == {"model": "m", "sku": "cpu"}
    assert dev.fetch("releases/m/r1/cpu/absent") is None
    assert dev.custom("releases/m/r1/cpu/absent") is None


def test_commit_with_nothing_to_do_writes_nothing(repo, keys):
    before = sorted(repo.list("metadata"))
    assert trust.commit(repo, keys, Expiry(), lambda targets, state: False) is None
    assert sorted(repo.list("metadata")) == before


def test_put_blob_is_by_content_and_repairs_a_damaged_copy(repo):
    sha = trust.put_blob(repo, b"payload")
    assert repo.get(trust.blob_key(sha)).data == b"payload"
    assert trust.put_blob(repo, b"payload") == sha
    repo.put(trust.blob_key(sha), b"payl")  # truncated by hand
    assert trust.put_blob(repo, b"payload") == sha
    assert repo.get(trust.blob_key(sha)).data == b"payload"


# --- concurrent writers -----------------------------------------------------------------------------


def test_two_concurrent_commits_lose_no_update(repo, keys, tmp_path):
    both_read = threading.Barrier(2)
    results: dict[str, trust.State] = {}
    errors: list[BaseException] = []

    def writer(path: str) -> None:
        data = path.encode()
        trust.put_blob(repo, data)
        calls = []

        def change(targets, state):
            calls.append(state.timestamp.signed.version)
            if len(calls) == 1:
                both_read.wait(timeout=30)  # both build on the same state: one must lose the swap
            trust.add_target(targets, path, data)
            return True

        try:
            results[path] = trust.commit(repo, keys, Expiry(), change)
        except BaseException as exc:  # reported below: a thread's exception would vanish
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(p,)) for p in ("a/one", "b/two")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors

    final = trust.read_state(repo)
    assert set(final.targets.signed.targets) == {"a/one", "b/two"}
    assert sorted(s.timestamp.signed.version for s in results.values()) == [2, 3]
    first, last = sorted(results.values(), key=lambda s: s.timestamp.signed.version)
    assert first.snapshot.signed.version < last.snapshot.signed.version
    assert first.targets.signed.version < last.targets.signed.version
    assert final.timestamp.signed.version == 3
    assert final.targets.signed.version == last.targets.signed.version
    dev = client(repo, tmp_path)
    assert dev.fetch("a/one") == b"a/one" and dev.fetch("b/two") == b"b/two"


def test_commit_whose_timestamp_answer_is_lost_succeeds_once(s3_repo, keys, proxy, tmp_path):
    repo = s3_repo
    proxy.clear()  # count only this commit's requests
    proxy.drop(method="PUT", key_pattern=r"metadata/timestamp\.json$", after_body=True)
    state = publish(repo, keys, ENGINE, b"engine")
    assert proxy.count(method="PUT", key_pattern=r"metadata/timestamp\.json$") == 2  # the write, its retry
    assert state.timestamp.signed.version == 2
    final = trust.read_state(repo)
    assert final.timestamp.signed.version == 2
    assert final.targets.signed.version == 2
    assert client(repo, tmp_path).fetch(ENGINE) == b"engine"


def test_interrupted_publish_is_invisible_until_it_completes(s3_repo, keys, proxy, tmp_path):
    repo = s3_repo
    publish(repo, keys, "old", b"old")
    proxy.fail(method="PUT", key_pattern=r"metadata/timestamp\.json$", status=500, code="InternalError", times=None)
    with pytest.raises(ServiceError, match="timestamp.json"):
        publish(repo, keys, ENGINE, b"engine")
    assert repo.exists(trust.blob_key(hashlib.sha256(b"engine").hexdigest()))  # blobs went up first

    dev = client(repo, tmp_path)
    assert dev.fetch(ENGINE) is None  # the signed state is still the previous one, whole
    assert dev.fetch("old") == b"old"
    assert trust.read_state(repo).timestamp.signed.version == 2

    proxy.clear()
    publish(repo, keys, ENGINE, b"engine")
    assert set(trust.read_state(repo).targets.signed.targets) == {"old", ENGINE}
    assert client(repo, tmp_path, "dev2").fetch(ENGINE) == b"engine"


# --- what a device refuses --------------------------------------------------------------------------


def test_corrupted_blob_is_refused(repo, keys, tmp_path):
    data = b"genuine engine"
    publish(repo, keys, ENGINE, data)
    sha = trust.read_state(repo).targets.signed.targets[ENGINE].hashes["sha256"]
    repo.put(trust.blob_key(sha), b"evil" + data[4:])  # same length, other bytes
    with pytest.raises(VerificationFailed, match=ENGINE):
        client(repo, tmp_path).fetch(ENGINE)
    with pytest.raises(VerificationFailed, match=ENGINE):
        trust.read_target(repo, trust.read_state(repo), ENGINE)
    repo.put(trust.blob_key(sha), data + b"trailer")  # longer
    with pytest.raises(VerificationFailed):
        client(repo, tmp_path, "dev2").fetch(ENGINE)


def _other_signer(data: bytes) -> bytes:
    from tuf.api.metadata import Metadata

    md = Metadata.from_bytes(data)
    md.sign(SigningKey.generate().tuf_signer())
    return md.to_bytes()


def _edited(data: bytes) -> bytes:
    doc = json.loads(data)
    doc["signed"]["targets"][ENGINE]["length"] += 1
    return json.dumps(doc).encode()


@pytest.mark.parametrize("tamper", [_other_signer, _edited], ids=["other-key", "edited"])
def test_tampered_targets_are_refused(repo, keys, tmp_path, tamper):
    publish(repo, keys, ENGINE, b"engine")
    key = "metadata/2.targets.json"
    repo.put(key, tamper(repo.get(key).data))
    with pytest.raises(VerificationFailed, match="targets"):
        trust.read_state(repo)
    with pytest.raises(VerificationFailed, match="Unsigned|signature"):
        client(repo, tmp_path).refresh()


def test_replayed_timestamp_is_refused(repo, keys, tmp_path):
    old = repo.get(trust.TIMESTAMP_KEY).data
    publish(repo, keys, "one", b"1")
    publish(repo, keys, "two", b"2")
    dev = client(repo, tmp_path)
    dev.refresh()
    assert dev.updater._trusted_set.timestamp.version == 3
    repo.put(trust.TIMESTAMP_KEY, old)  # validly signed, older
    with pytest.raises(trust.Replayed, match="serves timestamp version 1, older than version 3 this device trusts"):
        client(repo, tmp_path).refresh()  # the same device, restarted


def test_frozen_store_is_noticed_and_a_fresh_timestamp_cures_it(repo, keys, tmp_path, wait):
    publish(repo, keys, ENGINE, b"engine", expiry=Expiry(timestamp_days=2 / 86400))
    wait(3)
    with pytest.raises(VerificationFailed, match="(?i)expired"):
        client(repo, tmp_path).refresh()
    assert trust.refresh_timestamp(repo, keys, Expiry(), force=True)
    assert client(repo, tmp_path).fetch(ENGINE) == b"engine"


def test_refresh_timestamp_waits_for_half_life(repo, keys):
    assert trust.refresh_timestamp(repo, keys, Expiry()) is False
    assert trust.read_state(repo).timestamp.signed.version == 1
    assert trust.refresh_timestamp(repo, keys, Expiry(), force=True)
    assert trust.read_state(repo).timestamp.signed.version == 2


def test_writer_with_a_key_the_root_does_not_name_is_refused(repo):
    stranger = trust.Keys.single(SigningKey.generate())
    before = sorted(repo.list("metadata"))
    # not a root key of the store and nothing pinned: the store is not this writer's to sign
    with pytest.raises(VerificationFailed, match="not one this project created"):
        publish(repo, stranger, ENGINE, b"engine")
    with pytest.raises(VerificationFailed):
        trust.refresh_timestamp(repo, stranger, Expiry(), force=True)
    # pinned (it trusts this store's root) but not its online key: may not sign
    pinned = trust.Keys.single(stranger.online, anchor=repo.get("metadata/1.root.json").data)
    with pytest.raises(ConfigError, match="may not sign"):
        publish(repo, pinned, ENGINE, b"engine")
    assert sorted(repo.list("metadata")) == before


def test_unreachable_store_is_a_service_error_on_the_device(s3_repo, keys, proxy, tmp_path):
    publish(s3_repo, keys, ENGINE, b"engine")
    dev = client(s3_repo, tmp_path)
    proxy.fail(method="GET", key_pattern=r"metadata/", status=500, code="InternalError", times=None)
    with pytest.raises(ServiceError, match="metadata/.*HTTP 500"):
        dev.refresh()
    proxy.clear()
    dev = client(s3_repo, tmp_path)
    dev.refresh()
    proxy.fail(method="GET", key_pattern=r"blobs/", status=500, code="InternalError", times=None)
    with pytest.raises(ServiceError, match="blobs/sha256"):
        dev.fetch(ENGINE)


def test_forged_root_copy_is_refused(repo, keys):
    """Someone with write access to the store but no key replaces the root.json copy with a root
    that also names their key, and signs their own targets with it. A writer must not build on it
    (it would sign the forged targets with the real key, and devices would install them)."""
    from tuf.api.metadata import Metadata, MetaFile

    attacker = SigningKey.generate().tuf_signer()
    root = Metadata.from_bytes(repo.get("metadata/1.root.json").data)
    for role in ("targets", "snapshot", "timestamp"):
        root.signed.add_key(attacker.public_key, role)
    root.sign(attacker)
    repo.put("metadata/root.json", root.to_bytes())
    state = trust.read_state(repo)
    trust.add_target(state.targets.signed, "evil", b"evil")
    state.targets.signed.version = 2
    state.targets.sign(attacker)
    repo.put("metadata/2.targets.json", state.targets.to_bytes())
    state.snapshot.signed.version = 2
    state.snapshot.signed.meta["targets.json"] = MetaFile(version=2)
    state.snapshot.sign(attacker)
    repo.put("metadata/2.snapshot.json", state.snapshot.to_bytes())
    state.timestamp.signed.version = 2
    state.timestamp.signed.snapshot_meta = MetaFile(version=2)
    state.timestamp.sign(attacker)
    repo.put(trust.TIMESTAMP_KEY, state.timestamp.to_bytes())

    with pytest.raises(VerificationFailed):
        trust.read_state(repo)


def test_a_forged_root_chain_is_refused_by_writers(repo, keys):
    """A store writer replaces the whole chain with a root of their own that names the project's
    (public) online key for every online role: self-consistent, so readers cannot tell; a writer
    must, or it would sign the attacker's targets with the real key."""
    from tuf.api.metadata import Metadata

    attacker = SigningKey.generate()
    forged = Metadata.from_bytes(repo.get("metadata/1.root.json").data)
    forged.signed.roles["root"].keyids = []
    forged.signed.add_key(attacker.tuf_signer().public_key, "root")
    forged.sign(attacker.tuf_signer())
    repo.put("metadata/1.root.json", forged.to_bytes())
    repo.put("metadata/root.json", forged.to_bytes())

    with pytest.raises(VerificationFailed, match="not one this project created"):
        trust.commit(repo, keys, Expiry(), lambda targets, state: trust.add_target(targets, "evil", b"x") or True)
    pinned = trust.Keys.single(keys.online, anchor=forged.to_bytes())  # pinning it says: trust this one
    assert trust.read_state(repo, pinned).root.signed.version == 1


# --- a store put back to an older state (replay / rollback) ------------------------------------------


def _metadata(store) -> dict[str, bytes]:
    return {k: store.get(k).data for k in store.list("metadata")}


def test_replayed_timestamp_is_refused_by_writers_and_readers_until_repaired(repo, keys, tmp_path):
    """A store writer without keys puts back an older timestamp.json: every reader and writer here
    refuses it naming both versions (devices refuse it by themselves); repair signs above it."""
    publish(repo, keys, "one", b"1")
    old = repo.get(trust.TIMESTAMP_KEY).data  # v2
    publish(repo, keys, "two", b"2")  # v3
    dev = client(repo, tmp_path)
    dev.refresh()
    repo.put(trust.TIMESTAMP_KEY, old)
    before = _metadata(repo)

    replayed = r"timestamp.json is version 2, older than version 3 .*timestamps/999999999997-3.json"
    with pytest.raises(VerificationFailed, match=replayed) as err:
        trust.read_state(repo)
    assert "release repair" in err.value.hint
    with pytest.raises(VerificationFailed, match=replayed):
        publish(repo, keys, "three", b"3")
    with pytest.raises(VerificationFailed, match=replayed):
        trust.refresh_timestamp(repo, keys, Expiry(), force=True)
    assert _metadata(repo) == before  # nothing signed on top of the replayed state

    fixed = recovery.repair(repo, keys, Expiry())
    # v3's state, committed again above every version: its snapshot is v4 (a device may trust any)
    assert (fixed.replayed, fixed.found, fixed.newest, fixed.timestamp, fixed.kept, fixed.snapshot) == (
        True,
        2,
        3,
        4,
        3,
        4,
    )
    state = trust.read_state(repo)
    assert state.timestamp.signed.version == 4
    assert set(state.targets.signed.targets) == {"one", "two"}  # nothing lost
    dev = client(repo, tmp_path)  # the device that trusted v3, restarted
    dev.refresh()
    assert dev.fetch("two") == b"2"
    again = recovery.repair(repo, keys, Expiry())
    assert (again.replayed, again.timestamp) == (False, 4)
    publish(repo, keys, "three", b"3")
    assert trust.read_state(repo).timestamp.signed.version == 5


def test_the_writers_ledger_catches_a_replay_that_emptied_the_archive(repo, keys, tmp_path):
    """The archive is in the store, so a store writer can delete it: a writer's own record of what it
    committed (on its machine) still refuses, and repair goes back to the state it recorded."""
    mine = trust.Keys.single(keys.online, ledger=tmp_path / "ledger")
    publish(repo, mine, "one", b"1")
    old = repo.get(trust.TIMESTAMP_KEY).data
    publish(repo, mine, "two", b"2")
    repo.put(trust.TIMESTAMP_KEY, old)
    for key in list(repo.list(trust.ARCHIVE)):
        repo.delete(key)

    assert trust.read_state(repo).timestamp.signed.version == 2  # a reader without a record cannot tell
    with pytest.raises(VerificationFailed, match="version 2, older than version 3 this machine committed"):
        publish(repo, mine, "three", b"3")
    fixed = recovery.repair(repo, mine, Expiry())
    assert (fixed.replayed, fixed.newest, fixed.timestamp, fixed.kept, fixed.snapshot) == (True, 3, 4, 3, 4)
    assert set(trust.read_state(repo).targets.signed.targets) == {"one", "two"}
    publish(repo, mine, "three", b"3")


def test_a_store_made_again_at_the_same_url_is_not_a_replay(store, keys, tmp_path):
    mine = trust.Keys.single(keys.online, ledger=tmp_path / "ledger")
    assert trust.initialise(store, mine, Expiry()) == "created"
    publish(store, mine, "one", b"1")
    publish(store, mine, "two", b"2")
    for key in list(store.list("")):
        store.delete(key)
    # a new 1.root.json: another store (the same bytes would be the same store to devices too)
    assert trust.initialise(store, mine, Expiry(root_days=300)) == "created"
    publish(store, mine, "again", b"a")
    assert trust.read_state(store).timestamp.signed.version == 2


def test_archive_entries_that_do_not_verify_are_ignored(repo, keys):
    """Someone without the key writes 'newer' archive entries: a copy of an older timestamp, a
    timestamp signed by another key, garbage. None of them makes a sound store look replayed."""
    publish(repo, keys, "one", b"1")
    v2 = repo.get(trust.TIMESTAMP_KEY).data
    repo.put(trust.archive_key(7), v2)  # says version 2 inside
    repo.put(trust.archive_key(8), _other_signer(v2))
    repo.put(trust.archive_key(9), b"not json")
    repo.put(f"{trust.ARCHIVE}/000000000000-999.json", b"{}")  # not an archive name: never read
    assert trust.read_state(repo).timestamp.signed.version == 2
    publish(repo, keys, "two", b"2")
    assert trust.read_state(repo).timestamp.signed.version == 3


def test_a_commit_killed_before_its_archive_is_not_a_replay(repo, keys):
    publish(repo, keys, "one", b"1")
    repo.delete(trust.archive_key(2))  # the swap landed, the archive write did not
    assert trust.read_state(repo).timestamp.signed.version == 2
    assert recovery.repair(repo, keys, Expiry()).replayed is False
    assert repo.exists(trust.archive_key(2))  # repair archived the current one


def test_the_archive_lists_newest_first_and_is_read_one_page_deep(s3_repo, keys):
    """Readers stop at the first archive entry not above timestamp.json: one list request, however
    long the history."""
    for i in range(3):
        publish(s3_repo, keys, f"t{i}", str(i).encode())
    assert list(s3_repo.list(trust.ARCHIVE)) == [trust.archive_key(v) for v in (4, 3, 2, 1)]
    s3_repo.requests.clear()
    trust.read_state(s3_repo)
    assert s3_repo.requests["list"] == 1
    # 1.root.json, 2.root.json (absent), timestamp, snapshot, targets: no archived entry read
    assert s3_repo.requests["get"] == 5


def test_an_older_snapshot_copied_over_a_newer_is_refused(repo, keys):
    publish(repo, keys, "one", b"1")
    publish(repo, keys, "two", b"2")
    repo.put("metadata/3.snapshot.json", repo.get("metadata/2.snapshot.json").data)
    with pytest.raises(VerificationFailed, match="3.snapshot.json holds version 2"):
        trust.read_state(repo)


# --- keeping the metadata fresh ---------------------------------------------------------------------


def test_an_expired_timestamp_is_re_signed_without_force(repo, keys, tmp_path, wait):
    """`rollout advance --all` calls refresh_timestamp with no live rollout too: an already expired
    timestamp must be re-signed, and a device that trusted it refreshes again."""
    publish(repo, keys, ENGINE, b"engine", expiry=Expiry(timestamp_days=2 / 86400))
    dev = client(repo, tmp_path)
    dev.refresh()
    wait(3)
    with pytest.raises(VerificationFailed, match="(?i)expired"):
        client(repo, tmp_path).refresh()
    assert trust.refresh_timestamp(repo, keys, Expiry())
    assert trust.read_state(repo).timestamp.signed.version == 3
    assert client(repo, tmp_path).fetch(ENGINE) == b"engine"
    assert trust.refresh_timestamp(repo, keys, Expiry()) is False  # fresh now


def test_targets_and_snapshot_past_half_life_are_re_signed(repo, keys, tmp_path, wait):
    publish(repo, keys, ENGINE, b"engine", expiry=Expiry(targets_days=4 / 86400, snapshot_days=4 / 86400))
    wait(2.5)
    assert trust.refresh_timestamp(repo, keys, Expiry())
    state = trust.read_state(repo)
    assert (state.targets.signed.version, state.snapshot.signed.version, state.timestamp.signed.version) == (3, 3, 3)
    assert set(state.targets.signed.targets) == {ENGINE}
    wait(2)  # past the first expiry: the device gets the re-signed files
    assert client(repo, tmp_path).fetch(ENGINE) == b"engine"


# --- initialising a store ---------------------------------------------------------------------------


def test_an_interrupted_init_is_completed_by_the_next(store, keys, tmp_path):
    """An init killed after its claim (1.root.json) leaves a store the next init completes."""
    assert trust.initialise(store, keys, Expiry()) == "created"
    claim = store.get("metadata/1.root.json").data
    for key in list(store.list("")):
        if key != "metadata/1.root.json":
            store.delete(key)
    assert trust.initialise(store, keys, Expiry()) == "completed"
    assert store.get("metadata/1.root.json").data == claim
    assert trust.read_state(store).timestamp.signed.version == 1
    publish(store, keys, ENGINE, b"engine")
    assert client(store, tmp_path).fetch(ENGINE) == b"engine"


def test_init_checks_the_store_before_it_writes(store, keys, tmp_path):
    assert trust.initialise(store, keys, Expiry()) == "created"
    before = _metadata(store)
    stranger = trust.Keys.single(SigningKey.generate())
    with pytest.raises(VerificationFailed, match="not one this project created"):
        trust.initialise(store, stranger, Expiry())
    other = LocalStore(tmp_path / "other")
    trust.initialise(other, keys, Expiry(root_days=300))  # another root, whenever it is made
    other_pin = trust.Keys.single(keys.online, anchor=trust.root_bytes(other))  # the pin of another store
    with pytest.raises(VerificationFailed, match="does not contain the project's pinned root"):
        trust.initialise(store, other_pin, Expiry())
    assert _metadata(store) == before


def test_init_refuses_an_emptied_store_it_pinned(local_store, keys):
    pinned = trust.Keys.single(keys.online, anchor=b"{}")
    with pytest.raises(VerificationFailed, match="pins a root .* has no repository"):
        trust.initialise(local_store, pinned, Expiry())
    assert list(local_store.list("")) == []


def test_a_forged_root_naming_the_projects_key_beside_the_forgers_is_refused(repo, keys):
    """Threshold 1 of {project key, forger key}, signed by the forger only: a writer with nothing
    pinned must not take it for its own."""
    from tuf.api.metadata import Metadata

    attacker = SigningKey.generate()
    forged = Metadata.from_bytes(repo.get("metadata/1.root.json").data)
    forged.signed.add_key(attacker.tuf_signer().public_key, "root")
    forged.signatures.clear()
    forged.sign(attacker.tuf_signer())
    repo.put("metadata/1.root.json", forged.to_bytes())
    with pytest.raises(VerificationFailed, match="not one this project created"):
        trust.refresh_timestamp(repo, keys, Expiry(), force=True)


# --- the project's pins -----------------------------------------------------------------------------


def test_pins_are_per_store_and_name_the_store_as_configured(tmp_path):
    project = tmp_path / "project"
    a = trust.pin_path(project, "build/release-store")
    assert a.parent == project / trust.PINS and a.name.startswith("build-release-store-")
    assert trust.pin_path(project, "./build/release-store/") == a
    assert trust.pin_path(project, str(project / "build/release-store")) == a  # no path of this machine
    assert trust.pin_path(project, "build/other") != a
    s3 = trust.pin_path(project, "s3://bucket/fleet")
    assert s3.name.startswith("s3-bucket-fleet-") and trust.pin_path(project, "s3://bucket/fleet/") == s3
    assert trust.pin_path(project, "s3://bucket-fleet") != s3


def test_the_old_single_pin_is_read_for_its_own_store_only(tmp_path, keys):
    project = tmp_path / "project"
    first, second = LocalStore(project / "a"), LocalStore(project / "b")
    trust.initialise(first, keys, Expiry())
    trust.initialise(second, keys, Expiry(root_days=300))
    (project / trust.LEGACY_PIN).write_bytes(trust.root_bytes(first))
    assert trust.read_pin(project, "a", first) == trust.root_bytes(first)
    assert trust.read_pin(project, "b", second) is None
    trust.pin_path(project, "b").parent.mkdir()
    trust.pin_path(project, "b").write_bytes(trust.root_bytes(second))
    assert trust.read_pin(project, "b", second) == trust.root_bytes(second)


# --- the device's folder ----------------------------------------------------------------------------


def test_an_unwritable_agent_folder_is_a_storage_error(repo, keys, tmp_path):
    publish(repo, keys, ENGINE, b"engine")
    (tmp_path / "blocked").write_text("a file where the folder should be")
    with pytest.raises(StorageError, match="blocked") as err:
        Client(repo, tmp_path / "blocked" / "tuf", trust.root_bytes(repo))
    assert err.value.exit_code == 3
    dev = client(repo, tmp_path)
    dev.refresh()
    ts = tmp_path / "dev" / "timestamp.json"
    ts.unlink()
    ts.mkdir()  # ngclient cannot persist the next timestamp there
    publish(repo, keys, "more", b"more")
    with pytest.raises(StorageError, match=str(tmp_path / "dev")):
        client(repo, tmp_path).refresh()


def test_a_replayed_rollout_state_is_refused_by_every_command_and_repaired(store, project, keys, tmp_path):
    """The attack of issue 24: after an abort, the timestamp of the live rollout is put back. Status
    must not show it "active", advance / start / a move / publish must not sign on top of it; repair
    brings the abort back and the devices that saw it go on."""
    fleet = Fleet(10).inventory
    trust.initialise(store, keys, project.rollout.expiry)
    release.publish_release(project, store, keys, MODEL)
    controller.start(project, store, keys, MODEL, inventory=fleet, actor="test", reason="ship")
    live = store.get(trust.TIMESTAMP_KEY).data
    controller.move(project, store, keys, MODEL, "abort", actor="test", reason="bad")
    aborted = trust.read_state(store).timestamp.signed.version
    dev = client(store, tmp_path)
    dev.refresh()
    store.put(trust.TIMESTAMP_KEY, live)
    before = _metadata(store)

    replayed = f"timestamp.json is version {aborted - 1}, older than version {aborted}"
    for attempt in (
        lambda: controller.status(project, store, MODEL),
        lambda: controller.advance(project, store, keys, MODEL, inventory=fleet, actor="test"),
        lambda: controller.start(project, store, keys, MODEL, inventory=fleet, actor="test", reason="again"),
        lambda: controller.move(project, store, keys, MODEL, "resume", actor="test", reason="replayed"),
        lambda: release.publish_release(project, store, keys, MODEL),
    ):
        with pytest.raises(VerificationFailed, match=replayed):
            attempt()
    assert _metadata(store) == before

    assert recovery.repair(store, keys, project.rollout.expiry).timestamp == aborted + 1
    assert controller.status(project, store, MODEL).rollout.status == "aborted"
    client(store, tmp_path).refresh()  # the device that saw the abort is not stuck
