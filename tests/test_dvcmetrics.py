"""The git-tracked files `dvc metrics` / `dvc plots` read (DVC itself: tests/integration/test_dvc_metrics.py)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from pipeline.results import dvcmetrics
from pipeline.results.dvcmetrics import BENCH, COMPARE, LATENCY_CDF, SWEEP, TIMELINE, pair_file


def _rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


class _Point:
    batch, concurrency, p50_ms, p99_ms, throughput_per_s = 1, 2, 0.123456, 0.5, 16000.123


def _manifest(sku: str, p50: float) -> dict:
    return {
        "model": "m",
        "sku": sku,
        "benchmark": {
            "batch": 1,
            "concurrency": 1,
            "throughput_per_s": 9000.0,
            "throughput_ci_per_s": None,
            "engine_only": {"p50_ms": p50, "p50_ci_ms": [p50 * 0.5, p50 * 2], "p99_ms": 0.9, "p99_ci_ms": None},
        },
    }


def _bench(tmp_path: Path, scale: float) -> tuple[Path, Path]:
    tmp_path.mkdir()
    latency, timeline = tmp_path / "latency.csv", tmp_path / "timeline.csv"
    latency.write_text("iteration,latency_ms\n" + "".join(f"{i},{scale * (1 + i % 7):.4f}\n" for i in range(300)))
    timeline.write_text(
        "iteration,phase,latency_ms\n"
        + "".join(f"{i},{'warmup' if i < 10 else 'steady'},{scale * 2:.4f}\n" for i in range(310))
    )
    return latency, timeline


def test_bench_metrics_keep_numbers_and_name_interval_bounds():
    figures = dvcmetrics.bench_metrics(_manifest("s", 0.1)["benchmark"])
    assert figures["engine_only"] == {"p50_ms": 0.1, "p50_ci_ms": {"lo": 0.05, "hi": 0.2}, "p99_ms": 0.9}
    assert "throughput_ci_per_s" not in figures  # DVC shows no nulls


def test_latency_cdf_is_101_rounded_quantiles_from_min_to_max():
    rows = _rows(dvcmetrics.latency_cdf([0.123456789 * (1 + i) for i in range(1000)]))
    assert len(rows) == 101 and rows[0]["quantile"] == "0.00" and rows[-1]["quantile"] == "1.00"
    assert float(rows[0]["latency_ms"]) == 0.1235 and float(rows[-1]["latency_ms"]) == 123.5
    values = [float(r["latency_ms"]) for r in rows]
    assert values == sorted(values)


def test_timeline_bins_each_phase_apart_and_keeps_a_short_warmup():
    rows = [
        {"iteration": str(i), "phase": "warmup" if i < 50 else "steady", "latency_ms": str(1 + i)}
        for i in range(10_050)
    ]
    out = _rows(dvcmetrics.timeline(rows))
    assert len(out) <= dvcmetrics.TIMELINE_POINTS
    assert [r["iteration"] for r in out[:50]] == [str(i) for i in range(50)]
    assert out[50]["iteration"] == "50" and {r["phase"] for r in out[50:]} == {"steady"}


def test_write_metrics_writes_the_pair_and_the_models_comparison(tmp_path):
    latency, timeline = _bench(tmp_path / "a", 0.1)
    written = dvcmetrics.write_metrics(tmp_path, _manifest("s1", 0.1), latency, timeline, [_Point()])
    assert set(written) == {pair_file(tmp_path, k, "m", "s1") for k in (BENCH, LATENCY_CDF, TIMELINE, SWEEP)} | {
        tmp_path / "metrics" / COMPARE / "m.csv"
    } | {dvcmetrics.grouped_file(tmp_path, k, "m") for k in (LATENCY_CDF, TIMELINE, SWEEP)}
    assert _rows(pair_file(tmp_path, SWEEP, "m", "s1").read_text()) == [
        {"batch": "1", "concurrency": "2", "p50_ms": "0.1235", "p99_ms": "0.5", "throughput_per_s": "16000.0"}
    ]
    dvcmetrics.write_metrics(tmp_path, _manifest("s2", 0.2), latency, timeline)
    assert _rows((tmp_path / "metrics" / COMPARE / "m.csv").read_text()) == [
        {"sku": "s1", "p50_ms": "0.1", "p99_ms": "0.9", "throughput_per_s": "9000.0"},
        {"sku": "s2", "p50_ms": "0.2", "p99_ms": "0.9", "throughput_per_s": "9000.0"},
    ]


def test_a_rerun_the_manifest_settled_leaves_the_files_as_they_were(tmp_path):
    first, second = _bench(tmp_path / "a", 0.1), _bench(tmp_path / "b", 0.3)
    dvcmetrics.write_metrics(tmp_path, _manifest("s", 0.1), *first, [_Point()])
    cdf = pair_file(tmp_path, LATENCY_CDF, "m", "s").read_text()
    # same figures (the manifest kept them), other samples and no sweep this time
    assert dvcmetrics.write_metrics(tmp_path, _manifest("s", 0.1), *second) == []
    assert pair_file(tmp_path, LATENCY_CDF, "m", "s").read_text() == cdf
    assert not pair_file(tmp_path, SWEEP, "m", "s").exists()
    # figures that moved: every file follows the new run
    written = dvcmetrics.write_metrics(tmp_path, _manifest("s", 0.3), *second)
    assert pair_file(tmp_path, LATENCY_CDF, "m", "s") in written
    assert pair_file(tmp_path, LATENCY_CDF, "m", "s").read_text() != cdf
    assert json.loads(pair_file(tmp_path, BENCH, "m", "s").read_text())["engine_only"]["p50_ms"] == 0.3


def test_grouped_tables_hold_every_sku_of_the_model_in_one_file(tmp_path):
    """What `dvc plots show` draws: one file per model and kind with a sku column (one plot per model,
    a line per SKU), kept in step with the per-pair files."""
    dvcmetrics.write_metrics(tmp_path, _manifest("s1", 0.1), *_bench(tmp_path / "a", 0.1), [_Point()])
    dvcmetrics.write_metrics(tmp_path, _manifest("s2", 0.2), *_bench(tmp_path / "b", 0.2))
    cdf = _rows(dvcmetrics.grouped_file(tmp_path, LATENCY_CDF, "m").read_text())
    assert [r["sku"] for r in cdf] == ["s1"] * 101 + ["s2"] * 101
    assert set(cdf[0]) == {"sku", "quantile", "latency_ms"}
    assert cdf[:101] == [{"sku": "s1", **r} for r in _rows(pair_file(tmp_path, LATENCY_CDF, "m", "s1").read_text())]
    sweep = _rows(dvcmetrics.grouped_file(tmp_path, SWEEP, "m").read_text())
    assert [r["sku"] for r in sweep] == ["s1"]  # s2 does not sweep
    for kind in (LATENCY_CDF, TIMELINE, SWEEP):  # DVC fails on a plots folder that does not exist
        assert (dvcmetrics.grouped_file(tmp_path, kind, "m").parent / ".gitkeep").is_file()
    # a file of an older header is left out of the grouped table rather than mixed in
    pair_file(tmp_path, TIMELINE, "m", "s2").write_text("call,ms\n0,1.0\n")
    assert dvcmetrics.grouped_file(tmp_path, TIMELINE, "m") in dvcmetrics.write_model_tables(tmp_path, "m")
    assert {r["sku"] for r in _rows(dvcmetrics.grouped_file(tmp_path, TIMELINE, "m").read_text())} == {"s1"}
    # the last SKU with a sweep is rerun without one: its grouped file goes too
    dvcmetrics.write_metrics(tmp_path, _manifest("s1", 0.3), *_bench(tmp_path / "c", 0.3))
    assert not dvcmetrics.grouped_file(tmp_path, SWEEP, "m").exists()
    assert dvcmetrics.write_model_tables(tmp_path, "m") == []
