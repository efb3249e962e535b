"""A fork server for the tests' ``skuforge`` processes (tests/cli_helpers.py starts one per test process).

Each ``skuforge`` command the tests run is a process of its own, as a user's is: its exit code, its
stdout and stderr, its signals. Most of such a process's time is imports (ONNX, ONNX Runtime, MLflow:
seconds each on a 2-core host), the same for every command. This server imports them once and forks a
child per command; the child takes the command's working directory, environment and output files,
then runs ``pipeline.cli.main`` and leaves through the interpreter's normal exit (atexit handlers and
thread joins run as in a real process). Nothing of one command survives into the next: each child
starts from the server's state, which only ever imported.

Protocol on stdin/stdout, each message a 4-byte big-endian length and a JSON document:
request ``{"args", "cwd", "env", "out", "err"}``; replies ``{"pid"}`` at the fork, then ``{"code"}``
(the child's exit code, negative for a signal, as ``subprocess`` gives it). EOF on stdin ends it."""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # the real command does not see the tests folder

from pipeline.core.processes import receive_message, send_message  # noqa: E402

# What most commands import. ONNX Runtime stays out (a child forked after its import hangs in its exit),
# as do modules that start threads at import (OpenVINO, TVM): a forked child may inherit a lock one held.
PRELOAD = (
    "pipeline.cli",
    "pipeline.cli.commands",
    "pipeline.cli.rollout",
    "pipeline.cli.select",
    "pipeline.cli.bisect",
    "pipeline.cli.ci",
    "pipeline.cli.compare",
    "pipeline.cli.cache",
    "pipeline.cli.keys",
    "pipeline.stages.build",
    "pipeline.stages.validate",
    "pipeline.stages.bench",
    "pipeline.tracking.publish",
    "onnx",
    "mlflow",
    "boto3",
)

_REQUESTS, _REPLIES = 0, 1


def _child(request: dict) -> None:
    """In the forked child: become the command's process, run it, exit (never returns)."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    os.close(null)
    sys.argv = ["skuforge", *request["args"]]
    from pipeline.cli import main

    sys.exit(main(request["args"]))


def serve() -> None:
    while True:
        try:
            request = receive_message(_REQUESTS, None)
        except EOFError:
            return
        pid = os.fork()
        if pid == 0:
            _child(request)  # leaves through SystemExit, out of this loop and the interpreter
        send_message(_REPLIES, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        send_message(_REPLIES, {"code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # the imported objects leave the collector's generations: a child's collections (and its exit) then
    # neither walk nor write them, so their pages stay shared instead of being copied (about 0.3 s, not 1 s)
    gc.freeze()
    send_message(_REPLIES, {"ready": os.getpid()})
    serve()
