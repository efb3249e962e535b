"""The LiteRT conversion server, run by ``litert_converter.Server`` in the converter's environment as
``python server.py``: convert.py's ``main`` for many requests, TensorFlow imported once. Like
convert.py it imports nothing of skuforge's (it runs beside convert.py, which it imports)."""

from __future__ import annotations

import gc
import json
import os
import struct
import sys
import traceback
from typing import Any

from convert import main  # type: ignore[import-not-found]  # the script beside this one (sys.path[0])


def serve() -> int:
    """``python server.py``: a conversion server for one skuforge process (its client:
    ``litert_converter.Server``). TensorFlow and onnx2tf are imported once (seconds of each
    conversion's time); each request is converted in a child forked from this state, in a session
    of its own, with the request's working folder, environment and log file, so no TensorFlow or
    Keras state of one conversion reaches the next and a crash or a timeout ends only that child.

    Messages are a 4-byte big-endian length and a JSON document. Requests on stdin: ``{"request",
    "cwd", "env", "log"}``; replies on stdout: ``{"ready"}`` once imported, then per request
    ``{"pid"}`` and ``{"code"}`` (the exit status, negative for a signal). EOF on stdin ends it."""
    import onnx  # noqa: F401 - the imports of every conversion, made once
    import onnx2tf  # noqa: F401
    import tensorflow  # noqa: F401

    def read(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = os.read(0, n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def send(message: dict[str, Any]) -> None:
        body = json.dumps(message).encode()
        os.write(1, struct.pack(">I", len(body)) + body)

    gc.freeze()  # imported objects out of the collector's walk: a child's pages stay shared
    send({"ready": os.getpid()})
    while True:
        try:
            request = json.loads(read(struct.unpack(">I", read(4))[0]))
        except EOFError:
            return 0
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setsid()
                os.chdir(request["cwd"])
                os.environ.clear()
                os.environ.update(request["env"])
                log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                code = main(["convert.py", request["request"]])
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # the result file is written and closed; nothing else to finalize
        send({"pid": pid})
        _, status = os.waitpid(pid, 0)
        send({"code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    sys.exit(serve())
