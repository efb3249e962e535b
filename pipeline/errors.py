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


class ConfigError(SkuforgeError):
    """params.yaml or a command-line argument is wrong."""

    exit_code = 2


class InputError(SkuforgeError):
    """An input file (model, dataset) is missing, malformed or contradicts the config."""

    exit_code = 2


class EnvironmentProblem(SkuforgeError):
    """A backend SDK, device or toolchain is missing or does not match the SKU."""

    exit_code = 3


class ServiceError(SkuforgeError):
    """An external service (MLflow, S3) failed."""

    exit_code = 4


EXIT_OK = 0
EXIT_INTERNAL = 70
