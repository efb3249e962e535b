"""The benchmark's method: steady state, time caps, intervals, drift, rounding, and the manifest
that a rerun of an unchanged engine leaves as it was."""

from __future__ import annotations

import time

import models
import numpy as np
import pytest

from pipeline.core.io import read_json
from pipeline.core.paths import Layout
from pipeline.perf.harness import time_calls, warm_up
from pipeline.project.config import BenchSpec, load_registry
from pipeline.results.benchstats import (
    block_bootstrap,
    drift,
    latency_stats,
    round_ci,
    round_to_ci,
    same_figure,
    settled,
)
from pipeline.results.manifest import (
    Benchmark,
    EnergySummary,
    LatencySummary,
    SustainedSummary,
    benchmark_changes,
    settle,
)
from pipeline.stages.bench import bench
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# --- warm-up and time bounds ---------------------------------------------------------------------


def test_warm_up_ends_once_the_latency_settles():
    calls = []

    def engine():  # cold: 10x slower at first, settling geometrically (caches, clocks, allocator)
        calls.append(1)
        spin(0.0003 + 0.003 * 0.9 ** len(calls))

    cfg = BenchSpec(warmup=10, steady_window=10, steady_tolerance=0.25, max_warmup_seconds=5.0)
    samples, state = warm_up(engine, cfg)
    assert state.reached and state.window == 10
    # windows of 10 calls: medians ~2.1, 0.92, 0.52, 0.38, 0.33 ms: the first three that agree within 25% end at 51+
    assert 41 <= state.warmup_iterations == len(samples) <= 150
    assert "within 25%" in state.reason


def test_warm_up_that_never_settles_stops_at_its_cap_and_says_so():
    calls = []

    def engine():  # a sawtooth over 20 calls (a periodic neighbour): windows of 5 never agree
        calls.append(1)
        spin(0.0002 * (1 + len(calls) % 20))

    cfg = BenchSpec(warmup=5, steady_window=5, steady_tolerance=0.02, max_warmup_seconds=0.3)
    samples, state = warm_up(engine, cfg)
    assert not state.reached and "not settled within max_warmup_seconds (0.3 s" in state.reason
    assert state.warmup_seconds >= 0.3  # it returned: the cap stopped a warm-up that never settles


def test_warm_up_zero_skips_it():
    samples, state = warm_up(lambda: None, BenchSpec(warmup=0))
    assert samples == [] and not state.reached and "disabled" in state.reason


def test_a_slow_engine_stops_at_max_seconds_short_of_its_iterations():
    samples = time_calls(lambda: time.sleep(0.02), iterations=500, max_seconds=0.2)
    assert 1 <= len(samples) <= 10  # 0.2 s holds at most 10 calls of 20 ms, far short of 500


def test_min_seconds_keeps_a_fast_engine_going():
    samples = time_calls(lambda: None, iterations=10, min_seconds=0.05)
    assert len(samples) > 10 and sum(samples) > 0


# --- intervals, drift, rounding ------------------------------------------------------------------


def test_intervals_hold_the_estimate_and_are_reproducible():
    rng = np.random.default_rng(3)
    x = rng.lognormal(np.log(1.0), 0.1, 2000)
    ci = block_bootstrap(x, 0.95)
    assert ci == block_bootstrap(x, 0.95)  # seeded
    for name, q in (("p50", 50), ("p95", 95), ("p99", 99)):
        low, high = ci[name]
        assert low <= np.percentile(x, q) <= high and high - low < 0.1 * np.percentile(x, q)
    assert block_bootstrap(x[:10], 0.95) == {}  # too few calls: no interval


def test_correlated_samples_get_wider_intervals_than_shuffled_ones():
    rng = np.random.default_rng(5)
    level = np.repeat(rng.normal(1.0, 0.05, 40), 50)  # runs of 50 calls at one speed (a neighbour, a clock step)
    x = level + rng.normal(0, 0.005, len(level))
    width = lambda s: np.subtract(*block_bootstrap(s, 0.95)["p50"][::-1])  # noqa: E731
    assert width(x) > 1.5 * width(rng.permutation(x))


def test_stats_carry_intervals():
    s = latency_stats(np.linspace(1.0, 2.0, 500))
    assert s.p50_ci_ms[0] <= s.p50_ms <= s.p50_ci_ms[1] and s.p99_ci_ms is not None and s.mean_ci_ms is not None


def test_drift_between_first_and_last_window_is_flagged():
    flat = [1.0] * 300
    assert not drift(flat, 50, 0.05).flagged
    throttled = [1.0] * 150 + [1.2] * 150
    d = drift(throttled, 50, 0.05)
    assert d.flagged and d.ratio == pytest.approx(1.2) and d.first_p50_ms == 1.0
    assert drift([1.0] * 60, 50, 0.05) is None


def test_settled_needs_three_close_windows():
    assert not settled([1.0, 1.0], 0.05)
    assert settled([2.0, 1.0, 1.02, 1.01], 0.05) and not settled([1.0, 1.1, 1.0], 0.05)


def test_figures_are_rounded_to_what_their_interval_resolves():
    assert round_to_ci(0.046096, (0.0459, 0.0463)) == 0.0461
    assert round_to_ci(12.3456, (12.0, 12.8)) == 12.3
    assert round_to_ci(0.046096, None) == 0.04610
    assert round_ci((0.04587, 0.04632)) == (0.0458, 0.0464)
    assert round_to_ci(0.33, (0.07, 5.0)) == 0.3  # an interval wider than the figure: one significant digit


def test_same_figure_is_overlapping_intervals():
    assert same_figure(1.00, (0.98, 1.02), 1.01, (0.99, 1.03))
    assert not same_figure(1.00, (0.98, 1.02), 1.10, (1.08, 1.12))
    assert same_figure(100.0, None, 104.0, None) and not same_figure(100.0, None, 110.0, None)


def _summary(
    p50: float,
    ci: tuple[float, float],
    rss: float = 80.0,
    joules: float | None = None,
    decode: float | None = None,
    sustained_p50: float | None = None,
) -> Benchmark:
    lat = LatencySummary(p50_ms=p50, p50_ci_ms=ci, p99_ms=p50 * 2, p99_ci_ms=(ci[0] * 2, ci[1] * 2))
    energy = (
        EnergySummary(available=True, source="rapl", joules_per_inference=joules, domains=["package-0"])
        if joules is not None
        else EnergySummary(available=False, reason="unavailable: rapl: no /sys/class/powercap")
    )
    steps = {}
    if decode is not None:
        steps = {
            "decode": LatencySummary(
                p50_ms=decode, p50_ci_ms=(decode * 0.98, decode * 1.02), p99_ms=decode * 2, p99_ci_ms=None
            )
        }
    sustained = None
    if sustained_p50 is not None:
        sustained = SustainedSummary(
            stopped="flat",
            seconds=60,
            p50_ms=sustained_p50,
            p99_ms=sustained_p50 * 2,
            latency_drift_pct=1.0,
            clock_drop_pct=None,
            temperature_rise_c=None,
        )
    return Benchmark(
        energy=energy,
        end_to_end_steps=steps,
        sustained=sustained,
        batch=1,
        concurrency=1,
        engine_only=lat,
        end_to_end=lat,
        throughput_per_s=1000 / p50,
        throughput_ci_per_s=(1000 / ci[1], 1000 / ci[0]),
        peak_rss_mb=rss,
        engine_load_mb=10.0,
    )


def test_benchmark_changes_name_what_moved():
    old = _summary(0.050, (0.049, 0.051))
    assert benchmark_changes(old, _summary(0.0505, (0.0495, 0.0515))) == []
    assert benchmark_changes(old, _summary(0.0501, (0.0495, 0.0515), rss=81.0)) == []  # memory within 2 MB
    moved = benchmark_changes(old, _summary(0.060, (0.059, 0.061), rss=120.0))
    assert any(m.startswith("engine_only.p50_ms 0.05 -> 0.06") for m in moved)
    assert any(m.startswith("peak_rss_mb") for m in moved)
    # energy has no interval: within 10% is the same figure; a meter that appears is a change
    assert (
        benchmark_changes(_summary(0.05, (0.049, 0.051), joules=1.0), _summary(0.05, (0.049, 0.051), joules=1.05)) == []
    )
    assert benchmark_changes(_summary(0.05, (0.049, 0.051), joules=1.0), _summary(0.05, (0.049, 0.051), joules=1.2))
    assert benchmark_changes(old, _summary(0.05, (0.049, 0.051), joules=1.0))
    # an end-to-end step moves by its interval; a sustained run by 10% of its equilibrium p50
    a, b = _summary(0.05, (0.049, 0.051), decode=0.1), _summary(0.05, (0.049, 0.051), decode=0.2)
    assert benchmark_changes(a, b) == ["end_to_end_steps.decode.p50_ms 0.1 -> 0.2"]
    s1, s2 = _summary(0.05, (0.049, 0.051), sustained_p50=1.0), _summary(0.05, (0.049, 0.051), sustained_p50=1.05)
    assert benchmark_changes(s1, s2) == [] and benchmark_changes(s1, _summary(0.05, (0.049, 0.051), sustained_p50=1.3))


def test_settle_keeps_the_previous_figures_only_when_nothing_else_changed():
    from pipeline.results.manifest import digest

    def doc(bm: Benchmark, precision: str = "fp32") -> dict:
        d = {"schema_version": 5, "precision": precision, "benchmark": bm.to_json()}
        d["digest"] = digest(d)
        return d

    old = doc(_summary(0.050, (0.049, 0.051)))
    old["provenance"] = {"created": "then"}
    within = doc(_summary(0.0502, (0.0496, 0.0508)))
    kept = settle(within, old)  # the document as it was (write_manifest keeps its provenance: same digest)
    assert kept == {k: v for k, v in old.items() if k != "provenance"} and kept["digest"] == old["digest"]
    assert settle(doc(_summary(0.060, (0.059, 0.061))), old)["benchmark"]["engine_only"]["p50_ms"] == 0.06
    other = doc(_summary(0.0502, (0.0496, 0.0508)), precision="fp16")
    assert settle(other, old) is other  # a changed engine: its own figures
    assert settle(within, None) is within and settle(within, {"schema_version": 4}) is within


# --- the stages ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_method")
    models.conv_bn_model(root / "models/conv/model.onnx")
    sweep = {"batch": [1, 2], "concurrency": [1, 2], "seconds": 0.1}
    # noise_floor: reruns on this shared test machine vary by tens of percent (other test workers)
    skus = {
        "cpu": models.ort_sku(
            "fp32",
            bench={
                "warmup": 5,
                "steady_window": 20,
                "max_warmup_seconds": 2.0,
                "iterations": 400,
                "min_seconds": 0.3,
                "noise_floor": 0.5,
                "roofline": True,  # layer profiling and this host's (seeded) peaks: tests/conftest.py
            },
        ),
        "swept": models.ort_sku(
            "fp32",
            shapes={},
            profiles={"batch": {"min": 1, "opt": 1, "max": 4}},
            bench={"warmup": 2, "steady_window": 5, "max_warmup_seconds": 0.5, "iterations": 20, "sweep": sweep},
        ),
        "badsweep": models.ort_sku("fp32", bench={"warmup": 2, "iterations": 5, "sweep": {"batch": [8]}}),
        "int8": models.ort_sku("int8", bench={"warmup": 2, "steady_window": 5, "iterations": 20, "roofline": True}),
    }
    reg = load_registry(models.write_project(root, {"conv": models.conv_bn_spec()}, skus))
    for stage in (prepare, make_data, reference, calibrate):
        stage(reg, "conv")
    for name in skus:
        build(reg.pair("conv", name))
        validate(reg.pair("conv", name))
    return reg


def test_bench_report_records_method_and_writes_the_timeline(proj):
    rep = bench(proj.pair("conv", "cpu"))
    out = Layout(proj.root)
    assert rep.steady_state.warmup_iterations >= 5 and rep.stopped == "iterations"
    assert rep.engine_only.p50_ci_ms[0] <= rep.engine_only.p50_ms <= rep.engine_only.p50_ci_ms[1]
    assert rep.drift is not None and rep.drift.window == rep.steady_state.window
    assert (
        rep.execution.usable_cores >= 1
        and rep.execution.affinity
        and "intra_op_num_threads" in rep.execution.engine_threads
    )
    lines = out.timeline_csv("conv", "cpu").read_text().splitlines()
    assert lines[0] == "iteration,phase,latency_ms"
    phases = [line.split(",")[1] for line in lines[1:]]
    assert (
        phases.count("warmup") == rep.steady_state.warmup_iterations
        and phases.count("steady") == rep.engine_only.iterations
    )
    assert phases == sorted(phases, key=lambda p: p != "warmup")  # warm-up first
    roof = read_json(out.roofline("conv", "cpu"))  # the roofline: costs from the graph, peaks of this host
    # the fraction is not bounded by 1 here: peaks measured beside other test workers can be low
    assert rep.roofline_fraction == roof["compute_fraction"] > 0
    assert roof["flops"] > 0 and roof["peak_gflops"] > 0 and roof["profiled_ms"] > 0
    assert {layer["op"] for layer in roof["layers"]} >= {"Conv"}
    assert roof["precision"] == "fp32" and roof["peak_kind"] == "fp32" and roof["int8_share_of_ops"] == 0


def test_an_int8_engine_is_judged_against_the_int8_peak(proj):
    rep = bench(proj.pair("conv", "int8"))
    roof = read_json(Layout(proj.root).roofline("conv", "int8"))
    # the seeded peaks (tests/conftest.py): FP32 100 GFLOP/s, INT8 300 GOP/s; layers build.json says
    # stayed float (where the engine's layer names join the graph's nodes) are judged at FP32
    assert roof["precision"] == "int8" and roof["peak_kind"] in ("int8", "mixed") and roof["int8_share_of_ops"] > 0
    assert 100 < roof["peak_gflops"] <= 300 and "the INT8 peak (300 GOP/s" in roof["peak_basis"]
    assert rep.roofline_fraction == roof["compute_fraction"]
    assert roof["compute_fraction"] == pytest.approx(roof["achieved_gflops"] / roof["peak_gflops"])
    assert {"int8_all_cores", "int8_one_core"} <= set(roof["ceilings_gflops"])


def test_sweep_gives_a_point_per_batch_and_concurrency(proj):
    rep = bench(proj.pair("conv", "swept"))
    assert [(p.batch, p.concurrency) for p in rep.sweep] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(p.iterations > 0 and p.throughput_per_s > 0 and p.p50_ms <= p.p99_ms for p in rep.sweep)


def test_a_sweep_outside_the_engine_shapes_is_refused_before_timing(proj):
    from pipeline.core.errors import ConfigError

    with pytest.raises(ConfigError, match="built for batch 1, not 8") as err:
        bench(proj.pair("conv", "badsweep"))
    assert err.value.exit_code == 2 and "profiles" in err.value.hint
    assert not Layout(proj.root).report("conv", "badsweep", "bench").exists()


def test_a_rebuilt_unchanged_engine_leaves_the_manifest_byte_identical(proj):
    """Build, validate, bench and describe the pair twice. Everything but the benchmark must be
    identical by construction; the benchmark figures are kept when the rerun lies within their
    intervals, which is what a quiet runner gives (on a busy one the moved figures are named).
    bench and manifest run as the pipeline runs them, one process each: memory is per process."""
    from cli_helpers import skuforge

    out = Layout(proj.root)
    path = out.manifest("conv", "cpu")

    def bench_and_describe() -> bytes:
        for stage in ("bench", "manifest"):
            done = skuforge(stage, "--model", "conv", "--sku", "cpu", cwd=proj.root)
            assert done.returncode == 0, done.stderr
        return path.read_bytes()

    first = bench_and_describe()
    engine = read_json(out.report("conv", "cpu", "build"))["engine_sha256"]
    build(proj.pair("conv", "cpu"))
    assert read_json(out.report("conv", "cpu", "build"))["engine_sha256"] == engine
    validate(proj.pair("conv", "cpu"))
    for _ in range(3):  # a stall from another test worker can move a p99: give the runner three chances
        path.write_bytes(first)
        second = bench_and_describe()
        if second == first:
            break
    if first != second:
        import json

        a, b = json.loads(first), json.loads(second)
        moved = benchmark_changes(Benchmark.model_validate(a["benchmark"]), Benchmark.model_validate(b["benchmark"]))
        assert moved, "the manifest changed although no figure moved beyond its interval"
        same = {k: v for k, v in a.items() if k not in ("benchmark", "digest", "provenance")}
        assert same == {k: v for k, v in b.items() if k not in ("benchmark", "digest", "provenance")}
        pytest.xfail(f"the runner was too busy for a stable rerun: {moved}")
