"""The release store: a flat key -> bytes space with compare-and-swap, on S3 or in a local folder.

Everything rollout keeps lives here: content-addressed blobs (engines, manifests, golden data),
signed TUF metadata, and the device reports. Two writers never corrupt it: a write that must not
overwrite uses ``if_none_match``, one that replaces a value it read uses ``if_match=<etag>``; a lost
race raises :class:`PreconditionFailed` and the caller re-reads and tries again.

S3 (``s3://bucket/prefix``): boto3 with the usual credential chain; ``AWS_ENDPOINT_URL`` points it at
any S3-compatible server. Conditional writes are S3's own ``If-None-Match: *`` / ``If-Match``. Every
request is bounded (``S3_CONNECT_TIMEOUT``, ``S3_READ_TIMEOUT``, ``S3_ATTEMPTS``), so a dead or silent
endpoint fails a command in seconds (exit 4).
Local folder: writes go to a temporary file and are renamed into place; conditional writes hold an
exclusive ``flock`` on the store's lock file, so processes sharing the folder serialise. A writer
killed mid-write leaves its temporary (``.<name>.<random>.tmp``); the next writer's
:meth:`LocalStore.clean_stale` removes those older than an hour.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.core.env import AWS_ENDPOINT_URL, AWS_MAX_ATTEMPTS, AWS_RETRY_MODE, SKUFORGE_STORE
from pipeline.core.errors import ConfigError, ServiceError, StorageError
from pipeline.core.io import STALE_SECONDS, file_lock
from pipeline.core.redact import redact

log = logging.getLogger(__name__)

ENV_STORE = SKUFORGE_STORE.name
"""Overrides ``rollout.store`` of params.yaml (a folder or ``s3://bucket/prefix``)."""

S3_CONNECT_TIMEOUT = 3.0
"""Seconds to open a connection to the S3 endpoint."""
S3_READ_TIMEOUT = 4.0
"""Seconds to wait for the next bytes of an answer: a silent endpoint fails each attempt after this."""
S3_ATTEMPTS = 3
"""Attempts per request in all (botocore's standard retries: throttling, 5xx, connection errors and
timeouts). AWS_MAX_ATTEMPTS or AWS_RETRY_MODE (or max_attempts, retry_mode in the AWS profile) win."""

KEY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+=@-]*(/[A-Za-z0-9][A-Za-z0-9._:+=@-]*)*")


class PreconditionFailed(Exception):
    """A conditional write lost: the key exists (``if_none_match``) or changed (``if_match``)."""


@dataclass(frozen=True)
class Blob:
    data: bytes
    etag: str


def check_key(key: str) -> str:
    """A key is '/'-separated parts of safe characters: no '..', no leading '/', no spaces."""
    if not isinstance(key, str) or len(key) > 900 or not KEY_PATTERN.fullmatch(key) or ".." in key.split("/"):
        raise ValueError(f"not a valid store key: {key!r}")
    return key


class Store(Protocol):
    url: str
    requests: Counter

    def get(self, key: str) -> Blob | None: ...

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str: ...

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> Iterator[str]:
        """Keys under ``prefix``, lazily; the keys of one folder come in ascending order (a caller
        may stop early: S3 fetches the next page of 1000 only when it is reached)."""
        ...

    def delete(self, key: str) -> None: ...

    def clean_stale(self) -> Sequence[str]:
        """Remove what writers killed mid-write left behind; what was removed."""
        ...


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class LocalStore:
    """A store in a folder; etags are the sha256 of the content."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.url = str(self.root)
        self.requests: Counter = Counter()
        self._lock = threading.Lock()
        self._cleaned = False

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def get(self, key: str) -> Blob | None:
        self.requests["get"] += 1
        try:
            data = self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as exc:
            raise StorageError(
                f"cannot read {key} from the store {self.root}: {exc.strerror}",
                hint="check the folder's permissions",
                path=str(self._path(key)),
            ) from exc
        return Blob(data, _etag(data))

    def exists(self, key: str) -> bool:
        self.requests["head"] += 1
        return self._path(key).is_file()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock, file_lock(self.root / ".lock"):
            yield

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        self.requests["put"] += 1
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                if not (if_none_match or if_match):
                    os.replace(tmp, path)
                    return _etag(data)
                with self._locked():
                    current = path.read_bytes() if path.is_file() else None
                    if if_none_match and current is not None:
                        raise PreconditionFailed(f"{key} exists")
                    if if_match is not None and (current is None or _etag(current) != if_match):
                        raise PreconditionFailed(f"{key} changed since it was read")
                    os.replace(tmp, path)
                return _etag(data)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        except OSError as exc:
            raise StorageError(
                f"cannot write {key} to the store {self.root}: {exc.strerror}",
                hint="check the folder's permissions and free space",
                path=str(path),
            ) from exc

    def list(self, prefix: str) -> Iterator[str]:
        self.requests["list"] += 1
        base = self.root / check_key(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return
        for dirpath, dirs, files in os.walk(base):
            dirs.sort()
            for name in sorted(files):
                if name.startswith("."):
                    continue
                yield Path(dirpath, name).relative_to(self.root).as_posix()

    def delete(self, key: str) -> None:
        self.requests["delete"] += 1
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def clean_stale(self, max_age: float = STALE_SECONDS) -> Sequence[str]:
        """Remove the temporaries (``.<name>.<random>.tmp``) of writers killed mid-put, once per
        store object: only those older than ``max_age`` seconds, since a live writer on another
        host sharing the folder may still be renaming its own (no pid tells them apart here)."""
        if self._cleaned or not self.root.is_dir():
            return []
        self._cleaned = True
        cutoff = time.time() - max_age
        removed: list[str] = []
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                if not (name.startswith(".") and name.endswith(".tmp")):
                    continue
                path = Path(dirpath, name)
                with contextlib.suppress(OSError):  # gone already, or not ours to remove: harmless
                    if path.lstat().st_mtime < cutoff:
                        path.unlink()
                        removed.append(path.relative_to(self.root).as_posix())
        if removed:
            log.info("removed %d stale temporar%s from %s", len(removed), "y" if len(removed) == 1 else "ies", self.url)
        return removed


# --- S3 ---------------------------------------------------------------------------------------------


def s3_config(core):
    """botocore's ``Config`` for the store's client: the ``S3_*`` bounds above, path-style addressing
    for a custom endpoint. The retries the user set for botocore itself win: AWS_MAX_ATTEMPTS or
    AWS_RETRY_MODE (or the profile's max_attempts, retry_mode) leave them to botocore. ``core``: the
    botocore session the client is made from."""
    from botocore.config import Config
    from botocore.exceptions import ProfileNotFound

    try:
        profile = core.get_scoped_config()
    except ProfileNotFound:  # creating the client reports it
        profile = {}

    user_set = any(var.raw() for var in (AWS_MAX_ATTEMPTS, AWS_RETRY_MODE)) or any(
        name in profile for name in ("max_attempts", "retry_mode")
    )
    # the controller reads a wave's reports 16 at a time (pipeline/rollout/controller.py READERS)
    settings: dict = {
        "connect_timeout": S3_CONNECT_TIMEOUT,
        "read_timeout": S3_READ_TIMEOUT,
        "max_pool_connections": 32,
    }
    if not user_set:
        settings["retries"] = {"mode": "standard", "total_max_attempts": S3_ATTEMPTS}
    if AWS_ENDPOINT_URL.get():
        settings["s3"] = {"addressing_style": "path"}
    return Config(**settings)


_PRECONDITION = {"PreconditionFailed", "ConditionalRequestConflict", "412"}
_MISSING = {"NoSuchKey", "404", "NotFound"}


class S3Store:
    """``s3://bucket/prefix`` through boto3. Retries transient errors (standard mode) and bounds
    every request with connect/read timeouts (:func:`s3_config`); what still fails is a ServiceError
    (exit 4)."""

    def __init__(self, url: str, client=None):
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not bucket:
            raise ConfigError(f"{url!r} names no bucket", hint="write s3://bucket or s3://bucket/prefix")
        self.url, self.bucket, self.prefix = url, bucket, prefix.strip("/")
        self.requests: Counter = Counter()
        if client is None:
            import boto3
            import botocore.session

            core = botocore.session.Session()
            client = boto3.session.Session(botocore_session=core).client("s3", config=s3_config(core))
        self.client = client

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _fail(self, what: str, key: str, exc: Exception) -> ServiceError:
        from botocore.exceptions import ClientError, NoCredentialsError

        if isinstance(exc, NoCredentialsError):
            return ServiceError(
                f"S3: no credentials to {what} {self.url}/{key}",
                hint="set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role",
            )
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return ServiceError(
                f"S3 refused to {what} {self.url}/{key}: {err.get('Code')} (HTTP {status})",
                hint="check the bucket, its permissions and AWS_ENDPOINT_URL; transient errors were retried already",
            )
        return ServiceError(
            f"{self._endpoint()}: could not {what} {self.url}/{key}: {type(exc).__name__}{self._bounds()}",
            hint="the S3 endpoint is unreachable or timed out; check AWS_ENDPOINT_URL and the "
            "network, then run again (nothing was left half-written)",
        )

    def _endpoint(self) -> str:
        url = getattr(getattr(self.client, "meta", None), "endpoint_url", None)
        return f"S3 at {redact(url)}" if url else "S3"

    def _bounds(self) -> str:
        """What the client waited: its attempts and timeouts, as botocore was configured."""
        cfg = getattr(getattr(self.client, "meta", None), "config", None)
        if cfg is None:
            return ""
        attempts = (cfg.retries or {}).get("total_max_attempts")
        tried = f"{attempts} attempt{'s' if attempts != 1 else ''}, " if attempts else ""
        return f" ({tried}connect timeout {cfg.connect_timeout:g} s, read timeout {cfg.read_timeout:g} s)"

    @staticmethod
    def _code(exc: Exception) -> str | None:
        from botocore.exceptions import ClientError

        if not isinstance(exc, ClientError):
            return None
        err = exc.response.get("Error", {})
        return str(err.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))

    def get(self, key: str) -> Blob | None:
        from botocore.exceptions import BotoCoreError, ClientError

        self.requests["get"] += 1
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            data = resp["Body"].read()
        except (ClientError, BotoCoreError) as exc:
            if self._code(exc) in _MISSING:
                return None
            raise self._fail("read", key, exc) from exc
        return Blob(data, resp["ETag"])

    def exists(self, key: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        self.requests["head"] += 1
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except (ClientError, BotoCoreError) as exc:
            if self._code(exc) in _MISSING:
                return False
            raise self._fail("look up", key, exc) from exc
        return True

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        from botocore.exceptions import BotoCoreError, ClientError

        self.requests["put"] += 1
        extra = {"IfNoneMatch": "*"} if if_none_match else {"IfMatch": if_match} if if_match else {}
        try:
            resp = self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **extra)
        except (ClientError, BotoCoreError) as exc:
            if self._code(exc) in _PRECONDITION or (if_match and self._code(exc) in _MISSING):
                raise PreconditionFailed(f"{key}: {self._code(exc)}") from exc
            raise self._fail("write", key, exc) from exc
        return resp["ETag"]

    def list(self, prefix: str) -> Iterator[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        start = len(self.prefix) + 1 if self.prefix else 0
        token = None
        while True:
            self.requests["list"] += 1
            kwargs = {
                "Bucket": self.bucket,
                "Prefix": self._key(prefix.rstrip("/")) + "/"
                if prefix.strip("/")
                else (self.prefix + "/" if self.prefix else ""),
            }
            if token:
                kwargs["ContinuationToken"] = token
            try:
                resp = self.client.list_objects_v2(**kwargs)
            except (ClientError, BotoCoreError) as exc:
                raise self._fail("list", prefix, exc) from exc
            for obj in resp.get("Contents", []):
                yield obj["Key"][start:]
            if not resp.get("IsTruncated"):
                return
            token = resp["NextContinuationToken"]

    def delete(self, key: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        self.requests["delete"] += 1
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (ClientError, BotoCoreError) as exc:
            raise self._fail("delete", key, exc) from exc

    def clean_stale(self) -> Sequence[str]:
        """Nothing to do: an S3 put is whole or absent."""
        return []


def open_store(url: str, root: str | os.PathLike | None = None) -> Store:
    """A store from ``s3://bucket/prefix`` or a folder (relative to ``root``, the project)."""
    if url.startswith("s3://"):
        return S3Store(url)
    if "://" in url:
        raise ConfigError(f"unsupported store {url!r}", hint="use a folder or s3://bucket/prefix")
    path = Path(url)
    if not path.is_absolute() and root is not None:
        path = Path(root) / path
    return LocalStore(path)


def store_url(configured: str, env: Mapping[str, str] | None = None) -> str:
    """``SKUFORGE_STORE`` when set, else ``configured`` (``rollout.store``)."""
    return SKUFORGE_STORE.get(env) or configured
