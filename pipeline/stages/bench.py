"""bench: warm-up apart from steady state, latency percentiles, throughput, memory, engine-only
and end to end (preprocess, batch, infer, postprocess), device state at the time."""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..backends import get_backend
from ..config import Registry
from ..data import LABELS, iter_batches, postprocess, preprocess
from ..io import atomic_write_bytes, atomic_write_json, sha256_bytes
from ..results import BenchReport, BuildReport, LatencyStats, PrepareReport
from ..runner.probe import device_state, rss_mb
from . import Progress
from .build import require_host
from .common import batch_indices, check_engine, layout, load_arrays, log, read_report


def latency_stats(samples_ms: list[float]) -> LatencyStats:
    import numpy as np

    a = np.asarray(samples_ms, dtype=np.float64)
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return LatencyStats(iterations=len(a), mean_ms=float(a.mean()), std_ms=float(a.std()), min_ms=float(a.min()),
                        p50_ms=float(p50), p95_ms=float(p95), p99_ms=float(p99), max_ms=float(a.max()))


def time_calls(fn: Callable[[], object], iterations: int, min_seconds: float = 0.0,
               progress: Progress | None = None, label: str = "", stop: threading.Event | None = None) -> list[float]:
    """Call ``fn`` at least ``iterations`` times and for at least ``min_seconds`` (until ``stop`` is
    set); ms per call."""
    out: list[float] = []
    start = time.perf_counter()
    while (len(out) < iterations or time.perf_counter() - start < min_seconds) and not (stop and stop.is_set()):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
        if progress is not None and len(out) % 50 == 0:
            progress(label, min(1.0, len(out) / iterations))
    return out


def _concurrent(fn: Callable[[], object], threads: int, iterations: int, min_seconds: float) -> tuple[list[float], float]:
    """Each thread times its own calls; returns all latencies and the wall time.

    On Ctrl-C (delivered to the main thread only) the workers are told to stop and are waited
    for a moment; they are daemons, so one stuck in a long inference call cannot hold the exit.
    """
    results: list[list[float]] = [[] for _ in range(threads)]
    per_thread = max(1, iterations // threads)
    stop = threading.Event()

    def work(i: int) -> None:
        results[i] = time_calls(fn, per_thread, min_seconds, stop=stop)

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


def bench(registry: Registry, model: str, sku: str, progress: Progress | None = None) -> BenchReport:
    require_host(registry, sku)
    spec, sku_spec = registry.model(model), registry.sku(sku)
    cfg = registry.bench(sku)
    out = layout(registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    build = read_report(out.report(model, sku, "build"), BuildReport, "build")
    batch = registry.pins(model, sku).get(spec.batch_axis or "", 1)
    in_idx, _ = batch_indices(registry, model, prep.signature)
    golden = load_arrays(out.split(model, "golden"), "data")
    raw = load_arrays(out.split(model, "golden", raw=True), "data")
    for arrays in (golden, raw):
        arrays.pop(LABELS, None)
    _, feeds = next(iter_batches(golden, in_idx, batch))
    raw_batch = {k: v[:batch] for k, v in raw.items()}
    state_before = device_state()
    mem_before = rss_mb()
    t0 = time.perf_counter()
    with get_backend(sku_spec.backend).load(out.engine_dir(model, sku), sku_spec) as runner:
        load_seconds = time.perf_counter() - t0
        engine_sha = check_engine(runner, build, out.engine_dir(model, sku), model, sku)
        mem_loaded = rss_mb()
        t0 = time.perf_counter()
        runner.infer(feeds)
        first_ms = (time.perf_counter() - t0) * 1000
        warm = time_calls(lambda: runner.infer(feeds), cfg.warmup) if cfg.warmup else []
        if cfg.concurrency == 1:
            steady = time_calls(lambda: runner.infer(feeds), cfg.iterations, cfg.min_seconds, progress, "bench engine")
            wall = sum(steady) / 1000
        else:
            steady, wall = _concurrent(lambda: runner.infer(feeds), cfg.concurrency, cfg.iterations, cfg.min_seconds)

        def end_to_end() -> object:
            inputs = preprocess(spec, raw_batch)
            _, batched = next(iter_batches(inputs, in_idx, batch))
            return postprocess(spec, runner.infer(batched))

        e2e = time_calls(end_to_end, cfg.iterations, cfg.min_seconds, progress, "bench end-to-end")
        mem_after = rss_mb()
    samples = ("iteration,latency_ms\n" + "".join(f"{i},{v:.4f}\n" for i, v in enumerate(steady))).encode()
    report = BenchReport(
        model=model, sku=sku, engine_sha256=engine_sha, build_config_sha256=build.build_config_sha256,
        latency_sha256=sha256_bytes(samples), batch=batch, concurrency=cfg.concurrency, load_seconds=round(load_seconds, 4),
        first_inference_ms=first_ms, warmup=latency_stats(warm) if warm else None,
        engine_only=latency_stats(steady), end_to_end=latency_stats(e2e),
        throughput_per_s=len(steady) * batch / wall if wall > 0 else 0.0,
        memory_mb={"rss_before_load": mem_before["rss"], "rss_after_load": mem_loaded["rss"],
                   "engine_load_delta": mem_loaded["rss"] - mem_before["rss"], "rss_after_bench": mem_after["rss"],
                   "peak_rss": mem_after["peak_rss"]},
        device_state={"before": state_before, "after": device_state()},
    )
    atomic_write_bytes(out.latency_csv(model, sku), samples)  # samples first: the report names their hash
    atomic_write_json(out.report(model, sku, "bench"), report.to_json())
    s = report.engine_only
    log(model, sku).info("bench: p50 %.3f ms p95 %.3f ms p99 %.3f ms, %.0f samples/s", s.p50_ms, s.p95_ms, s.p99_ms,
                         report.throughput_per_s)
    return report
