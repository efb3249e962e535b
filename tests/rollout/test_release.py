"""publish_release: one signed release of the built engines, refused when their evidence does not hold."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from pipeline.core.errors import GateFailed, ServiceError, SkuforgeError
from pipeline.core.io import sha256_bytes
from pipeline.host.probe import host_arch
from pipeline.project.config import load_registry
from pipeline.results.signing import signing_key
from pipeline.rollout import agent, release, trust
from pipeline.rollout.client import Client

MODEL = "conv"


@pytest.fixture
def keys():
    return trust.Keys.single(signing_key())


@pytest.fixture
def copy(project, tmp_path):
    """The built project copied, to damage without touching the module's build."""
    root = shutil.copytree(project.root, tmp_path / "project")
    return load_registry(root / "params.yaml")


def initialised(store, registry, keys):
    trust.initialise(store, keys, registry.rollout.expiry)
    return store


def released(store) -> list[str]:
    return release.releases_of(trust.read_state(store).targets.signed, MODEL)


def flat_files(files: dict) -> dict[str, str]:
    """A release entry's ``files`` as name -> target path, the names its ``sha256`` uses."""
    out = {f"{k}.npz" if k in ("golden", "expected") else f"{k}.json": v for k, v in files.items() if k != "engine"}
    out.update({f"engine/{rel}": path for rel, path in files["engine"].items()})
    return out


def test_publish_is_signed_and_idempotent(project, local_store, keys, tmp_path):
    initialised(local_store, project, keys)
    first = release.publish_release(project, local_store, keys, MODEL, actor="ci")
    assert (first.release, first.created, first.fallback_sku) == ("r1", True, "portable")
    assert sorted(s.sku for s in first.skus) == ["cpu", "portable"]

    timestamp = local_store.get(trust.TIMESTAMP_KEY).data
    again = release.publish_release(project, local_store, keys, MODEL)
    assert (again.release, again.created) == ("r1", False)
    assert released(local_store) == ["r1"] and local_store.get(trust.TIMESTAMP_KEY).data == timestamp

    doc = release.release_doc(local_store, MODEL, "r1")
    assert (doc["model"], doc["release"], doc["previous"], doc["actor"]) == (MODEL, "r1", None, "ci")
    assert doc["fallback_sku"] == "portable" and sorted(doc["skus"]) == ["cpu", "portable"]
    cpu, portable = doc["skus"]["cpu"], doc["skus"]["portable"]
    assert cpu["requires"]["portable"] is False and cpu["requires"]["arch"] == host_arch()
    assert cpu["requires"]["exact"] == {"onnxruntime": agent.installed_runtimes()["onnxruntime"]}
    assert portable["requires"] == {"arch": None, "cpu_features": [], "exact": {}, "specifiers": {}, "portable": True}
    for entry in (cpu, portable):
        assert [t["output"] for t in entry["tolerance"]] == ["probs"]
        assert all(t["atol"] > 0 and t["rtol"] > 0 for t in entry["tolerance"])
    rows = {s.sku: s for s in first.skus}
    assert rows["cpu"].manifest_digest == cpu["manifest_digest"] != portable["manifest_digest"]

    device = Client(local_store, tmp_path / "device", trust.root_bytes(local_store))
    device.refresh()
    assert json.loads(device.fetch(release.release_path(MODEL, "r1", release.RELEASE_DOC))) == doc
    for sku, entry in doc["skus"].items():
        files = flat_files(entry["files"])
        assert sorted(files) == sorted(entry["sha256"]) == sorted(rows[sku].files)
        assert "engine/model.onnx" in files and "engine/engine.json" in files
        for name, path in files.items():
            assert path == release.release_path(MODEL, "r1", sku, name)
            assert sha256_bytes(device.fetch(path)) == entry["sha256"][name] == rows[sku].files[name], path
        pointer = json.loads(device.fetch(release.channel_path(MODEL, sku)))
        assert (pointer["release"], pointer["release_doc"]) == ("r1", release.release_path(MODEL, "r1", "release.json"))


def _change_engine(root):
    path = root / "build/conv/cpu/engine/model.onnx"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def _replace_golden_outputs(root):
    path = root / "build/conv/cpu/outputs.npz"
    with np.load(path) as z:
        arrays = {k: z[k] + 1 for k in z.files}
    np.savez(path, **arrays)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(_change_engine, id="engine-changed-after-manifest"),
        pytest.param(_replace_golden_outputs, id="golden-outputs-replaced"),
    ],
)
def test_refused_when_evidence_does_not_hold(copy, local_store, keys, damage):
    initialised(local_store, copy, keys)
    timestamp = local_store.get(trust.TIMESTAMP_KEY).data
    damage(copy.root)
    with pytest.raises(GateFailed, match="cpu"):
        release.publish_release(copy, local_store, keys, MODEL)
    assert released(local_store) == []
    assert local_store.get(trust.TIMESTAMP_KEY).data == timestamp


def test_refused_without_the_fallback(copy, local_store, keys):
    initialised(local_store, copy, keys)
    (copy.root / "manifests/conv/portable.json").unlink()
    with pytest.raises(SkuforgeError, match="portable"):
        release.publish_release(copy, local_store, keys, MODEL)
    assert released(local_store) == []


def test_missing_fallback_is_a_gate_failure(copy, local_store, keys):
    initialised(local_store, copy, keys)
    (copy.root / "manifests/conv/portable.json").unlink()
    with pytest.raises(GateFailed, match="fallback portable"):
        release.publish_release(copy, local_store, keys, MODEL)


def test_interrupted_commit_publishes_nothing(project, s3_store, proxy, keys):
    initialised(s3_store, project, keys)
    proxy.fail(method="PUT", key_pattern=r"metadata/timestamp\.json$", times=None)
    with pytest.raises(ServiceError) as failed:
        release.publish_release(project, s3_store, keys, MODEL)
    assert failed.value.exit_code == 4
    assert proxy.count("PUT", r"metadata/timestamp\.json$") >= 1
    assert released(s3_store) == []

    proxy.clear()
    result = release.publish_release(project, s3_store, keys, MODEL)
    assert (result.release, result.created) == ("r1", True)
    assert released(s3_store) == ["r1"]
