"""`skuforge release`, `skuforge rollout` and `skuforge agent` as a user runs them: from a built
project to an engine active on a device, and the errors a careless or hostile input gets."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import yaml
from cli_helpers import assert_user_error, skuforge

from pipeline.host.probe import host_arch
from pipeline.rollout.inventory import Device, write_inventory
from rollout.fleet import Fleet


@pytest.fixture(scope="module")
def shipped(project, tmp_path_factory):
    """A copy of the project with its store initialised and r1 published, a fleet and a device file."""
    root = tmp_path_factory.mktemp("cli") / "project"
    shutil.copytree(project.root, root)
    env = {**os.environ, "SKUFORGE_STORE": str(root / "store")}
    for args in (
        ("release", "init"),
        ("release", "publish", "--model", "conv"),
        ("release", "root", "--out", "root.json"),
    ):
        proc = skuforge(*args, cwd=root, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    write_inventory(
        root / "fleet.csv",
        [
            Device(id=f"dev-{i:03d}", sku="cpu", arch="x86_64", runtime={"onnxruntime": "1.32.0"}, key=k.public_key)
            for i, k in enumerate(Fleet(200).keys.values())
        ],
    )
    return root, env


def _device_file(path, device_id: str, **extra) -> None:
    path.write_text(
        yaml.safe_dump(
            {"id": device_id, "sku": "cpu", "models": ["conv"], "arch": host_arch(), "cpu_features": [], **extra}
        )
    )


def test_ship_to_a_device(shipped, tmp_path):
    root, env = shipped
    proc = skuforge("rollout", "plan", "--model", "conv", "--inventory", "fleet.csv", "--json", cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["devices"] == 200 and [w["name"] for w in plan["waves"]] == ["canary", "half", "all"]

    proc = skuforge(
        "rollout",
        "start",
        "--model",
        "conv",
        "--inventory",
        "fleet.csv",
        "--reason",
        "first ship",
        "--json",
        cwd=root,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["status"] == "active" and doc["release"] == "r1" and doc["planned"][-1] == 200

    from pipeline.project.config import Wave
    from pipeline.rollout.plan import included

    waves = [Wave(**w) for w in doc["waves"]]
    canary = next(f"dev-{i:03d}" for i in range(200) if included(waves, 0, doc["id"], f"dev-{i:03d}", None))
    _device_file(tmp_path / "device.yaml", canary)
    # provisioning: the device's public key goes into the inventory the controller reads
    proc = skuforge("agent", "identity", "--state", "state", "--json", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    device_key = json.loads(proc.stdout)["key"]
    fleet = [
        Device(
            id=f"dev-{i:03d}",
            sku="cpu",
            arch="x86_64",
            runtime={"onnxruntime": "1.32.0"},
            key=device_key if f"dev-{i:03d}" == canary else k.public_key,
        )
        for i, k in enumerate(Fleet(200).keys.values())
    ]
    write_inventory(tmp_path / "fleet.csv", fleet)
    env = {**env, "INVENTORY": str(tmp_path / "fleet.csv")}
    proc = skuforge(
        "agent",
        "--device",
        "device.yaml",
        "--state",
        "state",
        "--root",
        str(root / "root.json"),
        "--json",
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["outcome"] == "ok" and result["active"]["release"] == "r1"
    assert (tmp_path / "state/models/conv/slots/a/engine/model.onnx").is_file()

    inv = ("--inventory", env["INVENTORY"])
    proc = skuforge("rollout", "status", "--all", "--json", *inv, cwd=root, env=env)
    status = json.loads(proc.stdout)["conv"]
    assert status["health"]["counts"]["ok"] == 1 and status["action"] == "wait"
    proc = skuforge("rollout", "status", "--all", "--json", cwd=root, env=env)  # no inventory: no gates
    assert json.loads(proc.stdout)["conv"]["health"] is None
    proc = skuforge("rollout", "status", "--all", "--markdown", *inv, cwd=root, env=env)
    assert proc.stdout.startswith("| model | rollout |") and "conv" in proc.stdout

    proc = skuforge("rollout", "advance", "--all", *inv, cwd=root, env=env)
    assert proc.returncode == 0 and "wait" in proc.stdout, proc.stdout + proc.stderr
    proc = skuforge("rollout", "advance", "--all", cwd=root, env=env)  # live, and nothing to verify reports with
    assert_user_error(proc, 2, "1 live rollout(s) (conv) and no fleet inventory")

    proc = skuforge("rollout", "pause", "--model", "conv", cwd=root, env=env)
    assert proc.returncode == 2 and "--reason" in proc.stderr  # argparse: the reason is required
    for action, status_after in (("pause", "paused"), ("resume", "active"), ("abort", "aborted")):
        proc = skuforge("rollout", action, "--model", "conv", "--reason", f"test {action}", "--json", cwd=root, env=env)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)[0]["status"] == status_after
    proc = skuforge("rollout", "rollback", "--model", "conv", "--reason", "no previous", cwd=root, env=env)
    assert_user_error(proc, 2, "no previous release")

    # ended rollouts stay visible in CI's summary, with their last transition
    proc = skuforge("rollout", "status", "--all", "--markdown", cwd=root, env=env)
    assert "**aborted**" in proc.stdout and "abort by " in proc.stdout and "test abort" in proc.stdout
    proc = skuforge("agent", "--device", "device.yaml", "--state", "state", "--json", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = json.loads(proc.stdout)
    assert (kept["outcome"], kept["active"]["release"]) == ("idle", "r1") and "aborted" in kept["detail"]


def test_agent_refuses_bad_device_files(shipped, tmp_path):
    root, env = shipped
    _device_file(tmp_path / "device.yaml", "../../etc")
    proc = skuforge(
        "agent", "--device", "device.yaml", "--state", "state", "--root", str(root / "root.json"), cwd=tmp_path, env=env
    )
    assert_user_error(proc, 2, "device.yaml")
    assert not (tmp_path / "state").exists()
    _device_file(tmp_path / "device.yaml", "dev-x", models=["conv", "../../x"])  # model names name folders here
    proc = skuforge(
        "agent", "--device", "device.yaml", "--state", "state", "--root", str(root / "root.json"), cwd=tmp_path, env=env
    )
    assert_user_error(proc, 2, "device.yaml: models.1: '../../x' is not a model name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["device.yaml"]  # nothing written
    (tmp_path / "device.yaml").write_text("id: [unclosed\n")
    proc = skuforge("agent", "--device", "device.yaml", "--state", "state", cwd=tmp_path, env=env)
    assert_user_error(proc, 2, "device.yaml")


def test_agent_without_a_trusted_root(shipped, tmp_path):
    root, env = shipped
    _device_file(tmp_path / "device.yaml", "dev-new")
    proc = skuforge("agent", "--device", "device.yaml", "--state", "state", cwd=tmp_path, env=env)
    assert_user_error(proc, 2, "trusted root")


@pytest.mark.parametrize(
    "args, code, words",
    [
        (("rollout", "status", "--model", "x; rm -rf ~"), 2, ("unknown model",)),
        (("rollout", "start", "--model", "../../x"), 2, ("unknown model",)),
        (("release", "publish", "--model", "conv", "--store", "ftp://host/x"), 2, ("unsupported store",)),
        (("release", "publish", "--model", "conv", "--alias", "nope"), 2, ("unknown alias",)),
    ],
)
def test_hostile_arguments(shipped, args, code, words):
    root, env = shipped
    proc = skuforge(*args, cwd=root, env=env)
    assert_user_error(proc, code, *words)
    assert not (root / "x").exists()


def test_partial_release_and_rollout_overrides(shipped, tmp_path):
    root, env = shipped
    proc = skuforge("release", "publish", "--model", "conv", "--sku", "portable", cwd=root, env=env)
    assert_user_error(proc, 1, "would lack 1 of its 2 SKUs: cpu", "--allow-partial cpu")
    proc = skuforge(
        "rollout", "plan", "--model", "conv", "--inventory", "fleet.csv", "--waves", "5,100", "--bake", "3",
        "--label", "lab", "--json", cwd=root, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert [(w["name"], w["percent"], w["bake_minutes"]) for w in plan["waves"]] == [
        ("wave1", 5, 3),
        ("wave2", 100, 0),  # the last wave keeps rollout.waves' last bake time
    ]
    assert plan["not_targeted"]["devices"] == 200 and plan["labels"] == ["lab"]
    proc = skuforge(
        "rollout", "plan", "--model", "conv", "--waves", "50,5", "--inventory", "fleet.csv", cwd=root, env=env
    )
    assert_user_error(proc, 2, "rising percentages")
    proc = skuforge("rollout", "plan", "--model", "conv", "--waves", "x", cwd=root, env=env)
    assert proc.returncode == 2 and "comma-separated percentages" in proc.stderr


def test_advance_all_keeps_the_timestamp_fresh_with_no_live_rollout(project, tmp_path):
    root = tmp_path / "project"
    shutil.copytree(project.root, root)
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["rollout"]["expiry"] = {"timestamp_days": 2 / 86400}  # two seconds
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "SKUFORGE_STORE": str(root / "store")}
    assert skuforge("release", "init", cwd=root, env=env).returncode == 0
    ts = root / "store" / "metadata" / "timestamp.json"
    before = json.loads(ts.read_text())["signed"]
    time.sleep(1.5)  # past half the timestamp's life, whatever the host's speed: it must be re-signed
    proc = skuforge("rollout", "advance", "--all", "--json", cwd=root, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out == {"rollouts": {}, "timestamp_refreshed": True}
    after = json.loads(ts.read_text())["signed"]
    assert after["version"] > before["version"] and after["expires"] > before["expires"]


def test_release_init_pins_each_store_and_checks_before_it_writes(project, tmp_path):
    """Two stores of one project: each init writes that store's pin, and every writer anchors on the
    pin of the store it opens (the issue: a second init on another store exited 1 after creating it,
    then 0 "already initialised" with the first store's pin)."""
    root = tmp_path / "project"
    shutil.copytree(project.root, root)
    env = {k: v for k, v in os.environ.items() if k != "SKUFORGE_STORE"}
    pins = {}
    for store in ("stores/a", "stores/b"):
        proc = skuforge("release", "init", "--store", store, "--json", cwd=root, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = json.loads(proc.stdout)
        assert out["result"] == "created" and out["pin_written"] and out["pin"].startswith("release-roots/")
        pins[store] = out["pin"]
        assert (root / out["pin"]).read_bytes() == (root / store / "metadata/1.root.json").read_bytes()
    assert pins["stores/a"] != pins["stores/b"]
    for store in ("stores/a", str(root / "stores/b")):  # an absolute path inside the project: the same pin
        proc = skuforge("release", "publish", "--model", "conv", "--store", store, cwd=root, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = skuforge("release", "init", "--store", "stores/a", "--json", cwd=root, env=env)
    assert json.loads(proc.stdout)["result"] == "existing" and not json.loads(proc.stdout)["pin_written"]
    proc = skuforge("release", "root", "--store", "stores/b", "--out", "b.json", "--json", cwd=root, env=env)
    assert proc.returncode == 0 and json.loads(proc.stdout)["root_version"] == 1, proc.stderr

    # a pinned store emptied: init refuses (and creates nothing) instead of starting another root
    shutil.rmtree(root / "stores/b")
    proc = skuforge("release", "init", "--store", "stores/b", cwd=root, env=env)
    assert_user_error(proc, 1, "pins a root", "has no repository")
    assert not (root / "stores/b/metadata").exists()

    # the single release-root.json of earlier versions still anchors the store it was made for
    (root / "release-root.json").write_bytes((root / pins["stores/a"]).read_bytes())
    (root / pins["stores/a"]).unlink()
    proc = skuforge("release", "root", "--store", "stores/a", "--out", "a.json", cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr
    proc = skuforge("release", "init", "--store", "stores/a", "--json", cwd=root, env=env)
    assert json.loads(proc.stdout)["pin_written"] and (root / pins["stores/a"]).is_file()


def test_a_replayed_store_is_refused_by_every_command_until_repaired(project, tmp_path):
    """Issue 24's replay, from the command line: an older timestamp.json put back after an abort."""
    root = tmp_path / "project"
    shutil.copytree(project.root, root)
    env = {**os.environ, "SKUFORGE_STORE": str(root / "store")}
    for args in (("release", "init"), ("release", "publish", "--model", "conv")):
        proc = skuforge(*args, cwd=root, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    write_inventory(root / "fleet.csv", Fleet(20).inventory)
    ts = root / "store/metadata/timestamp.json"
    proc = skuforge(
        "rollout", "start", "--model", "conv", "--inventory", "fleet.csv", "--reason", "ship", cwd=root, env=env
    )
    assert proc.returncode == 0, proc.stderr
    live = ts.read_bytes()
    proc = skuforge("rollout", "abort", "--model", "conv", "--reason", "bad", cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr
    aborted = json.loads(ts.read_text())["signed"]["version"]
    ts.write_bytes(live)

    versions = f"version {aborted - 1}, older than version {aborted}"
    for args in (
        ("rollout", "status", "--model", "conv"),
        ("rollout", "advance", "--all"),
        ("rollout", "resume", "--model", "conv", "--reason", "replayed"),
        ("rollout", "start", "--model", "conv", "--inventory", "fleet.csv"),
        ("release", "publish", "--model", "conv"),
    ):
        assert_user_error(skuforge(*args, cwd=root, env=env), 1, versions, "skuforge release repair")
    assert ts.read_bytes() == live

    proc = skuforge("release", "repair", "--json", cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["replayed"], out["found"], out["newest"], out["timestamp"]) == (True, aborted - 1, aborted, aborted + 1)
    proc = skuforge("rollout", "status", "--model", "conv", "--json", cwd=root, env=env)
    assert proc.returncode == 0 and json.loads(proc.stdout)["conv"]["rollout"]["status"] == "aborted", proc.stderr
    proc = skuforge("release", "repair", cwd=root, env=env)
    assert proc.returncode == 0 and "nothing to repair" in proc.stdout


def test_s3_commands_do_not_print_botocore_chatter(moto_s3, tmp_path):
    from cli_helpers import project as make_cli_project
    from cli_helpers import service_env

    make_cli_project(tmp_path)
    env = service_env(
        AWS_ENDPOINT_URL=moto_s3.endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(tmp_path / "none"),
    )
    store = f"s3://{moto_s3.make_bucket()}/fleet"
    proc = skuforge("release", "init", "--store", store, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "credentials" not in proc.stderr.lower(), proc.stderr
    proc = skuforge("release", "root", "--store", store, "--out", "root.json", cwd=tmp_path, env=env)
    assert proc.returncode == 0 and "credentials" not in proc.stderr.lower(), proc.stderr
