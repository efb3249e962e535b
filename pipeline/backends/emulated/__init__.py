"""Engines of an aarch64 SKU run on an x86-64 host under QEMU user-mode emulation (issue 40): the
runtime's own aarch64 build, from PyPI's wheels at the host's versions, in an aarch64 Python
(pipeline/host/emulation.py makes that environment), so an arm64 kernel, a cross-built engine or an
engine built for the host that computes something else there is found before a device runs it.

The worker (worker.py beside this file) runs only the runtime's calls; the skuforge runner around
it is the native one, given a proxy of the runtime object it drives: ``EmulatedSession`` for ONNX
Runtime's ``InferenceSession``, ``EmulatedInterpreter`` for LiteRT's ``Interpreter``. The correctness
gates judge what comes back as for any engine. Timings under emulation mean nothing: an emulated
engine is validated, never benchmarked.
"""

from __future__ import annotations

import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core.env import process_environment
from pipeline.core.errors import EnvironmentProblem, InputError
from pipeline.core.processes import receive_message, send_message, stop_group
from pipeline.host import emulation

if TYPE_CHECKING:
    import numpy as np

    from pipeline.backends.contract import Runner

WORKER = Path(__file__).with_name("worker.py")
RPC_SERVER = Path(__file__).with_name("rpc_server.py")
RPC_START_S = 300.0  # TVM's import under QEMU: ~10 s on a 2-core host
LOAD_TIMEOUT_S = 600.0  # a load under QEMU takes seconds here (import ~1 s); the bound is for a loaded host
RUN_TIMEOUT_S = 600.0
SETUP_HINT = "scripts/setup.sh --with emulation (qemu-user-static and an aarch64 Python environment)"


def packages() -> dict[str, str]:
    """The aarch64 environment's packages: numpy and the runtimes at the versions this host has, so an
    emulated engine runs the same runtime release as a native one (the SKU's pins hold for both)."""
    return emulation.host_versions()


def problems() -> list[str]:
    """Why this host cannot run engines under emulation now (empty: it can)."""
    return emulation.problems(packages())


def _record(env_dir: Path, runtime: dict[str, str], **more: str) -> dict[str, Any]:
    """What the validation report records of an emulated run ("validated under emulation")."""
    return {
        "emulator": emulation.EMULATOR,
        "cpu": emulation.QEMU_CPU,
        "runtime": runtime,
        **more,
        "environment": emulation.versions(env_dir),
    }


class Worker:
    """One engine in one emulated worker process; calls are serialised (one worker, one engine)."""

    def __init__(self, load: dict[str, Any], what: str) -> None:
        missing = problems()
        if missing:
            raise EnvironmentProblem(f"{what} cannot run under emulation: {'; '.join(missing)}", hint=SETUP_HINT)
        env_dir = emulation.env_dir(packages())
        argv, env = emulation.command(env_dir, WORKER)
        self.what = what
        self._lock = threading.Lock()
        self._tmp = tempfile.TemporaryDirectory(prefix="skuforge-emulated-")
        self._stderr = open(Path(self._tmp.name) / "stderr.txt", "w+b")  # noqa: SIM115 (closed in close())
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env, start_new_session=True
        )
        try:
            self.info = self._request({"load": load}, LOAD_TIMEOUT_S)
            if self.info.get("machine") != "aarch64":  # the emulated Python is not what it should be
                raise EnvironmentProblem(
                    f"the emulated Python reports machine {self.info.get('machine')!r}, not aarch64", hint=SETUP_HINT
                )
        except BaseException:
            self.close()
            raise
        self.record = _record(env_dir, self.info.get("versions", {}))

    def _request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            send_message(self._proc.stdin.fileno(), message)
            reply = receive_message(self._proc.stdout.fileno(), timeout_s)
        except (BrokenPipeError, EOFError, subprocess.TimeoutExpired) as exc:
            self._stderr.seek(0)
            tail = self._stderr.read().decode(errors="replace").strip().splitlines()[-3:]
            code = self._proc.poll()
            why = (
                f"did not answer in {timeout_s:.0f} s"
                if isinstance(exc, subprocess.TimeoutExpired)
                else f"exited with {code}"
                if code is not None
                else str(exc)
            )
            raise InputError(
                f"{self.what}: the emulated aarch64 runtime {why}" + (f": {' | '.join(tail)}" if tail else ""),
                hint="a crash here is what an arm64 device would do with this engine; run it on the device to confirm",
            ) from None
        if "error" in reply:
            raise InputError(
                f"{self.what}: under emulation ({emulation.QEMU_CPU}) the aarch64 runtime failed: "
                f"{reply.get('kind')}: {reply['error']}",
                hint="the engine does not run on the SKU's CPU: rebuild it for the target (skuforge build)",
            )
        return reply

    def run(self, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        import numpy as np

        with self._lock:
            folder = Path(self._tmp.name)
            inputs, outputs = folder / "inputs.npz", folder / "outputs.npz"
            named: dict[str, Any] = dict(feeds)
            with open(inputs, "wb") as f:
                np.savez(f, **named)
            self._request({"run": {"inputs": str(inputs), "outputs": str(outputs), "names": names}}, RUN_TIMEOUT_S)
            with np.load(outputs, allow_pickle=False) as data:
                return {name: data[name] for name in names}

    def close(self) -> None:
        proc = self._proc
        if proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                stop_group(proc, grace_s=2)
                proc.wait()
        for stream in (proc.stdout, self._stderr):
            if stream is not None:
                stream.close()
        self._tmp.cleanup()


def describe() -> dict[str, Any]:
    """The emulator and the environment an emulated run would use (for ``skuforge runner probe``)."""
    return {
        "emulator": emulation.EMULATOR,
        "cpu": emulation.QEMU_CPU,
        "environment": str(emulation.env_dir(packages())),
        "packages": packages(),
    }


@dataclass
class _Io:
    name: str
    type: str
    shape: list[int | None]


class EmulatedSession:
    """What skuforge's ONNX Runtime runner uses of an ``InferenceSession``, answered by the worker."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._inputs = [_Io(**t) for t in worker.info["inputs"]]
        self._outputs = [_Io(**t) for t in worker.info["outputs"]]

    def get_inputs(self) -> list[_Io]:
        return self._inputs

    def get_outputs(self) -> list[_Io]:
        return self._outputs

    def get_providers(self) -> list[str]:
        return list(self.worker.info.get("providers", []))

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        out = self.worker.run(feeds, list(names))
        return [out[n] for n in names]


class EmulatedInterpreter:
    """What skuforge's LiteRT runner uses of an ``Interpreter``: tensors set, one invoke, tensors read."""

    def __init__(self, worker: Worker, outputs: list[int]) -> None:
        self.worker = worker
        self._outputs = [str(i) for i in outputs]
        self._feeds: dict[str, np.ndarray] = {}
        self._results: dict[str, np.ndarray] = {}

    def set_tensor(self, index: int, value: np.ndarray) -> None:
        self._feeds[str(index)] = value

    def invoke(self) -> None:
        self._results = self.worker.run(self._feeds, self._outputs)

    def get_tensor(self, index: int) -> np.ndarray:
        return self._results[str(index)]


def stamp() -> Path:
    """The file whose change means the emulated environment changed (the host check's cache key)."""
    return emulation.env_dir(packages()) / emulation.STAMP


def emulated_runner(runner: Runner, worker: Worker) -> Runner:
    runner.emulation = worker.record
    return runner


def check_versions(worker: Worker, built: dict[str, str], keys: tuple[str, ...], engine: Path) -> None:
    """An engine runs under emulation only on the runtime release that built it (as natively)."""
    have = worker.info.get("versions", {})
    for key in keys:
        if key in have and built.get(key) != have[key]:
            raise InputError(
                f"{engine} was built with {key} {built.get(key)}, the emulated environment has {have[key]}",
                hint=f"rebuild the engine, or remake the environment: {SETUP_HINT}",
            )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(lines[-3:])


class RpcDevice:
    """The SKU's device for TVM's RPC path, emulated: TVM's tracker on loopback (this host's TVM) and,
    registered with it under ``key``, TVM's RPC server in the aarch64 Python under QEMU. The engine
    then goes through the tracker and ``RemoteTvmRunner`` exactly as to a board on a device bench:
    the cross-compiled library is uploaded, loaded by the aarch64 TVM runtime and run there.
    ``tracker``: (host, port) to ask. ``close`` stops both."""

    def __init__(self, key: str, what: str) -> None:
        missing = problems() or ([] if "apache-tvm" in packages() else ["apache-tvm is not installed on this host"])
        if missing:
            raise EnvironmentProblem(f"{what} cannot run under emulation: {'; '.join(missing)}", hint=SETUP_HINT)
        env_dir = emulation.env_dir(packages())
        self._tmp = tempfile.TemporaryDirectory(prefix="skuforge-emulated-rpc-")
        self._procs: list[subprocess.Popen] = []
        self.tracker = ("127.0.0.1", _free_port())
        try:
            self._start_tracker()
            self._start_server(env_dir, key, what)
        except BaseException:
            self.close()
            raise
        self.record = _record(
            env_dir,
            {"apache-tvm": packages()["apache-tvm"]},
            rpc=f"TVM's rpc_server under the key {key!r}, through a tracker on loopback",
        )

    def _spawn(self, argv: list[str], env: Any, log: str, **kw: Any) -> subprocess.Popen:
        with open(Path(self._tmp.name) / log, "wb") as err:
            proc = subprocess.Popen(argv, stderr=err, env=env, start_new_session=True, **kw)
        self._procs.append(proc)
        return proc

    def _start_tracker(self) -> None:
        host, port = self.tracker
        argv = [sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", host, "--port", str(port)]
        proc = self._spawn([*argv, "--port-end", str(port + 1), "--silent"], process_environment(), "tracker.log")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection((host, port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise EnvironmentProblem(
            f"TVM's RPC tracker did not start on {host}:{port}: {_tail(Path(self._tmp.name) / 'tracker.log')}"
        )

    def _start_server(self, env_dir: Path, key: str, what: str) -> None:
        base = _free_port()
        host, port = self.tracker
        argv, env = emulation.command(env_dir, RPC_SERVER, host, str(base), str(base + 100), host, str(port), key)
        proc = self._spawn(argv, env, "server.log", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        ready = select.select([proc.stdout], [], [], RPC_START_S)[0]
        line = proc.stdout.readline().strip() if ready else b""
        if not line.isdigit():
            why = f"did not start in {RPC_START_S:.0f} s" if not ready else f"exited with {proc.poll()}"
            raise InputError(
                f"{what}: the emulated aarch64 TVM RPC server {why}: {_tail(Path(self._tmp.name) / 'server.log')}",
                hint=SETUP_HINT,
            )

    def death(self) -> str:
        """Why the emulated server died ("" while it runs): an illegal instruction is a library using
        what the emulated CPU lacks (qemu kills itself with the guest's signal)."""
        server = self._procs[-1] if len(self._procs) == 2 else None
        if server is None:
            return ""
        try:
            code = server.wait(timeout=5)  # the crash and the dropped session come together
        except subprocess.TimeoutExpired:
            return ""
        try:
            what = signal.Signals(-code).name if code < 0 else f"exit {code}"
        except ValueError:
            what = f"signal {-code}"
        lacks = f" (an instruction the emulated {emulation.QEMU_CPU} lacks)" if code == -signal.SIGILL else ""
        tail = _tail(Path(self._tmp.name) / "server.log")
        return f"the emulated aarch64 rpc_server died of {what}{lacks}" + (f": {tail}" if tail else "")

    def close(self) -> None:
        for proc in reversed(self._procs):
            if proc.poll() is None:
                stop_group(proc, grace_s=2)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
        self._procs = []
        self._tmp.cleanup()
