"""Verdicts in the device app's terms on the exporter-style fixtures (tests/exporter_models.py):
each fixture built for the CPU SKU kinds ONNX Runtime INT8, OpenVINO INT8 and LiteRT INT8, with
ONNX Runtime FP32 as the baseline, in one temporary project per fixture, validated and benchmarked
in one run, side by side. One table:

- verdict: passed, gate failed, or unsupported (the op the backend refused);
- task: the gated statistic of the declared postprocess (docs/correctness.md, "Task agreement")
  with its interval and n, "decides" when its sets resolve the threshold, "too few" when the tensor
  gates decide in its place; "-" for a model without a postprocess;
- tensor: the tensor gates' verdict as it would have been (their failure lines: diagnostics where
  the task decided);
- p50: the engine-only median latency at batch 1, and its ratio to the FP32 engine's, measured in
  the same run.

A failed gate starts no bisection here (the verdict is the figure, not its diagnosis).

    python benchmarks/task_verdicts.py [--fixtures dbnet,crnn] [--skus ort_int8,ov_int8] [--iterations 200]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import exporter_models  # noqa: E402
import models  # noqa: E402

from pipeline.core.errors import GateFailed, SkuforgeError, UnsupportedOp  # noqa: E402
from pipeline.core.paths import Layout  # noqa: E402
from pipeline.project.artifacts import read_report  # noqa: E402
from pipeline.project.config import load_registry  # noqa: E402
from pipeline.results.reports import ValidationReport  # noqa: E402
from pipeline.stages.bench import bench  # noqa: E402
from pipeline.stages.build import build  # noqa: E402
from pipeline.stages.calibrate import calibrate  # noqa: E402
from pipeline.stages.data import make_data  # noqa: E402
from pipeline.stages.prepare import prepare  # noqa: E402
from pipeline.stages.reference import reference  # noqa: E402
from pipeline.stages.validate import validate  # noqa: E402
from pipeline.verify.compare import output_problems  # noqa: E402

SKUS = {
    "ort_fp32": models.CPU_SKUS["ort_fp32"],
    "ort_int8": models.CPU_SKUS["ort_int8"],
    "ov_int8": models.CPU_SKUS["ov_int8"],
    "litert_int8": exporter_models.LITERT_INT8,
}
BASELINE = "ort_fp32"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def _task(report: ValidationReport | None) -> str:
    """The gated statistic: value, interval, n, and whether it decided."""
    if report is None:
        return "-"
    gated = [t for t in report.task if t.threshold is not None]
    if not gated:
        return "-"
    t = gated[0]
    interval = f" [{_pct(t.interval[0])}, {_pct(t.interval[1])}]" if t.interval else ""
    unit = {"cer": "chars", "box_f1": "boxes"}.get(t.statistic, "samples")
    side = ">=" if t.direction == "min" else "<="
    how = "decides" if t.judgeable else f"too few (needs {t.needed_units})"
    return f"{t.statistic} {_pct(t.value)}{interval} n={t.units} {unit}, {side} {_pct(t.threshold)}: {how}"


def _tensor(report: ValidationReport | None) -> str:
    if report is None:
        return "-"
    lines = sum(len(output_problems(e)) for e in report.outputs)
    gating = any(e.gating for e in report.outputs)
    verdict = "passed" if not lines else f"failed ({lines} lines)"
    return verdict + ("" if gating else " [diagnostic]")


def run(fixtures: list[str], skus: list[str], iterations: int, root: Path) -> list[dict]:
    bench_settings = {"warmup": 20, "steady_window": 20, "iterations": iterations, "max_seconds": 20.0}
    # no bisection on a failed gate: the verdict is the figure here, not its diagnosis
    sku_specs = {
        s: SKUS[s] | {"bench": SKUS[s]["bench"] | bench_settings, "bisect": {"on_failure": False}}
        for s in [BASELINE, *skus]
    }
    rows = []
    for name in fixtures:
        builder, spec = exporter_models.FIXTURES[name]
        proj = root / name
        builder(proj / "m" / "model.onnx")
        registry = load_registry(models.write_project(proj, {name: spec("m")}, sku_specs))
        for stage in (prepare, make_data, reference, calibrate):
            stage(registry, name)
        fp32_p50 = None
        for sku in sku_specs:
            row = {"fixture": name, "sku": sku, "report": None, "p50": None}
            started = time.perf_counter()
            try:
                build(registry.pair(name, sku))
            except UnsupportedOp as exc:
                row["verdict"] = f"unsupported: {exc.op_type}"
                rows.append(row)
                continue
            try:
                validate(registry.pair(name, sku))
                row["verdict"] = "passed"
            except GateFailed:
                row["verdict"] = "gate failed"
            except SkuforgeError as exc:
                row["verdict"] = f"not judged: {type(exc).__name__}"
            path = Layout(registry.root).report(name, sku, "validate")
            if path.is_file():
                row["report"] = read_report(path, ValidationReport, "validate")
            row["p50"] = bench(registry.pair(name, sku)).engine_only.p50_ms
            row["seconds"] = time.perf_counter() - started
            if sku == BASELINE:
                fp32_p50 = row["p50"]
            row["ratio"] = row["p50"] / fp32_p50 if fp32_p50 else None
            rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    header = ["fixture", "SKU", "verdict", "gated task statistic (interval, n)", "tensor gates", "p50 ms", "vs fp32"]
    table = [
        [
            r["fixture"],
            r["sku"],
            r["verdict"],
            _task(r["report"]),
            _tensor(r["report"]),
            "-" if r["p50"] is None else f"{r['p50']:.3f}",
            "-" if r.get("ratio") is None else f"{r['ratio']:.2f}x",
        ]
        for r in rows
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *table, strict=True)]
    lines = [" | ".join(f"{c:<{w}}" for c, w in zip(header, widths, strict=True))]
    lines.append("-|-".join("-" * w for w in widths))
    lines += [" | ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=True)) for row in table]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixtures", default=",".join(exporter_models.FIXTURES))
    ap.add_argument("--skus", default=",".join(s for s in SKUS if s != BASELINE))
    ap.add_argument("--iterations", type=int, default=200, help="timed engine-only calls per engine")
    ap.add_argument("--keep", type=Path, help="build the projects here (kept) instead of a temporary folder")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    unknown = sorted(set(args.skus.split(",")) - set(SKUS))
    if unknown:
        ap.error(f"unknown SKUs {unknown}; known: {sorted(SKUS)}")
    with tempfile.TemporaryDirectory(prefix="task-verdicts-") as tmp:
        root = args.keep or Path(tmp)
        rows = run(args.fixtures.split(","), [s for s in args.skus.split(",") if s != BASELINE], args.iterations, root)
    print(render(rows))


if __name__ == "__main__":
    main()
