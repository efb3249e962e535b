"""The read-only views' host answers, cached per host fingerprint (pipeline/engine/hostcheck.py,
pipeline/host/fingerprint.py): the same answers as asking, a second command that imports no SDK,
and a new answer when what it depends on changes. Also the faster readers under ``skuforge
summary``: the manifest schema validator built once, params.yaml on libyaml's parser."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import models
import pytest

from pipeline.core.errors import ConfigError, InputError
from pipeline.engine import hostcheck
from pipeline.engine.hostcheck import CACHE_PREFIX, HostCheckCache, cached_host_problems, host_problems
from pipeline.engine.matrix import sku_statuses
from pipeline.host import probe
from pipeline.host.probe import ENV_FAKE_CPU_FLAGS
from pipeline.project.config import load_registry, parse_registry
from pipeline.results.manifest import published_schema, validate_document

REPO = Path(__file__).resolve().parents[2]
# what a "can this host build it" answer must not import once it is cached
SDKS = ("tvm", "openvino", "iree.runtime", "iree.compiler", "tensorrt", "torch", "onnx", "mlflow", "ai_edge_litert")
_STATUSES = f"""
import json, sys
from pipeline.project.config import load_registry
from pipeline.engine.matrix import sku_statuses
statuses = [s.to_json() for s in sku_statuses(load_registry({str(REPO / "params.yaml")!r}))]
print(json.dumps({{"statuses": statuses, "imported": [m for m in {SDKS!r} if m in sys.modules]}}))
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SKUFORGE_CACHE_DIR", str(tmp_path))
    return tmp_path


def registry(**sku):
    return parse_registry(models.one_sku_params(**sku))


def _statuses_in_a_new_process() -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _STATUSES], capture_output=True, text=True, check=True, env=dict(os.environ), cwd=REPO
    )
    return json.loads(proc.stdout)


def test_the_cached_answers_are_the_live_ones_and_a_second_command_imports_no_sdk(cache):
    """Every SKU of the example registry (all six backends): the first command asks the SDKs, the
    second answers the same from the cache without importing any of them."""
    first = _statuses_in_a_new_process()
    assert list(cache.glob(f"{CACHE_PREFIX}*.json")), "the first command kept no answers"
    second = _statuses_in_a_new_process()
    assert second["imported"] == []
    assert second["statuses"] == first["statuses"]
    reg = load_registry(REPO / "params.yaml")
    live = [s.to_json() for s in sku_statuses(reg, cached=False)]
    assert first["statuses"] == live


def test_an_answer_is_read_back_not_asked_again_and_a_changed_sku_is_a_new_question(cache, monkeypatch):
    reg = registry()
    assert cached_host_problems(reg) == {"s": {"build": [], "run": []}}

    def asked(*_args: object) -> list[str]:
        raise AssertionError("asked again although the answer is cached")

    monkeypatch.setattr(hostcheck, "host_problems", asked)
    assert cached_host_problems(reg) == {"s": {"build": [], "run": []}}
    monkeypatch.undo()
    monkeypatch.setenv("SKUFORGE_CACHE_DIR", str(cache))
    other = registry(target={"arch": probe.host_arch(), "cpu_features": ["no_such_flag"]})
    lacks = ["needs CPU features ['no_such_flag'] this host lacks"]
    assert cached_host_problems(other) == {"s": {"build": lacks, "run": lacks}}


def test_a_changed_host_is_asked_again(cache, monkeypatch):
    """The CPU flags (here faked through the testing hook) are part of the fingerprint: the host
    that lost AVX2 is not answered from the cache of the one that had it."""
    reg = registry(target={"arch": probe.host_arch(), "cpu_features": ["avx2"]})
    if "avx2" not in probe.cpu_features():
        pytest.skip("this host has no AVX2 to lose")
    assert cached_host_problems(reg)["s"]["build"] == []
    before = HostCheckCache().key
    monkeypatch.setenv(ENV_FAKE_CPU_FLAGS, "sse2")
    assert HostCheckCache().key != before
    assert cached_host_problems(reg)["s"]["build"] == ["needs CPU features ['avx2'] this host lacks"]
    assert cached_host_problems(reg)["s"]["build"] == host_problems(reg, "s", "build")


def test_a_tool_added_to_path_is_a_new_fingerprint(cache, tmp_path, monkeypatch):
    tools = tmp_path / "bin"
    tools.mkdir()
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    before = HostCheckCache().key
    (tools / "nvidia-smi").write_text("#!/bin/sh\n")  # a tool appearing changes its folder
    os.utime(tools, ns=(1, 1))
    assert HostCheckCache().key != before


def test_an_unreadable_cache_is_an_empty_one(cache):
    reg = registry()
    path = HostCheckCache().path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{ not json")
    assert cached_host_problems(reg) == {"s": {"build": [], "run": []}}
    assert json.loads(path.read_text())["key"] == HostCheckCache().key  # written again, whole


def test_the_published_schema_is_a_valid_schema():
    """validate_document builds its validator once and no longer checks the schema on every call."""
    schema = published_schema()
    jsonschema.validators.validator_for(schema).check_schema(schema)


def test_a_manifest_off_the_schema_names_where():
    with pytest.raises(
        InputError, match=r"does not match the manifest schema at \(root\): '\w+' is a required property"
    ):
        validate_document({"digest": "x"}, "m.json")


def test_a_repeated_key_is_refused_by_the_c_parser_too(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("defaults: {}\nexamples: {}\nmodels: {}\nmodels: {}\nskus: {}\n")
    with pytest.raises(ConfigError, match=r"key 'models' appears twice in one mapping \(lines 3 and 4\)"):
        load_registry(params)
