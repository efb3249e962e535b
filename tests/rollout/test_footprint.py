"""`pip install skuforge[agent]` is what a device gets: the agent, the CLI's `skuforge agent` and one
pass against S3 import no package outside the base dependencies and the ``agent`` extra.

The allowed packages are read from pyproject.toml and expanded through the installed packages'
own requirements, so a new dependency of the agent shows up here as a pyproject change, not as an
edit of a list in this test."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import sysconfig
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement

from pipeline.host.probe import host_arch
from pipeline.project.config import Wave
from pipeline.results.signing import signing_key
from pipeline.rollout import controller, identity, release, trust
from pipeline.rollout.inventory import Device, Inventory
from pipeline.rollout.store import S3Store
from rollout.conftest import MODEL

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[2]
PROJECT = "skuforge"

# What the build toolchain brings and a device must not carry (the list).
BUILD_ONLY = {"mlflow", "dvc", "scipy", "onnx", "matplotlib", "jinja2", "jsonschema", "ruamel-yaml", "torch"}

# Top-level modules an allowed package imports when they are there and does without otherwise: not
# dependencies, so a device without them is no different.
OPPORTUNISTIC = {
    "certifi",  # botocore takes its CA bundle when installed, else its own (botocore/httpsession.py)
    "backports",  # urllib3 tries `backports.zstd`: any backports.* package loads the namespace
}

# Runs in a fresh interpreter: import the agent, then run `skuforge agent` once through the CLI's
# own entry (parser, handler, the agent's pass); writes the top-level modules each step added, with
# their file or, for a namespace package (ruamel, google), their first folder.
_CHILD = """
import json, sys
def top(before):
    where = lambda m: getattr(m, "__file__", None) or next(iter(getattr(m, "__path__", None) or ()), None)
    return {n: where(m) for n, m in list(sys.modules.items()) if "." not in n and n not in before}
before = set(sys.modules)
import pipeline.rollout.agent
imported = top(before)
from pipeline.cli import main
code = main(sys.argv[2:])
with open(sys.argv[1], "w") as out:
    json.dump({"code": code, "import": imported, "pass": top(before)}, out)
"""


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _declared(extra: str | None) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def closure(extras: tuple[str, ...]) -> set[str]:
    """Normalised names of the distributions ``pip install skuforge[extras]`` installs: pyproject's
    base dependencies and the extras, then each installed package's own requirements, recursively
    (markers evaluated for this interpreter)."""
    todo = [(r, "") for r in _declared(None)] + [(r, "") for e in extras for r in _declared(e)]
    seen: set[str] = set()
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({**default_environment(), "extra": extra}):
            continue
        name = _name(req.name)
        if name == PROJECT:  # a self-reference: skuforge[agent] inside another extra
            todo += [(r, "") for e in req.extras for r in _declared(e)]
            continue
        if name in seen:
            continue
        seen.add(name)
        for spec in importlib.metadata.requires(req.name) or []:
            sub = Requirement(spec)
            todo += [(sub, e) for e in (req.extras or {""})]
    return seen


def third_party(modules: dict[str, str | None]) -> dict[str, set[str]]:
    """The modules loaded from site-packages (not the standard library, not skuforge itself, not
    made at run time), each with the distributions that provide it (empty: none is known)."""
    paths = sysconfig.get_paths()
    sites = {Path(paths[k]).resolve() for k in ("purelib", "platlib")}
    owners = importlib.metadata.packages_distributions()
    return {
        name: {_name(d) for d in owners.get(name, ())}
        for name, file in modules.items()
        if file and name != "pipeline" and any(Path(file).resolve().is_relative_to(s) for s in sites)
    }


def outside(modules: dict[str, str | None], allowed: set[str]) -> dict[str, list[str]]:
    """The third-party modules among ``modules`` whose distribution is not in ``allowed``."""
    found = third_party(modules).items()
    return {name: sorted(dists) for name, dists in found if not dists & allowed and name not in OPPORTUNISTIC}


def test_the_agent_extra_leaves_the_build_toolchain_out():
    agent = closure(("agent",))
    assert {"boto3", "tuf", "onnxruntime", "numpy", "pydantic", "pyyaml", "cryptography"} <= agent
    assert not agent & BUILD_ONLY, sorted(agent & BUILD_ONLY)
    # every install path asks for the toolchain by the extra's name (scripts/setup.sh serves .ci/run,
    # the rendered workflows and the runner classes)
    assert BUILD_ONLY - {"torch"} <= closure(("pipeline",))
    assert re.search(r'extras="[^"]*\bpipeline\b', (REPO / "scripts/setup.sh").read_text())


@pytest.fixture
def device_on_s3(project, moto_s3, tmp_path):
    """A bucket holding r1 and a rollout of it to a one-device fleet, and that device provisioned:
    its key made in its agent folder (public half in the inventory), its device file, the store's root."""
    bucket = moto_s3.make_bucket()
    store = S3Store(f"s3://{bucket}/fleet", client=moto_s3.client())
    keys = trust.Keys.single(signing_key())
    trust.initialise(store, keys, project.rollout.expiry)
    release.publish_release(project, store, keys, MODEL)
    state = tmp_path / "state"
    fleet = Inventory([Device(id="dev0", sku="cpu", arch=host_arch(), key=identity.device_key(state).public_key)])
    every = [Wave(name="all", percent=100, bake_minutes=0)]
    controller.start(project, store, keys, MODEL, inventory=fleet, waves=every, now=datetime.now(timezone.utc))
    device = {"id": "dev0", "sku": "cpu", "models": [MODEL], "arch": host_arch(), "cpu_features": []}
    (tmp_path / "device.yaml").write_text(yaml.safe_dump(device))
    (tmp_path / "root.json").write_bytes(trust.root_bytes(store))
    return store.url, moto_s3.endpoint, tmp_path


def test_agent_imports_only_what_the_agent_extra_installs(device_on_s3):
    url, endpoint, where = device_on_s3
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(where),
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    out = where / "modules.json"
    argv = ["agent", "--device", "device.yaml", "--state", "state", "--root", "root.json", "--store", url, "--json"]
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(out), *argv], cwd=where, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(out.read_text())
    assert seen["code"] == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["outcome"] == "ok", proc.stdout

    base, agent = closure(()), closure(("agent",))
    # the check sees what it must: pydantic on import, boto3 and onnxruntime in the pass
    assert {"pydantic", "yaml"} <= set(third_party(seen["import"])), seen["import"]
    assert {"boto3", "onnxruntime", "tuf", "numpy"} <= set(third_party(seen["pass"])), seen["pass"]
    assert outside(seen["import"], base) == {}, "importing the agent loads more than the base dependencies"
    assert outside(seen["pass"], agent) == {}, "an agent pass loads packages outside skuforge[agent]"
