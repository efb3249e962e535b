"""Running ``skuforge`` as a user would, and what every user-error case asserts: the exit code,
a message naming the culprit with a hint, and no traceback. Shared by tests/cli and tests/security."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import models

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("skuforge")
COMMAND = (
    [str(SCRIPT)]
    if SCRIPT.is_file()
    else [sys.executable, "-c", "from pipeline.cli import main; raise SystemExit(main())"]
)


def skuforge(*args: str, cwd: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


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
