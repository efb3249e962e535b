"""How published engines look in the MLflow UI: classic ML experiments (runs table, not GenAI
traces) with a saved view of the key columns, and the signature kept out of the version's visible
tags; stores an older skuforge wrote are brought up to date by publishing again."""

from __future__ import annotations

import json
import re

import pytest
from registry_helpers import make_project, sku

from pipeline.stages.publish import publish
from pipeline.tracking.client import TAG_SIGNATURE, TAG_SIGNATURE_BEFORE, connect, version_signature
from pipeline.tracking.promotion import promote
from pipeline.tracking.views import (
    CLASSIC_ML,
    EXPERIMENT_KIND_TAG,
    KEY_VIEW_ID,
    KEY_VIEW_NAME,
    SAVED_VIEW_PREFIX,
    key_metrics,
    runs_view_url,
)

VIEW_TAG = SAVED_VIEW_PREFIX + KEY_VIEW_ID
COLUMN = re.compile(r"^(attributes|params|metrics|tags)\.`([^`]+)`$")  # how the UI names a column


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield make_project(tmp_path_factory.mktemp("views"), {s: sku("fp32", iterations=30) for s in ("a", "b")})
    mp.undo()


def _view_state(experiment) -> dict:
    """The saved view as the UI reads it: an envelope with a string name, a number createdAt and a
    string state holding the runs page's JSON state."""
    envelope = json.loads(experiment.tags[VIEW_TAG])
    assert isinstance(envelope["name"], str) and isinstance(envelope["createdAt"], int)
    return json.loads(envelope["state"])


def test_key_metrics_keep_their_order_and_match_per_output_names():
    logged = ["layers", "error.probs.max_abs_error", "latency.engine_only.p99_ms", "gate.correctness_passed"]
    assert key_metrics(logged) == ["gate.correctness_passed", "latency.engine_only.p99_ms", "error.probs.max_abs_error"]
    assert runs_view_url("http://127.0.0.1:5000/", "7") == (
        f"http://127.0.0.1:5000/#/experiments/7/runs?viewStateShareKey={KEY_VIEW_ID}&workflowType=machine_learning"
    )


def test_an_experiment_opens_as_classic_ml_with_a_view_of_logged_key_metrics(proj):
    result = publish(proj.pair("conv", "a"))
    client = connect(proj).client
    exp = client.get_experiment(result.experiment_id)
    assert exp.tags[EXPERIMENT_KIND_TAG] == CLASSIC_ML
    assert json.loads(exp.tags[VIEW_TAG])["name"] == KEY_VIEW_NAME
    state = _view_state(exp)
    columns = [COLUMN.match(c) for c in state["selectedColumns"]]
    assert all(columns), state["selectedColumns"]
    metrics = [c.group(2) for c in columns if c and c.group(1) == "metrics"]
    run = client.get_run(result.run_id)
    assert set(metrics) <= set(run.data.metrics), "the view names a metric the run does not hold"
    assert {"latency.engine_only.p50_ms", "gate.correctness_passed", "error.probs.max_abs_error"} <= set(metrics)
    assert len(state["selectedColumns"]) < len(run.data.metrics) / 3  # a selection, not everything
    assert state["orderByKey"] == "tags.`mlflow.runName`" and state["orderByAsc"] is True


def test_an_older_experiment_is_brought_up_to_date_by_publishing_again(proj):
    result = publish(proj.pair("conv", "a"))
    client = connect(proj).client
    wanted = client.get_experiment(result.experiment_id).tags
    # as an older skuforge left it, after the UI guessed "GenAI" for it
    client.set_experiment_tag(result.experiment_id, EXPERIMENT_KIND_TAG, "genai_development")
    client.delete_experiment_tag(result.experiment_id, VIEW_TAG)
    again = publish(proj.pair("conv", "a"))
    assert not again.created_run and not again.created_version
    tags = client.get_experiment(result.experiment_id).tags
    assert tags[EXPERIMENT_KIND_TAG] == CLASSIC_ML and tags[VIEW_TAG] == wanted[VIEW_TAG]


def test_the_signature_is_a_hidden_tag_and_an_older_visible_one_moves_unchanged(proj):
    result = publish(proj.pair("conv", "b"))
    client = connect(proj).client
    name, number = result.registered_model, result.version
    tags = client.get_model_version(name, number).tags
    assert TAG_SIGNATURE.startswith("mlflow.")  # the UI lists no mlflow.* tag of a version
    signed = tags[TAG_SIGNATURE]
    assert isinstance(version_signature(tags), dict)
    visible_json = [k for k, v in tags.items() if not k.startswith("mlflow.") and v.lstrip().startswith("{")]
    assert visible_json == []
    # a version an older skuforge signed: the signature under its earlier, visible name
    client.set_model_version_tag(name, number, TAG_SIGNATURE_BEFORE, signed)
    client.delete_model_version_tag(name, number, TAG_SIGNATURE)
    assert promote(proj, "conv", "candidate", ["b"]).passed  # still read
    publish(proj.pair("conv", "b"))
    tags = client.get_model_version(name, number).tags
    assert tags[TAG_SIGNATURE] == signed and TAG_SIGNATURE_BEFORE not in tags
    # nothing is trusted for where it sits: a garbage signature under the new name still fails
    client.set_model_version_tag(name, number, TAG_SIGNATURE, "{not json")
    assert version_signature(client.get_model_version(name, number).tags) == "unreadable"
