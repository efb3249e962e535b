"""`release publish --alias`: the engines holding an alias in a real MLflow server become a signed
release; a version whose evidence does not add up is refused and nothing is committed."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from pipeline.core.errors import GateFailed
from pipeline.results.signing import signing_key
from pipeline.rollout import release, trust
from pipeline.rollout.client import Client
from pipeline.stages.publish import publish
from pipeline.tracking.client import connect
from pipeline.tracking.promotion import promote


@pytest.fixture(scope="module")
def promoted(project, server):
    tracking = connect(project, uri=server.uri)
    published = {s: publish(project.pair("conv", s), tracking=tracking) for s in ("cpu", "portable")}
    promote(project, "conv", "candidate", ["cpu", "portable"], tracking=tracking)
    return tracking, published


def test_the_alias_holders_become_a_release(project, promoted, local_store):
    tracking, published = promoted
    keys = trust.Keys.single(signing_key())
    trust.initialise(local_store, keys, project.rollout.expiry)
    r = release.publish_release(project, local_store, keys, "conv", alias="candidate", tracking=tracking)
    assert r.created and r.release == "r1"
    sources = {s.sku: s.source for s in r.skus}
    assert sources["cpu"] == f"mlflow conv.cpu v{published['cpu'].version} (candidate)"
    doc = release.release_doc(local_store, "conv", "r1")
    assert doc["source"] == "mlflow alias candidate" and doc["fallback_sku"] == "portable"
    client = Client(local_store, Path(tempfile.mkdtemp()) / "dev", trust.root_bytes(local_store))
    expected = client.fetch(doc["skus"]["cpu"]["files"]["expected"])
    assert expected == (project.root / "build/conv/cpu/outputs.npz").read_bytes()


def test_an_alias_nobody_holds_is_refused(project, promoted, local_store):
    tracking, _ = promoted
    keys = trust.Keys.single(signing_key())
    trust.initialise(local_store, keys, project.rollout.expiry)
    with pytest.raises(GateFailed, match="portable fallback"):
        release.publish_release(project, local_store, keys, "conv", alias="staging", tracking=tracking)
    assert release.releases_of(trust.read_state(local_store).targets.signed, "conv") == []


def test_a_replaced_manifest_artifact_is_refused(project, server, local_store, tmp_path):
    tracking = connect(project, uri=server.uri)
    keys = trust.Keys.single(signing_key())
    trust.initialise(local_store, keys, project.rollout.expiry)
    version = tracking.client.get_model_version_by_alias("conv.cpu", "candidate")
    doc = json.loads(
        Path(tracking.client.download_artifacts(version.run_id, "manifest.json", str(tmp_path))).read_text()
    )
    doc["precision"] = "fp16"
    edited = tmp_path / "edit" / "manifest.json"
    edited.parent.mkdir()
    edited.write_text(json.dumps(doc))
    try:
        tracking.client.log_artifact(version.run_id, str(edited))
        with pytest.raises(GateFailed, match="manifest"):
            release.publish_release(project, local_store, keys, "conv", alias="candidate", tracking=tracking)
        assert release.releases_of(trust.read_state(local_store).targets.signed, "conv") == []
    finally:  # put the original back for other tests
        original = tmp_path / "orig" / "manifest.json"
        original.parent.mkdir()
        original.write_text((project.root / "manifests/conv/cpu.json").read_text())
        tracking.client.log_artifact(version.run_id, str(original))
