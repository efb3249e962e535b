"""boto3 through FaultProxy to a real moto server: faults are seen as a real S3 would cause them."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import pytest
from botocore.exceptions import ClientError, ConnectionClosedError, ReadTimeoutError

from rollout.s3server import MotoS3, object_key

NO_RETRIES = {"retries": {"total_max_attempts": 1}}  # "max_attempts" counts retries


# moto_s3 and proxy: the session fixtures of conftest.py


@pytest.fixture
def bucket(moto_s3, proxy):
    proxy.clear()
    yield moto_s3.make_bucket()
    proxy.clear()


def _code(exc: pytest.ExceptionInfo[ClientError]) -> tuple[int, str]:
    err = exc.value.response
    return err["ResponseMetadata"]["HTTPStatusCode"], err["Error"]["Code"]


def _exists(moto_s3, bucket: str, key: str) -> bool:
    try:
        moto_s3.client().head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response["Error"]["Code"] == "404":
            return False
        raise
    return True


def test_round_trip_and_request_log(moto_s3, proxy, bucket):
    s3 = proxy.client()
    s3.put_object(Bucket=bucket, Key="a/b c.json", Body=b"{}")
    assert s3.get_object(Bucket=bucket, Key="a/b c.json")["Body"].read() == b"{}"
    big = os.urandom(1 << 20)  # a file object: boto3 sends Expect: 100-continue
    s3.put_object(Bucket=bucket, Key="big", Body=io.BytesIO(big))
    assert moto_s3.client().get_object(Bucket=bucket, Key="big")["Body"].read() == big
    assert [r.key for r in proxy.requests] == ["a/b c.json", "a/b c.json", "big"]
    assert proxy.count("PUT") == 2 and proxy.count(key_pattern=r"^a/") == 2


def test_conditional_writes_pass_through(proxy, bucket):
    s3 = proxy.client(**NO_RETRIES)
    etag = s3.put_object(Bucket=bucket, Key="k", Body=b"1", IfNoneMatch="*")["ETag"]
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=bucket, Key="k", Body=b"2", IfNoneMatch="*")
    assert _code(exc) == (412, "PreconditionFailed")
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=bucket, Key="k", Body=b"2", IfMatch='"0123456789abcdef0123456789abcdef"')
    assert _code(exc) == (412, "PreconditionFailed")
    s3.put_object(Bucket=bucket, Key="k", Body=b"3", IfMatch=etag)
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"3"


def test_injected_503_reaches_client_and_not_moto(moto_s3, proxy, bucket):
    proxy.fail(method="PUT", key_pattern=r"\.json$", status=503, code="SlowDown")
    s3 = proxy.client(**NO_RETRIES)
    s3.put_object(Bucket=bucket, Key="other.bin", Body=b"x")  # no match: forwarded
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=bucket, Key="m.json", Body=b"x")
    assert _code(exc) == (503, "SlowDown")
    assert not _exists(moto_s3, bucket, "m.json")
    s3.put_object(Bucket=bucket, Key="m.json", Body=b"x")  # times=1: used up
    assert proxy.count("PUT", r"\.json$") == 2


def test_injected_error_on_head_has_no_body(proxy, bucket):
    proxy.fail(method="HEAD", status=404, code="NoSuchKey", times=None)
    s3 = proxy.client(**NO_RETRIES)
    for _ in range(2):  # the connection stays usable after a bodiless error
        with pytest.raises(ClientError) as exc:
            s3.head_object(Bucket=bucket, Key="nothing")
        assert _code(exc) == (404, "404")


def test_standard_retries_get_past_one_503(proxy, bucket):
    proxy.fail(method="PUT", status=503, code="SlowDown", times=1)
    s3 = proxy.client(retries={"mode": "standard", "max_attempts": 3})
    resp = s3.put_object(Bucket=bucket, Key="k", Body=b"x")
    assert resp["ResponseMetadata"]["RetryAttempts"] == 1
    assert proxy.count("PUT") == 2


def test_delay_beyond_read_timeout(moto_s3, proxy, bucket):
    proxy.delay(5, method="PUT")
    s3 = proxy.client(read_timeout=0.3, **NO_RETRIES)
    started = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        s3.put_object(Bucket=bucket, Key="k", Body=b"x")
    print(f"read timeout after {time.monotonic() - started:.1f} s of a 5 s delay")  # the error is the claim
    proxy.clear()  # the held request is dropped, never applied
    time.sleep(0.1)
    assert not _exists(moto_s3, bucket, "k")


def test_delayed_answer_after_apply(moto_s3, proxy, bucket):
    proxy.delay(5, method="PUT", after_body=True)
    with pytest.raises(ReadTimeoutError):
        proxy.client(read_timeout=0.3, **NO_RETRIES).put_object(Bucket=bucket, Key="k", Body=b"x")
    assert _exists(moto_s3, bucket, "k")


def test_drop_after_body_applies_the_write(moto_s3, proxy, bucket):
    proxy.drop(method="PUT", after_body=True)
    s3 = proxy.client(**NO_RETRIES)
    with pytest.raises(ConnectionClosedError):
        s3.put_object(Bucket=bucket, Key="k", Body=b"lost answer")
    assert moto_s3.client().get_object(Bucket=bucket, Key="k")["Body"].read() == b"lost answer"
    s3.put_object(Bucket=bucket, Key="k2", Body=b"x")  # a fresh connection works


def test_drop_before_body_does_not(moto_s3, proxy, bucket):
    proxy.drop(method="PUT")
    with pytest.raises(ConnectionClosedError):
        proxy.client(**NO_RETRIES).put_object(Bucket=bucket, Key="k", Body=b"x")
    assert not _exists(moto_s3, bucket, "k")


def test_object_key():
    assert object_key("/b/a/b%20c.json?x-id=PutObject") == "a/b c.json"
    assert object_key("/b?list-type=2") is None and object_key("/b/") is None and object_key("/") is None


def test_reset_forgets_buckets():
    with MotoS3() as own:  # not the session server: other tests' buckets live there
        name = own.make_bucket()
        own.reset()
        assert name not in [b["Name"] for b in own.client().list_buckets()["Buckets"]]


def test_server_dies_with_its_test_process():
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from rollout.s3server import MotoS3; "
        "import os; s = MotoS3(); print(s._proc.pid, flush=True); os.kill(os.getpid(), 9)"
    )
    tests_dir = os.path.dirname(os.path.dirname(__file__))
    out = subprocess.run(
        [sys.executable, "-c", code, tests_dir], capture_output=True, text=True, timeout=30, check=False
    )
    assert out.returncode == -signal.SIGKILL and out.stdout.strip().isdigit(), out.stderr
    child = int(out.stdout)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the moto server outlived its SIGKILLed test process")
