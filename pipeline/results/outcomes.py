"""Outcome records: what a failed stage command leaves for ``skuforge repro``'s matrix (exit code,
one redacted line, the unsupported op, the time budget that ran out). Written by the CLI on failure,
cleared when the stage runs again, read by pipeline/engine/matrix.py. Never trusted as evidence: a record is a hint."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pipeline.core.errors import TimedOut, UnsupportedOp
from pipeline.core.io import atomic_write_json, git_ignored
from pipeline.core.redact import redact

OUTCOMES_DIR = Path("build") / ".outcomes"  # not inside any stage's outs: dvc neither removes nor tracks it


def outcome_path(root: Path, stage: str, model: str | None = None, sku: str | None = None) -> Path:
    """``build/.outcomes/config.json``, ``<model>/<stage>.json`` or ``<model>/<stage>@<sku>.json``."""
    base = Path(root) / OUTCOMES_DIR
    if model is None:
        return base / f"{stage}.json"
    return base / model / (f"{stage}@{sku}.json" if sku else f"{stage}.json")


def record_outcome(
    root: Path,
    stage: str,
    model: str | None,
    sku: str | None,
    exit_code: int,
    message: str,
    error: BaseException | None = None,
) -> Path:
    """Write the failure of one stage command (atomically): stage, exit code, one-line message and,
    for an UnsupportedOp, the backend, op and node."""

    git_ignored(Path(root) / OUTCOMES_DIR)  # local state of this checkout, like build/
    lines = [line.strip() for line in redact(message).splitlines() if line.strip()]
    record: dict[str, Any] = {
        "stage": stage,
        "model": model,
        "sku": sku,
        "exit_code": exit_code,
        "message": " / ".join(lines[:4]) or "failed without a message",
        "time": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        "unsupported": None,
    }
    if isinstance(error, TimedOut):  # a gate on time: the matrix says so rather than a correctness failure
        record["timed_out"] = {"stage": error.stage, "seconds": error.seconds}
    if isinstance(error, UnsupportedOp):
        record["unsupported"] = {"backend": error.backend, "op_type": error.op_type, "node": error.node}
    return atomic_write_json(outcome_path(root, stage, model, sku), record)


def clear_outcome(root: Path, stage: str, model: str | None = None, sku: str | None = None) -> None:
    outcome_path(root, stage, model, sku).unlink(missing_ok=True)


def read_outcome(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
        record["_mtime"] = path.stat().st_mtime
        return record if isinstance(record, dict) and "stage" in record else None
    except (OSError, ValueError):
        return None  # half-written or foreign: a record is a hint, never a reason to fail
