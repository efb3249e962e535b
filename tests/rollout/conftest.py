"""Rollout fixtures: a real moto S3 server behind a fault-injecting proxy (tests/rollout/s3server.py),
and a tiny built project with an optimized and a portable SKU."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from registry_helpers import make_project, sku
from shared import copy_shared, shared_once

from pipeline.project.config import load_registry
from rollout.s3server import FaultProxy, MotoS3, s3_client

FAST = {"connect_timeout": 1, "read_timeout": 2, "retries": {"mode": "standard", "total_max_attempts": 3}}

WAVES = [
    {"name": "canary", "percent": 20, "bake_minutes": 30},
    {"name": "half", "percent": 50, "bake_minutes": 30},
    {"name": "all", "percent": 100, "bake_minutes": 0},
]


@pytest.fixture(scope="session")
def moto_s3():
    with MotoS3() as server:
        yield server


@pytest.fixture(scope="session")
def proxy(moto_s3):
    with FaultProxy(moto_s3.endpoint) as p:
        yield p


@pytest.fixture
def s3_store(moto_s3, proxy):
    """An S3Store on a fresh bucket, every request through the fault proxy."""
    from pipeline.rollout.store import S3Store

    proxy.clear()
    bucket = moto_s3.make_bucket()
    yield S3Store(f"s3://{bucket}/fleet", client=s3_client(proxy.endpoint, **FAST))
    proxy.clear()


@pytest.fixture
def local_store(tmp_path):
    from pipeline.rollout.store import LocalStore

    return LocalStore(tmp_path / "store")


@pytest.fixture(params=["local", "s3"])
def store(request):
    """Each test that takes ``store`` runs on the local folder and on S3 over HTTP."""
    return request.getfixturevalue("local_store" if request.param == "local" else "s3_store")


def _make_project(root: Path) -> None:
    make_project(
        root,
        {"cpu": sku(), "portable": sku(options={"graph_optimization_level": "basic"})},
        rollout={
            "fallback_sku": "portable",
            "waves": WAVES,
            "gates": {
                "min_reports": 3,
                "max_failure_rate": 0.1,
                "max_smoke_failures": 0,
                "max_latency_regression": 0.5,
            },
        },
    )


def classed_copy(tmp_path_factory, tmp_path: Path, device_class: str = "x86-test") -> tuple[Path, dict]:
    """A copy of the built rollout project whose two SKUs (``cpu``, ``portable``) both serve
    ``device_class``: two candidates of one class. Returns its root and its params.yaml as a dict."""
    made = shared_once(tmp_path_factory, "rollout-project", _make_project)
    root = copy_shared(made, tmp_path / "project")
    params = root / "params.yaml"
    doc = yaml.safe_load(params.read_text())
    for name in ("cpu", "portable"):
        doc["skus"][name]["device_class"] = device_class
    params.write_text(yaml.safe_dump(doc, sort_keys=False))
    return root, doc


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """conv_bn built for an optimized SKU (``cpu``) and the portable fallback (``portable``): built,
    validated, benched and described once per test session, each module its own copy."""
    made = shared_once(tmp_path_factory, "rollout-project", _make_project)
    return load_registry(copy_shared(made, tmp_path_factory.mktemp("rollout_project") / "project") / "params.yaml")


MODEL = "conv"


@pytest.fixture
def keys():
    from pipeline.results.signing import signing_key
    from pipeline.rollout import trust

    return trust.Keys.single(signing_key())


@pytest.fixture(scope="module")
def published(project, tmp_path_factory):
    """A store holding release r1 of the module's project, copied by each test (publishing is the slow part)."""
    from pipeline.results.signing import signing_key
    from pipeline.rollout import release, trust
    from pipeline.rollout.store import LocalStore

    store = LocalStore(tmp_path_factory.mktemp("published") / "store")
    keys = trust.Keys.single(signing_key())
    trust.initialise(store, keys, project.rollout.expiry)
    release.publish_release(project, store, keys, MODEL)
    return store.root


@pytest.fixture
def published_s3(published, moto_s3):
    """The ``published`` store (r1) copied into a fresh bucket: a store on S3 without publishing again."""
    from pipeline.rollout.store import LocalStore, S3Store

    local = LocalStore(published)
    store = S3Store(f"s3://{moto_s3.make_bucket()}/fleet", client=moto_s3.client())
    for key in local.list(""):
        store.put(key, local.get(key).data)
    return store


def first_in(doc, wave: int, n: int = 1) -> list[str]:
    """``n`` device ids the rollout's wave ``wave`` is the first to take."""
    import itertools

    from pipeline.rollout import plan

    ids = (f"dev{i}" for i in itertools.count())
    return list(itertools.islice((i for i in ids if plan.first_wave(doc.waves, doc.id, i, None) == wave), n))
