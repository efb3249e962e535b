"""Secrets out of every message that leaves the process.

:func:`redact` is the one filter: the CLI applies it to its error lines, every log record, warnings,
tracebacks and everything written to stdout/stderr (:func:`install`); the library applies it to
the MLflow error text it wraps. It removes

- the user and password of any URI (``scheme://user:pass@host`` -> ``scheme://***@host``);
- the value of every secret environment variable, wherever it appears verbatim (and URL-quoted);
- ``Authorization: Bearer …`` / ``Basic …`` headers and ``token=…``-style parameters.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, TextIO
from urllib.parse import quote, unquote, urlsplit

from pipeline.core.env import (
    DATABASE_URL,
    MLFLOW_REGISTRY_URI,
    MLFLOW_TRACKING_PASSWORD,
    MLFLOW_TRACKING_URI,
    MLFLOW_TRACKING_USERNAME,
    SKUFORGE_SIGNING_KEY,
    process_environment,
)

MASK = "***"

# Always secret, whatever their name says.
SECRET_ENV = (
    "MLFLOW_TRACKING_TOKEN",
    MLFLOW_TRACKING_PASSWORD.name,
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "GITHUB_TOKEN",
    SKUFORGE_SIGNING_KEY.name,
    "DATABRICKS_TOKEN",
)
SECRET_SUFFIXES = ("_TOKEN", "_SECRET", "_PASSWORD", "_PASSWD", "_KEY", "_API_KEY", "_ACCESS_KEY")
# Names that end like a secret but hold public values (Python images set GPG_KEY to a key fingerprint).
NOT_SECRET = frozenset({"GPG_KEY", "PYTHON_GPG_KEY", "CACHE_KEY", "SORT_KEY", "PRIMARY_KEY", "SSH_AUTH_KEY"})
NOT_SECRET_SUFFIXES = ("_PUBLIC_KEY", "_PUB_KEY", "_KEY_ID", "_KEY_PATH", "_KEY_FILE")
# URIs whose password is a secret even when the variable's name does not say so.
URI_ENV = (MLFLOW_TRACKING_URI.name, MLFLOW_REGISTRY_URI.name, DATABASE_URL.name)
MIN_SECRET = 6  # shorter values ("true", "1", "cpu") would mask ordinary words

_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^\s/?#'\"<>]*@(?=[^\s@/])")
_AUTH_HEADER = re.compile(r"(?i)\b(authorization[\"']?\s*[:=]\s*[\"']?(?:bearer|basic|token|digest)?\s*)[^\s\"',;}]+")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[a-z0-9._~+/=\-]{6,}")
_PARAM = re.compile(
    r"(?i)\b((?:access_token|id_token|refresh_token|token|password|passwd|pwd|secret|api_key|apikey"
    r"|client_secret|x-amz-security-token|x-amz-signature|sig)(?:\s*=\s*|[\"']\s*:\s*)[\"']?)"
    r"(?!\*\*\*)[^\s&\"',;}]+"
)


def is_secret_name(name: str) -> bool:
    name = name.upper()
    if name in SECRET_ENV:
        return True
    if name in NOT_SECRET or name.endswith(NOT_SECRET_SUFFIXES):
        return False
    return name.endswith(SECRET_SUFFIXES)


def secret_values(env: Mapping[str, str] | None = None) -> list[str]:
    """The values to mask, longest first (so a secret containing another is masked whole)."""
    env = process_environment() if env is None else env
    values: set[str] = set()
    for name, value in env.items():
        if value and is_secret_name(name):
            values.add(value)
    if MLFLOW_TRACKING_PASSWORD.get(env):  # the user name is only worth hiding next to its password
        values.add(MLFLOW_TRACKING_USERNAME.get(env) or "")
    for var in (MLFLOW_TRACKING_URI, MLFLOW_REGISTRY_URI, DATABASE_URL):
        try:
            parts = urlsplit(var.get(env) or "")
            values.update(v for v in (parts.password,) if v)
        except ValueError:
            continue
    quoted = {quote(v, safe="") for v in values} | {unquote(v) for v in values}
    return sorted((v for v in values | quoted if len(v) >= MIN_SECRET), key=len, reverse=True)


def redact(text: Any, env: Mapping[str, str] | None = None) -> str:
    """``text`` without credentials: safe to print, log or write into a CI summary."""
    text = str(text)
    for value in secret_values(env):
        if value in text:
            text = text.replace(value, MASK)
    if "://" in text:
        text = _USERINFO.sub(rf"\1{MASK}@", text)
    text = _AUTH_HEADER.sub(rf"\1{MASK}", text)
    text = _BEARER.sub(rf"\1{MASK}", text)
    return _PARAM.sub(rf"\1{MASK}", text)


def redact_all(texts: Iterable[Any]) -> list[str]:
    return [redact(t) for t in texts]


# --- the CLI's hooks -----------------------------------------------------------------------------


class RedactingStream:
    """A text stream that redacts each write before passing it on (stdout/stderr of the CLI)."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(redact(text))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding, ...
        return getattr(self.stream, name)


class RedactingFilter(logging.Filter):
    """Rewrites a record's message and traceback text redacted (install on handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        _redact_record(record)
        return True


def _redact_record(record: logging.LogRecord) -> logging.LogRecord:
    if getattr(record, "_redacted", False):
        return record
    try:
        message = record.getMessage()
    except Exception:  # a bad format string is the logging module's to report
        return record
    record.msg, record.args = redact(message), None
    if record.exc_info and not record.exc_text:
        record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
    elif record.exc_text:
        record.exc_text = redact(record.exc_text)
    if record.stack_info:
        record.stack_info = redact(record.stack_info)
    record._redacted = True
    return record


class Installed:
    """What :func:`install` replaced, put back by :meth:`undo`."""

    def __init__(self) -> None:
        self.stdout, self.stderr = sys.stdout, sys.stderr
        self.factory = logging.getLogRecordFactory()
        self.showwarning = warnings.showwarning

    def undo(self) -> None:
        sys.stdout, sys.stderr = self.stdout, self.stderr
        logging.setLogRecordFactory(self.factory)
        warnings.showwarning = self.showwarning


def install() -> Installed:
    """Redact everything this process prints: stdout, stderr, every log record of any logger
    (MLflow's and urllib3's have their own handlers) and warnings."""
    before = Installed()
    if not isinstance(sys.stdout, RedactingStream) and sys.stdout is not None:
        sys.stdout = RedactingStream(sys.stdout)
    if not isinstance(sys.stderr, RedactingStream) and sys.stderr is not None:
        sys.stderr = RedactingStream(sys.stderr)
    factory = before.factory

    def make_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        return _redact_record(factory(*args, **kwargs))

    logging.setLogRecordFactory(make_record)
    show = before.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        show(redact(message), category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    return before
