"""bench: warm-up apart from steady state, latency percentiles, throughput, memory, engine-only
and end to end (preprocess, batch, infer, postprocess), device state at the time."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Literal

from pipeline.backends import get_backend
from pipeline.core.budget import Budget
from pipeline.core.env import (
    GOMP_CPU_AFFINITY,
    KMP_AFFINITY,
    MKL_NUM_THREADS,
    OMP_NUM_THREADS,
    OMP_PLACES,
    OMP_PROC_BIND,
    OPENBLAS_NUM_THREADS,
    TVM_NUM_THREADS,
)
from pipeline.core.errors import ConfigError
from pipeline.core.io import atomic_write_bytes, atomic_write_json, sha256_bytes
from pipeline.core.paths import Layout
from pipeline.host.energy import EnergyMeter, open_meter, unavailable
from pipeline.perf.harness import (
    above_idle,
    phase_cfg,
    samples_csv,
    stopped_by,
    timed,
    timeline_csv,
    warm_up,
)
from pipeline.perf.sustained import sustained_run
from pipeline.project.config import BenchSpec, Pair, SkuSpec, device_preprocessing
from pipeline.project.data import LABELS, iter_batches, preprocess
from pipeline.project.files import unpack
from pipeline.project.postprocessing import postprocess
from pipeline.project.processing import Preprocessor, describe
from pipeline.results.benchstats import drift, e2e_below_engine, latency_stats
from pipeline.results.power import ENERGY_SOURCES, EnergyResult, EnergySource
from pipeline.results.reports import (
    BenchReport,
    BuildReport,
    Execution,
    HostInfo,
    LatencyStats,
    PrepareReport,
    SweepPoint,
)

if TYPE_CHECKING:
    from pipeline.perf.roofline import RooflineReport
from pipeline.core.progress import Progress
from pipeline.engine.build import require_host
from pipeline.host.peaks import host_peaks
from pipeline.host.probe import device_state, host, rss_mb, usable_cores
from pipeline.perf.cost import graph_cost
from pipeline.perf.roofline import roofline
from pipeline.project.artifacts import RESULT, batch_indices, check_engine, layout, load_arrays, log, read_report

ENERGY_PHASE = "engine-only steady state"
IDLE_SECONDS = 1.0  # the host's floor, measured before the steady phase where a meter exists


THREAD_ENV = (
    OMP_NUM_THREADS,
    MKL_NUM_THREADS,
    OPENBLAS_NUM_THREADS,
    TVM_NUM_THREADS,
    OMP_PROC_BIND,
    OMP_PLACES,
    GOMP_CPU_AFFINITY,
    KMP_AFFINITY,
)


def execution(build: BuildReport, concurrency: int) -> Execution:
    """The thread and affinity settings the engine runs under (read after it was loaded: a runner
    may set its pool's variable)."""
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    threads = {
        k: v
        for k, v in build.options.items()
        if any(word in k for word in ("thread", "stream", "num_cores", "topology", "affinity"))
    }
    return Execution(
        affinity=affinity,
        usable_cores=usable_cores(),
        engine_threads=threads,
        env={var.name: value for var in THREAD_ENV if (value := var.raw()) is not None},
        concurrency=concurrency,
        timer="time.perf_counter around runner.infer",
    )


def _sweep_feeds(pair: Pair, golden: dict, in_idx, batches: list[int]) -> dict[int, dict]:
    """Inputs per swept batch size, refused before any timing when the engine cannot take them."""
    model, sku, spec, sku_spec = pair.model, pair.sku, pair.spec, pair.sku_spec
    pinned = pair.pins.get(spec.batch_axis or "", 1)
    profile = sku_spec.profiles.get(spec.batch_axis or "")
    feeds = {}
    for b in batches:
        if b != pinned and (profile is None or not profile.min <= b <= profile.max):
            raise ConfigError(
                f"skus.{sku}.bench.sweep.batch: {model}/{sku} is built for batch {pinned}"
                + (f" (profile {profile.min}..{profile.max})" if profile else "")
                + f", not {b}",
                hint=f"move {spec.batch_axis or 'batch'} from skus.{sku}.shapes to skus.{sku}.profiles "
                "with a min..max covering the swept batch sizes, or sweep only the built batch",
            )
        rows = max(len(next(iter(golden.values()))), 1)
        tiled = {k: v if len(v) >= b else v[[i % rows for i in range(b)]] for k, v in golden.items()}
        _, feeds[b] = next(iter_batches(tiled, in_idx, b))
    return feeds


def sweep(runner, cfg: BenchSpec, feeds: dict[int, dict], progress: Progress | None) -> list[SweepPoint]:
    """Throughput against latency at each (batch, concurrency) the SKU asks for (``feeds``: per
    batch size, from ``_sweep_feeds``)."""
    import numpy as np

    if cfg.sweep is None:
        return []
    points = []
    for b in feeds:
        for c in cfg.sweep.concurrency or [cfg.concurrency]:
            call = functools.partial(runner.infer, feeds[b])
            call()  # a new shape may re-plan
            point_cfg = cfg.model_copy(
                update={
                    "iterations": 1,
                    "min_seconds": cfg.sweep.seconds,
                    "max_seconds": max(cfg.sweep.seconds, 1.0) * 2,
                }
            )
            samples, wall, _ = timed(call, point_cfg, c, progress, f"bench sweep b{b} c{c}")
            points.append(
                SweepPoint(
                    batch=b,
                    concurrency=c,
                    iterations=len(samples),
                    p50_ms=float(np.percentile(samples, 50)),
                    p99_ms=float(np.percentile(samples, 99)),
                    throughput_per_s=len(samples) * b / wall if wall > 0 else 0.0,
                )
            )
    return points


def engine_roofline(
    pair: Pair,
    runner,
    feeds: dict,
    build: BuildReport,
    p50_ms: float,
    budget: Budget | None = None,
    warnings: list[str] | None = None,
) -> RooflineReport | None:
    """The engine against this host's peaks (measured once per host and cached: ``skuforge runner
    probe --peaks``), with per-layer times where the backend profiles them: its INT8 ops (the SKU's
    precision, or its layers') against the INT8 peak, the others against the FP32 one. None, with a
    warning, where the graph's costs cannot be counted, or (said in ``warnings``) where the 20
    profiled runs would not fit in what is left of ``budget``; the benchmark never fails on it."""
    if budget is not None and budget.remaining() <= 25 * p50_ms / 1000:  # a warm-up and 20 runs
        if warnings is not None:
            warnings.append(f"bench: no roofline: its 20 profiled runs would not fit in what is left of {budget.key}")
        return None
    model, sku = pair.model, pair.sku
    out = layout(pair.registry)
    try:
        cost = graph_cost(out.prepared_model(model), pair.pins)
    except Exception as exc:  # noqa: BLE001 - an analysis, not a gate: say why and go on
        log(model, sku).warning("bench: no roofline: the graph's costs could not be counted (%s)", exc)
        return None
    try:
        times = runner.profile_layers(feeds)
    except Exception as exc:  # noqa: BLE001
        log(model, sku).warning("bench: per-layer times unavailable (%s)", exc)
        times = None
    return roofline(cost, p50_ms, host_peaks(), times, layers=build.layers, precision=build.precision)


class EndToEnd:
    """One end-to-end call as the device makes it, timed per step: decode (raw files only),
    preprocess (the device-side steps, or the affine map of raw arrays), infer, postprocess. Each
    call appends its steps' milliseconds to ``times``; the per-step clock reads are four
    ``perf_counter`` calls, well under a microsecond."""

    def __init__(self, pair: Pair, runner, in_idx: dict, batch: int):
        import numpy as np

        self.np = np
        model, spec = pair.model, pair.spec
        out = layout(pair.registry)
        self.spec, self.runner, self.in_idx, self.batch = spec, runner, in_idx, batch
        self.times: dict[str, list[float]] = {}
        raw = load_arrays(out.split(model, "golden", raw=True), "data")
        self.pre: tuple[str, Preprocessor] | None = None  # the input made from raw files (config: one)
        self.described: dict[str, dict] = {}
        if spec.file_inputs:
            blobs, names, _ = unpack(raw)
            take = [i % len(blobs) for i in range(batch)]
            self.blobs = [blobs[i] for i in take]
            self.names = [names[i] for i in take]
            name, steps = next(iter(spec.file_inputs.items()))
            shipped = device_preprocessing(steps, pair.sku_spec.preprocessing.device)
            self.pre = (name, Preprocessor(shipped, spec.input(name).dtype))
            self.described[name] = describe(shipped)
            kinds = sorted({n.rsplit(".", 1)[-1].lower() for n in self.names})
            self.source = (
                f"{len(self.blobs)} raw {'/'.join(kinds)} file(s) from the golden set "
                f"({sum(map(len, self.blobs))} bytes, in memory), the device-side preprocessing"
            )
            self.steps: tuple[str, ...] = ("decode", "preprocess", "infer", "postprocess")
        else:
            raw.pop(LABELS, None)
            self.raw_batch = {k: v[:batch] for k, v in raw.items()}
            self.source = "raw golden arrays (models.<name>.preprocess: an affine map per input)"
            self.steps = ("preprocess", "infer", "postprocess")
        for step in self.steps:
            self.times[step] = []

    def __call__(self) -> object:
        clock = time.perf_counter
        t0 = clock()
        if self.pre is not None:
            name, pre = self.pre
            decoded = [pre.decode(b, n) for b, n in zip(self.blobs, self.names, strict=True)]
            t1 = clock()
            inputs = {name: self.np.stack([pre.transform(d) for d in decoded])}
            self.times["decode"].append((t1 - t0) * 1000.0)
        else:
            t1 = t0
            inputs = preprocess(self.spec, self.raw_batch)
        _, batched = next(iter_batches(inputs, self.in_idx, self.batch))
        t2 = clock()
        outputs = self.runner.infer(batched)
        t3 = clock()
        result = postprocess(self.spec, outputs)
        t4 = clock()
        times = self.times
        times["preprocess"].append((t2 - t1) * 1000.0)
        times["infer"].append((t3 - t2) * 1000.0)
        times["postprocess"].append((t4 - t3) * 1000.0)
        return result

    def reset(self) -> None:
        for samples in self.times.values():
            samples.clear()


def _engine_only(
    call: Callable[[], object],
    cfg: BenchSpec,
    sku_spec: SkuSpec,
    budget: Budget,
    batch: int,
    progress: Progress | None,
) -> tuple[list[float], float, Literal["iterations", "max_seconds", "budget"], EnergyResult]:
    """The engine-only steady phase with the host's energy counters around it (the idle floor
    first), or why there are none: (ms per call, busy seconds, what stopped it, energy)."""
    steady_cfg = phase_cfg(cfg, budget, 0.5)
    with energy_meter(cfg, sku_spec) as meter:
        if isinstance(meter, str):
            steady, wall, capped = timed(call, steady_cfg, cfg.concurrency, progress, "bench engine")
            energy = unavailable(meter, ENERGY_PHASE)
        else:
            meter.start()  # the floor first: the engine loaded and not called
            time.sleep(IDLE_SECONDS)
            idle = meter.stop(0, "idle")
            meter.start()
            steady, wall, capped = timed(call, steady_cfg, cfg.concurrency, progress, "bench engine")
            energy = above_idle(meter.stop(len(steady) * batch, ENERGY_PHASE), idle)
    return steady, wall, stopped_by(cfg, steady_cfg, capped), energy


def _sweep_if_it_fits(
    runner, cfg: BenchSpec, feeds: dict[int, dict], budget: Budget, progress: Progress | None, warnings: list[str]
) -> list[SweepPoint]:
    """The batch/concurrency sweep where one is asked for and what is left of the budget holds it."""
    if cfg.sweep is None:
        return []
    need = len(feeds) * len(cfg.sweep.concurrency or [cfg.concurrency]) * max(cfg.sweep.seconds, 1.0) * 2
    if budget.remaining() > need:
        return sweep(runner, cfg, feeds, progress)
    warnings.append(f"bench: no sweep: it needs up to {need:g} s, more than is left of {budget.key}")
    return []


def _write(
    out: Layout, model: str, sku: str, report: BenchReport, samples: bytes, timeline: bytes, roof_bytes: bytes | None
) -> None:
    """The samples first (the report names their hashes), the roofline (or none: never a stale
    analysis beside a new report), then the report."""
    atomic_write_bytes(out.latency_csv(model, sku), samples)
    atomic_write_bytes(out.timeline_csv(model, sku), timeline)
    if roof_bytes is not None:
        atomic_write_bytes(out.roofline(model, sku), roof_bytes)
    else:
        out.roofline(model, sku).unlink(missing_ok=True)  # never a stale analysis beside a new report
    atomic_write_json(out.report(model, sku, "bench"), report.to_json())


def _log(lg: logging.LoggerAdapter, report: BenchReport, warnings: list[str]) -> None:
    steady_state = report.steady_state
    s = report.engine_only
    lg.info(
        "bench: p50 %.4g ms (%s) p99 %.4g ms, %.0f samples/s; %s",
        s.p50_ms,
        _ci(s.p50_ci_ms),
        s.p99_ms,
        report.throughput_per_s,
        steady_state.reason,
        extra=RESULT,
    )
    if not steady_state.reached:
        lg.warning("bench: %s", steady_state.reason)
    for line in warnings:
        lg.warning("%s", line)
    if report.drift is not None and report.drift.flagged:
        lg.warning(
            "bench: latency drifted %.1f%% between the first and last %d calls (%.4g -> %.4g ms): "
            "throttling or a noisy neighbour; the figures may not hold",
            (report.drift.ratio - 1) * 100,
            report.drift.window,
            report.drift.first_p50_ms,
            report.drift.last_p50_ms,
        )


def _end_to_end(
    end_to_end: EndToEnd, cfg: BenchSpec, budget: Budget, progress: Progress | None
) -> tuple[list[float], Literal["iterations", "max_seconds", "budget"]]:
    """The end-to-end phase at the engine-only phase's concurrency (e2e latency under fewer callers
    is not comparable), after one call that loads the codecs: (ms per call, what stopped it)."""
    end_to_end()  # the first decode loads the library's codecs: not a steady-state call
    end_to_end.reset()
    e2e_cfg = phase_cfg(cfg, budget, 0.5)
    e2e, _, capped = timed(end_to_end, e2e_cfg, cfg.concurrency, progress, "bench end-to-end")
    return e2e, stopped_by(cfg, e2e_cfg, capped)


def _memory(before: dict[str, float], loaded: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        "rss_before_load": before["rss"],
        "rss_after_load": loaded["rss"],
        "engine_load_delta": loaded["rss"] - before["rss"],
        "rss_after_bench": after["rss"],
        "peak_rss": after["peak_rss"],
    }


def _e2e_below_engine(engine: LatencyStats, e2e: LatencyStats, model: str, sku: str, warnings: list[str]) -> bool:
    """Whether end to end measured faster than the engine alone (impossible: it includes it), warned."""
    impossible = e2e_below_engine(engine, e2e)
    if impossible:
        warnings.append(
            f"bench: end-to-end p50 {e2e.p50_ms:.4g} ms is below engine-only p50 {engine.p50_ms:.4g} ms, "
            "which end to end includes: a measurement error (a neighbour, a frequency step or throttling between "
            f"the phases); rerun `skuforge bench --model {model} --sku {sku}` on a quiet runner"
        )
    return impossible


def _first_ms(runner, feeds: dict) -> float:
    """The first inference's ms (lazy initialisation, first-touch allocations: not a steady call)."""
    t0 = time.perf_counter()
    runner.infer(feeds)
    return (time.perf_counter() - t0) * 1000


def bench(pair: Pair, progress: Progress | None = None) -> BenchReport:
    import numpy as np

    model, sku, spec, sku_spec, cfg = pair.model, pair.sku, pair.spec, pair.sku_spec, pair.bench
    require_host(sku, sku_spec)
    out = layout(pair.registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    build = read_report(out.report(model, sku, "build"), BuildReport, "build")
    batch = pair.pins.get(spec.batch_axis or "", 1)
    in_idx, _ = batch_indices(spec, prep.signature)
    golden = load_arrays(out.split(model, "golden"), "data")
    golden.pop(LABELS, None)
    _, feeds = next(iter_batches(golden, in_idx, batch))
    # impossible batch sizes are refused before any timing
    sweep_feeds = _sweep_feeds(pair, golden, in_idx, cfg.sweep.batch or [batch]) if cfg.sweep else {}
    state_before = device_state()
    mem_before = rss_mb()
    lg = log(model, sku)
    budget = Budget(sku_spec.max_seconds, "bench", f"skus.{sku}.max_seconds", lg)
    warnings: list[str] = []
    t0 = time.perf_counter()
    with budget.watch(), get_backend(sku_spec.backend).load(out.engine_dir(model, sku), sku_spec) as runner:
        load_seconds = time.perf_counter() - t0
        engine_sha = check_engine(runner, build, out.engine_dir(model, sku), model, sku)
        mem_loaded = rss_mb()
        budget.check("bench first inference")
        first_ms = _first_ms(runner, feeds)
        call = functools.partial(runner.infer, feeds)  # no per-call closure or lookup beyond the runner's own
        # each phase gets a share of what is left of the stage's budget, so that the later ones still run
        budget.check("bench warm-up")
        warm_cfg = cfg.model_copy(update={"max_warmup_seconds": budget.cap(cfg.max_warmup_seconds, 0.25)})
        warm, steady_state = warm_up(call, warm_cfg, progress)
        budget.check("bench engine-only")
        steady, wall, stopped, energy = _engine_only(call, cfg, sku_spec, budget, batch, progress)
        end_to_end = EndToEnd(pair, runner, in_idx, batch)
        budget.check("bench end-to-end")
        e2e, e2e_stopped = _end_to_end(end_to_end, cfg, budget, progress)
        for phase, n, how in (("engine-only", len(steady), stopped), ("end-to-end", len(e2e), e2e_stopped)):
            if how == "budget":
                warnings.append(
                    f"bench: the stage budget ({budget.key}: {budget.seconds:g} s) cut the {phase} phase "
                    f"to n={n} of {cfg.iterations} iterations: its intervals are wide"
                )
        # the sweep and the roofline come last and only where the budget still holds them
        points = _sweep_if_it_fits(runner, cfg, sweep_feeds, budget, progress, warnings)
        p50, roof = float(np.median(steady)), None
        if cfg.roofline:
            roof = engine_roofline(pair, runner, feeds, build, p50, budget, warnings)
        sustained = (
            _sustained(call, cfg, sku_spec, batch, budget, progress, warnings) if cfg.sustained is not None else None
        )
        run = execution(build, cfg.concurrency)
        mem_after = rss_mb()
    # the statistics of the samples as latency.csv holds them: the manifest stage recomputes them from it
    steady = [float(f"{v:.4f}") for v in steady]
    samples, timeline = samples_csv(steady), timeline_csv(warm, steady)
    roof_bytes = json.dumps(roof.to_json(), indent=2, sort_keys=True).encode() + b"\n" if roof is not None else None
    engine, end_to_end_stats = latency_stats(steady, cfg.confidence), latency_stats(e2e, cfg.confidence)
    impossible = _e2e_below_engine(engine, end_to_end_stats, model, sku, warnings)
    throughput_ci = None
    if engine.mean_ci_ms is not None and cfg.concurrency == 1:
        throughput_ci = (batch * 1000 / engine.mean_ci_ms[1], batch * 1000 / engine.mean_ci_ms[0])
    report = BenchReport(
        model=model,
        sku=sku,
        engine_sha256=engine_sha,
        build_config_sha256=build.build_config_sha256,
        latency_sha256=sha256_bytes(samples),
        timeline_sha256=sha256_bytes(timeline),
        roofline_sha256=sha256_bytes(roof_bytes) if roof_bytes is not None else None,
        roofline_fraction=roof.compute_fraction if roof is not None else None,
        e2e_below_engine=impossible,
        warnings=warnings,
        batch=batch,
        concurrency=cfg.concurrency,
        load_seconds=round(load_seconds, 4),
        first_inference_ms=first_ms,
        warmup=latency_stats(warm, cfg.confidence) if warm else None,
        steady_state=steady_state,
        engine_only=engine,
        end_to_end=end_to_end_stats,
        end_to_end_steps={step: latency_stats(times, cfg.confidence) for step, times in end_to_end.times.items()},
        end_to_end_input=end_to_end.source,
        preprocessing=end_to_end.described,
        energy=energy,
        sustained=sustained,
        stopped=stopped,
        drift=drift(steady, steady_state.window, cfg.drift_threshold),
        throughput_per_s=len(steady) * batch / wall if wall > 0 else 0.0,
        throughput_ci_per_s=throughput_ci,
        execution=run,
        sweep=points,
        memory_mb=_memory(mem_before, mem_loaded, mem_after),
        device_state={"before": state_before, "after": device_state()},
        host=HostInfo(**host()),  # the manifest's host comes from here, not from wherever the manifest is written
    )
    _write(out, model, sku, report, samples, timeline, roof_bytes)
    _log(lg, report, warnings)
    return report


def energy_sources(sku: SkuSpec) -> tuple[EnergySource, ...]:
    """The meters to try, the SKU's device first: a GPU SKU's energy is the GPU's (NVML; a Jetson's
    input rail), a CPU SKU's the CPU package's (RAPL)."""
    if sku.target.device == "gpu":
        return ("nvml", "ina3221", "rapl")
    return ENERGY_SOURCES


@contextlib.contextmanager
def energy_meter(cfg: BenchSpec, sku: SkuSpec) -> Iterator[EnergyMeter | str]:
    """The host's meter for the SKU (closed after), or why there is none ("unavailable: ...")."""
    meter = open_meter(sources=energy_sources(sku)) if cfg.energy else "unavailable: bench.energy is false"
    try:
        yield meter
    finally:
        if not isinstance(meter, str):
            meter.close()


def _sustained(call, cfg: BenchSpec, sku_spec: SkuSpec, batch: int, budget: Budget, progress, warnings: list[str]):
    """The sustained run within what is left of the stage's budget (a margin kept for the report)."""
    assert cfg.sustained is not None
    spec = cfg.sustained
    left = budget.remaining()
    if left < spec.window_seconds * spec.trend_windows:
        warnings.append(
            f"bench: no sustained run: {left:.0f} s left of {budget.key}, less than its "
            f"{spec.trend_windows} windows of {spec.window_seconds:g} s"
        )
        return None
    with energy_meter(cfg, sku_spec) as meter:
        result = sustained_run(
            call,
            spec,
            batch,
            progress=progress,
            meter=None if isinstance(meter, str) else meter,
            deadline=time.perf_counter() + left * 0.9 if math.isfinite(left) else None,
        )
    if result.stopped != "flat":
        warnings.append(f"bench: sustained run not at equilibrium: {result.reason}")
    return result


def _ci(ci: tuple[float, float] | None) -> str:
    return f"95% CI {ci[0]:.4g}..{ci[1]:.4g}" if ci else "no CI"
