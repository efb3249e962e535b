"""Running ``skuforge`` as a user would, and what every user-error case asserts: the exit code,
a message naming the culprit with a hint, and no traceback. Shared by tests/cli and tests/security."""

from __future__ import annotations

import atexit
import locale
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import models

from pipeline.core.processes import receive_message, send_message

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("skuforge")
COMMAND = (
    [str(SCRIPT)]
    if SCRIPT.is_file()
    else [sys.executable, "-c", "from pipeline.cli import main; raise SystemExit(main())"]
)


def skuforge(*args: str, cwd: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``skuforge args`` in a process of its own, as a user runs it: forked from this test process's
    fork server (tests/cli_zygote.py: the imports made once), or started afresh where the fork server
    cannot stand in for a real start (see ``Zygote.serves``; PYTEST_SKUFORGE_FORK=0 starts every one)."""
    env = dict(os.environ if env is None else env)
    zygote = Zygote.get()
    if zygote is not None and zygote.serves(env) and zygote.lock.acquire(blocking=False):
        try:
            return zygote.run(list(args), cwd, env, timeout)
        finally:
            zygote.lock.release()
    return subprocess.run([*COMMAND, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


class Zygote:
    """The client side of tests/cli_zygote.py: one server per test process, started on first use."""

    _instance: Zygote | None = None
    _failed = False
    # variables the interpreter reads at start-up: a command run with other values needs a real start
    STARTUP = ("PYTHON", "LD_", "VIRTUAL_ENV")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("cli_zygote.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            cwd=REPO,
            env=self.env,
        )
        self.scratch = Path(tempfile.mkdtemp(prefix="skuforge-zygote-"))
        try:
            self._receive(timeout=300)  # {"ready": pid}: the imports are made
        except BaseException:
            self.close()
            raise

    @classmethod
    def get(cls) -> Zygote | None:
        if cls._failed or os.environ.get("PYTEST_SKUFORGE_FORK", "1") == "0" or not hasattr(os, "fork"):
            return None
        if cls._instance is None or cls._instance.proc.poll() is not None:
            try:
                cls._instance = cls()
            except (OSError, EOFError, subprocess.TimeoutExpired):
                cls._failed = True
                return None
            atexit.register(cls._instance.close)
        return cls._instance

    def serves(self, env: dict[str, str]) -> bool:
        def startup(mapping: dict[str, str]) -> dict[str, str]:
            return {k: v for k, v in mapping.items() if k.startswith(self.STARTUP)}

        return startup(env) == startup(self.env)

    def run(self, args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        out, err = self.scratch / "out", self.scratch / "err"
        send_message(
            self.proc.stdin.fileno(), {"args": args, "cwd": str(cwd), "env": env, "out": str(out), "err": str(err)}
        )
        pid = self._receive(timeout=60)["pid"]
        try:
            code = self._receive(timeout=timeout)["code"]
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            self._receive(timeout=60)
            raise subprocess.TimeoutExpired([*COMMAND, *args], timeout, _text(out), _text(err)) from None
        return subprocess.CompletedProcess([*COMMAND, *args], code, _text(out), _text(err))

    def _receive(self, timeout: float) -> dict:
        return receive_message(self.proc.stdout.fileno(), timeout)  # unbuffered (bufsize=0)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _text(path: Path) -> str:
    """The output as ``subprocess.run(text=True)`` decodes it (the locale's encoding, universal newlines)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ""
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


def service_env(**extra: str) -> dict[str, str]:
    """This process's environment without the developer's MLflow, AWS or release-store settings, plus ``extra``."""
    own = ("MLFLOW_", "AWS_", "SKUFORGE_STORE")
    return {**{k: v for k, v in os.environ.items() if not k.startswith(own)}, **extra}


def assert_user_error(proc: subprocess.CompletedProcess, code: int, *words: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out
    assert "skuforge: error:" in proc.stderr, out
    assert "hint:" in proc.stderr, out
    assert "Traceback" not in out and "internal error" not in out, out
    for word in words:
        assert word in proc.stderr, (word, out)


def project(
    root: Path, spec: dict | None = None, builder=models.conv_bn_model, skus: dict | None = None, **top
) -> Path:
    spec = spec or models.conv_bn_spec()
    builder(root / spec["dir"] / spec["source"])
    return models.write_project(root, {"m": spec}, skus or {"cpu": models.ort_sku("fp32")}, **top)
