"""What `dvc metrics` and `dvc plots` read: small git-tracked files per built (model, SKU).

dvc.yaml's top-level ``metrics:`` and ``plots:`` sections name the folders below, never a pair's
file: a folder holds the pairs built somewhere (this runner or another one that committed its
results) and nothing for the others, so `dvc metrics show` and `dvc plots show` list no SKU that
was never built, and `dvc metrics diff` / `dvc plots diff <rev>` read both revisions from git
without DVC's cache (build/ is DVC-cached and absent on a fresh runner).

    metrics/bench/<model>/<sku>.json        the manifest's benchmark figures (rounded to their intervals)
    metrics/latency_cdf/<model>/<sku>.csv   quantile,latency_ms: 101 quantiles of the engine-only samples
    metrics/timeline/<model>/<sku>.csv      iteration,phase,latency_ms: warm-up and steady calls, at most 200 rows
    metrics/sweep/<model>/<sku>.csv         batch,concurrency,p50_ms,p99_ms,throughput_per_s (when swept)
    metrics/compare/<model>.csv             sku,p50_ms,p99_ms,throughput_per_s: every built SKU of the model
    metrics/by_sku/<kind>/<model>.csv       the model's latency_cdf, timeline or sweep files in one table
                                            with a leading sku column: what `dvc plots show` draws, one
                                            plot per model with a line (or colour) per SKU

Each folder keeps a ``.gitkeep`` (ignored by DVC through .dvcignore): DVC fails on a plots or
metrics folder that does not exist. The figures follow the manifest: when the manifest keeps its
reviewed figures (a rerun within the intervals) the plot files are left as they were too, so a
rerun of an unchanged engine leaves no diff.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pipeline.core.io import atomic_write_bytes, atomic_write_json, to_json

log = logging.getLogger(__name__)

ROOT = "metrics"
BENCH, LATENCY_CDF, TIMELINE, SWEEP, COMPARE = "bench", "latency_cdf", "timeline", "sweep", "compare"
FOLDERS: tuple[str, ...] = (BENCH, LATENCY_CDF, TIMELINE, SWEEP, COMPARE)
BY_SKU = "by_sku"  # metrics/by_sku/<kind>/<model>.csv: the per-pair files of one kind, one table per model
GROUPED: tuple[str, ...] = (LATENCY_CDF, TIMELINE, SWEEP)
QUANTILES = 101
TIMELINE_POINTS = 200
DIGITS = 4  # significant digits of a plotted latency: below what two runs of one engine tell apart
SWEEP_COLUMNS = ("batch", "concurrency", "p50_ms", "p99_ms", "throughput_per_s")
COMPARE_COLUMNS = ("sku", "p50_ms", "p99_ms", "throughput_per_s")


class SweepPoint(Protocol):  # pipeline.results.SweepPoint, or anything with its figures
    batch: int
    concurrency: int
    p50_ms: float
    p99_ms: float
    throughput_per_s: float


def folder(root: str | Path, kind: str) -> Path:
    return Path(root) / ROOT / kind


def pair_file(root: str | Path, kind: str, model: str, sku: str) -> Path:
    return folder(root, kind) / model / f"{sku}.{'json' if kind == BENCH else 'csv'}"


def _sig(value: float, digits: int = DIGITS) -> float:
    return float(f"{value:.{digits}g}") if math.isfinite(value) else value


def bench_metrics(benchmark: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's ``benchmark`` section as DVC reads metrics: nested numbers only (an interval
    ``[lo, hi]`` becomes ``{"lo": .., "hi": ..}``; DVC drops lists and nulls)."""
    out: dict[str, Any] = {}
    for key, value in benchmark.items():
        if isinstance(value, Mapping):
            value = bench_metrics(value)
        elif isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value):
            value = {"lo": value[0], "hi": value[1]}
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if value != {}:
            out[key] = value
    return out


def _csv(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue()


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def latency_cdf(samples_ms: Sequence[float], points: int = QUANTILES) -> str:
    """``quantile,latency_ms``: the samples' distribution at ``points`` evenly spaced quantiles
    (linear interpolation, as the report's percentiles); empty samples give the header only."""
    import numpy as np

    rows: list[tuple[str, float]] = []
    if len(samples_ms):
        qs = np.linspace(0.0, 1.0, points)
        values = np.quantile(np.asarray(samples_ms, dtype=np.float64), qs)
        rows = [(f"{q:.2f}", _sig(float(v))) for q, v in zip(qs, values, strict=True)]
    return _csv(("quantile", "latency_ms"), rows)


def timeline(rows: Sequence[Mapping[str, str]], points: int = TIMELINE_POINTS) -> str:
    """``iteration,phase,latency_ms`` in at most ``points`` rows, half per phase: consecutive calls of
    one phase binned, each bin its first iteration and median latency (a short warm-up stays whole)."""
    import numpy as np

    counts: dict[str, int] = {}
    for r in rows:
        counts[r["phase"]] = counts.get(r["phase"], 0) + 1
    out, start = [], 0
    while start < len(rows):
        phase = rows[start]["phase"]
        size, end = max(1, math.ceil(counts[phase] / max(1, points // len(counts)))), start
        while end < len(rows) and end - start < size and rows[end]["phase"] == phase:
            end += 1
        median = float(np.median([float(r["latency_ms"]) for r in rows[start:end]]))
        out.append((rows[start]["iteration"], phase, _sig(median)))
        start = end
    return _csv(("iteration", "phase", "latency_ms"), out)


def sweep_table(points: Iterable[SweepPoint]) -> str:
    return _csv(
        SWEEP_COLUMNS,
        (
            (p.batch, p.concurrency, _sig(p.p50_ms), _sig(p.p99_ms), _sig(p.throughput_per_s))
            for p in sorted(points, key=lambda p: (p.batch, p.concurrency))
        ),
    )


def comparison(root: str | Path, model: str) -> str:
    """``sku,p50_ms,p99_ms,throughput_per_s`` (engine-only) of every SKU with a bench summary of ``model``."""
    rows = []
    for path in sorted((folder(root, BENCH) / model).glob("*.json")):
        fig = json.loads(path.read_text(encoding="utf-8"))
        engine = fig.get("engine_only", {})
        rows.append((path.stem, engine.get("p50_ms", ""), engine.get("p99_ms", ""), fig.get("throughput_per_s", "")))
    return _csv(COMPARE_COLUMNS, rows)


def write_comparison(root: str | Path, model: str) -> Path | None:
    """Rewrite ``metrics/compare/<model>.csv`` from the model's bench summaries (also what resolves a
    merge conflict in it); the path when its content changed, else None."""
    path = folder(root, COMPARE) / f"{model}.csv"
    table = comparison(root, model)
    if path.is_file() and path.read_text(encoding="utf-8") == table:
        return None
    return atomic_write_bytes(path, table.encode())


def by_sku(root: str | Path, kind: str, model: str) -> str | None:
    """The model's per-pair ``kind`` files as one CSV with a leading ``sku`` column (a file of another
    header, an older format, is left out); None when no SKU of the model has one."""
    header: list[str] | None = None
    rows: list[list[str]] = []
    for path in sorted((folder(root, kind) / model).glob("*.csv")):
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.reader(fh)
            head = next(reader, None)
            if head is None or (header is not None and head != header):
                log.warning("%s: not the header of the other %s files, left out of the grouped plot", path, kind)
                continue
            header = head
            rows += [[path.stem, *row] for row in reader]
    return None if header is None else _csv(("sku", *header), rows)


def grouped_file(root: str | Path, kind: str, model: str) -> Path:
    return folder(root, BY_SKU) / kind / f"{model}.csv"


def write_model_tables(root: str | Path, model: str) -> list[Path]:
    """Rewrite the files every SKU of ``model`` shares (``metrics/compare/<model>.csv`` and
    ``metrics/by_sku/*/<model>.csv``) from the per-pair files (also what resolves a merge conflict
    in them); the files whose content changed (a grouped file no SKU feeds any more is removed)."""
    written = [p for p in (write_comparison(root, model),) if p is not None]
    for kind in GROUPED:
        path, table = grouped_file(root, kind, model), by_sku(root, kind, model)
        keep = path.parent / ".gitkeep"  # DVC fails to load a plots folder that does not exist
        if not keep.is_file():
            atomic_write_bytes(keep, b"")
        if table is None:
            path.unlink(missing_ok=True)  # as the pair files no longer produced: removed, not listed
        elif not (path.is_file() and path.read_text(encoding="utf-8") == table):
            written.append(atomic_write_bytes(path, table.encode()))
    return written


def write_metrics(
    root: str | Path,
    manifest: Mapping[str, Any],
    latency_csv: str | Path,
    timeline_csv: str | Path | None = None,
    sweep: Sequence[SweepPoint] = (),
) -> list[Path]:
    """Write one pair's files under ``<root>/metrics/`` from its manifest document (as written) and
    the bench stage's ``latency.csv`` / ``timeline.csv`` and sweep points; refresh the model's
    comparison. Returns the files written.

    The plot files are rewritten only when the figures changed or one is missing, so they describe
    the run whose figures the manifest carries (a rerun the manifest settled leaves them as they were)."""
    model, sku = manifest["model"], manifest["sku"]
    figures = bench_metrics(manifest["benchmark"])
    summary = pair_file(root, BENCH, model, sku)
    wanted: dict[str, Callable[[], str]] = {
        LATENCY_CDF: lambda: latency_cdf([float(r["latency_ms"]) for r in _read_csv(Path(latency_csv))])
    }
    if timeline_csv is not None and Path(timeline_csv).is_file():
        wanted[TIMELINE] = lambda: timeline(_read_csv(Path(timeline_csv)))
    if sweep:
        wanted[SWEEP] = lambda: sweep_table(sweep)
    written: list[Path] = []
    for kind in {TIMELINE, SWEEP} - wanted.keys():  # no longer produced (a sweep taken out of the registry)
        pair_file(root, kind, model, sku).unlink(missing_ok=True)
    same = summary.is_file() and summary.read_text(encoding="utf-8") == to_json(figures)
    if not (same and all(pair_file(root, kind, model, sku).is_file() for kind in wanted)):
        written += [
            atomic_write_bytes(pair_file(root, kind, model, sku), make().encode()) for kind, make in wanted.items()
        ]
    if not same:
        written.append(atomic_write_json(summary, figures))
    written += write_model_tables(root, model)
    log.info(
        "%s/%s: dvc metrics and plots data %s",
        model,
        sku,
        ", ".join(str(p.relative_to(root)) for p in written) if written else "unchanged",
    )
    return written
