"""One module per pipeline stage. Each stage reads its inputs, writes its outputs atomically and
returns its typed report; the CLI and dvc.yaml call these functions."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, float], None]
