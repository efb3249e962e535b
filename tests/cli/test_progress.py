"""The progress line: a few lines in a log (not one per call), a rate and an ETA on a terminal."""

from __future__ import annotations

import io

from pipeline.cli.progress import ProgressLine


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _export(stream, epochs: int = 40, seconds_each: float = 0.2) -> str:
    """What an example's export reports: one call per epoch, after a 2.5 s start-up."""
    clock = Clock()
    line = ProgressLine(stream=stream, clock=clock)
    for epoch in range(1, epochs + 1):
        clock.now = 2.5 + epoch * seconds_each
        line(f"digits: epoch {epoch}/{epochs}", epoch / epochs)
    line.close()
    return stream.getvalue()


def test_a_log_gets_the_start_a_few_lines_and_the_end():
    lines = _export(io.StringIO()).splitlines()
    assert 3 <= len(lines) <= 7, lines  # was one per epoch (40)
    assert lines[0].startswith("digits: epoch 1/40") and lines[-1].startswith("digits: epoch 40/40")
    assert "100%" in lines[-1]


def test_a_long_step_in_a_log_prints_every_ten_seconds():
    clock = Clock()
    out = io.StringIO()
    line = ProgressLine(stream=out, clock=clock)
    for second in range(301):  # five minutes creeping from 20 % to 70 %
        clock.now = float(second)
        line("tvm tune 12 tasks", 0.2 + 0.5 * second / 300)
    line.close()
    lines = out.getvalue().splitlines()
    assert 28 <= len(lines) <= 32, len(lines)
    assert all("ETA" in x for x in lines[1:]), lines[:3]


def test_a_terminal_gets_one_redrawn_line_with_rate_and_eta():
    out = Terminal()
    text = _export(out)
    assert "\n" not in text and text.count("\r") > 5
    frames = [f for f in text.split("\r") if f.strip()]
    middle = next(f for f in frames if "epoch 20/40" in f)
    assert "epoch/s" in middle and "ETA" in middle, middle
    assert text.endswith("\r")  # cleared at the end


def test_a_short_step_prints_nothing():
    clock = Clock()
    out = io.StringIO()
    line = ProgressLine(stream=out, clock=clock)
    for i in range(10):
        clock.now = i * 0.05
        line("quick", i / 10)
    line.close()
    assert out.getvalue() == ""
