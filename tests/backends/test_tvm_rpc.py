"""A device bench on loopback: a real TVM RPC tracker and two rpc_server processes under one key.
The tiny conv model is tuned through them (a server killed after the first measured batch: the
search goes on on the other), a SKU whose key no server has fails with exit 4 naming the key
after the bounded wait, a SKU with a key and no tracker variable refuses to tune (exit 3), and a
built engine is validated and benchmarked through a remote session."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("tvm", reason="apache-tvm is not installed (pip install -e '.[tvm]')")
if importlib.util.find_spec("tornado") is None:
    pytest.skip("TVM's RPC tracker needs tornado (pip install tornado)", allow_module_level=True)

import models  # noqa: E402
from rpc_bench import free_port, start  # noqa: E402
from test_tvm import _import_intrinsics  # noqa: E402 - tuning's slow import, answered fast (see there)

from pipeline.backends import tvm_rpc  # noqa: E402
from pipeline.backends.tvm import (  # noqa: E402
    TvmOptions,
    extract_tasks,
    import_onnx,
    lower,
    open_database,
    target_of,
    tune_run,
)
from pipeline.backends.tvm_rpc import RpcOptions, connect, registered, rpc_runner  # noqa: E402
from pipeline.core.errors import EnvironmentProblem, ServiceError  # noqa: E402
from pipeline.host.probe import cpu_features, host_arch  # noqa: E402
from pipeline.project.config import load_registry  # noqa: E402
from pipeline.stages.bench import bench  # noqa: E402
from pipeline.stages.build import build  # noqa: E402
from pipeline.stages.data import make_data  # noqa: E402
from pipeline.stages.prepare import prepare  # noqa: E402
from pipeline.stages.reference import reference  # noqa: E402
from pipeline.stages.validate import validate  # noqa: E402

if host_arch() != "x86_64" or "avx2" not in cpu_features():
    pytest.skip("the TVM test SKUs compile for x86-64-v3 hosts", allow_module_level=True)

KEY = "loopback"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _wait(check, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (ServiceError, OSError, RuntimeError):
            pass
        time.sleep(0.3)
    raise AssertionError("the loopback bench did not come up")


@pytest.fixture(scope="module")
def bench_rpc():
    """A tracker and two servers under KEY, on loopback."""
    port = free_port()
    tracker = start("tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port), "--port-end", str(port + 1))
    servers = []
    try:
        _wait(lambda: registered("127.0.0.1", port) is not None)
        for _ in range(2):
            p = free_port()
            servers.append(
                start(
                    "tvm.exec.rpc_server",
                    "--tracker",
                    f"127.0.0.1:{port}",
                    "--key",
                    KEY,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(p),
                    "--port-end",
                    str(p + 1),
                )
            )
        _wait(lambda: registered("127.0.0.1", port).get(KEY) == 2)
        yield SimpleNamespace(address=f"127.0.0.1:{port}", port=port, servers=servers)
    finally:
        for proc in [*servers, tracker]:
            _stop(proc)


def _conv_tasks(tmp_path: Path):
    import onnx
    import tvm

    path = models.conv_bn_model(tmp_path / "conv.onnx", batch=1)
    model = onnx.load(str(path))
    imported = import_onnx(model, {})
    target = tvm.target.Target(target_of(TvmOptions(target_cpu="x86-64-v3", num_cores=1), "x86_64"))
    mod, _ = lower(imported.mod, target, imported.node_of)
    return extract_tasks(mod, target), target


def test_tuning_measures_on_the_bench_and_survives_a_lost_server(bench_rpc, tmp_path, monkeypatch):
    monkeypatch.setenv("SKUFORGE_TVM_TRACKER", bench_rpc.address)
    tasks, target = _conv_tasks(tmp_path)
    _import_intrinsics()
    options = RpcOptions(key=KEY, session_timeout_s=5)
    host, port = connect(options, wait_s=5)
    killed: dict[str, int] = {}

    def progress(label: str, fraction: float) -> None:
        trials = int(label.split("trials ")[1].split("/")[0])
        if trials and not killed:  # after the first measured batch: one device is lost
            os.killpg(bench_rpc.servers[0].pid, signal.SIGKILL)
            killed["after"] = trials

    work = tmp_path / "tuning"
    work.mkdir()
    run = tune_run(
        tasks[:2], target, work, trials=4, per_task=2, progress=progress, runner=rpc_runner(options, host, port)
    )
    assert killed, "no batch was measured"
    # the search went on on the surviving server; a candidate sent to the lost one is a failed measurement
    # (at most killed["after"] candidates ran before the kill: more ran since, on the survivor)
    assert run.measured - run.failed > killed["after"] and run.trials >= 1, run
    assert open_database(work).get_all_tuning_records()  # records measured on the surviving server
    _wait(lambda: registered(host, port).get(KEY) == 1, 10)  # the tracker dropped the dead server


def test_a_key_without_servers_fails_with_exit_4_after_the_bounded_wait(bench_rpc, monkeypatch):
    monkeypatch.setenv("SKUFORGE_TVM_TRACKER", bench_rpc.address)
    slept: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(tvm_rpc.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    with pytest.raises(ServiceError) as info:
        connect(RpcOptions(key="nobody"), wait_s=1)
    # bounded: it polled until the 1 s deadline and gave up (no wall-clock figure: a busy host is slow)
    assert slept and sum(slept) <= 1 + tvm_rpc._POLL_SECONDS and "after 1 s" in info.value.message
    assert info.value.exit_code == 4 and "'nobody'" in info.value.message and bench_rpc.address in info.value.message
    assert f"{KEY} (" in info.value.message  # the keys the tracker has


def test_a_key_without_the_tracker_variable_refuses_to_run_here(monkeypatch):
    monkeypatch.delenv("SKUFORGE_TVM_TRACKER", raising=False)
    with pytest.raises(EnvironmentProblem) as info:
        connect(RpcOptions(key=KEY), wait_s=0)
    assert info.value.exit_code == 3 and "SKUFORGE_TVM_TRACKER is unset" in info.value.message


def test_validate_and_bench_run_the_engine_through_a_remote_session(bench_rpc, tmp_path, monkeypatch):
    sku = {
        "backend": "tvm",
        "precision": "fp32",
        "target": {"arch": "x86_64", "device": "cpu", "os": "linux"},
        "runner_labels": ["self-hosted", "linux", "x64"],
        "shapes": {"batch": 1},
        "options": {"target_cpu": "x86-64-v3", "num_cores": 1, "rpc": {"key": KEY, "session_timeout_s": 30}},
        "placement": {"allowed": ["cpu"]},
        "bench": dict(models.FAST_BENCH),
    }
    models.conv_bn_model(tmp_path / "models/conv/model.onnx")
    tuned = {**sku, "options": {**sku["options"], "trials": 2}}
    reg = load_registry(models.write_project(tmp_path, {"conv": models.conv_bn_spec()}, {"bench": sku, "tuned": tuned}))
    prepare(reg, "conv")
    make_data(reg, "conv")
    reference(reg, "conv")
    build(reg, "conv", "bench")
    # a build that must tune for the bench, with no tracker set: refused, never tuned on this host
    monkeypatch.delenv("SKUFORGE_TVM_TRACKER", raising=False)
    monkeypatch.setenv("SKUFORGE_TUNE", "1")
    with pytest.raises(EnvironmentProblem, match="SKUFORGE_TVM_TRACKER is unset"):
        build(reg, "conv", "tuned")
    monkeypatch.delenv("SKUFORGE_TUNE")
    monkeypatch.setenv("SKUFORGE_TVM_TRACKER", bench_rpc.address)
    served = []
    original = tvm_rpc.RemoteTvmRunner.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        served.append(self.where)

    monkeypatch.setattr(tvm_rpc.RemoteTvmRunner, "__init__", spy)
    result = validate(reg, "conv", "bench")
    assert result.passed, result.failures
    stats = bench(reg, "conv", "bench")
    assert stats.engine_only.p50_ms > 0
    assert served and all(w == f"{KEY}@{bench_rpc.address}" for w in served)


def test_max_minutes_ends_the_search_and_keeps_what_was_measured(tmp_path):
    tasks, target = _conv_tasks(tmp_path)
    _import_intrinsics()
    work = tmp_path / "tuning"
    work.mkdir()
    # a budget already spent when the first batch is measured: the search ends there
    run = tune_run(tasks[:2], target, work, trials=4, per_task=2, max_minutes=1e-6)
    assert run.stopped_at_budget and 0 < run.measured < 4, run
    assert len(open_database(work).get_all_tuning_records()) == run.trials >= 1
