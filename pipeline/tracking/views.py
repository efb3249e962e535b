"""How skuforge's experiments open in the MLflow UI: as classic ML experiments, with a saved view of
the key columns.

What MLflow 3.17's bundled UI (``mlflow/server/js``) does, read from its source:

- Which layout an experiment opens in (GenAI traces or the runs table) follows a per-browser switch,
  "GenAI | Model training" at the top of the sidebar, GenAI until the user flips it; the link
  parameter ``workflowType=machine_learning`` overrides it. The experiment tag
  ``mlflow.experimentKind`` (``custom_model_development``: "Machine learning") decided this in the
  UIs before that switch and still names the experiment's kind: skuforge sets both, the tag on every
  experiment and the parameter on every link it gives.
- The runs table starts with the same three columns everywhere (Source, Models, Dataset); there is
  no per-experiment default. There are *saved views*: experiment tags
  ``mlflow.sharedViewState.<id>`` listed under "Views" on the Runs tab and opened by
  ``#/experiments/<id>/runs?viewStateShareKey=<view id>``. skuforge saves one, "skuforge: key
  metrics".
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
CLASSIC_ML = "custom_model_development"  # the UI's "Machine learning" kind: runs table, not traces
CLASSIC_WORKFLOW = "machine_learning"  # the link parameter: the "Model training" side of the switch
PRIMARY_METRIC_TAG = "mlflow.experiment.primaryMetric.name"  # the UI charts it first
SAVED_VIEW_PREFIX = "mlflow.sharedViewState."
KEY_VIEW_ID = "skuforge-key-metrics"
KEY_VIEW_NAME = "skuforge: key metrics"
PRIMARY_METRIC = "latency.engine_only.p50_ms"

# In the order they read best; patterns match per-output and per-split metrics.
KEY_METRICS = (
    "gate.correctness_passed",
    "latency.engine_only.p50_ms",
    "latency.engine_only.p99_ms",
    "latency.end_to_end.p50_ms",
    "throughput_per_s",
    "memory.peak_rss_mb",
    "energy.joules_per_inference",
    "error.*.max_abs_error",
    "task.*.delta",
    "preprocessing.*.metric_drop",
)
KEY_TAGS = ("skuforge.backend", "skuforge.precision")
COLUMN_WIDTH = 175  # px


def _column(kind: str, key: str) -> str:
    """A runs-table column id as the UI writes it: ``metrics.`latency.engine_only.p50_ms```."""
    return f"{kind}.`{key}`"


def key_metrics(logged: Iterable[str]) -> list[str]:
    """The logged metric names the key view shows, in :data:`KEY_METRICS` order."""
    names = sorted(set(logged))
    out: list[str] = []
    for pattern in KEY_METRICS:
        out += [n for n in names if fnmatch.fnmatchcase(n, pattern) and n not in out]
    return out


def key_view(logged: Iterable[str]) -> str:
    """The saved view's tag value: the UI's envelope around its runs-page state (search facets and
    the selected columns), runs sorted by name (``<sku> <digest>``: a model's SKUs side by side)."""
    columns = [
        *(_column("metrics", m) for m in key_metrics(logged)),
        *(_column("tags", t) for t in KEY_TAGS),
    ]
    state = {
        "searchFilter": "",
        "orderByKey": "tags.`mlflow.runName`",
        "orderByAsc": True,
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "datasetsFilter": [],
        "modelVersionFilter": "All Runs",
        "selectedColumns": columns,
        "columnOrder": columns,  # else the table sorts them by name
        "columnWidths": dict.fromkeys(columns, COLUMN_WIDTH),  # wide enough for "latency.engine_only.p50_ms"
        "runsHiddenMode": "SHOW_ALL",  # charts: every SKU, not the first ten runs
    }
    # createdAt is fixed so that the same view is the same tag value (set once, not on every publish)
    return json.dumps(
        {"name": KEY_VIEW_NAME, "createdAt": 0, "updatedAt": 0, "state": json.dumps(state, sort_keys=True)},
        sort_keys=True,
    )


def experiment_tags(logged: Iterable[str]) -> dict[str, str]:
    """The tags every skuforge experiment carries: set at creation, brought up to date on publish."""
    return {
        EXPERIMENT_KIND_TAG: CLASSIC_ML,
        PRIMARY_METRIC_TAG: PRIMARY_METRIC,
        SAVED_VIEW_PREFIX + KEY_VIEW_ID: key_view(logged),
    }


def ui_url(server: str, route: str, **query: str) -> str:
    """A page of the MLflow UI at ``server`` (its base URL), in the "Model training" layout."""
    params = "&".join(f"{k}={v}" for k, v in {**query, "workflowType": CLASSIC_WORKFLOW}.items())
    return f"{server.rstrip('/')}/#/{route.strip('/')}?{params}"


def runs_view_url(server: str, experiment_id: str) -> str:
    """The link that opens an experiment's runs table in the key view."""
    return ui_url(server, f"experiments/{experiment_id}/runs", viewStateShareKey=KEY_VIEW_ID)
