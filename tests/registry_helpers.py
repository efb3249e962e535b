"""Helpers of the MLflow tests: a real `mlflow server` on loopback (SQLite backend, served artifacts
in a temporary folder) and a tiny project whose engines the stage functions build with ONNX Runtime."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import models
import pytest

from pipeline.core.errors import GateFailed
from pipeline.core.io import atomic_write_bytes, atomic_write_json, sha256_bytes
from pipeline.core.paths import Layout
from pipeline.project.config import Registry, load_registry
from pipeline.results.benchstats import latency_stats
from pipeline.results.reports import BenchReport
from pipeline.stages.bench import bench
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.manifest import write_manifest
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate

MLFLOW = Path(sys.executable).with_name("mlflow")
FAST_RETRIES = {"retries": 2, "backoff_seconds": 0.05, "max_backoff_seconds": 0.2, "timeout_seconds": 5}


def free_port() -> int:
    """A loopback port nothing listens on (a closed port: connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SilentServer:
    """A dead service of the worst kind: it accepts TCP connections on 127.0.0.1 and never answers.
    ``connections`` counts the attempts a client made."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.1)  # accept() wakes up to see the server stopped
        self.port: int = self._sock.getsockname()[1]
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def connections(self) -> int:
        return len(self._held)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self._held.append(conn)  # held open, never read from or written to

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        for conn in self._held:
            conn.close()


@dataclass
class Server:
    """`mlflow server` in its own process group, so stop() ends it and its workers."""

    root: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def up(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self, timeout: float = 120, new_port_if_taken: bool = False) -> None:
        """Start and wait for /health; a port taken meanwhile (another test process) is replaced
        when ``new_port_if_taken`` (the first start, before any client knows the URI)."""
        assert self.proc is None, "already running"
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(MLFLOW),
                    "server",
                    "--backend-store-uri",
                    f"sqlite:///{self.root / 'server.db'}",
                    "--artifacts-destination",
                    str(self.root / "artifacts"),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--workers",
                    "1",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.root,
                # no background job runner (a dozen huey processes the tests never use)
                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # ours answers, not another test process's server on a port taken meanwhile
            if self.up() and f"Uvicorn running on {self.uri}".encode() in self.log.read_bytes()[offset:]:
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        tail = self.log.read_text(errors="replace")[-3000:]
        self.stop()
        if new_port_if_taken and "address already in use" in tail.lower():
            self.port = free_port()
            return self.start(timeout, new_port_if_taken=False)
        pytest.fail(f"mlflow server did not come up on {self.uri}:\n{tail}")

    def stop(self) -> None:
        """Kill the server and its workers at once, as a crash or a pulled cable would."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=15)
        self.proc = None
        deadline = time.monotonic() + 10
        while self.up() and time.monotonic() < deadline:  # the port must be free before a restart
            time.sleep(0.1)


# --- a tiny project -------------------------------------------------------------------------------


def sku(precision: str = "fp32", iterations: int = 60, **extra) -> dict:
    return models.ort_sku(
        precision,
        bench={
            "warmup": 2,
            "steady_window": 5,
            "max_warmup_seconds": 1.0,
            "roofline": False,
            "iterations": iterations,
            "min_seconds": 0.0,
        },
        **extra,
    )


def make_project(root: Path, skus: dict, release: dict | None = None, failing: tuple[str, ...] = (), **top) -> Registry:
    """conv_bn model, the given SKUs built, validated, benched and described by a manifest.

    SKUs in ``failing`` are expected to fail validation (their report and manifest are still
    written, as under `skuforge validate` followed by bench and manifest).
    """
    models.conv_bn_model(root / "models/conv/model.onnx")
    params = models.write_project(
        root, {"conv": models.conv_bn_spec()}, skus, release=release or {"tracking": FAST_RETRIES}, **top
    )
    reg = load_registry(params)
    prepare(reg, "conv")
    make_data(reg, "conv")
    reference(reg, "conv")
    calibrate(reg, "conv")
    for name in skus:
        build(reg.pair("conv", name))
        try:
            validate(reg.pair("conv", name))
        except GateFailed:
            assert name in failing, f"{name} failed validation"
        else:
            assert name not in failing, f"{name} passed validation"
        bench(reg.pair("conv", name))
        write_manifest(reg.pair("conv", name))
    return reg


def fake_bench(reg: Registry, model: str, sku_name: str, samples_ms) -> str:
    """Replace the pair's latency samples (and the stats in bench.json), rewrite the manifest as a
    runner without the previous one would (no figures kept from it): a new digest for the same
    engine, whose latency the test chose. Returns the digest."""
    out = Layout(reg.root)
    samples = [round(float(x), 4) for x in samples_ms]  # as latency.csv holds them
    csv = ("iteration,latency_ms\n" + "".join(f"{i},{v:.4f}\n" for i, v in enumerate(samples))).encode()
    report = BenchReport.model_validate_json(out.report(model, sku_name, "bench").read_text())
    atomic_write_json(
        out.report(model, sku_name, "bench"),
        report.model_copy(
            update={"engine_only": latency_stats(samples), "latency_sha256": sha256_bytes(csv)}
        ).to_json(),
    )
    atomic_write_bytes(out.latency_csv(model, sku_name), csv)
    out.manifest(model, sku_name).unlink(missing_ok=True)
    return write_manifest(reg.pair(model, sku_name)).digest
