"""The LiteRT converter's environment: a virtualenv made from ``requirements.lock`` (onnx2tf and the
exact TensorFlow, numpy, onnx and ONNX Runtime it pins, which clash with skuforge's own), in which
``convert.py`` runs as a subprocess. skuforge's own environment never imports TensorFlow.

A process that converts more than once (a bisection's scratch builds, a test session) keeps one
``server.py`` (``Server``): TensorFlow and onnx2tf are imported once, and each conversion
runs in a child forked from it, with its own folder, environment, log and deadline.

Where it lives: ``$SKUFORGE_LITERT_CONVERTER`` if set, else ``litert-converter-<lock sha256[:12]>`` in
skuforge's cache folder (``$SKUFORGE_CACHE_DIR``, ``$XDG_CACHE_HOME/skuforge``, ``~/.cache/skuforge``),
so a changed lock gets a new environment. It is
whole only when its stamp file holds the lock's sha256, written last; an environment without it (a
killed install) is removed and made again. ``python -m pipeline.backends.litert_converter`` makes it
(scripts/setup.sh runs that).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from pipeline.core.env import SKUFORGE_LITERT_CONVERTER
from pipeline.core.io import file_lock
from pipeline.core.paths import cache_dir
from pipeline.core.processes import receive_message, send_message

LOCK = Path(__file__).with_name("requirements.lock")
SCRIPT = Path(__file__).with_name("convert.py")
SERVER = Path(__file__).with_name("server.py")  # convert.py's main for many requests (Server)
ENV_VAR = SKUFORGE_LITERT_CONVERTER.name
STAMP = "skuforge-lock.sha256"
INSTALL_TIMEOUT_S = 1800


def lock_sha256() -> str:
    return hashlib.sha256(LOCK.read_bytes()).hexdigest()


def script_sha256() -> str:
    """convert.py's sha256: what it rewrites decides the engine's bytes as much as the lock does."""
    return hashlib.sha256(SCRIPT.read_bytes()).hexdigest()


def lock_versions() -> dict[str, str]:
    """The pinned versions of the converter's packages (name -> version), from the lock."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            pins[name.lower()] = version
    return pins


def env_dir() -> Path:
    return SKUFORGE_LITERT_CONVERTER.get() or cache_dir() / f"litert-converter-{lock_sha256()[:12]}"


def python() -> Path:
    return env_dir() / "bin" / "python"


def problems() -> list[str]:
    """Why the converter cannot run here (empty: it can)."""
    env = env_dir()
    stamp = env / STAMP
    if not python().is_file():
        return [f"the LiteRT converter environment {env} does not exist"]
    if not stamp.is_file():
        return [f"the LiteRT converter environment {env} is incomplete (an install did not finish)"]
    if stamp.read_text().strip() != lock_sha256():
        return [f"the LiteRT converter environment {env} was made from another requirements.lock"]
    return []


def create(force: bool = False, quiet: bool = True) -> Path:
    """Make the environment (once per lock; concurrent callers wait for the first). Returns its python."""
    env = env_dir()
    with file_lock(env.parent / f".{env.name}.lock"):
        if not force and not problems():
            return python()
        shutil.rmtree(env, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)
        pip = [str(env / "bin" / "python"), "-m", "pip", "install", *(["--quiet"] if quiet else [])]
        subprocess.run([*pip, "--upgrade", "pip"], check=True, timeout=INSTALL_TIMEOUT_S)
        subprocess.run(
            [*pip, "--no-deps", "--only-binary", ":all:", "-r", str(LOCK)], check=True, timeout=INSTALL_TIMEOUT_S
        )
        (env / STAMP).write_text(lock_sha256() + "\n")
    return python()


SERVER_START_S = 300
# variables read when TensorFlow and the interpreter start: a conversion asking for other values than
# the server started with gets a server started with them
_STARTUP = ("PYTHON", "LD_", "TF_", "CUDA", "XLA_", "OMP_", "KMP_", "MKL_", "OPENBLAS", "VIRTUAL_ENV")


class Server:
    """The client of one ``server.py`` (see server.serve): started on first use, reused by
    the conversions of this process one at a time, ended at exit. ``convert`` returns the child's exit
    status as a one-shot ``convert.py`` would, or None where the server cannot take the request (it
    could not start, or another thread holds it): the caller then runs ``convert.py`` itself."""

    _lock = threading.Lock()
    _current: Server | None = None
    _unavailable = False  # a server failed to start in this process

    def __init__(self, python: Path, env: Mapping[str, str], key: tuple) -> None:
        self.key = key
        self.child: int | None = None  # the last conversion's process
        self.proc = subprocess.Popen(
            [str(python), str(SERVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # TensorFlow's import-time noise; each conversion logs to its file
            bufsize=0,
            env=dict(env),
            start_new_session=True,
        )
        try:
            self._receive(SERVER_START_S)
        except BaseException:
            self.close()
            raise

    @classmethod
    def convert(cls, request: Path, cwd: Path, env: Mapping[str, str], log: Path, timeout_s: float) -> int | None:
        if cls._unavailable or not cls._lock.acquire(blocking=False):
            return None
        try:
            key = (str(python()), _startup(env), os.getpid())  # a forked process starts its own
            server = cls._current
            if server is None or server.key != key or server.proc.poll() is not None:
                if server is not None and server.key[2] == os.getpid():
                    server.close()
                cls._current = None
                try:
                    server = cls._current = Server(python(), env, key)
                except (OSError, EOFError, subprocess.TimeoutExpired):
                    cls._unavailable = True  # not tried again by this process: one-shot conversions
                    return None
            try:
                return server.run(request, cwd, env, log, timeout_s)
            except (EOFError, BrokenPipeError):  # the server died (not the conversion): one-shot instead
                server.close()
                cls._current = None
                return None
        finally:
            cls._lock.release()

    def run(self, request: Path, cwd: Path, env: Mapping[str, str], log: Path, timeout_s: float) -> int:
        """The child's exit status. A deadline passed raises subprocess.TimeoutExpired, and anything
        raised while waiting (Ctrl-C, SIGTERM, a stage budget) propagates; the child's session is
        killed first in both cases."""
        assert self.proc.stdin is not None
        send_message(
            self.proc.stdin.fileno(), {"request": str(request), "cwd": str(cwd), "env": dict(env), "log": str(log)}
        )
        pid = self.child = int(self._receive(60)["pid"])
        try:
            return int(self._receive(timeout_s)["code"])
        except BaseException:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # the child leads its own session
            with contextlib.suppress(OSError, EOFError, subprocess.TimeoutExpired):
                self._receive(30)  # its exit status: the server is ready for the next request
            raise

    def _receive(self, timeout_s: float) -> dict:
        assert self.proc.stdout is not None
        return receive_message(self.proc.stdout.fileno(), timeout_s)  # unbuffered: select sees every byte

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # EOF: the server returns
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _startup(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_STARTUP)))


@atexit.register
def _close_server() -> None:
    if Server._current is not None and Server._current.key[2] == os.getpid():
        Server._current.close()


def main(argv: list[str]) -> int:
    force = "--force" in argv
    try:
        path = create(force=force, quiet="--verbose" not in argv)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"could not make the LiteRT converter environment {env_dir()}: {exc}", file=sys.stderr)
        return 3
    print(f"LiteRT converter: {path} (onnx2tf {lock_versions().get('onnx2tf')}, lock {lock_sha256()[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
