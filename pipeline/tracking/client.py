"""The MLflow client: which store, names, and calls retried with backoff.

The store is ``MLFLOW_TRACKING_URI`` when set (any tracking server or database), else the embedded
``sqlite:///<project root>/mlflow.db`` with artifacts in ``<project root>/mlartifacts`` (both kept
out of git), so the example project records its engines with no server.

Every MLflow call goes through :meth:`Tracking.call`: connection errors, 5xx answers, a locked
SQLite database and a concurrent writer's unique-key clash are retried with exponential backoff;
after the last attempt, or on any other MLflow error, it raises ``ServiceError`` (exit 4) naming the
URI and the operation. A server that is down or does not answer costs each call at most
``release.tracking.deadline_seconds``: every request waits ``timeout_seconds`` at most, and no retry
starts that could not end before the deadline. What retrying cannot heal fails at once: an
unsupported URI scheme (``ConfigError``), a missing database driver (``EnvironmentProblem``), a
read-only or full local database or artifact folder (``StorageError``, naming which). Every message
is redacted (no credentials of the URI or the environment).
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from pipeline.core.env import (
    GITHUB_ACTOR,
    MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR,
    MLFLOW_HTTP_REQUEST_MAX_RETRIES,
    MLFLOW_HTTP_REQUEST_TIMEOUT,
    MLFLOW_REGISTRY_URI,
    MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT,
    MLFLOW_TRACKING_URI,
    declared,
)
from pipeline.core.errors import ConfigError, EnvironmentProblem, ServiceError, SkuforgeError, StorageError
from pipeline.core.io import storage_error
from pipeline.core.redact import redact  # also imported from here by older callers
from pipeline.project.config import NAME_FORBIDDEN, Registry, Release, TrackingSpec

log = logging.getLogger(__name__)
T = TypeVar("T")

ENV_TRACKING_URI = MLFLOW_TRACKING_URI.name
ENV_REGISTRY_URI = MLFLOW_REGISTRY_URI.name
EMBEDDED_DB = "mlflow.db"
EMBEDDED_ARTIFACTS = "mlartifacts"

# Tags skuforge writes (runs, versions, registered models).
TAG_MODEL = "skuforge.model"
TAG_SKU = "skuforge.sku"
TAG_DIGEST = "skuforge.manifest_digest"
TAG_CORRECTNESS = "skuforge.correctness"  # on a version: passed or failed, recomputed from the manifest at publish
# On a version: the publisher's signature of the manifest digest (JSON). Under ``mlflow.`` because
# the UI hides those tags: a raw JSON blob among the version's tags helps no reader of the page.
TAG_SIGNATURE = "mlflow.skuforge.signature"
TAG_SIGNATURE_BEFORE = "skuforge.signature"  # its earlier, visible name: still read; a re-publish moves it
TAG_LOGGED = "skuforge.logged"  # params, inputs and metrics are in (set in the metrics batch)
TAG_COMPLETE = "skuforge.artifacts_complete"  # every artifact uploaded and checked
TAG_HISTORY = "skuforge.history."  # + alias: JSON list of moves, on the registered model

_TRANSIENT_CODES = {"TEMPORARILY_UNAVAILABLE", "INTERNAL_ERROR", "REQUEST_LIMIT_EXCEEDED"}
# The server could not be reached or did not answer (as opposed to answering with an error).
_NETWORK_TEXT = (
    "connection refused",
    "connection reset",
    "connection aborted",
    "connection broken",
    "timed out",
    "max retries exceeded",
    "remotedisconnected",
    "temporary failure in name resolution",
)
_NETWORK_ERRORS = {("requests", "ConnectionError"), ("requests", "Timeout"), ("urllib3", "HTTPError")}
_TRANSIENT_TEXT = (
    "database is locked",
    "unique constraint failed",
    "integrityerror",
    "duplicate key",
    "bad gateway",
    "service unavailable",
) + _NETWORK_TEXT
# Checked first: a 500 answer or a wrapped OperationalError that no retry heals.
_READ_ONLY_TEXT = ("readonly database", "read-only database", "read-only file system", "unable to open database file")
_FULL_TEXT = ("database or disk is full", "no space left on device")
# Wrapped in urllib3's "Max retries exceeded" like a refused connection, but no retry heals them.
_PERMANENT_TEXT = (
    "certificate verify failed",
    "sslerror",
    "wrong version number",
    "no connection adapters",
    "invalid url",
    "name or service not known",
    "nodename nor servname",
)
# Database drivers SQLAlchemy imports for a scheme, and the pip package that provides each.
_DRIVERS = {
    "psycopg2": "psycopg2-binary",
    "psycopg": "'psycopg[binary]'",
    "MySQLdb": "mysqlclient",
    "pymysql": "pymysql",
    "pyodbc": "pyodbc",
    "pymssql": "pymssql",
    "asyncpg": "asyncpg",
    "pg8000": "pg8000",
    "mysql": "mysql-connector-python",
}


def _check_name(name: str, what: str) -> str:
    bad = [c for c in NAME_FORBIDDEN if c in name]
    if bad or not name.strip():
        raise ConfigError(
            f"{what} {name!r} cannot be an MLflow name (it contains {' '.join(bad) or 'nothing'})",
            hint=f"rename it in params.yaml without {' '.join(NAME_FORBIDDEN)}",
        )
    return name


def registered_model_name(release: Release, model: str, sku: str) -> str:
    """One registered model per (model, SKU): aliases then move per SKU (production on one SKU
    says nothing about another)."""
    _check_name(model, "model")
    _check_name(sku, "SKU")
    return f"{release.name_prefix}{model}.{sku}"


def experiment_name(release: Release, model: str) -> str:
    """One experiment per model: its SKUs' runs sit side by side in the MLflow UI."""
    return f"{release.name_prefix}{_check_name(model, 'model')}"


def version_signature(tags: Mapping[str, str] | None) -> Any:
    """The signature a version carries (parsed JSON), ``"unreadable"`` when it is not JSON, None when
    it has none. Every reader goes through here, so where the tag lives is decided once."""
    tags = tags or {}
    raw = tags.get(TAG_SIGNATURE, tags.get(TAG_SIGNATURE_BEFORE))
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return "unreadable"


def _chain(exc: BaseException):
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def transient(exc: BaseException) -> bool:
    """Worth retrying: the server or database was unreachable, overloaded or busy."""
    chain = list(_chain(exc))
    texts = [str(e).lower() for e in chain]
    if any(t in text for text in texts for t in _READ_ONLY_TEXT + _FULL_TEXT + _PERMANENT_TEXT):
        return False
    for current, text in zip(chain, texts, strict=True):
        if isinstance(current, (ConnectionError, TimeoutError)):
            return True
        if getattr(current, "error_code", None) in _TRANSIENT_CODES:
            return True
        status = getattr(getattr(current, "response", None), "status_code", None)
        if isinstance(status, int) and (status >= 500 or status == 429):
            return True
        if any(t in text for t in _TRANSIENT_TEXT):
            return True
    return False


def unreachable(exc: BaseException) -> bool:
    """The server was down, unreachable or silent: no answer came (a locked database did answer)."""
    for current in _chain(exc):
        if isinstance(current, (ConnectionError, TimeoutError)):
            return True
        if any((cls.__module__.split(".")[0], cls.__name__) in _NETWORK_ERRORS for cls in type(current).__mro__):
            return True
        if any(t in str(current).lower() for t in _NETWORK_TEXT):
            return True
    return False


def _is_service_error(exc: BaseException) -> bool:
    """An error of MLflow or of the network under it (not a local bug or file problem)."""
    for cls in type(exc).__mro__:
        module = cls.__module__.split(".")[0]
        if module in ("mlflow", "requests", "urllib3", "sqlalchemy"):
            return True
    return isinstance(exc, (ConnectionError, TimeoutError))


_REASON = re.compile(r"\[(?:Errno -?\d+|SSL: [A-Z_]+)\][^'\")(]+|Caused by \w+")


def _first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of the error, redacted (MLflow's text repeats the URI with its password)."""
    text = redact(str(exc)).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    if len(line) <= limit:
        return line
    # urllib3 puts the reason after a long URL: keep it ("[Errno 111] Connection refused")
    reasons = _REASON.findall(line[limit:])
    return line[:limit] + "…" + (f" ({reasons[-1].strip()})" if reasons else "")


def _missing_driver(exc: BaseException) -> str | None:
    for e in _chain(exc):
        if isinstance(e, ModuleNotFoundError) and (top := (e.name or "").split(".")[0]) in _DRIVERS:
            return top
    return None


def _sqlite_path(uri: str) -> str | None:
    parts = urlsplit(uri)
    if parts.scheme != "sqlite" or not parts.path:
        return None
    return parts.path[1:] if parts.path.startswith("//") else parts.path.lstrip("/") or None


@dataclass
class Tracking:
    """An MLflow client bound to one store, with the project's retry policy."""

    uri: str
    registry_uri: str
    embedded: bool
    artifact_location: str | None
    policy: TrackingSpec = field(default_factory=TrackingSpec)
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    _client: Any = field(default=None, init=False, repr=False)

    @property
    def display(self) -> str:
        return redact(self.uri)

    @property
    def client(self):
        if self._client is None:
            _configure_mlflow(self.policy)
            mlflow = require_mlflow()
            try:
                self._client = mlflow.MlflowClient(tracking_uri=self.uri, registry_uri=self.registry_uri)
            except Exception as exc:
                problem = self.store_problem(exc, "open the store")
                if problem is None:
                    raise
                raise problem from exc
        return self._client

    def store_problem(self, exc: BaseException, what: str) -> SkuforgeError | None:
        """What no retry heals, as the error to raise: an unsupported scheme, a missing database
        driver, a read-only or full database. None for anything else."""
        text = " ".join(str(e) for e in _chain(exc)).lower()
        where = f"MLflow at {self.display}"
        problem = self.artifact_problem(exc, what)
        if problem is not None:
            return problem
        if "unsupported uri" in text or any(
            "Unsupported" in type(e).__name__ and "URI" in type(e).__name__ for e in _chain(exc)
        ):
            return ConfigError(
                f"{where}: {what} failed: the URI scheme {urlsplit(self.uri).scheme + '://'!r} is not "
                "one MLflow supports",
                hint=f"set {ENV_TRACKING_URI} to http(s)://HOST:PORT of a tracking "
                "server, or a database URI (sqlite:///PATH, postgresql://…, mysql://…); unset it to use "
                "the project's embedded store",
            )
        driver = _missing_driver(exc)
        if driver:
            return EnvironmentProblem(
                f"{where}: {what} failed: the database driver {driver!r} is not installed",
                hint=f"pip install {_DRIVERS[driver]} in this environment, or point "
                f"{ENV_TRACKING_URI} at a tracking server (http://HOST:PORT)",
            )
        local = _sqlite_path(self.uri)
        if any(t in text for t in _READ_ONLY_TEXT):
            if local:
                state = (
                    "cannot be opened (its folder is missing or read-only)"
                    if "unable to open" in text
                    else "is read-only"
                )
                return StorageError(
                    f"{where}: {what} failed: the database {local} {state}",
                    hint=f"make {local} and its folder writable (permissions, `lsattr`, read-only "
                    "mounts), then run again",
                    path=local,
                )
            return ServiceError(
                f"{where}: {what} failed: the server's database is read-only ({_first_line(exc, 200)})",
                hint="ask the server's operator to make its backend store writable; then run again",
            )
        if any(t in text for t in _FULL_TEXT):
            if local:
                return StorageError(
                    f"{where}: {what} failed: no space left for the database {local}",
                    hint=f"free space on the disk holding {local}, then run again",
                    path=local,
                )
            return ServiceError(
                f"{where}: {what} failed: the server's disk is full ({_first_line(exc, 200)})",
                hint="ask the server's operator to free space; then run again",
            )
        return None

    def artifact_problem(self, exc: BaseException, what: str) -> StorageError | None:
        """A local file the store writes (an artifact under ``mlartifacts/``) that cannot be written:
        the error names that folder, not the database."""
        failed = next((e for e in _chain(exc) if isinstance(e, OSError) and e.filename), None)
        err = storage_error(failed) if failed is not None else None
        if err is None:
            return None
        root = self.artifact_root
        if root is not None and Path(err.path or "").is_relative_to(root):
            return StorageError(
                f"MLflow at {self.display}: {what} failed: the artifact folder {root} cannot be "
                f"written: {err.message.removeprefix('cannot write ')}",
                hint=err.hint,
                path=str(root),
            )
        return StorageError(f"MLflow at {self.display}: {what} failed: {err.message}", hint=err.hint, path=err.path)

    @property
    def artifact_root(self) -> Path | None:
        """The local folder artifacts go to (the embedded store's ``mlartifacts``), else None."""
        parts = urlsplit(self.artifact_location or "")
        return Path(unquote(parts.path)) if parts.scheme == "file" else None

    def hint(self) -> str:
        if self.embedded:
            return (
                f"the embedded store is {self.uri}; if another process holds it, run again, or route "
                f"parallel jobs through one `mlflow server` ({ENV_TRACKING_URI})"
            )
        return (
            f"check that the tracking server at {self.display} is up and reachable ({ENV_TRACKING_URI}); "
            f"publish and promote are idempotent: run the same command again when it is back"
        )

    def call(self, what: str, fn: Callable[..., T], *args: Any, expect: Collection[str] = (), **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` with retries on transient failures.

        MLflow errors whose ``error_code`` is in ``expect`` are raised as they are, for the caller
        to handle (e.g. RESOURCE_ALREADY_EXISTS from a concurrent writer); any other MLflow or
        network error ends in ``ServiceError`` naming the URI and ``what``.
        """
        attempts = self.policy.retries + 1
        began = self.clock()
        for attempt in range(1, attempts + 1):
            tried = self.clock()
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                if getattr(exc, "error_code", None) in expect:
                    raise
                problem = self.store_problem(exc, what)
                if problem is not None:
                    raise problem from exc
                if not _is_service_error(exc):
                    raise
                if not transient(exc):
                    raise ServiceError(
                        f"MLflow at {self.display}: {what} failed: {_first_line(exc)}", hint=self.hint()
                    ) from exc
                delay = min(self.policy.max_backoff_seconds, self.policy.backoff_seconds * 2 ** (attempt - 1))
                delay *= random.uniform(0.8, 1.2)  # concurrent writers should not retry in lockstep
                now = self.clock()
                # a dead or silent server: no retry that could not end before the deadline, judging by
                # this attempt (a busy database answers: it gets every retry)
                late = (
                    attempt < attempts
                    and unreachable(exc)
                    and now - began + delay + (now - tried) > self.policy.deadline_seconds
                )
                if attempt == attempts or late:
                    spent = (
                        (
                            f" in {now - began:.1f} s (release.tracking.deadline_seconds: "
                            f"{self.policy.deadline_seconds:g})"
                        )
                        if late
                        else ""
                    )
                    raise ServiceError(
                        f"MLflow at {self.display}: {what} failed after {attempt} attempt"
                        f"{'s' if attempt > 1 else ''}{spent}: {_first_line(exc)}",
                        hint=self.hint(),
                    ) from exc
                log.warning(
                    "MLflow at %s: %s failed (%s); retry %d of %d in %.1fs",
                    self.display,
                    what,
                    _first_line(exc, 120),
                    attempt,
                    attempts - 1,
                    delay,
                )
                self.sleep(delay)
        raise AssertionError("unreachable")

    def experiment_id(self, name: str, tags: Mapping[str, str] | None = None) -> str:
        """The experiment's id, created with ``tags`` when missing (a concurrent creator wins
        harmlessly); an existing one gets each of ``tags`` it lacks or holds another value of."""
        tags = dict(tags or {})
        exp = self.call(f"read experiment {name!r}", self.client.get_experiment_by_name, name)
        if exp is None:
            try:
                return self.call(
                    f"create experiment {name!r}",
                    self.client.create_experiment,
                    name,
                    artifact_location=self.artifact_location,
                    tags=tags,
                    expect={"RESOURCE_ALREADY_EXISTS"},
                )
            except Exception as exc:
                if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = self.call(f"read experiment {name!r}", self.client.get_experiment_by_name, name)
        if exp is None:
            raise ServiceError(
                f"MLflow at {self.display}: experiment {name!r} vanished while being created",
                hint="run the command again",
            )
        if exp.lifecycle_stage != "active":
            raise ServiceError(
                f"MLflow at {self.display}: experiment {name!r} is deleted",
                hint=f"restore it (mlflow experiments restore --experiment-id {exp.experiment_id}) "
                "or set release.name_prefix in params.yaml",
            )
        for key, value in tags.items():
            if (exp.tags or {}).get(key) != value:
                self.call(f"tag experiment {name!r}", self.client.set_experiment_tag, exp.experiment_id, key, value)
        return exp.experiment_id

    def registered_model(self, name: str, tags: dict[str, str], description: str | None = None):
        """The registered model, created when missing."""
        try:
            return self.call(
                f"create registered model {name!r}",
                self.client.create_registered_model,
                name,
                tags=tags,
                description=description,
                expect={"RESOURCE_ALREADY_EXISTS"},
            )
        except Exception as exc:
            if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                raise
        return self.call(f"read registered model {name!r}", self.client.get_registered_model, name)

    def get_registered_model(self, name: str):
        """The registered model, or None when it does not exist."""
        try:
            return self.call(
                f"read registered model {name!r}",
                self.client.get_registered_model,
                name,
                expect={"RESOURCE_DOES_NOT_EXIST"},
            )
        except Exception as exc:
            if getattr(exc, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                raise
            return None


def require_mlflow():
    """The mlflow module, or EnvironmentProblem saying how to get it."""
    try:
        import mlflow
    except ImportError as exc:
        raise EnvironmentProblem(
            f"mlflow is not importable here ({exc})",
            hint="install the build toolchain: pip install 'skuforge[pipeline]' (it brings mlflow)",
        ) from exc
    return mlflow


def mlflow_environment(policy: TrackingSpec) -> dict[str, str]:
    """MLflow's settings (environment variables it reads per request) that skuforge's client runs with."""
    return {
        # MLflow's own HTTP retries (7 by default, minutes of backoff) would hide a dead server behind
        # the policy's retries and deadline
        MLFLOW_HTTP_REQUEST_MAX_RETRIES.name: "0",
        MLFLOW_HTTP_REQUEST_TIMEOUT.name: str(
            max(1, math.ceil(policy.timeout_seconds))
        ),  # connect and read; whole seconds
        # ending a run prints "View run ... at" to stdout for servers: it would corrupt --json output
        MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.name: "true",
        MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name: "false",  # tqdm bars in CI logs
    }


_SET_BY_US: dict[str, str] = {}  # what _configure_mlflow put in os.environ; any other value there is the user's


def _configure_mlflow(policy: TrackingSpec) -> None:
    """Set :func:`mlflow_environment`, except a variable the user set: theirs wins."""
    for name, value in mlflow_environment(policy).items():
        var = declared(name)
        if var.is_set() and var.raw() != _SET_BY_US.get(name):
            continue
        var.set(value)
        _SET_BY_US[name] = value


def embedded_uri(root: Path) -> str:
    return f"sqlite:///{(root / EMBEDDED_DB).resolve()}"


def connect(registry: Registry, uri: str | None = None) -> Tracking:
    """The store for this project: ``uri``, else MLFLOW_TRACKING_URI, else the embedded one."""
    uri = uri or MLFLOW_TRACKING_URI.get() or None
    policy = registry.release.tracking
    if uri:
        return Tracking(
            uri=uri,
            registry_uri=MLFLOW_REGISTRY_URI.get() or uri,
            embedded=False,
            artifact_location=None,
            policy=policy,
        )
    root = registry.root.resolve()
    local = embedded_uri(root)
    return Tracking(
        uri=local,
        registry_uri=local,
        embedded=True,
        artifact_location=(root / EMBEDDED_ARTIFACTS).as_uri(),
        policy=policy,
    )


def actor(env: Mapping[str, str] | None = None) -> str:
    """Who acts: the CI user (GITHUB_ACTOR) when there is one, else the local user."""
    ci_user = GITHUB_ACTOR.get(env)
    if ci_user:
        return ci_user
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container user without a passwd entry
        return "unknown"
