"""The cross-SKU page of a model: its pairs side by side, the charts, the selection per device class
and the consistency matrix."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError, SkuforgeError
from pipeline.core.paths import Layout
from pipeline.project.config import KnownGap, Registry
from pipeline.report import plots
from pipeline.report.common import Images, as_dict, as_interval, as_list, as_number, chart, engine_bytes, safe_name
from pipeline.report.load import PairData, read_optional
from pipeline.report.pair import drift_view, energy_view
from pipeline.results.manifest import Manifest, load_manifest
from pipeline.results.selection import ClassSelection, SelectionRecord
from pipeline.verify.selection import select

log = logging.getLogger(__name__)


def model_row(pair: PairData, outcome: tuple[str, str], href: str | None) -> dict[str, Any]:
    b = as_dict(pair.bench)
    engine, e2e, memory = as_dict(b.get("engine_only")), as_dict(b.get("end_to_end")), as_dict(b.get("memory_mb"))
    deltas = [
        (m.get("split"), m.get("delta")) for m in as_list(as_dict(pair.validate).get("metrics")) if isinstance(m, dict)
    ]
    return {
        "sku": pair.sku,
        "outcome": outcome[0],
        "href": href,
        "p50": as_number(engine.get("p50_ms")),
        "p50_ci": as_interval(engine.get("p50_ci_ms")),
        "p99": as_number(engine.get("p99_ms")),
        "p99_ci": as_interval(engine.get("p99_ci_ms")),
        "e2e_p50": as_number(e2e.get("p50_ms")),
        "throughput": as_number(b.get("throughput_per_s")),
        "throughput_ci": as_interval(b.get("throughput_ci_per_s")),
        "peak_rss": as_number(memory.get("peak_rss")),
        "load_delta": as_number(memory.get("engine_load_delta")),
        "deltas": deltas,
        "engine_bytes": engine_bytes(pair.build),
        "drift": [(d["input"], d["metric_drop"], d["passed"]) for d in drift_view(pair.validate) or []],
        "energy": _energy_cell(b.get("energy")),
    }


def _energy_cell(energy: Any) -> dict[str, Any] | None:
    """J/inference for the cross-SKU table, or the reason there is none (never a 0)."""
    view = energy_view(energy)
    if view is None:
        return None
    if not view["available"]:
        return {"jpi": None, "reason": view["reason"]}
    return {"jpi": as_number(as_dict(energy).get("joules_per_inference")), "reason": None}


def model_charts(model: str, rows: list[dict[str, Any]], images: Images, notes: list[str]) -> list[tuple[str, str]]:
    benched = [r for r in rows if r["p50"] is not None]
    if not benched:
        return []
    skus = [r["sku"] for r in benched]
    charts = [
        (
            "latency.png",
            "engine-only latency per SKU",
            lambda: plots.latency_bars(
                skus,
                [r["p50"] for r in benched],
                [r["p50_ci"] for r in benched],
                [r["p99"] for r in benched],
                [r["p99_ci"] for r in benched],
            ),
        ),
        (
            "throughput.png",
            "throughput per SKU",
            lambda: plots.bars(
                skus,
                [r["throughput"] for r in benched],
                "throughput per SKU",
                "samples/s",
                [r["throughput_ci"] for r in benched],
            ),
        ),
        (
            "memory.png",
            "peak memory per SKU",
            lambda: plots.bars(skus, [r["peak_rss"] for r in benched], "peak RSS per SKU", "MB"),
        ),
        (
            "engine-size.png",
            "engine size per SKU",
            lambda: plots.bars(skus, [r["engine_bytes"] for r in benched], "engine size per SKU", "bytes"),
        ),
    ]
    out = []
    for name, alt, draw in charts:
        src = chart(images, notes, name, f"{model} {alt}", draw)
        if src:
            out.append((src, alt))
    return out


# --- the selection per device class ---------------------------------------------------------------


ACCURACY_SPLIT = "evaluation"  # the split whose task-metric delta the selection chart plots, where present


def _accuracy(m: Manifest | None) -> tuple[str, float] | None:
    """(what, figure) the selection chart plots upwards for one engine: the task metric's delta on
    the evaluation split (else the first split), else the first task agreement; None: neither."""
    if m is None:
        return None
    metrics = sorted(m.correctness.metrics, key=lambda x: x.split != ACCURACY_SPLIT)
    if metrics:
        return f"task metric delta ({metrics[0].split})", metrics[0].delta
    agreed = [t for t in m.correctness.task if t.value is not None]
    if agreed:
        return f"{agreed[0].statistic} (engine vs reference)", float(agreed[0].value or 0.0)
    return None


def _point_state(c: ClassSelection, sku: str, eligible: bool) -> str:
    if sku == c.chosen:
        return "selected"
    if not eligible:
        return "gates failed"
    return "tied" if sku in c.tied else "passed"


def _class_view(
    record: SelectionRecord,
    c: ClassSelection,
    manifests: dict[str, Manifest],
    gaps: dict[str, list[KnownGap]],
    images: Images,
    notes: list[str],
) -> dict[str, Any]:
    lower = record.objective != "throughput"
    unit = "ms" if lower else "samples/s"
    xlabel = f"engine-only {record.objective} ({unit})" if lower else "throughput (samples/s)"
    accuracy = {x.sku: _accuracy(manifests.get(x.sku)) for x in c.candidates}
    labels = sorted({a[0] for a in accuracy.values() if a is not None})
    ylabel = labels[0] if len(labels) == 1 else ("accuracy figure (see the table)" if labels else None)
    rows, points = [], []
    for x in c.candidates:
        a = accuracy[x.sku]
        state = _point_state(c, x.sku, x.eligible) if x.value is not None else None
        rows.append(
            {
                "sku": x.sku,
                "backend": x.backend,
                "precision": x.precision,
                "value": x.value,
                "interval": x.interval,
                "accuracy": a[1] if a else None,
                "accuracy_what": a[0] if a else None,
                "gates": "passed" if x.eligible else x.reason,
                "eligible": x.eligible,
                "state": state or "no figure",
                "chosen": x.sku == c.chosen,
                "upstream": [] if x.sku == c.chosen else gaps.get(x.sku, []),  # why a losing one is slow
            }
        )
        if x.value is not None and (ylabel is None or a is not None):
            points.append((x.sku, x.value, x.interval, a[1] if a else None, state or "passed"))
    if ylabel is not None and len(points) < sum(1 for x in c.candidates if x.value is not None):
        notes.append(f"{c.device_class}: a candidate without an accuracy figure is in the table, not on the chart")
    name = f"selection-{safe_name(c.device_class)}.png"
    title = f"{c.device_class}: {record.objective} against accuracy" if ylabel else f"{c.device_class}: {xlabel}"
    plot = (
        chart(
            images,
            notes,
            name,
            f"{record.model} selection for {c.device_class}",
            lambda: plots.selection(points, xlabel, ylabel, title),
        )
        if points
        else None
    )
    return {
        "device_class": c.device_class,
        "decision": c.decision,
        "chosen": c.chosen,
        "runner_up": c.runner_up,
        "summary": c.summary,
        "tied": c.tied,
        "margin": c.margin,
        "notes": c.notes,
        "rule": c.rule,
        "rows": rows,
        "plot": plot,
        "alt": f"{c.device_class}: {'latency' if lower else 'throughput'} of each candidate"
        + (" against accuracy" if ylabel else "")
        + (f", {c.chosen} selected" if c.chosen else ", none selected"),
        "unit": unit,
    }


def selection_view(registry: Registry, model: str, images: Images, notes: list[str]) -> dict[str, Any] | None:
    """The selection per device class (pipeline/verify/selection.py), computed from the manifests
    present as `skuforge select` does; whether build/.selection/<model>.json is that record."""
    layout = Layout(registry.root)
    try:
        record = select(registry, model)
        manifests = {
            x.sku: load_manifest(layout.manifest(model, x.sku))
            for c in record.classes
            for x in c.candidates
            if x.manifest_digest is not None
        }
    except SkuforgeError as exc:
        notes.append(f"selection left out: {exc}")
        return None
    if not record.classes:
        return None
    path = layout.selection(model)
    try:
        written = read_optional(path)
    except InputError:
        written = {"digest": "unreadable"}
    on_disk = (
        f"build/.selection/{model}.json is this record"
        if written is not None and written.get("digest") == record.digest
        else f"build/.selection/{model}.json is not written yet: skuforge select --model {model} writes it"
        if written is None
        else f"build/.selection/{model}.json differs (stale): shown is the selection the manifests give now; "
        f"skuforge select --model {model} writes it again"
    )
    return {
        "digest": record.digest,
        "objective": record.objective,
        "confidence": record.confidence,
        "on_disk": on_disk,
        "classes": [_class_view(record, c, manifests, registry.known_gaps(), images, notes) for c in record.classes],
    }


def consistency_view(path: Path) -> dict[str, Any] | None:
    report = read_optional(path)
    if report is None:
        return None
    outputs = []
    for o in as_list(report.get("outputs")):
        o = as_dict(o)
        labels = [str(x) for x in as_list(o.get("labels"))]
        tables = [
            (metric.replace("_", " "), list(zip(labels, as_list(o.get(metric)), strict=True)))
            for metric in ("max_abs_error", "mean_abs_error", "top1_agreement", "nonfinite_mismatch")
            if isinstance(o.get(metric), list)
        ]
        outputs.append({"output": o.get("output"), "kind": o.get("kind"), "labels": labels, "tables": tables})
    return {
        "samples": report.get("samples"),
        "skus": [str(as_dict(s).get("sku")) for s in as_list(report.get("skus"))],
        "skipped": [(as_dict(s).get("sku"), as_dict(s).get("reason")) for s in as_list(report.get("skipped"))],
        "outputs": outputs,
    }
