"""publish: record one (model, SKU) in MLflow and register its engine (pipeline/tracking/publish.py).

The stage reads what the earlier stages wrote (manifest, reports, engine, latency samples), checks
that they belong together, and writes ``publish.json``: the store, run and registered version.
"""

from __future__ import annotations

from dataclasses import replace

from pipeline.core.io import atomic_write_json
from pipeline.core.progress import Progress
from pipeline.project.artifacts import RESULT, layout, log
from pipeline.project.config import Pair
from pipeline.report import write_pair_report
from pipeline.tracking.client import Tracking, connect
from pipeline.tracking.evidence import collect
from pipeline.tracking.publish import publish_engine
from pipeline.tracking.reports import PublishResult


def publish(pair: Pair, progress: Progress | None = None, tracking: Tracking | None = None) -> PublishResult:
    registry, model, sku = pair.registry, pair.model, pair.sku
    inputs = collect(pair)  # refused before anything is written when the evidence does not hold together
    page = write_pair_report(registry, model, sku)  # report.html: the pair's page, self-contained (docs/report.md)
    inputs = replace(inputs, reports=[*inputs.reports, *(p for p in page if p not in inputs.reports)])
    result = publish_engine(tracking or connect(registry), registry, inputs, progress)
    atomic_write_json(layout(registry).report(model, sku, "publish"), result.receipt())
    log(model, sku).info(
        "published: %s version %s (run %s%s)",
        result.registered_model,
        result.version,
        result.run_id[:12],
        ", new" if result.created_version else "",
        extra=RESULT,
    )
    return result
