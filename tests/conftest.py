"""Shared test set-up: ``import models`` finds the tiny ONNX model builders in tests/models.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


@pytest.fixture(autouse=True, scope="session")
def _developer_key_in_tmp(tmp_path_factory):
    """Publish signs with a developer key made on first use: keep it out of the real home."""
    if "SKUFORGE_KEY_DIR" not in os.environ:
        os.environ["SKUFORGE_KEY_DIR"] = str(tmp_path_factory.mktemp("skuforge-keys"))
    yield


@pytest.fixture(scope="session")
def zip_bomb(tmp_path_factory) -> Path:
    """A real zip bomb: an .npz of about 1 MiB whose member 'x.npy' (a valid float32 header) inflates to
    1 GiB of zeros, about 1000-fold. Built once per process by streaming zeros through deflate."""
    import zipfile

    from numpy.lib import format as npy

    path = tmp_path_factory.mktemp("bomb") / "bomb.npz"
    inflated, chunk = 1 << 30, bytes(1 << 24)
    with (
        zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive,
        archive.open("x.npy", "w", force_zip64=True) as member,
    ):
        npy.write_array_header_1_0(member, {"descr": "<f4", "fortran_order": False, "shape": (inflated // 4, 1)})
        for _ in range(inflated // len(chunk)):
            member.write(chunk)
    return path


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One real `mlflow server` on loopback per test process (see registry_helpers.Server)."""
    from registry_helpers import MLFLOW, Server

    if not MLFLOW.is_file():
        pytest.skip(f"no mlflow executable next to {sys.executable} (pip install mlflow)")
    srv = Server(tmp_path_factory.mktemp("mlflow_server"))
    srv.start(new_port_if_taken=True)
    yield srv
    srv.stop()
