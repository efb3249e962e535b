"""A planted slowdown: the same model, its SKU changed to a deliberately worse option. The new
engine's benchmark summary moves beyond its intervals and the promotion gate blocks it on the
latency samples, with a real ONNX Runtime engine, real timings and a real MLflow server."""

from __future__ import annotations

import models
import pytest
from registry_helpers import FAST_RETRIES

from pipeline.core.paths import Layout
from pipeline.project.config import load_registry
from pipeline.results.manifest import benchmark_changes, load_manifest
from pipeline.stages.bench import bench
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.manifest import write_manifest
from pipeline.stages.prepare import prepare
from pipeline.stages.publish import publish
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate
from pipeline.tracking.client import connect
from pipeline.tracking.promotion import PromotionBlocked, promote

pytestmark = pytest.mark.slow

BENCH = {"warmup": 5, "steady_window": 20, "max_warmup_seconds": 2.0, "iterations": 300, "min_seconds": 0.3}


def project(root, level: str):
    sku = models.ort_sku(
        "fp32", options={"providers": ["CPUExecutionProvider"], "graph_optimization_level": level}, bench=BENCH
    )
    release = {"tracking": FAST_RETRIES, "performance": {"max_regression": 0.1, "min_samples": 30}}
    return load_registry(
        models.write_project(root, {"ln": models.vector_model_spec("models/ln")}, {"cpu": sku}, release=release)
    )


def engine(reg) -> None:
    for stage in (build, validate, bench, write_manifest):
        stage(reg.pair("ln", "cpu"))


def test_a_worse_sku_option_moves_the_benchmark_and_the_performance_gate_blocks_it(tmp_path, server):
    models.decomposed_layernorm_model(tmp_path / "models/ln/model.onnx")
    reg = project(tmp_path, "all")  # each decomposed layer norm fused into one kernel
    for stage in (prepare, make_data, reference, calibrate):
        stage(reg, "ln")
    engine(reg)
    tracking = connect(reg, uri=server.uri)
    publish(reg.pair("ln", "cpu"), tracking=tracking)
    assert promote(reg, "ln", "candidate", ["cpu"], tracking=tracking).passed
    path = Layout(reg.root).manifest("ln", "cpu")
    before = load_manifest(path).benchmark

    reg = project(tmp_path, "disable")  # the planted slowdown: nine nodes per layer norm
    engine(reg)
    after = load_manifest(path).benchmark
    moved = benchmark_changes(before, after)
    assert any(m.startswith("engine_only.p50_ms") for m in moved), moved
    assert after.engine_only.p50_ci_ms[0] > before.engine_only.p50_ci_ms[1]
    publish(reg.pair("ln", "cpu"), tracking=tracking)
    with pytest.raises(PromotionBlocked) as blocked:
        promote(reg, "ln", "candidate", ["cpu"], tracking=tracking, reason="planted slowdown")
    gate = next(g for g in blocked.value.report.moves[0].gates if g.name == "performance")
    assert not gate.passed and gate.data["outcome"] == "regressed", gate.detail
    assert gate.data["ratio"] > 1.1 and gate.data["incumbent"] == "1"
    assert dict(tracking.client.get_registered_model("ln.cpu").aliases) == {"candidate": "1"}
