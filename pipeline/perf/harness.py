"""The timing harness: calls timed with one clock read on each side and nothing else between them,
a warm-up that ends when the medians settle, steady-state phases under iteration and time bounds
(one thread or several), and the samples as CSV. The bench stage uses it, and so do the benchmarks
that compare it with each stack's own tool (benchmarks/fidelity.py)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from pipeline.results.benchstats import settled
from pipeline.results.power import EnergyResult
from pipeline.results.reports import SteadyState

if TYPE_CHECKING:
    from pipeline.core.budget import Budget
    from pipeline.core.progress import Progress
    from pipeline.project.config import BenchSpec


def above_idle(energy: EnergyResult, idle: EnergyResult | None) -> EnergyResult:
    """``energy`` with the floor measured just before it (idle power) and what the inferences added
    above it; unchanged where either was not measured."""
    if not energy.available or idle is None or not idle.available or idle.mean_power_w is None:
        return energy
    above = None
    if energy.joules is not None and energy.inferences > 0:
        above = (energy.joules - idle.mean_power_w * energy.window_seconds) / energy.inferences
    return energy.model_copy(update={"idle_power_w": idle.mean_power_w, "above_idle_joules_per_inference": above})


def time_calls(
    fn: Callable[[], object],
    iterations: int,
    min_seconds: float = 0.0,
    progress: Progress | None = None,
    label: str = "",
    stop: threading.Event | None = None,
    max_seconds: float = math.inf,
) -> list[float]:
    """Call ``fn`` at least ``iterations`` times and for at least ``min_seconds``, but never past
    ``max_seconds`` (after one call) or once ``stop`` is set; ms per call. The loop does one clock
    read per side of the call and nothing else between them."""
    clock = time.perf_counter
    out: list[float] = []
    append = out.append
    start = clock()
    min_end, deadline = start + min_seconds, start + max_seconds
    while True:
        t0 = clock()
        fn()
        t1 = clock()
        append((t1 - t0) * 1000.0)
        n = len(out)
        if (n >= iterations and t1 >= min_end) or t1 >= deadline:
            return out
        if n % 64 == 0:
            if stop is not None and stop.is_set():
                return out
            if progress is not None:
                progress(label, min(1.0, n / iterations))


def warm_up(
    fn: Callable[[], object], cfg: BenchSpec, progress: Progress | None = None
) -> tuple[list[float], SteadyState]:
    """Call ``fn`` in windows until the medians of the last three settle (after at least
    ``cfg.warmup`` calls), or until ``cfg.max_warmup_seconds``; ``warmup: 0`` skips it. A window is shrunk
    for slow engines so that three fit in the time cap."""
    import numpy as np

    if cfg.warmup == 0:
        return [], SteadyState(
            reached=False,
            warmup_iterations=0,
            warmup_seconds=0.0,
            window=cfg.steady_window,
            tolerance=cfg.steady_tolerance,
            reason="warm-up disabled (bench.warmup: 0)",
        )
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    samples = [once * 1000.0]
    window = int(min(cfg.steady_window, max(5, cfg.max_warmup_seconds / 4 / once)))
    medians: list[float] = []
    start = time.perf_counter()
    while True:
        block = time_calls(fn, window, max_seconds=cfg.max_warmup_seconds)
        samples += block
        medians.append(float(np.median(block)))
        elapsed = time.perf_counter() - start
        if len(samples) >= cfg.warmup and settled(medians, cfg.steady_tolerance):
            reason = (
                f"medians of the last 3 windows of {window} calls within {cfg.steady_tolerance:.0%} "
                f"after {len(samples)} calls"
            )
            return samples, SteadyState(
                reached=True,
                warmup_iterations=len(samples),
                warmup_seconds=round(elapsed, 3),
                window=window,
                tolerance=cfg.steady_tolerance,
                reason=reason,
            )
        if elapsed >= cfg.max_warmup_seconds:
            reason = (
                f"not settled within max_warmup_seconds ({cfg.max_warmup_seconds:g} s, {len(samples)} calls): "
                f"last window medians {', '.join(f'{m:.4g}' for m in medians[-3:])} ms"
            )
            return samples, SteadyState(
                reached=False,
                warmup_iterations=len(samples),
                warmup_seconds=round(elapsed, 3),
                window=window,
                tolerance=cfg.steady_tolerance,
                reason=reason,
            )
        if progress is not None:
            progress("bench warm-up", min(1.0, elapsed / cfg.max_warmup_seconds))


def concurrent(
    fn: Callable[[], object], threads: int, iterations: int, min_seconds: float, max_seconds: float = math.inf
) -> tuple[list[float], float]:
    """Each thread times its own calls; returns all latencies and the wall time.

    On Ctrl-C (delivered to the main thread only) the workers are told to stop and are waited
    for a moment; they are daemons, so one stuck in a long inference call cannot hold the exit.
    """
    results: list[list[float]] = [[] for _ in range(threads)]
    per_thread = max(1, iterations // threads)
    stop = threading.Event()

    def work(i: int) -> None:
        results[i] = time_calls(fn, per_thread, min_seconds, stop=stop, max_seconds=max_seconds)

    workers = [threading.Thread(target=work, args=(i,), daemon=True, name=f"bench-{i}") for i in range(threads)]
    start = time.perf_counter()
    try:
        for w in workers:
            w.start()
        for w in workers:
            while w.is_alive():  # a join with a timeout: Ctrl-C gets through on every platform
                w.join(0.2)
    finally:
        stop.set()
        for w in workers:
            if w.is_alive():
                w.join(2.0)
    return [x for r in results for x in r], time.perf_counter() - start


def phase_cfg(cfg: BenchSpec, budget: Budget, share: float) -> BenchSpec:
    """``cfg`` with its time bounds cut to ``share`` of what is left of the stage's budget."""
    cap = budget.cap(cfg.max_seconds, share)
    return cfg.model_copy(update={"max_seconds": cap, "min_seconds": min(cfg.min_seconds, cap)})


def stopped_by(cfg: BenchSpec, phase: BenchSpec, capped: bool) -> Literal["iterations", "max_seconds", "budget"]:
    if not capped:
        return "iterations"
    return "budget" if phase.max_seconds < cfg.max_seconds else "max_seconds"


def timed(
    fn: Callable[[], object], cfg: BenchSpec, concurrency: int, progress: Progress | None, label: str
) -> tuple[list[float], float, bool]:
    """Steady-state calls at ``concurrency`` under the SKU's iteration and time bounds: (ms per call,
    busy seconds for the throughput, whether max_seconds ended them)."""
    start = time.perf_counter()
    if concurrency == 1:
        samples = time_calls(fn, cfg.iterations, cfg.min_seconds, progress, label, max_seconds=cfg.max_seconds)
        wall = sum(samples) / 1000
    else:
        samples, wall = concurrent(fn, concurrency, cfg.iterations, cfg.min_seconds, cfg.max_seconds)
    return samples, wall, time.perf_counter() - start >= cfg.max_seconds


def samples_csv(samples: list[float]) -> bytes:
    return ("iteration,latency_ms\n" + "".join(f"{i},{v:.4f}\n" for i, v in enumerate(samples))).encode()


def timeline_csv(warm: list[float], steady: list[float]) -> bytes:
    rows = [f"{i},warmup,{v:.4f}\n" for i, v in enumerate(warm)]
    rows += [f"{len(warm) + i},steady,{v:.4f}\n" for i, v in enumerate(steady)]
    return ("iteration,phase,latency_ms\n" + "".join(rows)).encode()
