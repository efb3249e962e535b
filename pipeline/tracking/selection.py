"""Publish a model's selection record (pipeline/results/selection.py) to MLflow.

One run per record in the model's experiment (the one its SKUs' runs sit in), named
``selection <digest12>`` and idempotent on the record's digest as engine runs are on the manifest's:

1. find the run tagged with this digest (complete first), or create it (the digest is a tag from the
   start, so a run whose creation answer was lost is found on the next try);
2. log, in one batch, per device class the tags ``skuforge.selection.<class>`` (the SKU chosen, or
   ``none``), ``.decision``, ``.runner_up`` and ``.why``, and the margin as metrics; upload the record
   as ``selection.json`` (the bytes ``build/.selection/<model>.json`` holds), list it back, compare
   its size, then mark the run complete;
3. point the experiment at it: experiment tags ``skuforge.selection.digest``, ``.run_id`` and
   ``skuforge.selection.<class>`` per class (a class the record no longer has loses its tag).

The experiment tags follow the last record published; each record's run stays, so the history of
choices is the experiment's selection runs. Every value written is a string MLflow stores as it is
(class names are validated names, ``[a-z0-9_-]``); free text is cut to MLflow's tag length.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from pathlib import Path

from pipeline import __version__
from pipeline.core.errors import ServiceError
from pipeline.core.io import to_json
from pipeline.project.config import Registry
from pipeline.results.selection import ClassSelection, SelectionRecord
from pipeline.tracking.client import TAG_COMPLETE, TAG_MODEL, Tracking, actor, experiment_name
from pipeline.tracking.publish import _ended_on_failure, _listing, _name
from pipeline.tracking.reports import SelectionPublishResult

log = logging.getLogger(__name__)

SELECTION_ARTIFACT = "selection.json"
TAG_KIND = "skuforge.kind"  # "selection" on a selection run (engine runs carry skuforge.sku instead)
KIND = "selection"
TAG_SELECTION = "skuforge.selection."  # + digest, run_id, or a device class
TAG_SELECTION_DIGEST = TAG_SELECTION + "digest"
TAG_SELECTION_RUN = TAG_SELECTION + "run_id"
MAX_TAG_VALUE = 5000  # under MLflow's 8000: room for the multi-byte characters a reason may hold
NONE = "none"  # the tag value of a class where nothing was chosen


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TAG_VALUE else text[: MAX_TAG_VALUE - 1] + "…"


def class_tag(device_class: str, what: str = "") -> str:
    """``skuforge.selection.<class>[.<what>]``, a key MLflow accepts whatever the class is called."""
    return _name(TAG_SELECTION + device_class + (f".{what}" if what else ""))


def class_tags(c: ClassSelection) -> dict[str, str]:
    """A class's choice as run tags."""
    return {
        class_tag(c.device_class): c.chosen or NONE,
        class_tag(c.device_class, "decision"): c.decision,
        class_tag(c.device_class, "runner_up"): c.runner_up or NONE,
        class_tag(c.device_class, "why"): _cut(c.why),
    }


def selection_metrics(record: SelectionRecord) -> dict[str, float]:
    """Per class with a margin: ``selection.<class>.margin`` (above 1: the chosen one is ahead), its
    interval's ends, and ``.separated`` (1 or 0)."""
    out: dict[str, float] = {}
    for c in record.classes:
        if c.margin is None:
            continue
        key = _name(f"selection.{c.device_class}")
        out[f"{key}.margin"] = c.margin.ratio
        if c.margin.interval is not None:
            out[f"{key}.margin_low"], out[f"{key}.margin_high"] = c.margin.interval
        out[f"{key}.separated"] = float(c.margin.separated)
    return {k: float(v) for k, v in out.items() if math.isfinite(v)}


def _note(record: SelectionRecord) -> str:
    lines = [f"Selection of {record.model} (objective {record.objective}; record {record.digest[:12]})"]
    lines += [f"- {c.summary}" for c in record.classes]
    return _cut("\n".join(lines))


def _run_tags(record: SelectionRecord) -> dict[str, str]:
    tags = {
        TAG_KIND: KIND,
        TAG_MODEL: record.model,
        TAG_SELECTION_DIGEST: record.digest,
        "skuforge.selection.objective": record.objective,
        "skuforge.version": __version__,
        "mlflow.user": actor(),
        "mlflow.note.content": _note(record),
    }
    for c in record.classes:
        tags.update(class_tags(c))
    return tags


def _find(tracking: Tracking, experiment_id: str, digest: str):
    from mlflow.entities import ViewType

    runs = tracking.call(
        "search selection runs",
        tracking.client.search_runs,
        [experiment_id],
        filter_string=f"tags.`{TAG_SELECTION_DIGEST}` = '{digest}'",
        run_view_type=ViewType.ACTIVE_ONLY,
        order_by=["attributes.start_time ASC"],
    )
    complete = [r for r in runs if r.data.tags.get(TAG_COMPLETE) == "true"]
    return (complete or runs or [None])[0]


def _experiment_tags(tracking: Tracking, experiment_id: str, record: SelectionRecord, run_id: str) -> None:
    """Point the experiment at this record's run; drop the tags of classes it no longer has."""
    client = tracking.client
    exp = tracking.call("read experiment", client.get_experiment, experiment_id)
    have = dict(exp.tags or {})
    want = {TAG_SELECTION_DIGEST: record.digest, TAG_SELECTION_RUN: run_id}
    want.update({class_tag(c.device_class): c.chosen or NONE for c in record.classes})
    for key, value in want.items():
        if have.get(key) != value:
            tracking.call("tag experiment", client.set_experiment_tag, experiment_id, key, value)
    stale = [k for k in have if k.startswith(TAG_SELECTION) and k not in want]
    for key in stale:
        tracking.call("untag experiment", client.delete_experiment_tag, experiment_id, key)


def publish_selection(tracking: Tracking, registry: Registry, record: SelectionRecord) -> SelectionPublishResult:
    """Record ``record`` in the model's experiment; see the module docstring for the steps. The caller
    passes a current record (pipeline.verify.selection.select or read_selection)."""
    from mlflow.entities import Metric, RunTag

    started = time.perf_counter()
    client = tracking.client
    experiment_id = tracking.experiment_id(experiment_name(registry.release, record.model))
    body = to_json(record.to_json()).encode()

    def find_or_create():
        found = _find(tracking, experiment_id, record.digest)
        if found is not None:
            return found, False
        run = client.create_run(
            experiment_id,
            tags={TAG_KIND: KIND, TAG_MODEL: record.model, TAG_SELECTION_DIGEST: record.digest},
            run_name=f"selection {record.digest[:12]}",
        )
        return run, True

    run, created = tracking.call(f"create selection run in experiment {experiment_id}", find_or_create)
    run_id = run.info.run_id
    if run.data.tags.get(TAG_COMPLETE) != "true":
        with _ended_on_failure(tracking, run_id):
            now = int(time.time() * 1000)
            tracking.call(
                "log selection",
                client.log_batch,
                run_id,
                metrics=[Metric(k, v, now, 0) for k, v in sorted(selection_metrics(record).items())],
                tags=[RunTag(k, v) for k, v in sorted(_run_tags(record).items())],
            )
            with tempfile.TemporaryDirectory(prefix="skuforge-selection-") as tmp:
                path = Path(tmp) / SELECTION_ARTIFACT
                path.write_bytes(body)
                tracking.call("upload selection.json", client.log_artifact, run_id, str(path))
            listed = _listing(tracking, run_id)
            if listed.get(SELECTION_ARTIFACT, -1) not in (len(body), None):
                raise ServiceError(
                    f"MLflow at {tracking.display}: {SELECTION_ARTIFACT} of run {run_id} missing or truncated "
                    "after upload",
                    hint="publish the selection again (the run is resumed); check the artifact store's space",
                )
            tracking.call("mark run complete", client.set_tag, run_id, TAG_COMPLETE, "true")
        tracking.call("end run", client.set_terminated, run_id, "FINISHED")
    _experiment_tags(tracking, experiment_id, record, run_id)
    log.debug("selection of %s %s: run %s", record.model, record.digest[:12], run_id)
    return SelectionPublishResult(
        model=record.model,
        digest=record.digest,
        tracking_uri=tracking.display,
        experiment_id=experiment_id,
        run_id=run_id,
        artifact_uri=run.info.artifact_uri,
        classes={c.device_class: c.chosen for c in record.classes},
        created_run=created,
        seconds=round(time.perf_counter() - started, 3),
    )
