"""Ending a process tree: a command that is interrupted (Ctrl-C, SIGTERM from CI) takes the processes
it started with it, however they were started: dvc in its own process group with the stage commands
under it, a compiler's tuning workers under a stage command. A child reparented to init when its
parent died is out of reach, so the tree is read before anything is signalled.

Linux reads the tree from /proc; elsewhere ``ps -A -o pid=,ppid=`` (macOS, BSD)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import struct
import subprocess
import time
from collections.abc import Iterable

GRACE_S = 10.0


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt so the same unwinding
    (temporary folders, atomic writes, stopping children) runs; the command exits 143."""


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process this user can see."""
    table: dict[int, int] = {}
    proc = "/proc"
    if os.path.isdir(proc):
        for name in os.listdir(proc):
            if not name.isdigit():
                continue
            try:
                with open(f"{proc}/{name}/stat", "rb") as f:
                    stat = f.read().decode("ascii", "replace")
            except OSError:  # gone meanwhile
                continue
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            fields = stat[stat.rfind(")") + 2 :].split()
            if len(fields) > 1:
                table[int(name)] = int(fields[1])
        return table
    try:
        out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, check=False).stdout
    except OSError:
        return table
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            table[int(parts[0])] = int(parts[1])
    return table


def descendants(pid: int | None = None) -> list[int]:
    """The processes under ``pid`` (default: this process), parents before their children."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    todo = [root]
    while todo:
        for child in sorted(children.get(todo.pop(0), [])):
            if child not in found and child != root:
                found.append(child)
                todo.append(child)
    return found


def _alive(pids: Iterable[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        # a zombie (exited, not yet reaped by its parent) counts as gone
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[-1].split()[:1] == [b"Z"]:
                    continue
        except OSError:
            pass
        alive.append(pid)
    return alive


def _signal(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def end_processes(pids: list[int], grace_s: float = GRACE_S, first: signal.Signals = signal.SIGTERM) -> list[int]:
    """Signal ``pids`` with ``first``, then SIGKILL those still alive after ``grace_s``. Returns the
    pids that had to be killed."""
    _signal(pids, first)
    deadline = time.monotonic() + grace_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    stubborn = _alive(pids)
    _signal(stubborn, signal.SIGKILL)
    return stubborn


def end_descendants(grace_s: float = 2.0) -> list[int]:
    """End every process this one started, directly or not (SIGTERM, SIGKILL after ``grace_s``):
    what a command runs before it leaves on an interrupt. Returns the pids that had to be killed."""
    return end_processes(descendants(), grace_s)


def stop_group(proc: subprocess.Popen, grace_s: float = GRACE_S) -> str:
    """Stop ``proc``, started with ``start_new_session=True``, and everything under it: SIGINT to its
    process group (dvc and the stage command unwind as on Ctrl-C, their temporaries removed), SIGTERM
    after ``grace_s``, then SIGKILL to the group and to any descendant that left it. Returns what
    ``proc`` still printed (when its stdout is a pipe)."""
    tree = [proc.pid, *descendants(proc.pid)]
    rest: list[str] = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        _signal([p for p in tree if p != proc.pid] if sig == signal.SIGKILL else [], sig)
        try:
            out, _ = proc.communicate(timeout=grace_s)
            rest.append(out or "")
            break
        except subprocess.TimeoutExpired:
            continue
        except KeyboardInterrupt:  # a second Ctrl-C: stop waiting politely
            continue
    # the stage commands under dvc end with it; a worker that left the group or ignored the signals does not
    tree += [p for p in descendants(proc.pid) if p not in tree]
    end_processes([p for p in tree if p != proc.pid], grace_s=min(grace_s, 2.0))
    return "".join(rest)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within the block, SIGTERM raises Terminated in the main thread (restored after). Outside the
    main thread (a library caller's worker) nothing changes."""
    try:
        previous = signal.getsignal(signal.SIGTERM)

        def _raise(signum, frame):  # noqa: ARG001
            raise Terminated()

        signal.signal(signal.SIGTERM, _raise)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def send_message(fd: int, message: dict) -> None:
    """One message to a worker process's pipe: a 4-byte big-endian length, then the JSON document."""
    body = json.dumps(message).encode()
    os.write(fd, struct.pack(">I", len(body)) + body)


def receive_message(fd: int, timeout_s: float | None) -> dict:
    """The next message (see send_message) on an unbuffered pipe. subprocess.TimeoutExpired when none
    begins within ``timeout_s`` (None: wait for it); EOFError when the writer is gone or the message
    is not a JSON object."""
    if not select.select([fd], [], [], timeout_s)[0]:
        raise subprocess.TimeoutExpired("a worker process's reply", timeout_s or 0)

    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise EOFError("the worker process exited")
            data += chunk
        return data

    try:
        message = json.loads(exactly(struct.unpack(">I", exactly(4))[0]))
    except ValueError as exc:
        raise EOFError(f"the worker process sent a message that is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise EOFError("the worker process sent a message that is not a JSON object")
    return message
