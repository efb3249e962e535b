"""The progress callback long operations accept: ``progress(message, fraction)``."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, float], None]
