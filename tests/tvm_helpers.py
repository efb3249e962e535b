"""What the TVM test modules share before anything else: TVM imported as skuforge imports it."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from pipeline.backends.tvm.loading import import_tvm


def tvm_or_skip() -> Any:
    """The ``tvm`` module, imported with PyTorch hidden (pipeline/backends/tvm/loading.py) so that
    collecting a TVM module does not import torch; skips the module where apache-tvm is missing."""
    with contextlib.suppress(ImportError):
        import_tvm()
    return pytest.importorskip("tvm", reason="apache-tvm is not installed (pip install -e '.[tvm]')")
