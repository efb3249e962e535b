"""A TVM device bench on loopback for the RPC tests and benchmarks/tvm_rpc_tuning.py: a free port,
TVM's tracker and rpc_server started as real processes, and the services that never answer (a hung
tracker, a frozen device) that the deadlines are for."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from pipeline.backends.tvm.loading import torch_free_command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args: str) -> subprocess.Popen:
    """``python -m ARGS`` (tvm.exec.rpc_tracker, tvm.exec.rpc_server) in its own process group:
    rpc_server forks a child per session, and the group is what a test stops. PyTorch is hidden
    from it, as from skuforge's own TVM processes (pipeline/backends/tvm/loading.py): a device's
    runtime has none, and its import would be most of the start."""
    return subprocess.Popen(
        torch_free_command(*args),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


@contextmanager
def _silent_port() -> Iterator[tuple[socket.socket, int]]:
    """A listening socket nobody accepts on: the kernel completes each connection (as it does for a
    process that is stopped or wedged) and nothing is ever sent back."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s, s.getsockname()[1]


@contextmanager
def silent_tracker() -> Iterator[str]:
    """host:port of a tracker that takes connections and never answers."""
    with _silent_port() as (_, port):
        yield f"127.0.0.1:{port}"


@contextmanager
def silent_server(tracker_port: int, key: str) -> Iterator[int]:
    """A device registered under ``key`` at the tracker on ``tracker_port`` that never answers a
    session: a board frozen after it registered. Yields its port; leaving deregisters it."""
    from tvm.rpc import base

    with _silent_port() as (_, port), socket.create_connection(("127.0.0.1", tracker_port), timeout=10) as tracker:
        tracker.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
        assert struct.unpack("<i", base.recvall(tracker, 4))[0] == base.RPC_TRACKER_MAGIC
        # what tvm.exec.rpc_server says when it registers (tvm/rpc/server.py, _listen_loop)
        base.sendjson(tracker, [base.TrackerCode.UPDATE_INFO, {"key": f"server:{key}", "addr": ["127.0.0.1", port]}])
        assert base.recvjson(tracker) == base.TrackerCode.SUCCESS
        base.sendjson(tracker, [base.TrackerCode.PUT, key, (port, base.random_key(key)), "127.0.0.1"])
        assert base.recvjson(tracker) == base.TrackerCode.SUCCESS
        yield port
