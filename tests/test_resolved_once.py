"""A command resolves its (model, SKU) once (``Registry.pair``) and passes the pair down: the build
(with a remedy that bisects and rebuilds), validate, bench, a bisection and the manifest look
neither name up again. Counted on the Registry's lookups themselves, through the library and
through the command line in this process."""

from __future__ import annotations

import pickle
from collections import Counter

import models
import pytest
import yaml

import pipeline.cli.commands as commands
from pipeline.cli import main
from pipeline.core.paths import Layout
from pipeline.project.config import Registry, load_registry
from pipeline.stages.bench import bench
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.config import resolved
from pipeline.stages.data import make_data
from pipeline.stages.manifest import write_manifest
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate
from pipeline.verify.bisect import bisect

# every Registry method that looks a model or a SKU up by name, or derives a pair's setting from one
LOOKUPS = ("model", "sku", "pair", "tolerance", "metric_gate", "bench", "pins", "higher_precision", "model_file")
SKU = "ort_int8"
BENCH = {"warmup": 2, "steady_window": 5, "max_warmup_seconds": 1.0, "roofline": False, "iterations": 30}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """An INT8 engine with a planted outlier channel, built with the remedy during the build (the
    build bisects, keeps nodes precise and rebuilds): every path that could look the pair up."""
    root = tmp_path_factory.mktemp("resolved")
    models.outlier_channel_model(root / "m" / "model.onnx")
    sku = models.CPU_SKUS[SKU] | {"bisect": {"fix_during_build": True}, "bench": BENCH}
    models.write_project(root, {"m": models.outlier_channel_spec()}, {SKU: sku})
    reg = load_registry(root / "params.yaml")
    for stage in (prepare, make_data, reference, calibrate):
        stage(reg, "m")
    return root


@pytest.fixture
def lookups(monkeypatch) -> Counter:
    calls: Counter = Counter()
    for name in LOOKUPS:
        real = getattr(Registry, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Registry, name, counted)
    return calls


def test_the_library_stages_given_a_pair_look_nothing_up(project, lookups):
    reg = load_registry(project / "params.yaml")
    lookups.clear()  # the loader's own checks walk every entry
    pair = reg.pair("m", SKU)
    assert lookups == Counter(pair=1, model=1, sku=1)
    lookups.clear()
    report = build(pair)
    assert report.remedy is not None and report.remedy.builds > 1  # the remedy bisected and rebuilt
    assert validate(pair).passed
    bench(pair)
    bisect(pair, max_builds=4)
    write_manifest(pair)
    assert lookups == Counter(), f"looked up again below the edge: {dict(lookups)}"


@pytest.mark.parametrize(
    "command",
    [
        ["build"],
        ["validate"],
        ["bench"],
        ["bisect", "--max-builds", "4"],
        ["manifest"],
    ],
)
def test_each_command_resolves_the_pair_once(project, lookups, monkeypatch, command):
    real = commands.load_registry

    def loaded(params):  # the loader's own checks walk every entry: counted from after it
        reg = real(params)
        lookups.clear()
        return reg

    monkeypatch.setattr(commands, "load_registry", loaded)
    for before in {
        "validate": ["build"],
        "bench": ["build"],
        "bisect": ["build"],
        "manifest": ["build", "validate", "bench"],
    }.get(command[0], []):  # what the command reads
        assert main(["--params", str(project / "params.yaml"), before, "--model", "m", "--sku", SKU]) == 0
    argv = ["--params", str(project / "params.yaml"), command[0], "--model", "m", "--sku", SKU, *command[1:]]
    assert main(argv) == 0
    assert lookups == Counter(pair=1, model=1, sku=1), dict(lookups)


def test_the_settings_dvc_tracks_are_the_pair_the_stages_use(project):
    """stages/config.py writes the pair's settings file from the same object the stages get."""
    reg = load_registry(project / "params.yaml")
    pair = reg.pair("m", SKU)
    assert resolved(reg)[Layout(project).config_file("m", SKU).name] == pair.settings()
    doc = yaml.safe_load((project / "params.yaml").read_text())
    assert pair.settings()["sku_spec"]["bisect"]["fix_during_build"] is True
    assert pair.settings()["pins"] == reg.pins("m", SKU)
    assert pair.settings()["tolerance"] == reg.tolerance("m", SKU).model_dump(mode="json")
    assert list(pair.higher_precision) == doc["models"]["m"].get("higher_precision", {}).get(SKU, [])


def test_a_pairs_pins_refuse_changes_and_travel_to_a_spawned_build(project):
    """A stage that wants other axis values copies them; the pair pickles to the reproducibility
    check's second process with its values."""
    pair = load_registry(project / "params.yaml").pair("m", SKU)
    with pytest.raises(TypeError, match="read-only"):
        pair.pins["batch"] = 4
    with pytest.raises(TypeError, match="read-only"):
        pair.pins.update(batch=4)
    again = pickle.loads(pickle.dumps(pair))
    assert again.pins == pair.pins and again.settings() == pair.settings()
