"""A TVM RPC server in the emulated aarch64 Python (``pipeline.backends.emulated.RpcDevice``): the
SKU's device as an RPC server under QEMU, registered with a tracker under a key, so a cross-compiled
TVM library is uploaded, loaded and run through the same tracker and ``RemoteTvmRunner`` a real board
uses. It imports nothing of skuforge's.

``python rpc_server.py HOST PORT PORT_END TRACKER_HOST TRACKER_PORT KEY``: serves on HOST in
[PORT, PORT_END), prints the port it took, and serves until its stdin closes.

One difference from TVM's rpc_server, forced by the emulator: TVM serves each session in a forked
child (multiprocessing), and under QEMU user mode that child aborts at once ("terminate called
without an active exception": the parent's runtime threads do not survive the emulated fork). Here a
session is served by a thread of the server process instead; the device serves one skuforge process,
one session at a time."""

from __future__ import annotations

import os
import sys
import threading
from types import SimpleNamespace
from typing import Any


class _SessionThread(threading.Thread):
    """What tvm.rpc.server._serving uses of multiprocessing.Process, as a thread."""

    exitcode = 0

    def __init__(self, target: Any, args: tuple) -> None:
        super().__init__(target=target, args=args, daemon=True)
        self.pid = os.getpid()

    def terminate(self) -> None:  # a session past its timeout was told so; its thread ends with the socket
        pass


def main(argv: list[str]) -> int:
    host, port, port_end, tracker_host, tracker_port, key = argv
    from tvm.rpc import server

    server.multiprocessing = SimpleNamespace(Process=_SessionThread)
    taken = server._popen_start_rpc_server(
        host, int(port), int(port_end), tracker_addr=(tracker_host, int(tracker_port)), key=key, silent=True
    )
    print(taken, flush=True)
    sys.stdin.read()  # until the host closes it
    os._exit(0)  # the server's threads are not daemons


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
