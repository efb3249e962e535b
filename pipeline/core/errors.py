"""User-facing failures and their exit codes.

Only these reach the user as a message; any other exception is a bug (exit 70).
"""

from __future__ import annotations


class SkuforgeError(Exception):
    """A failure the user can act on. ``hint`` says what to do."""

    exit_code = 70

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


class GateFailed(SkuforgeError):
    """A correctness, placement or performance gate failed (the report is still written)."""

    exit_code = 1


class TimedOut(GateFailed):
    """A stage ran past its time budget (skus.<sku>.max_seconds): a gate on how long it may take,
    so exit 1 like any gate; ``stage``, ``seconds`` and where it was name what ran out."""

    def __init__(self, message: str, hint: str | None = None, stage: str = "", seconds: float = 0.0):
        super().__init__(message, hint)
        self.stage, self.seconds = stage, seconds


class ConfigError(SkuforgeError):
    """params.yaml or a command-line argument is wrong."""

    exit_code = 2


class InputError(SkuforgeError):
    """An input file (model, dataset) is missing, malformed or contradicts the config."""

    exit_code = 2


class MalformedFile(InputError, ValueError):
    """A file is not what it should be (not JSON, not UTF-8). Also a ValueError, so callers that
    handle a corrupt file (and rebuild it) keep doing so."""


class EnvironmentProblem(SkuforgeError):
    """A backend SDK, device or toolchain is missing or does not match the SKU."""

    exit_code = 3


class StorageError(EnvironmentProblem):
    """A folder is read-only, or the disk (or quota) is full: names the path and what to do."""

    def __init__(self, message: str, hint: str | None = None, path: str | None = None):
        super().__init__(message, hint)
        self.path = path


class UnsupportedOp(EnvironmentProblem):
    """A backend cannot compile or run an op of the model: names the op, the node and the backend."""

    def __init__(self, backend: str, op_type: str | None, node: str | None, detail: str, hint: str | None = None):
        where = f"op {op_type!r}" if op_type else "an op"
        where += f" (node {node!r})" if node else ""
        super().__init__(
            f"{backend} cannot compile {where}: {detail}",
            hint or "use another backend for this model, or replace the op before export",
        )
        self.backend, self.op_type, self.node = backend, op_type, node


class ServiceError(SkuforgeError):
    """An external service (MLflow, S3) failed."""

    exit_code = 4


def first_line(what: BaseException | str) -> str:
    """The first non-empty line of an exception's (or a message's) text: what a one-line error
    quotes of an SDK's multi-line message; the exception's type when it says nothing."""
    text = str(what).strip()
    if text:
        return text.splitlines()[0].strip()
    return type(what).__name__ if isinstance(what, BaseException) else "unknown error"


EXIT_OK = 0
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT)
EXIT_TERMINATED = 143  # SIGTERM (128 + 15, as a shell reports it)
