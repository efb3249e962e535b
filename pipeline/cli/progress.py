"""A progress line on stderr for steps longer than a second: redrawn on a terminal, a line every
few seconds otherwise (CI logs)."""

from __future__ import annotations

import sys
import time


class ProgressLine:
    def __init__(self, stream=None, delay: float = 1.0, interval: float = 5.0):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.monotonic()
        self.delay = delay
        self.interval = interval if not self.tty else 0.1
        self.last = 0.0
        self.label = ""
        self.drawn = False

    def __call__(self, label: str, fraction: float) -> None:
        now = time.monotonic()
        if now - self.start < self.delay or (now - self.last < self.interval and label == self.label):
            return
        self.last, self.label = now, label
        bar = "#" * int(fraction * 20)
        text = f"{label} [{bar:<20}] {fraction:4.0%} {now - self.start:5.1f}s"
        if self.tty:
            self.stream.write("\r" + text[:120].ljust(80))
            self.drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r" + " " * 80 + "\r")
            self.stream.flush()
