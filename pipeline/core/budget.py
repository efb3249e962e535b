"""A stage's wall-clock budget (``skus.<sku>.max_seconds``): validate and bench check it between
engine calls, log the progress of slow calls, and a watchdog thread ends the stage when one call
alone outlasts it.

A call inside a compiler runtime cannot be interrupted from Python, so the watchdog hands the
``TimedOut`` to the process's hard stop, which the CLI installs (``on_hard_stop``): it records the
outcome and exits 1 with the call still in flight. Without one (the Python API), the watchdog logs
the overrun and the stage raises ``TimedOut`` as soon as the call returns.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from pipeline.core.errors import TimedOut

HardStop = Callable[[TimedOut], None]
_hard_stop: HardStop | None = None

T = TypeVar("T")

LOG_EVERY_SECONDS = 10.0  # progress lines: one per slow call, else at most one per this many seconds


def on_hard_stop(fn: HardStop | None) -> HardStop | None:
    """Install what the watchdog calls when a stage's budget runs out inside one call (the CLI's:
    record the outcome, exit 1); returns the one it replaces. None: the stage fails when the call returns."""
    global _hard_stop  # noqa: PLW0603 - one per process, like a signal handler
    previous, _hard_stop = _hard_stop, fn
    return previous


class Budget:
    """``seconds`` of wall time for one stage of one (model, SKU) from now (None: unbounded).
    ``key`` is the params.yaml key that sets it, named in the timeout's hint."""

    def __init__(
        self,
        seconds: float | None,
        stage: str,
        key: str,
        log: logging.Logger | logging.LoggerAdapter[Any],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.seconds, self.stage, self.key, self.log, self.clock = seconds, stage, key, log, clock
        self.start = clock()
        self.where = stage  # what runs now: "validate golden sample 3/32", "bench warm-up"
        self.call_seconds: list[float] = []  # of the calls counted by ``calls``
        self._in_call_since: float | None = None
        self._last_log = self.start

    def elapsed(self) -> float:
        return self.clock() - self.start

    def remaining(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()

    def cap(self, seconds: float, share: float = 1.0) -> float:
        """``seconds``, or ``share`` of what is left of the budget where that is less (never below 0)."""
        return max(0.0, min(seconds, self.remaining() * share))

    def check(self, where: str | None = None) -> None:
        """Raise ``TimedOut`` when the budget is spent; ``where`` names what starts next."""
        if where is not None:
            self.where = where
        if self.remaining() <= 0:
            raise self.timed_out()

    def timed_out(self) -> TimedOut:
        assert self.seconds is not None  # an unbounded budget never runs out
        done = self.call_seconds
        if self._in_call_since is not None and not done:
            pace = f"; its first call has run {self.clock() - self._in_call_since:.0f} s"
        elif done:
            pace = f" ({sum(done) / len(done):.3g} s per call over {len(done)})"
        else:
            pace = ""
        return TimedOut(
            f"timed out after {self.seconds:g} s at {self.where}{pace}",
            hint=f"raise {self.key} (now {self.seconds:g} s) for this device, or make the golden set "
            "or the bench iterations smaller; a device this slow may need a faster SKU",
            stage=self.stage,
            seconds=self.seconds,
        )

    def calls(self, fn: Callable[[T], Any], label: str, total: int, unit: str = "sample") -> Callable[[T], Any]:
        """``fn`` counting its calls as ``label`` ``unit`` i/``total``: the budget is checked before
        each, and a call slower than LOG_EVERY_SECONDS (or the first after that long) is logged."""
        count = 0

        def call(arg: T) -> Any:
            nonlocal count
            count += 1
            self.check(f"{label} {unit} {count}/{total}")
            t0 = self._in_call_since = self.clock()
            try:
                result = fn(arg)
            finally:
                self._in_call_since = None
            t1 = self.clock()
            self.call_seconds.append(t1 - t0)
            if t1 - self._last_log >= LOG_EVERY_SECONDS:
                self._last_log = t1
                self.log.info(
                    "%s %s %d/%d in %.3g s (%.0f s of %s)",
                    label,
                    unit,
                    count,
                    total,
                    t1 - t0,
                    t1 - self.start,
                    "no budget" if self.seconds is None else f"{self.seconds:g} s",
                )
            return result

        return call

    @contextmanager
    def watch(self) -> Iterator[None]:
        """A watchdog over the block: when the budget runs out inside it, the hard stop (see
        ``on_hard_stop``) ends the process; without one the overrun is logged and the next
        ``check`` raises."""
        if self.seconds is None:
            yield
            return
        done = threading.Event()
        lock = threading.Lock()

        def watchdog() -> None:
            if done.wait(max(self.remaining(), 0.0)):
                return
            with lock:
                if done.is_set():
                    return
                exc = self.timed_out()
                hard_stop = _hard_stop
                if hard_stop is None:
                    self.log.error("%s: %s is still running; the stage fails when it returns", exc.message, self.where)
                    return
                self.log.error("%s: the call in flight cannot be interrupted, ending the process", exc.message)
                hard_stop(exc)

        thread = threading.Thread(target=watchdog, daemon=True, name=f"{self.stage}-budget")
        thread.start()
        try:
            yield
        finally:
            with lock:
                done.set()
            thread.join(1.0)
