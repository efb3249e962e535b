"""Session fixture: one real `mlflow server` per test process (see registry_helpers.Server)."""

from __future__ import annotations

import sys

import pytest

from registry_helpers import MLFLOW, Server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    if not MLFLOW.is_file():
        pytest.skip(f"no mlflow executable next to {sys.executable} (pip install mlflow)")
    srv = Server(tmp_path_factory.mktemp("mlflow_server"))
    srv.start(new_port_if_taken=True)
    yield srv
    srv.stop()
