"""A device bench reached through TVM's RPC tracker: a TVM SKU that names a tracker key
(``options.rpc.key``) has its tuning candidates measured, and its engine validated and
benchmarked, on the devices registered under that key; this host only compiles.

The tracker's address comes from SKUFORGE_TVM_TRACKER alone (a CI secret or a runner's
environment, never params.yaml). Every wait on the tracker or a device has a deadline, and passing
one is a ServiceError (exit 4) naming the address, the key and the variable that sets it:

- SKUFORGE_TVM_RPC_TIMEOUT: one answer of the tracker (the connection, its handshake, each query)
  or of a device (opening a session, the engine's upload and load, each inference). TVM's Python
  tracker client has no timeout (and retries a refused connection for a minute), so the tracker's
  protocol is spoken here over sockets with timeouts. TVM's C++ session has none either: a call
  runs under a watchdog thread that, past the deadline, shuts the session's socket down, which
  ends the call blocked on it with an error (and the device's server ends the session).
- SKUFORGE_TVM_RPC_WAIT: a device to register under the key (TVM's tracker queues a request for a
  key no server has forever), then one of them to be free.
- ``options.rpc.session_timeout_s``: one tuning candidate, in MetaSchedule's RPCRunner worker
  process; past it the worker is killed and the candidate is a failed run, the search goes on.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from pipeline.backends.contract import Runner
from pipeline.backends.tvm.loading import import_tvm
from pipeline.core.env import SKUFORGE_TVM_RPC_TIMEOUT, SKUFORGE_TVM_RPC_WAIT, SKUFORGE_TVM_TRACKER, Number
from pipeline.core.errors import EnvironmentProblem, InputError, ServiceError, first_line
from pipeline.results.reports import TensorSig

if TYPE_CHECKING:
    import numpy as np

KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_POLL_SECONDS = 0.5


class RpcOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = Field(
        pattern=KEY_PATTERN,
        description="the tracker key the SKU's devices register under (rpc_server --key), e.g. rk3588",
    )
    session_timeout_s: int = Field(
        120,
        ge=1,
        le=3600,
        description="seconds one RPC session may last (the device's server ends it then): one tuning candidate "
        "(past it the candidate is a failed run), one validate or bench",
    )


def _seconds(var: Number) -> float:
    return float(var.get() or 0.0)


def tracker_address(key: str) -> tuple[str, int]:
    """host and port of SKUFORGE_TVM_TRACKER; EnvironmentProblem when it is unset or not host:port,
    so a SKU meant for a device never tunes or runs silently on this host instead."""
    text = (SKUFORGE_TVM_TRACKER.get() or "").strip()
    if not text:
        raise EnvironmentProblem(
            f"the SKU's engine runs on devices under the RPC tracker key {key!r}, but "
            f"{SKUFORGE_TVM_TRACKER.name} is unset",
            hint=f"set {SKUFORGE_TVM_TRACKER.name}=host:port of the bench's tracker (docs/backends/tvm.md, "
            "'A device bench'), or remove options.rpc to use this host",
        )
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EnvironmentProblem(
            f"{SKUFORGE_TVM_TRACKER.name}={text!r} is not host:port",
            hint="write it as host:port, e.g. tracker.lab:9190",
        )
    return host, int(port)


# TVM's tracker protocol (tvm/rpc/base.py): a magic number each way, then length-prefixed JSON
# messages. Spoken here without importing TVM (seconds), so a tracker that is down fails first.
_TRACKER_MAGIC = 0x2F271
_SUCCESS, _REQUEST, _SUMMARY = 0, 4, 6
_MAX_MESSAGE = 1 << 20


class _Tracker:
    """One connection to TVM's tracker whose every connect and read has SKUFORGE_TVM_RPC_TIMEOUT."""

    def __init__(self, host: str, port: int, key: str | None) -> None:
        self.host, self.port = host, port
        self.timeout = _seconds(SKUFORGE_TVM_RPC_TIMEOUT)
        self.name = f"the RPC tracker at {host}:{port} ({SKUFORGE_TVM_TRACKER.name}" + (
            f", for the RPC key {key!r})" if key else ")"
        )
        self._sock: socket.socket | None = None

    def __enter__(self) -> _Tracker:
        try:
            self._sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            self._sock.sendall(struct.pack("<i", _TRACKER_MAGIC))
            (magic,) = struct.unpack("<i", self._read(4))
        except OSError as exc:
            self.close()
            raise self.failed("connecting", exc) from exc
        if magic != _TRACKER_MAGIC:
            self.close()
            raise ServiceError(
                f"{self.name} is not a TVM RPC tracker: it answered the handshake with {magic:#x}",
                hint=f"fix {SKUFORGE_TVM_TRACKER.name}: the port of python -m tvm.exec.rpc_tracker",
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _read(self, size: int) -> bytes:
        assert self._sock is not None, "used inside its with block"
        data = b""
        while len(data) < size:
            chunk = self._sock.recv(size - len(data))
            if not chunk:
                raise ConnectionResetError("the connection closed")
            data += chunk
        return data

    def exchange(self, message: list[Any], timeout: float | None = None) -> Any:
        """Send ``message`` and read the answer, each read waiting at most ``timeout`` (default: the
        answer timeout); OSError (TimeoutError when late) or ValueError (not JSON) as raised."""
        assert self._sock is not None, "used inside its with block"
        self._sock.settimeout(timeout or self.timeout)
        body = json.dumps(message).encode()
        self._sock.sendall(struct.pack("<i", len(body)) + body)
        (size,) = struct.unpack("<i", self._read(4))
        if not 0 < size <= _MAX_MESSAGE:
            raise ValueError(f"a message of {size} bytes")
        return json.loads(self._read(size))

    def ask(self, message: list[Any], doing: str) -> Any:
        try:
            return self.exchange(message)
        except (OSError, ValueError) as exc:
            raise self.failed(doing, exc) from exc

    def failed(self, doing: str, exc: BaseException) -> ServiceError:
        if isinstance(exc, TimeoutError):
            return ServiceError(
                f"{self.name} did not answer within {self.timeout:g} s ({doing})",
                hint=f"check that a TVM tracker runs there and answers (python -m tvm.exec.query_rpc_tracker "
                f"--host {self.host} --port {self.port}); on a slow link raise {SKUFORGE_TVM_RPC_TIMEOUT.name}",
            )
        what = (
            "refused the connection: nothing listens there"
            if isinstance(exc, ConnectionRefusedError)
            else f"failed ({doing}): {exc}"
        )
        return ServiceError(
            f"{self.name} {what}",
            hint=f"start it (python -m tvm.exec.rpc_tracker --host 0.0.0.0 --port {self.port}) or fix "
            f"{SKUFORGE_TVM_TRACKER.name}",
        )


def registered(host: str, port: int, key: str | None = None) -> dict[str, int]:
    """Servers per key the tracker knows (free and busy); ServiceError when it does not answer in
    time (``key``: the key asked for, named in the error)."""
    with _Tracker(host, port, key) as tracker:
        answer = tracker.ask([_SUMMARY], "asked for its devices")
    if not isinstance(answer, list) or len(answer) != 2 or answer[0] != _SUCCESS:
        raise ServiceError(f"{tracker.name} answered the summary query with {answer!r}")
    counts: dict[str, int] = {}
    for server in answer[1].get("server_info", []):
        name = str(server.get("key", "")).removeprefix("server:")
        counts[name] = counts.get(name, 0) + 1
    return counts


def wait_for_key(host: str, port: int, key: str, wait_s: float | None = None) -> int:
    """Wait until a server is registered under ``key`` (at most ``wait_s``, default
    SKUFORGE_TVM_RPC_WAIT seconds); returns how many are. ServiceError names the key, the tracker
    and the keys it has, when none registers in time."""
    wait_s = _seconds(SKUFORGE_TVM_RPC_WAIT) if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    while True:
        counts = registered(host, port, key)
        if counts.get(key):
            return counts[key]
        if time.monotonic() >= deadline:
            others = ", ".join(f"{k} ({n})" for k, n in sorted(counts.items())) or "none"
            raise ServiceError(
                f"no device is registered under the RPC key {key!r} at the tracker {host}:{port} "
                f"after {wait_s:g} s (keys registered: {others})",
                hint=f"start a server on the device: python -m tvm.exec.rpc_server --tracker {host}:{port} "
                f"--key {key}; or raise {SKUFORGE_TVM_RPC_WAIT.name}",
            )
        time.sleep(_POLL_SECONDS)


def connect(options: RpcOptions, wait_s: float | None = None) -> tuple[str, int]:
    """The tracker's address once a server is registered under the SKU's key."""
    host, port = tracker_address(options.key)
    wait_for_key(host, port, options.key, wait_s)
    return host, port


def request_device(host: str, port: int, key: str, wait_s: float | None = None) -> tuple[str, int, str]:
    """A free device under ``key`` from the tracker: its host, port and the match key its server
    expects. Waits at most ``wait_s`` (default SKUFORGE_TVM_RPC_WAIT, at least the answer timeout)
    while the devices are busy; closing the connection withdraws the request."""
    wait_s = _seconds(SKUFORGE_TVM_RPC_WAIT) if wait_s is None else wait_s
    with _Tracker(host, port, key) as tracker:
        wait_s = max(wait_s, tracker.timeout)
        try:
            answer = tracker.exchange([_REQUEST, key, "", 1], wait_s)
        except TimeoutError as exc:
            raise ServiceError(
                f"no device under the RPC key {key!r} at the tracker {host}:{port} was free within {wait_s:g} s: "
                "the devices registered are busy with other sessions, or stopped answering",
                hint=f"free or add a device under the key; or raise {SKUFORGE_TVM_RPC_WAIT.name}",
            ) from exc
        except (OSError, ValueError) as exc:
            raise tracker.failed("asked for a device", exc) from exc
    try:
        code, (url, device_port, matchkey) = answer
        assert code == _SUCCESS
        return str(url), int(device_port), str(matchkey)
    except (AssertionError, TypeError, ValueError):
        raise ServiceError(f"{tracker.name} answered a request for a device with {answer!r}") from None


def _shut_down_sockets_to(host: str, port: int) -> int:
    """Shut down this process's TCP connections to host:port (found through /proc/self/fd), so a
    native call blocked reading one returns with an error; returns how many there were."""
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError:
        addresses = {host}
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))  # a duplicate: shutting it down shuts the connection
        except (OSError, ValueError):
            continue
        with sock:
            try:
                peer = sock.getpeername()
                if isinstance(peer, tuple) and peer[1] == port and peer[0] in addresses:
                    sock.shutdown(socket.SHUT_RDWR)
                    count += 1
            except OSError:  # not connected (a listening socket, one still connecting)
                continue
    return count


def _late(device: str, seconds: float, doing: str) -> ServiceError:
    return ServiceError(
        f"{device} did not answer within {seconds:g} s while {doing}",
        hint="the device or its rpc_server is frozen or overloaded: restart it (a stopped server stays "
        f"registered until its connection to the tracker drops); for a slow device or link raise "
        f"{SKUFORGE_TVM_RPC_TIMEOUT.name}",
    )


class _Watchdog:
    """Deadlines for the calls on one TVM RPC session, which has no timeout of its own: a device that
    stops answering holds a call in recv() forever. A call runs under ``deadline``; past it, this
    thread shuts down the connections to the device, which ends the call with an error that
    ``deadline`` turns into a ServiceError. One thread for the session's life (a thread per call
    would cost the bench's timed loop a thread start)."""

    def __init__(self, url: str, port: int, device: str) -> None:
        self._peer, self.device = (url, port), device
        self._cond = threading.Condition()
        self._due: float | None = None
        self._fired = self._closed = False
        threading.Thread(target=self._watch, name=f"tvm-rpc-deadline {url}:{port}", daemon=True).start()

    @contextmanager
    def deadline(self, seconds: float, doing: str) -> Iterator[None]:
        with self._cond:
            self._due, self._fired = time.monotonic() + seconds, False
            self._cond.notify()
        try:
            yield
        except Exception as exc:
            if self._disarm():
                raise _late(self.device, seconds, doing) from exc
            raise
        if self._disarm():  # it returned as the deadline passed: the session is shut down all the same
            raise _late(self.device, seconds, doing)

    def _disarm(self) -> bool:
        with self._cond:
            self._due = None
            return self._fired

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                left = None if self._due is None else self._due - time.monotonic()
                if left is None or left > 0:
                    self._cond.wait(left)
                    continue
                self._due, self._fired = None, True
                _shut_down_sockets_to(*self._peer)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


def open_session(host: str, port: int, options: RpcOptions) -> tuple[Any, _Watchdog]:
    """A session on a free device under the SKU's key, and the watchdog for its calls. The
    handshake runs in a thread given SKUFORGE_TVM_RPC_TIMEOUT: past it the connection is shut down
    (a device that accepted and never answers) or left to the kernel (one the network never
    reaches), and the error names the device."""
    url, device_port, matchkey = request_device(host, port, options.key)
    import_tvm()
    from tvm import rpc

    device = f"the device at {url}:{device_port} under the RPC key {options.key!r} (tracker {host}:{port})"
    timeout = _seconds(SKUFORGE_TVM_RPC_TIMEOUT)
    opened: dict[str, Any] = {}

    def handshake() -> None:
        try:
            opened["session"] = rpc.connect(url, device_port, matchkey, session_timeout=options.session_timeout_s)
        except Exception as exc:  # TVMError, OSError: kept for the caller's thread
            opened["error"] = exc

    worker = threading.Thread(target=handshake, name=f"tvm-rpc-connect {url}:{device_port}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        _shut_down_sockets_to(url, device_port)
        raise _late(device, timeout, "opening a session")
    if "error" in opened:
        raise ServiceError(
            f"{device} refused a session: {first_line(opened['error'])}",
            hint="check the device's rpc_server log, and that it runs the same apache-tvm as this host",
        ) from opened["error"]
    return opened["session"], _Watchdog(url, device_port, device)


def rpc_runner(options: RpcOptions, host: str, port: int) -> Any:
    """MetaSchedule's RPCRunner measuring on the devices under the key: one session per candidate,
    in a worker process. A candidate that outlives ``session_timeout_s`` (a device frozen
    mid-measurement, no device free) has its worker killed and is a failed run; a server that dies
    mid-batch gives that batch's candidates error results (recorded as failed measurements), and
    the next batch goes to a server still registered."""
    import_tvm()
    from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, RPCConfig, RPCRunner

    config = RPCConfig(
        tracker_host=host, tracker_port=port, tracker_key=options.key, session_timeout_sec=options.session_timeout_s
    )
    runner = RPCRunner(config, EvaluatorConfig(number=3, repeat=1, min_repeat_ms=20), max_workers=1)
    # RPCRunner makes its pool without a timeout (its futures report one that never fires), so a
    # device that stopped answering held its candidate, and the search, forever
    runner.pool._timeout = float(options.session_timeout_s)
    return runner


class RemoteTvmRunner(Runner):
    """The engine library uploaded to a device under the SKU's key and run by a Relax VM there
    (remote.cpu()); inputs go over the session and outputs come back per call, so bench times
    include the transfer. One session for the runner's life; calls are serialised, and each must
    answer within SKUFORGE_TVM_RPC_TIMEOUT."""

    def __init__(
        self,
        library: Path,
        inputs: list[TensorSig],
        outputs: list[str],
        entry: str,
        options: RpcOptions,
        tracker: tuple[str, int] | None = None,
        on_close: Callable[[], None] | None = None,
        device_death: Callable[[], str] | None = None,
    ) -> None:
        """``tracker``: this tracker instead of SKUFORGE_TVM_TRACKER's (an emulated device's);
        ``on_close``: called when the runner closes (to stop that device); ``device_death``: why
        the device's server died, where it did ("" where it did not or cannot tell)."""
        super().__init__(inputs, outputs)
        self._vm: Any = None
        self._main: Any = None
        self._session: Any = None
        self._watchdog: _Watchdog | None = None
        self._on_close = on_close
        self._death = device_death or str
        if tracker is None:
            host, port = connect(options)
        else:
            host, port = tracker
            wait_for_key(host, port, options.key)
        import_tvm()  # once the tracker answered: the import takes seconds
        from tvm import relax

        self.where = f"{options.key}@{host}:{port}"
        self._timeout = _seconds(SKUFORGE_TVM_RPC_TIMEOUT)
        self._lock = threading.Lock()
        self._session, watchdog = open_session(host, port, options)
        self._watchdog = watchdog
        try:
            with watchdog.deadline(self._timeout, f"receiving {library.name}"):
                self._session.upload(str(library))
            with watchdog.deadline(self._timeout, f"loading {library.name}"):
                module = self._session.load_module(library.name)
                self._dev = self._session.cpu(0)
                self._vm = relax.VirtualMachine(module, self._dev)
                self._main = self._vm[entry]
        except ServiceError:
            self.close()
            raise
        except Exception as exc:
            death = self._death()
            self.close()
            if death:  # the library killed the device's server: the engine's doing, not the link's
                raise InputError(
                    f"{library} killed the device {self.where} while loading: {death}",
                    hint="rebuild the engine for the device's target (options.target_cpu, target_cpu_features)",
                ) from exc
            if not isinstance(exc, OSError | RuntimeError):  # TVMError from the remote loader: another CPU or TVM
                raise InputError(
                    f"{library} cannot be loaded on the device {self.where}: {exc}",
                    hint="rebuild the engine for the device's target (options.target_cpu)",
                ) from exc
            raise ServiceError(
                f"{library} could not be loaded on the device {self.where}: {str(exc).strip().splitlines()[-1]}",
                hint="check the device's rpc_server log; the library must be built for the device's CPU",
            ) from exc

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import numpy as np
        from tvm import runtime

        assert self._watchdog is not None and self._main is not None, "inference on a closed runner"
        with self._lock, self._watchdog.deadline(self._timeout, "running the engine"):
            try:
                args = [runtime.tensor(np.asarray(feeds[s.name], order="C"), self._dev) for s in self.inputs]
                out = self._main(*args)
                outs = [out] if hasattr(out, "shape") else list(out)
                return {name: o.numpy() for name, o in zip(self.output_names, outs, strict=True)}
            except Exception as exc:  # TVMError: the session ended under the call
                death = self._death()
                if death:
                    raise InputError(
                        f"the engine killed the device {self.where} while running: {death}",
                        hint="rebuild the engine for the device's target (options.target_cpu, target_cpu_features)",
                    ) from exc
                raise ServiceError(
                    f"the device {self.where} failed while running the engine: {first_line(exc)}",
                    hint="check the device's rpc_server log",
                ) from exc

    def close(self) -> None:
        self._vm = self._main = self._session = None
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        if self._on_close is not None:
            self._on_close()
            self._on_close = None
