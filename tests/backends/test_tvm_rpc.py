"""A device bench on loopback: a real TVM RPC tracker and two rpc_server processes under one key.
The tiny conv model is tuned through them (a server killed after the first measured batch: the
search goes on on the other), a SKU whose key no server has fails with exit 4 naming the key
after the bounded wait, a SKU with a key and no tracker variable refuses to tune (exit 3), and a
built engine is validated and benchmarked through a remote session.

Every wait on the tracker or a device has a deadline (issue 37): a tracker that never answers, a
closed port, a key without devices, a device that never answers its session and one that freezes
mid-run each end with exit 4 naming the address and the variable to raise, and a device frozen
during tuning ends its candidate as a failed run. Those tests set 1-3 s deadlines and a 20 s
guard, so a wait that is not bounded fails instead of hanging the suite."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from tvm_helpers import tvm_or_skip

tvm_or_skip()
if importlib.util.find_spec("tornado") is None:
    pytest.skip("TVM's RPC tracker needs tornado (pip install tornado)", allow_module_level=True)

import models  # noqa: E402
from rpc_bench import free_port, silent_server, silent_tracker, start  # noqa: E402

from pipeline.backends.tvm import (  # noqa: E402
    TvmBackend,
    TvmOptions,
    extract_tasks,
    import_onnx,
    lower,
    open_database,
    target_of,
    tune_run,
)
from pipeline.backends.tvm import rpc as tvm_rpc  # noqa: E402
from pipeline.backends.tvm.rpc import RemoteTvmRunner, RpcOptions, connect, registered, rpc_runner  # noqa: E402
from pipeline.core.errors import ConfigError, EnvironmentProblem, ServiceError  # noqa: E402
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


@contextmanager
def _ends_within(seconds: int = 20):
    """Fails the test when the block is still waiting after ``seconds`` (the issue's bound for a dead
    or silent service; the deadlines under test are 1-3 s), instead of hanging the suite."""

    def stop(*_: object) -> None:
        raise AssertionError(f"still waiting after {seconds} s: a wait without a deadline")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _stop_servers(bench_rpc, sig: int) -> None:
    for proc in bench_rpc.servers:
        if proc.poll() is None:
            os.killpg(proc.pid, sig)


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


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A project with the conv model built for the SKU ``bench`` (options.rpc.key: KEY) and a SKU
    ``tuned`` that must tune for the bench (not built)."""
    root = tmp_path_factory.mktemp("project")
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
    models.conv_bn_model(root / "models/conv/model.onnx")
    tuned = {**sku, "options": {**sku["options"], "trials": 2}}
    reg = load_registry(models.write_project(root, {"conv": models.conv_bn_spec()}, {"bench": sku, "tuned": tuned}))
    prepare(reg, "conv")
    make_data(reg, "conv")
    reference(reg, "conv")
    build(reg.pair("conv", "bench"))
    return SimpleNamespace(registry=reg, engine=root / "build/conv/bench/engine")


def _remote(built, options: RpcOptions) -> RemoteTvmRunner:
    """The built engine opened on a device under ``options.key``, as TvmBackend.load does."""
    meta = TvmBackend().read_meta(built.engine)
    return RemoteTvmRunner(
        built.engine / meta.library, list(meta.inputs), [o.name for o in meta.outputs], meta.entry, options
    )


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
    monkeypatch.setenv("SKUFORGE_TVM_RPC_WAIT", "1")
    slept: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(tvm_rpc.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    with _ends_within(), pytest.raises(ServiceError) as info:
        connect(RpcOptions(key="nobody"))
    # bounded: it polled until the 1 s deadline and gave up (no wall-clock figure: a busy host is slow)
    assert slept and sum(slept) <= 1 + tvm_rpc._POLL_SECONDS and "after 1 s" in info.value.message
    assert info.value.exit_code == 4 and "'nobody'" in info.value.message and bench_rpc.address in info.value.message
    assert f"{KEY} (" in info.value.message  # the keys the tracker has
    assert "SKUFORGE_TVM_RPC_WAIT" in (info.value.hint or "")


def test_a_tracker_that_never_answers_fails_with_exit_4_after_its_deadline(monkeypatch):
    monkeypatch.setenv("SKUFORGE_TVM_RPC_TIMEOUT", "1")
    with silent_tracker() as address, _ends_within(), pytest.raises(ServiceError) as info:
        monkeypatch.setenv("SKUFORGE_TVM_TRACKER", address)
        connect(RpcOptions(key=KEY))
    error = info.value
    assert error.exit_code == 4 and address in error.message and f"{KEY!r}" in error.message, error
    assert "did not answer within 1 s" in error.message and "SKUFORGE_TVM_RPC_TIMEOUT" in (error.hint or "")


def test_a_closed_tracker_port_fails_with_exit_4_without_retrying(monkeypatch):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("SKUFORGE_TVM_TRACKER", address)
    slept: list[float] = []
    monkeypatch.setattr(tvm_rpc.time, "sleep", lambda s: slept.append(s))  # TVM's client retried 60 s, 5 s apart
    with _ends_within(), pytest.raises(ServiceError) as info:
        connect(RpcOptions(key=KEY))
    error = info.value
    assert error.exit_code == 4 and address in error.message and "refused" in error.message and not slept, error
    assert f"{KEY!r}" in error.message and "SKUFORGE_TVM_TRACKER" in (error.hint or "")


def test_a_deadline_that_is_not_a_positive_number_is_a_config_error(monkeypatch):
    monkeypatch.setenv("SKUFORGE_TVM_TRACKER", "127.0.0.1:9")
    monkeypatch.setenv("SKUFORGE_TVM_RPC_TIMEOUT", "0")
    with pytest.raises(ConfigError, match="SKUFORGE_TVM_RPC_TIMEOUT='0'.*the least is 0.1"):
        connect(RpcOptions(key=KEY))


def test_a_device_that_never_answers_its_session_fails_with_exit_4(bench_rpc, built, monkeypatch):
    monkeypatch.setenv("SKUFORGE_TVM_TRACKER", bench_rpc.address)
    monkeypatch.setenv("SKUFORGE_TVM_RPC_TIMEOUT", "1")
    with silent_server(bench_rpc.port, "frozen") as port, _ends_within(), pytest.raises(ServiceError) as info:
        _remote(built, RpcOptions(key="frozen"))
    error = info.value
    assert error.exit_code == 4 and "did not answer within 1 s" in error.message and "opening" in error.message, error
    assert f"127.0.0.1:{port}" in error.message and "'frozen'" in error.message and bench_rpc.address in error.message
    assert "SKUFORGE_TVM_RPC_TIMEOUT" in (error.hint or "")


def test_a_device_frozen_mid_run_fails_validate_with_exit_4(bench_rpc, built, monkeypatch):
    monkeypatch.setenv("SKUFORGE_TVM_TRACKER", bench_rpc.address)
    monkeypatch.setenv("SKUFORGE_TVM_RPC_TIMEOUT", "3")  # the upload and load before the freeze must fit
    servers = registered("127.0.0.1", bench_rpc.port).get(KEY)
    original = tvm_rpc.RemoteTvmRunner.__init__

    def freeze_after_loading(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _stop_servers(bench_rpc, signal.SIGSTOP)  # the device the session is on stops answering

    monkeypatch.setattr(tvm_rpc.RemoteTvmRunner, "__init__", freeze_after_loading)
    try:
        with _ends_within(), pytest.raises(ServiceError) as info:
            validate(built.registry.pair("conv", "bench"))
    finally:
        _stop_servers(bench_rpc, signal.SIGCONT)
    error = info.value
    assert error.exit_code == 4 and "did not answer within 3 s" in error.message and f"{KEY!r}" in error.message, error
    assert bench_rpc.address in error.message and "SKUFORGE_TVM_RPC_TIMEOUT" in (error.hint or "")
    # the session's socket was shut down, so the servers end it and register again
    _wait(lambda: registered("127.0.0.1", bench_rpc.port).get(KEY) == servers, 30)


def test_a_device_frozen_during_tuning_ends_its_candidate_as_a_failed_run(bench_rpc, tmp_path):
    from tvm.s_tir.meta_schedule.runner import RunnerInput

    artifact = tmp_path / "candidate.so"  # never read: the session to the device never opens
    artifact.write_bytes(b"")
    with silent_server(bench_rpc.port, "frozen-tuning"):
        runner = rpc_runner(RpcOptions(key="frozen-tuning", session_timeout_s=2), "127.0.0.1", bench_rpc.port)
        try:
            with _ends_within():
                (result,) = [f.result() for f in runner.run([RunnerInput(str(artifact), "cpu", [])])]
        finally:
            runner.pool.shutdown(wait=False)
    # MetaSchedule records a result with an error as a failed measurement and goes on searching
    assert result.run_secs is None and "Timeout, killed after 2" in (result.error_msg or ""), result.error_msg


def test_a_key_without_the_tracker_variable_refuses_to_run_here(monkeypatch):
    monkeypatch.delenv("SKUFORGE_TVM_TRACKER", raising=False)
    with pytest.raises(EnvironmentProblem) as info:
        connect(RpcOptions(key=KEY), wait_s=0)
    assert info.value.exit_code == 3 and "SKUFORGE_TVM_TRACKER is unset" in info.value.message


def test_validate_and_bench_run_the_engine_through_a_remote_session(bench_rpc, built, monkeypatch):
    reg = built.registry
    # a build that must tune for the bench, with no tracker set: refused, never tuned on this host
    monkeypatch.delenv("SKUFORGE_TVM_TRACKER", raising=False)
    monkeypatch.setenv("SKUFORGE_TUNE", "1")
    with pytest.raises(EnvironmentProblem, match="SKUFORGE_TVM_TRACKER is unset"):
        build(reg.pair("conv", "tuned"))
    monkeypatch.delenv("SKUFORGE_TUNE")
    monkeypatch.setenv("SKUFORGE_TVM_TRACKER", bench_rpc.address)
    served = []
    original = tvm_rpc.RemoteTvmRunner.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        served.append(self.where)

    monkeypatch.setattr(tvm_rpc.RemoteTvmRunner, "__init__", spy)
    result = validate(reg.pair("conv", "bench"))
    assert result.passed, result.failures
    stats = bench(reg.pair("conv", "bench"))
    assert stats.engine_only.p50_ms > 0
    assert served and all(w == f"{KEY}@{bench_rpc.address}" for w in served)


def test_max_minutes_ends_the_search_and_keeps_what_was_measured(tmp_path):
    tasks, target = _conv_tasks(tmp_path)
    work = tmp_path / "tuning"
    work.mkdir()
    # a budget already spent when the first batch is measured: the search ends there
    run = tune_run(tasks[:2], target, work, trials=4, per_task=2, max_minutes=1e-6)
    assert run.stopped_at_budget and 0 < run.measured < 4, run
    assert len(open_database(work).get_all_tuning_records()) == run.trials >= 1
