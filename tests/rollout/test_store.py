"""The release store on a local folder and on S3 over HTTP (moto behind the fault proxy)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from cli_helpers import assert_user_error, project, service_env, skuforge
from registry_helpers import SilentServer, free_port

from pipeline.core.errors import ServiceError
from pipeline.core.io import STALE_SECONDS
from pipeline.project.config import Expiry
from pipeline.results.signing import SigningKey
from pipeline.rollout import trust
from pipeline.rollout.store import (
    S3_ATTEMPTS,
    S3_CONNECT_TIMEOUT,
    S3_READ_TIMEOUT,
    LocalStore,
    PreconditionFailed,
    S3Store,
)
from rollout.conftest import FAST
from rollout.s3server import s3_client


def _is_s3(store) -> bool:
    return isinstance(store, S3Store)


# --- the interface, on both stores ------------------------------------------------------------------


def test_get_missing_is_none(store):
    assert store.get("nothing/here") is None
    assert not store.exists("nothing/here")


def test_put_get_round_trip(store):
    etag = store.put("a/b/c.bin", b"\x00payload\xff")
    blob = store.get("a/b/c.bin")
    assert blob.data == b"\x00payload\xff"
    assert blob.etag == etag
    assert store.exists("a/b/c.bin")


def test_etag_changes_with_content(store):
    first = store.put("k", b"one")
    second = store.put("k", b"two")
    assert first != second
    assert store.get("k").etag == second
    assert store.put("k", b"one") == first  # the etag is of the content, not of the write


def test_list_under_a_prefix(store):
    for key in ("rel/a", "rel/sub/b", "relative", "other/c"):
        store.put(key, b"x")
    assert sorted(store.list("rel")) == ["rel/a", "rel/sub/b"]
    assert sorted(store.list("rel/")) == ["rel/a", "rel/sub/b"]
    assert sorted(store.list("")) == ["other/c", "rel/a", "rel/sub/b", "relative"]
    assert list(store.list("absent")) == []


def test_get_of_a_prefix_is_missing(store, request):
    """A key that is only a prefix of others (a folder, locally) has no value."""
    store.put("dir/file", b"x")
    assert not store.exists("dir")
    assert store.get("dir") is None


def test_delete(store):
    store.put("gone", b"x")
    store.delete("gone")
    assert store.get("gone") is None
    store.delete("gone")  # deleting a missing key is not an error


def test_if_none_match_keeps_the_existing_value(store):
    store.put("once", b"first", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        store.put("once", b"second", if_none_match=True)
    assert store.get("once").data == b"first"


def test_if_match_needs_the_current_etag(store):
    stale = store.put("cas", b"v1")
    current = store.put("cas", b"v2")
    with pytest.raises(PreconditionFailed):
        store.put("cas", b"lost", if_match=stale)
    assert store.get("cas").data == b"v2"
    new = store.put("cas", b"v3", if_match=current)
    assert store.get("cas") == type(store.get("cas"))(b"v3", new)


def test_if_match_on_a_missing_key_is_a_lost_race(store, request):
    """A key deleted since it was read: the caller must re-read, as for any other lost race."""
    with pytest.raises(PreconditionFailed):
        store.put("deleted", b"x", if_match='"0123456789abcdef0123456789abcdef"')


def _increment(store, key: str, times: int, written: list[int] | None = None) -> int:
    """Add 1 to the counter ``times`` times by read-modify-write; how many swaps were lost."""
    lost = 0
    for _ in range(times):
        while True:
            blob = store.get(key)
            value = int(blob.data) + 1
            try:
                store.put(key, str(value).encode(), if_match=blob.etag)
                break
            except PreconditionFailed:
                lost += 1
        if written is not None:
            written.append(value)
    return lost


def test_concurrent_compare_and_swap_loses_no_update(store):
    threads, each = (8, 5) if _is_s3(store) else (16, 10)
    store.put("counter", b"0")
    errors: list[BaseException] = []
    lost: list[int] = []
    written: list[int] = []

    def work():
        try:
            lost.append(_increment(store, "counter", each, written))
        except BaseException as exc:  # reported below: a thread's exception would vanish
            errors.append(exc)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not errors
    assert sum(lost) > 0  # the writers did race: the condition was sent and enforced
    # moto checks If-Match and then writes without a lock, so two swaps from one etag can both win
    # there, rarely (real S3 is atomic); such a pair writes the same value. None may happen locally.
    server_races = len(written) - len(set(written))
    assert server_races <= (2 if _is_s3(store) else 0)
    assert int(store.get("counter").data) == threads * each - server_races


@pytest.mark.parametrize("key", ["../x", "a/../x", "/abs", "a b", "", "a//b", "trailing/"])
def test_bad_keys_are_refused(store, key):
    with pytest.raises(ValueError, match="not a valid store key"):
        store.put(key, b"x")
    with pytest.raises(ValueError):
        store.get(key)


# --- S3 faults, through the proxy -------------------------------------------------------------------


def test_s3_transient_503_is_retried(s3_store, proxy):
    s3_store.put("flaky", b"data")
    proxy.fail(method="GET", key_pattern=r"flaky$", status=503, times=1)
    assert s3_store.get("flaky").data == b"data"
    assert proxy.count(method="GET", key_pattern=r"flaky$") == 2


def test_s3_persistent_500_is_a_service_error(s3_store, proxy):
    proxy.fail(method="PUT", key_pattern=r"broken\.bin$", status=500, code="InternalError", times=None)
    with pytest.raises(ServiceError) as exc:
        s3_store.put("broken.bin", b"x")
    err = exc.value
    assert err.exit_code == 4
    assert "broken.bin" in err.message and "InternalError" in err.message and "500" in err.message
    assert "testing" not in str(err)  # the dummy access key and secret
    assert proxy.count(method="PUT", key_pattern=r"broken\.bin$") == FAST["retries"]["total_max_attempts"]


def test_s3_read_timeout_is_a_service_error(s3_store, proxy):
    s3_store.put("slow", b"x")
    proxy.delay(3, method="GET", key_pattern=r"slow$", times=None)
    started = time.monotonic()
    try:
        with pytest.raises(ServiceError, match="slow.*ReadTimeoutError"):
            s3_store.get("slow")
    finally:
        proxy.clear()
    print(f"read timeout surfaced after {time.monotonic() - started:.1f} s")  # ReadTimeoutError above is the claim
    assert s3_store.get("slow").data == b"x"


def test_s3_unreachable_endpoint_is_a_service_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = S3Store("s3://bucket/prefix", client=s3_client(f"http://127.0.0.1:{port}", **FAST))
    with pytest.raises(ServiceError, match="could not read s3://bucket/prefix/key") as exc:
        store.get("key")
    assert exc.value.exit_code == 4
    assert "unreachable" in exc.value.hint


def _bare_aws(monkeypatch, tmp_path) -> None:
    """No AWS setting of the developer's: dummy credentials, no profile file."""
    for name in ("AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def test_s3_client_bounds_every_request(monkeypatch, tmp_path):
    _bare_aws(monkeypatch, tmp_path)
    config = S3Store("s3://bucket/prefix").client.meta.config
    assert (config.connect_timeout, config.read_timeout) == (S3_CONNECT_TIMEOUT, S3_READ_TIMEOUT) == (3, 4)
    assert config.retries == {"mode": "standard", "total_max_attempts": S3_ATTEMPTS} and S3_ATTEMPTS == 3
    # the retries a user set for botocore win, from the environment or the AWS profile
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "7")
    assert S3Store("s3://bucket/prefix").client.meta.config.retries == {"mode": "standard", "total_max_attempts": 7}
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    (tmp_path / "aws-config").write_text("[default]\nretry_mode = adaptive\n")
    config = S3Store("s3://bucket/prefix").client.meta.config
    assert config.retries["mode"] == "adaptive" and config.read_timeout == S3_READ_TIMEOUT


@pytest.mark.parametrize("dead", ["closed port", "silent server"])
def test_a_dead_s3_endpoint_fails_the_command_with_exit_4(tmp_path, dead):
    """Through the CLI with the client skuforge makes: the endpoint, the key and the bounds are named."""
    project(tmp_path)
    with SilentServer() as silent:
        endpoint = f"http://127.0.0.1:{free_port()}" if dead == "closed port" else silent.url
        env = service_env(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_CONFIG_FILE=str(tmp_path / "none"),
        )
        started = time.monotonic()
        proc = skuforge("rollout", "status", "--model", "m", "--store", "s3://bucket/fleet", cwd=tmp_path, env=env)
        print(f"S3 at a {dead}: exit {proc.returncode} after {time.monotonic() - started:.1f} s")
        assert_user_error(
            proc,
            4,
            f"S3 at {endpoint}: could not read s3://bucket/fleet/",
            f"({S3_ATTEMPTS} attempts, connect timeout 3 s, read timeout 4 s)",
            "AWS_ENDPOINT_URL",
        )
        if dead == "closed port":
            assert "EndpointConnectionError" in proc.stderr
        else:
            assert "ReadTimeoutError" in proc.stderr and silent.connections == S3_ATTEMPTS


def test_s3_keys_live_under_the_prefix(s3_store, moto_s3):
    s3_store.put("x/y", b"1")
    raw = moto_s3.client().list_objects_v2(Bucket=s3_store.bucket)
    assert [o["Key"] for o in raw["Contents"]] == ["fleet/x/y"]
    assert list(s3_store.list("")) == ["x/y"]


# --- the local folder -------------------------------------------------------------------------------


class Crash(Exception):
    pass


@pytest.mark.parametrize("conditional", [False, True])
def test_local_crash_mid_write_leaves_no_partial_file(local_store, monkeypatch, conditional):
    local_store.put("keep", b"old")

    def crash(src, dst):
        raise Crash

    monkeypatch.setattr(os, "replace", crash)
    kwargs = {"if_match": local_store.get("keep").etag} if conditional else {}
    with pytest.raises(Crash):
        local_store.put("keep", b"new" * 1000, **kwargs)
    with pytest.raises(Crash):
        local_store.put("fresh/key", b"new", if_none_match=conditional)
    monkeypatch.undo()

    assert local_store.get("keep").data == b"old"
    assert local_store.get("fresh/key") is None
    assert sorted(local_store.list("")) == ["keep"]
    leftovers = [p.name for p in local_store.root.rglob("*") if p.is_file() and p.name not in ("keep", ".lock")]
    assert leftovers == []


def test_local_stores_on_one_folder_share_the_lock(tmp_path):
    """Two LocalStore objects (as two processes would have) on one folder still serialise."""
    a, b = LocalStore(tmp_path / "s"), LocalStore(tmp_path / "s")
    a.put("counter", b"0")
    workers = [threading.Thread(target=_increment, args=(s, "counter", 20)) for s in (a, b, a, b)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert int(a.get("counter").data) == 80


def test_stale_temporaries_of_killed_writers_are_cleaned_by_the_next_commit(local_store):
    """A put killed between its temporary and the rename leaves ``.<name>.<random>.tmp``; the next
    writer removes those older than an hour, not a live writer's nor anything else."""
    keys = trust.Keys.single(SigningKey.generate())
    trust.initialise(local_store, keys, Expiry())
    root = local_store.root
    stale = [root / "blobs/sha256/.abc.k2j4h1x9.tmp", root / "metadata/.timestamp.json.q8w7e6r5.tmp"]
    fresh = root / "metadata/.7.targets.json.zzzzzzzz.tmp"
    for path in [*stale, fresh]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half")
    old = time.time() - STALE_SECONDS - 60
    for path in stale:
        os.utime(path, (old, old))
    os.utime(root / ".lock", (old, old))

    trust.commit(local_store, keys, Expiry(), lambda targets, state: trust.add_target(targets, "a", b"a") or True)
    assert [p for p in stale if p.exists()] == []
    assert fresh.exists() and (root / ".lock").exists()
    assert local_store.clean_stale() == []  # once per store object: later commits do not walk it again


def test_cleaning_an_s3_store_is_nothing_to_do(s3_store):
    s3_store.put("k", b"x")
    s3_store.requests.clear()
    assert s3_store.clean_stale() == []
    assert sum(s3_store.requests.values()) == 0
