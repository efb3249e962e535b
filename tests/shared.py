"""Folders made once per test session and shared by the pytest-xdist workers: a pipeline that several
modules (or one module's tests on several workers) would otherwise each build again."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def shared_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> Path:
    """The folder ``<session tmp>/shared-<name>``, filled by ``make(folder)`` once per test session:
    under pytest-xdist the first worker to ask makes it under a file lock, the others wait for it and
    reuse it. Read-only to its users: a test that changes anything works on a copy (``copy_shared``)."""
    base = tmp_path_factory.getbasetemp()  # under xdist, a worker's own folder in the session's
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / f"shared-{name}"
    done = folder / ".made"
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed half-way
            folder.mkdir(parents=True)
            make(folder)
            done.touch()
    return folder


def copy_shared(folder: Path, dest: Path) -> Path:
    """A writable copy of a ``shared_once`` folder at ``dest``."""
    shutil.copytree(folder, dest, ignore=shutil.ignore_patterns(".made"), symlinks=True)
    return dest
