"""Device classes in a release: `release publish` ships the selection (class -> the selected SKU,
bound to the selection record's digest), and a device declaring its class runs that engine, or the
portable fallback with the reason when the release selects nothing for its class."""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime, timezone

import pytest
import yaml
from cli_helpers import assert_user_error, service_env, skuforge

from pipeline.core.errors import GateFailed, InputError
from pipeline.host.probe import host_arch
from pipeline.project.config import load_registry
from pipeline.results.manifest import load_manifest
from pipeline.results.signing import signing_key
from pipeline.rollout import agent, controller, identity, release, trust
from pipeline.rollout.inventory import Device as FleetDevice
from pipeline.rollout.inventory import write_inventory
from pipeline.rollout.store import LocalStore
from pipeline.verify.selection import select, write_selection
from rollout.conftest import MODEL
from rollout.fleet import Fleet

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=timezone.utc)
CLASS = "x86-avx2"


def with_class(root, **classes: str):
    """The project at ``root`` with ``skus.<s>.device_class`` set as given; its registry."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    for sku, device_class in classes.items():
        params["skus"][sku]["device_class"] = device_class
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return load_registry(root / "params.yaml")


@pytest.fixture
def keys():
    return trust.Keys.single(signing_key())


@pytest.fixture
def classed(project, tmp_path):
    """The built project copied, its ``cpu`` SKU of class x86-avx2, the selection written."""
    reg = with_class(shutil.copytree(project.root, tmp_path / "project"), cpu=CLASS)
    write_selection(reg, select(reg, MODEL))
    return reg


@pytest.fixture(scope="module")
def shipped(project, tmp_path_factory):
    """A store holding r1 published with the class map (publishing is the slow part)."""
    reg = with_class(shutil.copytree(project.root, tmp_path_factory.mktemp("classed") / "project"), cpu=CLASS)
    write_selection(reg, select(reg, MODEL))
    store = LocalStore(tmp_path_factory.mktemp("classed_store") / "store")
    keys = trust.Keys.single(signing_key())
    trust.initialise(store, keys, reg.rollout.expiry)
    release.publish_release(reg, store, keys, MODEL)
    return reg, store.root


def test_release_carries_the_class_map(classed, local_store, keys):
    trust.initialise(local_store, keys, classed.rollout.expiry)
    record = select(classed, MODEL)
    assert record.get(CLASS).chosen == "cpu", record.get(CLASS).why
    r = release.publish_release(classed, local_store, keys, MODEL)
    assert (r.classes, r.unselected, r.selection) == ({CLASS: "cpu"}, {}, record.digest)
    doc = release.release_doc(local_store, MODEL, "r1")
    assert doc["classes"] == {CLASS: "cpu"} and sorted(doc["skus"]) == ["cpu", "portable"]  # SKUs still served
    assert doc["selection"] == {"digest": record.digest, "objective": record.objective, "unselected": {}}
    assert doc["skus"]["cpu"]["manifest_digest"] == record.manifests["cpu"]
    assert not release.publish_release(classed, local_store, keys, MODEL).created  # same engines, same map

    # the selection changes what devices of the class get: a new release, though the engines are the same
    reg = with_class(classed.root, cpu="x86-avx512-vnni")
    write_selection(reg, select(reg, MODEL))
    again = release.publish_release(reg, local_store, keys, MODEL)
    assert (again.release, again.created, again.classes) == ("r2", True, {"x86-avx512-vnni": "cpu"})


def test_a_release_without_classes_has_an_empty_map(project, local_store, keys):
    trust.initialise(local_store, keys, project.rollout.expiry)
    r = release.publish_release(project, local_store, keys, MODEL)
    doc = release.release_doc(local_store, MODEL, r.release)
    assert (doc["classes"], doc["selection"], r.selection) == ({}, None, None)


def _tamper(reg):
    path = reg.root / "build/.selection" / f"{MODEL}.json"
    doc = json.loads(path.read_text())
    doc["classes"][0]["chosen"] = "portable"  # the fallback for the class, digest left as it was
    path.write_text(json.dumps(doc))


def _stale(reg):
    params = yaml.safe_load((reg.root / "params.yaml").read_text())
    params["selection"] = {"objective": "p99"}  # decides otherwise than the record says
    (reg.root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        pytest.param(_tamper, "digest does not match", id="tampered"),
        pytest.param(_stale, "is stale", id="stale"),
    ],
)
def test_publish_refuses_a_bad_selection_record(classed, local_store, keys, damage, words):
    trust.initialise(local_store, keys, classed.rollout.expiry)
    timestamp = local_store.get(trust.TIMESTAMP_KEY).data
    damage(classed)
    reg = load_registry(classed.root / "params.yaml")
    with pytest.raises(InputError) as caught:
        release.publish_release(reg, local_store, keys, MODEL)
    assert caught.value.exit_code == 2
    assert words in caught.value.message + (caught.value.hint or "")
    assert local_store.get(trust.TIMESTAMP_KEY).data == timestamp  # nothing published


def test_an_absent_record_is_computed_as_select_computes_it(classed, local_store, keys):
    path = classed.root / "build/.selection" / f"{MODEL}.json"
    written = json.loads(path.read_text())
    path.unlink()  # git ignores build/.selection: a fresh checkout has the manifests only
    trust.initialise(local_store, keys, classed.rollout.expiry)
    r = release.publish_release(classed, local_store, keys, MODEL)
    assert (r.classes, r.selection) == ({CLASS: "cpu"}, written["digest"])
    assert json.loads(path.read_text()) == written


def test_cli_publish_exits_2_on_a_tampered_selection(classed, tmp_path):
    env = service_env(SKUFORGE_STORE=str(tmp_path / "store"))
    proc = skuforge("release", "init", cwd=classed.root, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _tamper(classed)
    proc = skuforge("release", "publish", "--model", MODEL, cwd=classed.root, env=env)
    assert_user_error(proc, 2, "digest does not match")


def test_a_selected_sku_outside_the_release_is_refused(classed, local_store, keys):
    params = yaml.safe_load((classed.root / "params.yaml").read_text())
    params["release"] = {**(params.get("release") or {}), "skus": ["portable"]}
    (classed.root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    reg = load_registry(classed.root / "params.yaml")
    trust.initialise(local_store, keys, reg.rollout.expiry)
    with pytest.raises(GateFailed, match=f"device class {CLASS} selects cpu, which this release does not hold"):
        release.publish_release(reg, local_store, keys, MODEL)


def test_the_class_map_holds_only_the_engines_selected(classed):
    record = select(classed, MODEL)
    shipped = {s: load_manifest(classed.root / f"manifests/{MODEL}/{s}.json") for s in ("cpu", "portable")}
    assert release.class_map(record, shipped, []) == ({CLASS: "cpu"}, {}, [])
    # --alias: the version holding it is another cpu engine than the one selected here
    other = {**shipped, "cpu": shipped["cpu"].model_copy(update={"digest": "f" * 64})}
    classes, _, problems = release.class_map(record, other, [])
    assert classes == {} and problems == [
        f"device class {CLASS} selects cpu with manifest {record.manifests['cpu'][:12]}, the release holds "
        "ffffffffffff (promote the engine that was selected, or select again)"
    ]
    # shipped knowingly without it: the class's devices run the fallback, said so
    assert release.class_map(record, {"portable": shipped["portable"]}, ["cpu"]) == (
        {},
        {CLASS: "cpu selected, not in this release (--allow-partial)"},
        [],
    )


# --- the agent ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet():
    return Fleet(200)


@pytest.fixture
def repo(shipped, tmp_path):
    return LocalStore(shutil.copytree(shipped[1], tmp_path / "store"))


def run_device(reg, repo, fleet, tmp_path, *, sku=None, device_class=None, runtime=None):
    doc = controller.start(reg, repo, trust.Keys.single(signing_key()), MODEL, inventory=fleet.inventory, now=T0)
    dev = agent.Device(
        id=fleet.first_in(doc, 0)[0],
        sku=sku,
        device_class=device_class,
        arch=host_arch(),
        runtime=runtime or agent.installed_runtimes(),
        cpu_features=frozenset(),
    )
    a = agent.Agent(repo, dev, tmp_path / "device", trust.root_bytes(repo), key=fleet.keys[dev.id])
    result = a.run_once(MODEL, now=T0)
    report = identity.open_report(repo.get(result.reported).data, fleet.keys[dev.id].public_key)
    return a, result, report


def test_a_device_of_the_class_runs_the_selected_engine(shipped, repo, fleet, tmp_path):
    reg, _ = shipped
    a, result, report = run_device(reg, repo, fleet, tmp_path, device_class=CLASS)
    assert result.outcome == "ok", result.detail
    assert f"device class {CLASS}: cpu selected" in result.detail
    want = {"sku": "cpu", "kind": "optimized", "device_class": CLASS, "selected": "cpu"}
    assert {k: result.active[k] for k in want} == want
    assert a.active(MODEL) == result.active  # the decision in the device's state
    assert (report["device_class"], report["sku"], report["active"]) == (CLASS, None, result.active)


def test_a_class_without_a_selection_runs_the_fallback(shipped, repo, fleet, tmp_path):
    reg, _ = shipped
    _, result, report = run_device(reg, repo, fleet, tmp_path, device_class="rpi5")
    assert result.outcome == "fallback", result.detail
    assert "selects no engine for device class rpi5" in result.detail
    assert "running the portable fallback portable" in result.detail
    want = {"sku": "portable", "kind": "fallback", "device_class": "rpi5", "selected": None}
    assert {k: result.active[k] for k in want} == want
    assert (report["outcome"], report["device_class"]) == ("fallback", "rpi5")


def test_a_class_without_a_selection_takes_the_devices_sku(shipped, repo, fleet, tmp_path):
    reg, _ = shipped
    _, result, _ = run_device(reg, repo, fleet, tmp_path, sku="cpu", device_class="rpi5")
    assert result.outcome == "ok", result.detail
    assert "the device's SKU cpu" in result.detail
    assert (result.active["sku"], result.active["kind"], result.active["selected"]) == ("cpu", "optimized", None)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        pytest.param({"device_class": "../etc"}, "is not a device class name", id="dotdot"),
        pytest.param({"device_class": "X86 AVX2"}, "is not a device class name", id="spaces"),
        pytest.param({}, "name the device's sku, its device_class, or both", id="neither"),
    ],
)
def test_device_file_with_a_bad_class_is_refused(tmp_path, fields, words):
    path = tmp_path / "device.yaml"
    path.write_text(yaml.safe_dump({"id": "dev0", "models": [MODEL], **fields}))
    with pytest.raises(InputError, match="not a device class name|name the device's sku") as caught:
        agent.load_device(path)
    assert words in caught.value.message and caught.value.exit_code == 2
    proc = skuforge(
        "agent", "--device", str(path), "--state", str(tmp_path / "state"), "--store", str(tmp_path / "s"),
        cwd=tmp_path, env=service_env(),
    )  # fmt: skip
    assert_user_error(proc, 2, words)
    assert not os.path.exists(tmp_path / "s")


def test_device_file_with_a_class_only(tmp_path):
    path = tmp_path / "device.yaml"
    path.write_text(yaml.safe_dump({"id": "dev0", "models": [MODEL], "device_class": CLASS}))
    dev = agent.Device.from_config(agent.load_device(path))
    assert (dev.sku, dev.device_class) == (None, CLASS)


# --- the rollout plan ----------------------------------------------------------------------------------


def test_rollout_plan_keys_devices_by_class(shipped, tmp_path):
    """`rollout plan` on r1 (class x86-avx2 -> cpu, fallback portable) for a fleet of class-only,
    SKU-named and mixed devices: counted by class where a device names one, served as the agent serves
    it, the class map shown."""
    reg, store = shipped
    devices = (
        [FleetDevice(f"avx-{i}", None, "x86_64", device_class=CLASS) for i in range(6)]  # the class only
        + [FleetDevice(f"pi-{i}", None, "aarch64", device_class="rpi5") for i in range(3)]  # no selection, no SKU
        + [FleetDevice(f"port-{i}", "portable", "x86_64") for i in range(4)]  # the SKU only
        + [FleetDevice(f"mix-{i}", "portable", "x86_64", device_class=CLASS) for i in range(2)]  # the class decides
        + [FleetDevice("pi-cpu", "cpu", "aarch64", device_class="rpi5")]  # no selection: its own SKU
    )
    write_inventory(tmp_path / "fleet.csv", devices)
    env = service_env(SKUFORGE_STORE=str(store))
    args = ["rollout", "plan", "--model", MODEL, "--inventory", str(tmp_path / "fleet.csv"), "--waves", "100"]
    proc = skuforge(*args, "--json", cwd=reg.root, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    p = json.loads(proc.stdout)
    assert p["classes"] == {CLASS: "cpu"} and p["devices"] == 16
    (wave,) = p["waves"]
    assert (wave["by_class"], wave["by_sku"]) == ({CLASS: 8, "rpi5": 4}, {"portable": 4})
    assert (
        wave["on_fallback"] == 3
        and p["fallback"]["by_class"] == {"rpi5": 3}
        and p["fallback"]["examples"]
        == [
            "pi-0",
            "pi-1",
            "pi-2",
        ]
    )
    text = skuforge(*args, cwd=reg.root, env=env)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert any(line.split() == ["class", CLASS, "8", "devices", "->", "cpu"] for line in lines), text.stdout
    assert any(
        line.split()[:5] == ["class", "rpi5", "4", "devices", "->"] and "no engine selected" in line for line in lines
    )
    assert "devices naming no class: portable 4" in text.stdout
    assert "3 device(s) will run the portable fallback portable (the release has no engine for them): class rpi5 3" in (
        text.stdout
    )
