"""The TUF repository in the release store and the device client, on a local folder and on S3."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import pytest

from pipeline.core.errors import ConfigError, ServiceError
from pipeline.project.config import Expiry
from pipeline.results.signing import SigningKey
from pipeline.rollout import trust
from pipeline.rollout.trust import Client, VerificationFailed

ENGINE = "releases/m/r1/cpu/engine/model.onnx"


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
    assert trust.initialise(store, keys, Expiry())
    for name in ("1.root.json", "root.json", "1.targets.json", "1.snapshot.json", "timestamp.json"):
        assert store.exists(f"metadata/{name}"), name
    state = trust.read_state(store)
    assert [md.signed.version for md in (state.root, state.targets, state.snapshot, state.timestamp)] == [1, 1, 1, 1]
    assert state.targets.signed.targets == {}
    before = store.get(trust.TIMESTAMP_KEY)
    assert trust.initialise(store, keys, Expiry()) is False
    assert store.get(trust.TIMESTAMP_KEY) == before


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
    with pytest.raises(VerificationFailed, match="BadVersionNumber"):
        client(repo, tmp_path).refresh()  # the same device, restarted


def test_frozen_store_is_noticed_and_a_fresh_timestamp_cures_it(repo, keys, tmp_path):
    publish(repo, keys, ENGINE, b"engine", expiry=Expiry(timestamp_days=2 / 86400))
    time.sleep(3)
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
