"""Shared test set-up: ``import models`` finds the tiny ONNX model builders in tests/models.py."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
