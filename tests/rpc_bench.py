"""A TVM device bench on loopback for the RPC tests and benchmarks/tvm_rpc_tuning.py: a free port,
and TVM's tracker and rpc_server started as real processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args: str) -> subprocess.Popen:
    """``python -m ARGS`` (tvm.exec.rpc_tracker, tvm.exec.rpc_server) in its own process group:
    rpc_server forks a child per session, and the group is what a test stops."""
    return subprocess.Popen(
        [sys.executable, "-m", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
