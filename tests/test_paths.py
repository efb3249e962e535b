"""Where stages write: dvc.yaml names the same paths as pipeline.core.paths.Layout."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from pipeline.core.paths import Layout
from pipeline.engine.matrix import pipeline_file
from pipeline.ops.pipelines import pipeline_files
from pipeline.project.config import load_registry
from pipeline.results.dvcmetrics import pair_file

REPO = Path(__file__).resolve().parents[1]
ROOT = Path("/project")
L = Layout(ROOT)


def sku_files() -> dict[str, dict]:
    """The per-SKU pipeline files the repository's registry renders for its first SKU, that SKU's
    name written S: (model, SKU) stages run once per model, ``${item}``."""
    registry = load_registry(REPO / "params.yaml")
    sku = next(iter(registry.skus))
    return {
        "build": yaml.safe_load(pipeline_files(registry)[pipeline_file(sku, run=False)].replace(sku, "S")),
        "run": yaml.safe_load(pipeline_files(registry)[pipeline_file(sku, run=True)].replace(sku, "S")),
    }


def dvc_stages() -> dict:
    """dvc.yaml's stages, with the (model, SKU) stages of the SKU files as their per-model body."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for doc in sku_files().values():
        stages.update({name: stage["do"] for name, stage in doc["stages"].items()})
    return stages


def substitute(text: str) -> str:
    for var, value in (("${key}", "M"), ("${item}", "M")):
        text = text.replace(var, value)
    return text


def expand(path: str) -> Path:
    return ROOT / substitute(path)


def names(entries) -> set[Path]:
    return {expand(next(iter(e)) if isinstance(e, dict) else e) for e in entries}


def test_per_model_stage_outputs_match_the_layout():
    stages = dvc_stages()
    assert names(stages["prepare"]["do"]["outs"]) == {L.prepare_dir("M")}
    assert names(stages["data"]["do"]["outs"]) == {L.data_dir("M")}
    assert names(stages["reference"]["do"]["outs"]) == {L.reference_dir("M")}
    assert names(stages["calibrate"]["do"]["outs"]) == {L.calibration_dir("M")}


def test_per_sku_stage_outputs_match_the_layout():
    stages = dvc_stages()
    assert names(stages["build"]["outs"]) == {
        L.engine_dir("M", "S"),
        L.report("M", "S", "build"),
        L.cache_dir("M", "S"),
    }
    assert names(stages["validate"]["outs"]) == {L.report("M", "S", "validate"), L.engine_outputs("M", "S")}
    assert names(stages["bench"]["outs"]) == {
        L.report("M", "S", "bench"),
        L.latency_csv("M", "S"),
        L.timeline_csv("M", "S"),
    }
    assert names(stages["manifest"]["outs"]) == {
        L.manifest("M", "S"),
        *(pair_file(ROOT, kind, "M", "S") for kind in ("bench", "latency_cdf", "timeline")),
    }
    assert names(stages["publish"]["outs"]) == {L.report("M", "S", "publish")}


def test_publish_reads_what_the_earlier_stages_wrote():
    stages = dvc_stages()
    assert names(stages["publish"]["deps"]) == {
        L.config_file("M", "S"),
        L.manifest("M", "S"),
        L.engine_dir("M", "S"),
        L.report("M", "S", "build"),
        L.report("M", "S", "validate"),
        L.report("M", "S", "bench"),
        L.latency_csv("M", "S"),
        L.timeline_csv("M", "S"),
    }
    # a receipt of an external side effect: never restored from DVC's cache without running
    (receipt,) = stages["publish"]["outs"]
    assert next(iter(receipt.values())) == {"cache": False, "persist": True}


def test_reports_sit_next_to_their_outputs():
    assert L.report("M", None, "prepare") == L.prepare_dir("M") / "prepare.json"
    assert L.report("M", None, "data").parent == L.data_dir("M")
    assert L.split("M", "golden", raw=True).name == "golden.raw.npz"
    assert L.report("M", "S", "bench") == L.sku_dir("M", "S") / "bench.json"


def test_stage_commands_name_existing_cli_commands():
    from pipeline.cli import build_parser

    parser = build_parser()
    for name, stage in dvc_stages().items():
        cmd = (stage.get("do") or stage)["cmd"]
        assert cmd.startswith(f"skuforge {name} "), cmd
        # registry names reach a shell: each one is a single-quoted word (defence behind the name rule)
        assert not re.search(r"(?<!')\$\{[^}]*\}|\$\{[^}]*\}(?!')", cmd), cmd
        args = parser.parse_args(shlex.split(substitute(cmd))[1:])
        assert args.command == name


def test_every_stage_depends_on_its_resolved_config_file():
    stages = dvc_stages()
    assert names(stages["config"]["outs"]) == {L.config_dir()}
    assert expand(stages["export"]["do"]["deps"][0]) == L.config_file("M", example=True)
    for name in ("prepare", "data", "reference", "calibrate"):
        assert expand(stages[name]["do"]["deps"][0]) == L.config_file("M"), name
        assert "params" not in stages[name]["do"], name
    for name in ("build", "validate", "bench", "manifest", "publish"):
        assert expand(stages[name]["deps"][0]) == L.config_file("M", "S"), name
        assert "params" not in stages[name], name


def test_stage_families_in_repro_match_dvc_yaml():
    from pipeline.engine.matrix import (
        BUILD_STAGES,
        EXAMPLE_STAGES,
        GLOBAL_STAGES,
        MODEL_STAGES,
        PAIR_STAGES,
        RUN_STAGES,
    )

    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert set(stages) == {*GLOBAL_STAGES, *EXAMPLE_STAGES, *MODEL_STAGES}
    assert all("foreach" in stages[s] for s in (*EXAMPLE_STAGES, *MODEL_STAGES))
    files = sku_files()
    assert tuple(files["build"]["stages"]) == BUILD_STAGES and tuple(files["run"]["stages"]) == RUN_STAGES
    assert (*BUILD_STAGES, *RUN_STAGES) == PAIR_STAGES
    # each runs at the project root: commands and lock paths as if dvc.yaml held them
    for name, doc in files.items():
        depth = len(Path(pipeline_file("S", run=name == "run")).parent.parts)
        assert all(s["do"]["wdir"] == "/".join([".."] * depth) for s in doc["stages"].values()), name
