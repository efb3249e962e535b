"""A device bench reached through TVM's RPC tracker: a TVM SKU that names a tracker key
(``options.rpc.key``) has its tuning candidates measured, and its engine validated and
benchmarked, on the devices registered under that key; this host only compiles.

The tracker's address comes from SKUFORGE_TVM_TRACKER alone (a CI secret or a runner's
environment, never params.yaml). TVM's tracker queues a request for a key no server has
registered forever, so every use first waits for a server under the key, at most
SKUFORGE_TVM_RPC_WAIT seconds, and fails with ServiceError naming the key and the tracker.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from pipeline.backends.contract import Runner
from pipeline.core.env import SKUFORGE_TVM_RPC_WAIT, SKUFORGE_TVM_TRACKER
from pipeline.core.errors import EnvironmentProblem, InputError, ServiceError
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
        120, ge=1, le=3600, description="seconds one RPC session (one measured batch, one validate or bench) may last"
    )


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


def registered(host: str, port: int) -> dict[str, int]:
    """Servers per key the tracker knows (free and busy); ServiceError when it does not answer."""
    from tvm import rpc

    try:
        tracker = rpc.connect_tracker(host, port)
        try:
            summary = tracker.summary()
        finally:
            tracker.close()
    except (OSError, RuntimeError) as exc:
        raise ServiceError(
            f"the RPC tracker at {host}:{port} ({SKUFORGE_TVM_TRACKER.name}) does not answer: {exc}",
            hint="start it (python -m tvm.exec.rpc_tracker --host 0.0.0.0 --port 9190) or fix the address",
        ) from exc
    counts: dict[str, int] = {}
    for server in summary.get("server_info", []):
        name = str(server.get("key", "")).removeprefix("server:")
        counts[name] = counts.get(name, 0) + 1
    return counts


def wait_for_key(host: str, port: int, key: str, wait_s: float | None = None) -> int:
    """Wait until a server is registered under ``key`` (at most ``wait_s``, default
    SKUFORGE_TVM_RPC_WAIT seconds); returns how many are. ServiceError names the key, the tracker
    and the keys it has, when none registers in time."""
    wait_s = SKUFORGE_TVM_RPC_WAIT.get() if wait_s is None else wait_s
    deadline = time.monotonic() + float(wait_s or 0)
    while True:
        counts = registered(host, port)
        if counts.get(key):
            return counts[key]
        if time.monotonic() >= deadline:
            others = ", ".join(f"{k} ({n})" for k, n in sorted(counts.items())) or "none"
            raise ServiceError(
                f"no device is registered under the RPC key {key!r} at the tracker {host}:{port} "
                f"after {float(wait_s or 0):g} s (keys registered: {others})",
                hint=f"start a server on the device: python -m tvm.exec.rpc_server --tracker {host}:{port} "
                f"--key {key}; or raise {SKUFORGE_TVM_RPC_WAIT.name}",
            )
        time.sleep(_POLL_SECONDS)


def connect(options: RpcOptions, wait_s: float | None = None) -> tuple[str, int]:
    """The tracker's address once a server is registered under the SKU's key."""
    host, port = tracker_address(options.key)
    wait_for_key(host, port, options.key, wait_s)
    return host, port


def rpc_runner(options: RpcOptions, host: str, port: int) -> Any:
    """MetaSchedule's RPCRunner measuring on the devices under the key: one session per batch;
    a server that dies mid-batch gives that batch's candidates error results (recorded as failed
    measurements), and the next batch goes to a server still registered."""
    from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, RPCConfig, RPCRunner

    config = RPCConfig(
        tracker_host=host, tracker_port=port, tracker_key=options.key, session_timeout_sec=options.session_timeout_s
    )
    return RPCRunner(config, EvaluatorConfig(number=3, repeat=1, min_repeat_ms=20), max_workers=1)


class RemoteTvmRunner(Runner):
    """The engine library uploaded to a device under the SKU's key and run by a Relax VM there
    (remote.cpu()); inputs go over the session and outputs come back per call, so bench times
    include the transfer. One session for the runner's life; calls are serialised."""

    def __init__(
        self, library: Path, inputs: list[TensorSig], outputs: list[str], entry: str, options: RpcOptions
    ) -> None:
        super().__init__(inputs, outputs)
        from tvm import relax, rpc

        host, port = connect(options)
        self.where = f"{options.key}@{host}:{port}"
        try:
            tracker = rpc.connect_tracker(host, port)
            self._session = tracker.request(options.key, session_timeout=options.session_timeout_s)
            self._session.upload(str(library))
            module = self._session.load_module(library.name)
            self._dev = self._session.cpu(0)
            self._vm = relax.VirtualMachine(module, self._dev)
            self._main = self._vm[entry]
        except (OSError, RuntimeError) as exc:
            raise ServiceError(
                f"{library} could not be loaded on the device {self.where}: {str(exc).strip().splitlines()[-1]}",
                hint="check the device's rpc_server log; the library must be built for the device's CPU",
            ) from exc
        except Exception as exc:  # TVMError from the remote loader: a library for another CPU or TVM
            raise InputError(
                f"{library} cannot be loaded on the device {self.where}: {exc}",
                hint="rebuild the engine for the device's target (options.target_cpu)",
            ) from exc
        self._lock = threading.Lock()

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import numpy as np
        from tvm import runtime

        with self._lock:
            args = [runtime.tensor(np.asarray(feeds[s.name], order="C"), self._dev) for s in self.inputs]
            out = self._main(*args)
            outs = [out] if hasattr(out, "shape") else list(out)
            return {name: o.numpy() for name, o in zip(self.output_names, outs, strict=True)}

    def close(self) -> None:
        self._vm = self._main = self._session = None
