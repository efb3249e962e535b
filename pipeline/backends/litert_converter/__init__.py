"""The LiteRT converter's environment: a virtualenv made from ``requirements.lock`` (onnx2tf and the
exact TensorFlow, numpy, onnx and ONNX Runtime it pins, which clash with skuforge's own), in which
``convert.py`` runs as a subprocess. skuforge's own environment never imports TensorFlow.

Where it lives: ``$SKUFORGE_LITERT_CONVERTER`` if set, else ``litert-converter-<lock sha256[:12]>`` in
skuforge's cache folder (``$SKUFORGE_CACHE_DIR``, ``$XDG_CACHE_HOME/skuforge``, ``~/.cache/skuforge``),
so a changed lock gets a new environment. It is
whole only when its stamp file holds the lock's sha256, written last; an environment without it (a
killed install) is removed and made again. ``python -m pipeline.backends.litert_converter`` makes it
(scripts/setup.sh runs that).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from pipeline.core.env import SKUFORGE_LITERT_CONVERTER
from pipeline.core.paths import cache_dir

LOCK = Path(__file__).with_name("requirements.lock")
SCRIPT = Path(__file__).with_name("convert.py")
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


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def create(force: bool = False, quiet: bool = True) -> Path:
    """Make the environment (once per lock; concurrent callers wait for the first). Returns its python."""
    env = env_dir()
    with _locked(env.parent / f".{env.name}.lock"):
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
