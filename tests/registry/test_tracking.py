"""The MLflow client: store selection, names, retries with backoff and the errors they end in."""

from __future__ import annotations

import errno
import time

import models
import pytest
from cli_helpers import assert_user_error, project, service_env, skuforge
from registry_helpers import SilentServer, free_port

from pipeline.core.errors import ConfigError, EnvironmentProblem, ServiceError, StorageError
from pipeline.project.config import Release, TrackingSpec, parse_registry
from pipeline.tracking.client import (
    EMBEDDED_ARTIFACTS,
    EMBEDDED_DB,
    Tracking,
    actor,
    connect,
    experiment_name,
    redact,
    registered_model_name,
    transient,
    unreachable,
)


def registry(root, **release):
    return parse_registry(
        {
            "defaults": {},
            "examples": {},
            "models": {"conv": models.conv_bn_spec()},
            "skus": {"cpu": models.ort_sku()},
            "release": release,
        },
        root=root,
    )


def test_names():
    assert registered_model_name(Release(), "digits_cnn", "x86_ort_fp32") == "digits_cnn.x86_ort_fp32"
    assert registered_model_name(Release(name_prefix="team-"), "m", "s") == "team-m.s"
    assert experiment_name(Release(name_prefix="team-"), "m") == "team-m"
    for bad in ("a/b", "a:b", "it's"):
        with pytest.raises(ConfigError, match="cannot be an MLflow name"):
            registered_model_name(Release(), bad, "s")


def test_redact_masks_credentials():
    assert redact("https://user:secret@mlflow.example.com:8443/x") == "https://***@mlflow.example.com:8443/x"
    assert redact("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"


def test_store_defaults_to_the_embedded_one_at_the_project_root(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    t = connect(registry(tmp_path))
    assert t.embedded and t.uri == f"sqlite:///{tmp_path.resolve() / EMBEDDED_DB}"
    assert t.artifact_location == (tmp_path.resolve() / EMBEDDED_ARTIFACTS).as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    t = connect(registry(tmp_path))
    assert not t.embedded and t.uri == t.registry_uri == "http://127.0.0.1:1" and t.artifact_location is None


def test_actor_prefers_the_ci_user():
    assert actor({"GITHUB_ACTOR": "octocat"}) == "octocat"
    assert actor({}) != ""


def test_unreachable_server_is_retried_with_backoff_then_exit_4():
    from mlflow import MlflowClient

    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    waits: list[float] = []
    t = Tracking(
        uri=uri,
        registry_uri=uri,
        embedded=False,
        artifact_location=None,
        policy=TrackingSpec(retries=3, backoff_seconds=0.5, max_backoff_seconds=1.0, timeout_seconds=5),
        sleep=waits.append,
    )
    with pytest.raises(ServiceError) as info:
        t.call("read experiment 'x'", t.client.get_experiment_by_name, "x")
    assert info.value.exit_code == 4
    assert info.value.message.startswith(f"MLflow at {uri}: read experiment 'x' failed after 4 attempts")
    assert uri in info.value.hint and "again" in info.value.hint
    assert len(waits) == 3
    for wait, nominal in zip(waits, (0.5, 1.0, 1.0), strict=True):  # doubling, capped, with +-20% jitter
        assert 0.8 * nominal <= wait <= 1.2 * nominal
    assert isinstance(t.client, MlflowClient)


def test_retry_warnings_and_the_final_error_never_show_the_password(caplog):
    uri = f"http://ci-user:pa55-w0rd-x@127.0.0.1:{free_port()}"
    t = Tracking(
        uri=uri,
        registry_uri=uri,
        embedded=False,
        artifact_location=None,
        policy=TrackingSpec(retries=2, backoff_seconds=0.01, max_backoff_seconds=0.01, timeout_seconds=5),
        sleep=lambda s: None,
    )
    with caplog.at_level("WARNING"), pytest.raises(ServiceError) as info:
        t.call("read experiment 'x'", t.client.get_experiment_by_name, "x")
    shown = [r.getMessage() for r in caplog.records] + [str(info.value)]
    assert len(shown) == 3 and all("pa55-w0rd-x" not in m and "ci-user" not in m for m in shown), shown
    assert "http://***@127.0.0.1" in str(info.value)


def test_store_problems_are_not_retried(tmp_path):
    bad = Tracking(uri="foo://x", registry_uri="foo://x", embedded=False, artifact_location=None)
    with pytest.raises(ConfigError, match="'foo://' is not one MLflow supports"):
        _ = bad.client  # the property connects, and refuses the scheme
    t = connect(registry(tmp_path), uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    for text, cls in (
        ("(sqlite3.OperationalError) attempt to write a readonly database", StorageError),
        ("(sqlite3.OperationalError) database or disk is full", StorageError),
    ):
        assert not transient(RuntimeError(text))
        assert isinstance(t.store_problem(RuntimeError(text), "write"), cls)
    missing = ModuleNotFoundError("No module named 'psycopg2'", name="psycopg2")
    problem = t.store_problem(missing, "open the store")
    assert isinstance(problem, EnvironmentProblem) and "psycopg2-binary" in problem.hint
    assert t.store_problem(ModuleNotFoundError("No module named 'nope'", name="nope"), "x") is None  # a bug
    remote = Tracking(uri="http://h:5000", registry_uri="http://h:5000", embedded=False, artifact_location=None)
    readonly_server = remote.store_problem(RuntimeError("500: attempt to write a readonly database"), "log")
    assert isinstance(readonly_server, ServiceError) and readonly_server.exit_code == 4


def test_errors_that_retrying_cannot_fix_fail_at_once(tmp_path):
    from mlflow.exceptions import MlflowException

    t = connect(registry(tmp_path))
    waits: list[float] = []
    t.sleep = waits.append
    with pytest.raises(ServiceError, match="read version 7 of nope") as info:
        t.call("read version 7 of nope", t.client.get_model_version, "nope", "7")
    assert waits == [] and isinstance(info.value.__cause__, MlflowException)
    # an expected error code is the caller's to handle
    with pytest.raises(MlflowException) as raw:
        t.call("read", t.client.get_model_version, "nope", "7", expect={"RESOURCE_DOES_NOT_EXIST"})
    assert raw.value.error_code == "RESOURCE_DOES_NOT_EXIST"
    # a local bug is not a service failure
    with pytest.raises(ZeroDivisionError):
        t.call("divide", lambda: 1 / 0)


def test_transient_classification():
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import BAD_REQUEST, RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE

    assert transient(MlflowException("(sqlite3.OperationalError) database is locked", error_code=BAD_REQUEST))
    assert transient(MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE))
    assert transient(ConnectionRefusedError())
    assert not transient(MlflowException("no such model", error_code=RESOURCE_DOES_NOT_EXIST))
    assert not transient(MlflowException("bad name", error_code=BAD_REQUEST))
    assert not transient(
        MlflowException(  # urllib3 says "max retries" for a bad certificate too
            "API request to https://h/api failed with exception HTTPSConnectionPool(host='h', port=443): Max retries "
            "exceeded with url: /api (Caused by SSLError(SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] "
            "certificate verify failed')))"
        )
    )
    assert not transient(
        MlflowException("(sqlite3.OperationalError) attempt to write a readonly database", error_code="INTERNAL_ERROR")
    )
    try:
        try:
            raise ConnectionResetError("peer reset")
        except ConnectionResetError as inner:
            raise MlflowException("API call", error_code=BAD_REQUEST) from inner
    except MlflowException as outer:
        assert transient(outer)  # the cause decides


def test_release_section_is_checked():
    with pytest.raises(ConfigError, match="reserved"):
        registry(None, aliases=["candidate", "latest"])
    with pytest.raises(ConfigError, match="not a valid MLflow alias"):
        registry(None, aliases=["pre prod"])
    with pytest.raises(ConfigError, match=r"reason_required: \['prod'\] not in aliases"):
        registry(None, aliases=["staging"], reason_required=["prod"])
    with pytest.raises(ConfigError, match="release.skus: unknown SKU 'cpuu' \\(did you mean 'cpu'"):
        registry(None, skus=["cpuu"])
    with pytest.raises(ConfigError, match="release.name_prefix"):
        registry(None, name_prefix="a/b")
    with pytest.raises(ConfigError, match="release.performance.on_noisy"):
        registry(None, performance={"on_noisy": "maybe"})
    reg = registry(None)
    assert reg.release.aliases == ["candidate", "staging", "production"] and reg.release_skus() == ["cpu"]


# --- a dead tracking server fails each call in seconds, exit 4 ------------------------------------


def _remote(uri: str, **policy) -> Tracking:
    return Tracking(uri=uri, registry_uri=uri, embedded=False, artifact_location=None, policy=TrackingSpec(**policy))


def test_mlflow_runs_with_the_policy_timeout_and_no_retries_of_its_own(monkeypatch):
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT

    for name in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES"):
        monkeypatch.delenv(name, raising=False)
    default = TrackingSpec()
    assert (default.timeout_seconds, default.deadline_seconds) == (5, 10)
    assert _remote("http://127.0.0.1:1").client is not None  # made: MLflow's settings are in place
    assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 5 and MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 0
    assert _remote("http://127.0.0.1:1", timeout_seconds=2.5).client is not None  # another policy, same process
    assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 3
    # what the user set for MLflow itself wins
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "42")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    assert _remote("http://127.0.0.1:1").client is not None
    assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 42 and MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 1


class FakeTime:
    """A clock that only the attempts and the waits between them move."""

    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_no_retry_of_a_silent_server_starts_that_would_end_past_the_deadline():
    from mlflow.exceptions import MlflowException

    fake = FakeTime()

    def silent() -> None:
        fake.now += 4.0  # the attempt waited for its read timeout
        raise ConnectionError("Read timed out. (read timeout=4)")

    def locked() -> None:
        fake.now += 4.0  # SQLite's busy wait
        raise MlflowException("(sqlite3.OperationalError) database is locked")

    t = _remote("http://127.0.0.1:1", retries=4, backoff_seconds=0.5, max_backoff_seconds=8, deadline_seconds=10)
    t.sleep, t.clock = fake.sleep, lambda: fake.now
    # 4 s, a wait of 0.5 s (+-20%), 4 s: a third attempt would end near 13.5 s
    with pytest.raises(
        ServiceError, match=r"failed after 2 attempts in 8\.\d s \(release.tracking.deadline_seconds: 10\)"
    ):
        t.call("read experiment 'x'", silent)
    fake.now = 0.0
    with pytest.raises(ServiceError) as info:
        t.call("read experiment 'x'", silent)
    assert unreachable(info.value) and info.value.exit_code == 4
    fake.now = 0.0
    with pytest.raises(ServiceError, match="failed after 5 attempts: ") as info:  # busy, not dead: every retry
        t.call("write", locked)
    assert not unreachable(info.value)


@pytest.mark.parametrize("dead", ["closed port", "silent server"])
def test_a_dead_tracking_server_fails_the_command_with_exit_4(tmp_path, dead):
    """Through the CLI with the default policy: the store's URL and the attempts made are named."""
    project(tmp_path)
    with SilentServer() as silent:
        uri = f"http://127.0.0.1:{free_port()}" if dead == "closed port" else silent.url
        started = time.monotonic()
        proc = skuforge("releases", "--model", "m", cwd=tmp_path, env=service_env(MLFLOW_TRACKING_URI=uri))
        print(f"MLflow at a {dead}: exit {proc.returncode} after {time.monotonic() - started:.1f} s")
        assert_user_error(proc, 4, f"MLflow at {uri}: ", "failed after", "is up and reachable")
        if dead == "closed port":
            assert "failed after 5 attempts: " in proc.stderr and "Connection refused" in proc.stderr
        else:  # one attempt of 5 s: a second would end past the 10 s deadline
            assert silent.connections == 1
            assert "failed after 1 attempt in 5." in proc.stderr and "ReadTimeoutError" in proc.stderr


def test_an_unwritable_artifact_folder_is_named_not_the_database(tmp_path):
    """A read-only mount under mlartifacts/ was blamed on mlflow.db ("read-only file system")."""
    t = connect(registry(tmp_path))
    artifacts = tmp_path.resolve() / EMBEDDED_ARTIFACTS
    for code, reason in (
        (errno.EROFS, "Read-only file system"),
        (errno.EACCES, "Permission denied"),
        (errno.ENOTDIR, "Not a directory"),
    ):
        problem = t.store_problem(
            OSError(code, reason, str(artifacts / "0" / "run" / "artifacts" / "engine")), "upload model.onnx"
        )
        assert isinstance(problem, StorageError) and problem.exit_code == 3
        assert f"upload model.onnx failed: the artifact folder {artifacts} cannot be written" in problem.message
        assert reason in problem.message and "database" not in str(problem) and problem.path == str(artifacts)
