"""The remedy (``skuforge bisect --fix``, ``pipeline.verify.remedy.fix``) on a recognizer-like and
a classifier-like fixture whose all-INT8 engine fails the task gate (tests/exporter_models.py,
``OUTLIER_FIXTURES``: a dead channel of conv2 with a bias of ``--outlier`` that the next conv reads
none of), on ONNX Runtime INT8, OpenVINO INT8 and LiteRT INT8, one temporary project per fixture.
Per fixture and SKU: build and validate as configured (the verdict before), run the fix, apply its
nodes to params.yaml, build and validate again (the verdict after, the build stage's own engine).
One table:

- before, after: the gated task statistic (CER of the ctc_greedy strings, top-1 agreement of the
  topk labels) with its one-sided bounds and n, and the verdict;
- builds: the engine builds the fix spent (its anchor included), and its wall time;
- kept: the nodes the fix keeps in higher precision;
- x INT8, x FP32: the fixed engine's engine-only p50 over the all-INT8 engine's
  (``Remedy.latency_ratio``) and over the prepared model's on ONNX Runtime CPU FP32
  (``Remedy.fp32_latency_ratio``), timed interleaved in one process by the fix; INT8 x FP32: the
  all-INT8 engine's over FP32 (what the low precision gained before the fix).

A fix that ends failing is listed under the table with its summary (what it kept, what it learnt).

    python benchmarks/remedy_backends.py [--fixtures crnn_outlier] [--skus ort_int8,ov_int8] [--outlier 1e4]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import exporter_models  # noqa: E402
import models  # noqa: E402

from pipeline.core.errors import GateFailed, SkuforgeError  # noqa: E402
from pipeline.core.paths import Layout  # noqa: E402
from pipeline.project.artifacts import read_report  # noqa: E402
from pipeline.project.config import Registry, load_registry  # noqa: E402
from pipeline.results.reports import Remedy, TaskAgreement, ValidationReport  # noqa: E402
from pipeline.stages.build import build  # noqa: E402
from pipeline.stages.calibrate import calibrate  # noqa: E402
from pipeline.stages.data import make_data  # noqa: E402
from pipeline.stages.prepare import prepare  # noqa: E402
from pipeline.stages.reference import reference  # noqa: E402
from pipeline.stages.validate import validate  # noqa: E402
from pipeline.verify.remedy import apply_overrides, fix  # noqa: E402

# validate states the verdict; the fix bisects
SKUS = {
    "ort_int8": models.CPU_SKUS["ort_int8"] | {"bisect": {"on_failure": False}},
    "ov_int8": models.CPU_SKUS["ov_int8"] | {"bisect": {"on_failure": False}},
    "litert_int8": exporter_models.LITERT_INT8 | {"bisect": {"on_failure": False}},
}


def _stat(passed: bool, t: TaskAgreement | None) -> str:
    if t is None or t.value is None:
        return "-"
    interval = f" [{t.interval[0]:.2%}, {t.interval[1]:.2%}]" if t.interval else ""
    return f"{'pass' if passed else 'FAIL'}: {t.statistic} {t.value:.2%}{interval} n={t.units}"


def _verdict(registry: Registry, model: str, sku: str) -> tuple[bool, TaskAgreement | None]:
    """Build and validate as params.yaml says: whether the gate passed, and the gated task statistic."""
    build(registry.pair(model, sku))
    with contextlib.suppress(GateFailed):  # the report is written either way
        validate(registry.pair(model, sku))
    report = read_report(Layout(registry.root).report(model, sku, "validate"), ValidationReport, "validate")
    gated = [t for t in report.task if t.threshold is not None]
    return report.passed, gated[0] if gated else None


def _one(root: Path, name: str, sku: str) -> dict:
    params = root / "params.yaml"
    row: dict = {"fixture": name, "sku": sku}
    try:
        row["before"] = _verdict(load_registry(params), name, sku)
    except SkuforgeError as exc:  # a backend this host cannot build: say which and why
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        return row
    started = time.perf_counter()
    remedy: Remedy = fix(load_registry(params).pair(name, sku))
    row["seconds"] = time.perf_counter() - started
    row["remedy"] = remedy
    if remedy.passed:
        apply_overrides(params, name, sku, remedy.keep_precise)
        row["after"] = _verdict(load_registry(params), name, sku)
    return row


def run(fixtures: list[str], skus: list[str], outlier: float, root: Path) -> list[dict]:
    rows = []
    for name in fixtures:
        builder, spec = exporter_models.OUTLIER_FIXTURES[name]
        proj = root / name
        builder(proj / "m" / "model.onnx", outlier=outlier)
        registry = load_registry(models.write_project(proj, {name: spec("m")}, {s: SKUS[s] for s in skus}))
        for stage in (prepare, make_data, reference, calibrate):
            stage(registry, name)
        for sku in skus:
            rows.append(_one(proj, name, sku))
            print(f"{name} {sku} done", file=sys.stderr, flush=True)
    return rows


def render(rows: list[dict]) -> str:
    head = "| fixture | SKU | before | after | builds | kept in higher precision | x INT8 | x FP32 | INT8 x FP32 |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    notes = []
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['fixture']} | {row['sku']} | {row['error']} |" + " |" * 7)
            continue
        r: Remedy = row["remedy"]
        after = _stat(*row["after"]) if "after" in row else "FAIL (not fixed)"
        ratio = f"{r.latency_ratio:.2f}" if r.latency_ratio else "-"
        fp32 = f"{r.fp32_latency_ratio:.2f}" if r.fp32_latency_ratio else "-"
        gain = f"{r.before.p50_ms / r.fp32_p50_ms:.2f}" if r.before.p50_ms and r.fp32_p50_ms else "-"
        lines.append(
            f"| {row['fixture']} | {row['sku']} | {_stat(*row['before'])} | {after} | "
            f"{r.builds} ({row['seconds']:.0f} s) | {', '.join(r.keep_precise) or '-'} | {ratio} | {fp32} | {gain} |"
        )
        if not r.passed:
            notes.append(f"- {row['fixture']} / {row['sku']}: {r.summary}")
    return "\n".join([*lines, "", *notes])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", default=",".join(exporter_models.OUTLIER_FIXTURES))
    parser.add_argument("--skus", default=",".join(SKUS))
    parser.add_argument("--outlier", type=float, default=1e4, help="the dead channel's bias")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="remedy-backends-") as tmp:
        rows = run(args.fixtures.split(","), args.skus.split(","), args.outlier, Path(tmp))
    print(render(rows))
    return 0 if all(row.get("after", (False,))[0] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
