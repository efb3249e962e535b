"""The progress line on stderr for steps longer than a second (the ``Progress`` callback of
pipeline/core/progress.py: ``progress(label, fraction)``).

On a terminal one line is redrawn, with the step's rate and its estimated time left. Elsewhere (a
CI log, dvc's captured output) a few lines: the start, then a line every ~10 s, or after 10 % more
at most every 2 s, and the end; never one line per call (a 40-epoch export used to print 40)."""

from __future__ import annotations

import re
import sys
import time
from typing import TextIO

_COUNT = re.compile(r"(\d+)\s*/\s*(\d+)")
_DIGITS = re.compile(r"\d+")


def _phase(label: str) -> str:
    """The step a label names, without its counters: "epoch 3/20" and "epoch 4/20" are one phase."""
    return _DIGITS.sub("#", label)


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class ProgressLine:
    """A ``Progress`` callback; call :meth:`close` when the step ends (prints the last line)."""

    def __init__(
        self,
        stream: TextIO | None = None,
        delay: float = 1.0,
        interval: float = 10.0,
        step: float = 0.1,
        clock=time.monotonic,
    ):
        self.stream = stream or sys.stderr
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False
        self.clock = clock
        self.start = clock()
        self.delay = delay  # nothing for steps shorter than this
        self.interval = interval  # without a terminal: a line at least this often while it moves...
        self.step = step  # ...or after this much more progress (at most every 2 s)
        self.last = -1.0  # when the last line was written (-1: none yet)
        self.last_fraction = 0.0
        self.label = ""
        self.fraction = 0.0
        self.phase = ""
        self.phase_start = self.start
        self.phase_fraction = 0.0
        self.drawn = False
        self._printed_label = ""

    def __call__(self, label: str, fraction: float) -> None:
        now = self.clock()
        fraction = min(max(fraction, 0.0), 1.0)
        phase = _phase(label)
        if phase != self.phase or fraction < self.fraction:  # a new step: its own rate and ETA
            self.phase, self.phase_start, self.phase_fraction = phase, now, fraction
        self.label, self.fraction = label, fraction
        if now - self.start < self.delay:
            return
        if self.tty:
            if now - self.last >= 0.1 or fraction >= 1.0:
                self._write("\r" + self.text(now)[:120].ljust(80))
                self.drawn = True
                self.last = now
            return
        since = now - self.last
        moved = fraction - self.last_fraction >= self.step or phase != _phase(self._printed_label)
        if self.last < 0 or since >= self.interval or (moved and since >= 2.0):
            self._line(now)

    def _line(self, now: float) -> None:
        self._write(self.text(now) + "\n")
        self.last, self.last_fraction, self._printed_label = now, self.fraction, self.label

    def text(self, now: float | None = None) -> str:
        """``label [#####     ] 40% 12s, 3.1 epoch/s, ETA 18s`` (rate where the label counts, ETA
        once the step has moved)."""
        now = self.clock() if now is None else now
        bar = "#" * int(self.fraction * 20)
        parts = [f"{self.label} [{bar:<20}] {self.fraction:4.0%} {_duration(now - self.start)}"]
        elapsed = now - self.phase_start
        done = self.fraction - self.phase_fraction
        count = _COUNT.search(self.label)
        if count and elapsed > 0 and int(count.group(1)) > 0:
            unit = self.label[: count.start()].split()[-1] if self.label[: count.start()].split() else "it"
            parts.append(f"{int(count.group(1)) / (now - self.start):.1f} {unit.rstrip(':')}/s")
        if 0 < self.fraction < 1 and done > 0 and elapsed >= 1.0:
            parts.append(f"ETA {_duration(elapsed / done * (1 - self.fraction))}")
        return ", ".join(parts)

    def close(self) -> None:
        """End the line: on a terminal clear it; elsewhere, when the step was long enough to show,
        its last state unless that line is already there."""
        if self.drawn:
            self._write("\r" + " " * 80 + "\r")
        elif self.last >= 0 and (self.label, self.fraction) != (self._printed_label, self.last_fraction):
            self._line(self.clock())

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
