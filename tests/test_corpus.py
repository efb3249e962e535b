"""The corpus: models as other exporters write them (old opsets, weights in float_data, control
flow, recurrent state, several outputs, external data), each through the whole pipeline on every
CPU SKU kind this host can build (LiteRT INT8 on a representative subset, LITERT_INT8_FIXTURES: its
conversions take ~10 s each; LiteRT FP32 on all). Each (fixture, SKU) has a pinned outcome: it passes, or it is
listed in KNOWN_UNSUPPORTED (a clean UnsupportedOp naming that op, the node and the backend) or in
KNOWN_GATE_FAILURES (builds, runs, misses its gate). A pair that regresses from passed to
unsupported fails, and so does a listed pair that starts passing (strict: update the table).

The exporter-style fixtures of tests/exporter_models.py (a DBNet-style detector, a CTC recognizer,
an opset-11 classifier with a shapeless value_info entry, a stateful model with an If, a conv
classifier) declare a postprocess, so the task agreement decides their verdicts; they run on the
SKU kinds those verdicts are about only (EXPORTER_SKUS: ONNX Runtime FP32 and INT8, OpenVINO INT8,
LiteRT INT8, IREE FP16), which keeps their share of the module near a minute.

The outcomes are collected into a matrix printed at the end of the module (and written to
``corpus-matrix.txt`` in the module's temporary folder).
"""

from __future__ import annotations

from types import SimpleNamespace

import exporter_models
import models
import onnx
import pytest

from pipeline.backends import litert_converter
from pipeline.core.errors import GateFailed, UnsupportedOp
from pipeline.core.paths import Layout
from pipeline.project.config import load_registry
from pipeline.stages.bench import bench
from pipeline.stages.build import build
from pipeline.stages.calibrate import calibrate
from pipeline.stages.data import make_data
from pipeline.stages.manifest import write_manifest
from pipeline.stages.prepare import prepare
from pipeline.stages.reference import reference
from pipeline.stages.validate import validate

pytestmark = pytest.mark.slow

NEWEST = onnx.defs.onnx_opset_version()
# LiteRT's SKUs here only (not models.CPU_SKUS: tests/test_bisect.py would build them for every case);
# XNNPACK and the built-in kernels both allowed: fallback is reported in the build, not judged here
ANY_LITERT_KERNEL = {"placement": {"allowed": ["xnnpack", "cpu"]}}
SKUS = models.CPU_SKUS | {
    "litert_fp32": models.cpu_sku("litert", "fp32", {"delegate": "xnnpack"}) | ANY_LITERT_KERNEL,
    "litert_int8": exporter_models.LITERT_INT8,
}


def _conv(opset: int):
    return (lambda path: models.conv_pool_slice_model(path, opset)), models.vector_spec("m") | {
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 3, 8, 8]}]
    }


FIXTURES = {
    **{f"conv_opset{o}": _conv(o) for o in sorted({11, 12, 13, 17, NEWEST})},
    "if": (
        models.if_model,
        {
            "dir": "m",
            "source": "model.onnx",
            "inputs": [
                {"name": "x", "dtype": "float32", "shape": ["batch", 4], "range": [-1.0, 1.0]},
                {"name": "flag", "dtype": "float32", "shape": [], "range": [-1.0, 1.0]},
            ],
        },
    ),
    "loop": (models.loop_model, models.vector_spec("m")),
    "lstm": (lambda path: models.rnn_model(path, "LSTM"), models.rnn_spec("m", "LSTM")),
    "gru": (lambda path: models.rnn_model(path, "GRU"), models.rnn_spec("m", "GRU")),
    "multi_output": (models.multi_io_model, models.multi_io_spec("m")),
    # paddle2onnx names and an opset-11 Softmax over a non-last axis (the INT8 quantizer crashed)
    "paddle_softmax": (models.paddle_softmax_model, _conv(11)[1]),
    "external_data": (models.external_data_model, models.vector_spec("m")),
    # models whose outputs a device app post-processes: the task agreement decides their verdicts
    **{name: (builder, spec("m")) for name, (builder, spec) in exporter_models.FIXTURES.items()},
}
MATRIX: dict[tuple[str, str], str] = {}
# LiteRT INT8 (a ~10 s conversion each) on these only: a conv net, an opset-11 Softmax converted to
# 13, int64 and scalar I/O with an embedding, a refusal, and the exporter-style fixtures (their INT8
# verdicts are what they are for); LiteRT FP32 runs every fixture but those
LITERT_INT8_FIXTURES = ("conv_opset13", "paddle_softmax", "multi_output", "lstm", *exporter_models.FIXTURES)
# The exporter-style fixtures (tests/exporter_models.py) on the SKU kinds whose verdicts they are
# about only: INT8 on each INT8 backend and IREE FP16 against the ONNX Runtime FP32 baseline. Their
# LiteRT FP32, IREE FP32 and OpenVINO FP32 builds would add ~100 s to the module and judge nothing
# these do not (a LiteRT conversion takes ~13 s here)
EXPORTER_SKUS = ("ort_fp32", "ort_int8", "ov_int8", "iree_fp16", "litert_int8")
# Pairs a backend refuses with UnsupportedOp, and the op it names. Every fixture builds on every
# other CPU SKU (onnxruntime 1.32, OpenVINO 2026.4, IREE 3.13); onnx2tf 1.29.24 fails on these nodes
# (the Loop body's While layer, an LSTM Reshape and a GRU Split of the wrong size), keep_ncw or not
KNOWN_UNSUPPORTED: dict[tuple[str, str], str] = {
    **{(fixture, "litert_fp32"): op for fixture, op in (("loop", "Loop"), ("lstm", "LSTM"), ("gru", "GRU"))},
    ("lstm", "litert_int8"): "LSTM",
    # onnx2tf 1.29.24 fails on the If whose then branch reads weights of the outer graph ("could not
    # convert the model: 'wx'", a KeyError on that initializer); the "if" fixture's branches read only
    # a graph input and hold their own Constants, and it converts (litert_fp32)
    ("stateful_if", "litert_int8"): "If",
}
# Pairs that build and run but miss the accuracy gate, and why (strict: a fix turns them red)
KNOWN_GATE_FAILURES = {
    ("multi_output", "ov_int8"): "OpenVINO 2026.4 CPU computes the QDQ graph's quantized Gather (embedding) path "
    "wrong (ONNX Runtime runs the same graph within 0.04; with the intermediates made "
    "outputs OpenVINO matches exactly: a CPU graph transformation); skuforge bisect "
    "names the ReduceSum fed by the Gather, and --fix passes keeping [pool, embed] "
    "(tests/test_bisect.py)",
}


def _available(backend: str) -> bool:
    import importlib.util

    if backend == "litert":  # the runtime, and the converter's own environment to build with
        return importlib.util.find_spec("ai_edge_litert") is not None and not litert_converter.problems()
    module = {"onnxruntime": "onnxruntime", "openvino": "openvino", "iree": "iree.compiler"}[backend]
    return importlib.util.find_spec(module.split(".")[0]) is not None and importlib.util.find_spec(module) is not None


def render_matrix(matrix: dict[tuple[str, str], str]) -> str:
    skus = [s for s in SKUS if any(k[1] == s for k in matrix)]
    fixtures = [f for f in FIXTURES if any(k[0] == f for k in matrix)]
    width = max([len(f) for f in fixtures] + [7])
    cells = {k: v for k, v in matrix.items()}
    col = {s: max([len(s)] + [len(cells.get((f, s), "")) for f in fixtures]) for s in skus}
    lines = [f"{'fixture':<{width}} | " + " | ".join(f"{s:<{col[s]}}" for s in skus)]
    lines.append("-" * len(lines[0]))
    for f in fixtures:
        lines.append(f"{f:<{width}} | " + " | ".join(f"{cells.get((f, s), '-'):<{col[s]}}" for s in skus))
    return "\n".join(lines)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, request):
    """One project per fixture, prepared, with data, reference and calibration table."""
    root = tmp_path_factory.mktemp("corpus")
    projects = {}
    for name, (builder, spec) in FIXTURES.items():
        proj = root / name
        builder(proj / spec["dir"] / spec["source"])
        reg = load_registry(models.write_project(proj, {name: spec}, SKUS))
        prepare(reg, name)
        make_data(reg, name)
        reference(reg, name)
        calibrate(reg, name)
        projects[name] = SimpleNamespace(registry=reg, out=Layout(reg.root))
    yield projects
    table = render_matrix(MATRIX)
    (root / "corpus-matrix.txt").write_text(table + "\n")
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # teardown output is captured otherwise
            reporter.write_line(f"\ncorpus matrix (fixture x SKU):\n{table}")


def _pairs():
    for fixture in FIXTURES:
        for sku in SKUS:
            if sku == "litert_int8" and fixture not in LITERT_INT8_FIXTURES:
                continue
            if fixture in exporter_models.FIXTURES and sku not in EXPORTER_SKUS:
                continue
            reason = KNOWN_GATE_FAILURES.get((fixture, sku))
            marks = [pytest.mark.xfail(raises=GateFailed, strict=True, reason=reason)] if reason else []
            yield pytest.param(fixture, sku, id=f"{fixture}-{sku}", marks=marks)


@pytest.mark.parametrize(("fixture", "sku"), list(_pairs()))
def test_corpus(corpus, fixture, sku):
    backend = SKUS[sku]["backend"]
    if not _available(backend):
        MATRIX[fixture, sku] = "skipped: no SDK"
        pytest.skip(f"{backend} is not installed")
    reg = corpus[fixture].registry
    try:
        report = build(reg.pair(fixture, sku))
    except UnsupportedOp as exc:
        MATRIX[fixture, sku] = f"unsupported: {exc.op_type} ({exc.node})" if exc.op_type else "unsupported"
        assert exc.backend == backend
        assert exc.op_type and exc.node, f"the refusal must name the op and the node: {exc}"
        assert (fixture, sku) in KNOWN_UNSUPPORTED, (
            f"{fixture} on {sku} was expected to build, and {backend} refused {exc.op_type} ({exc.node}): "
            "a regression, or list it in KNOWN_UNSUPPORTED with the op"
        )
        assert exc.op_type == KNOWN_UNSUPPORTED[fixture, sku], exc
        return
    except BaseException:
        MATRIX[fixture, sku] = "ERROR (build)"
        raise
    assert (fixture, sku) not in KNOWN_UNSUPPORTED, (
        f"{fixture} on {sku} now builds: remove it from KNOWN_UNSUPPORTED ({KNOWN_UNSUPPORTED[fixture, sku]})"
    )
    try:
        validate(reg.pair(fixture, sku))
        bench(reg.pair(fixture, sku))
        manifest = write_manifest(reg.pair(fixture, sku))
    except GateFailed:
        MATRIX[fixture, sku] = "gate failed" + (" (known)" if (fixture, sku) in KNOWN_GATE_FAILURES else "")
        raise
    except BaseException as exc:
        MATRIX[fixture, sku] = f"ERROR ({type(exc).__name__})"
        raise
    record = (report.calibration or {}).get("opset_conversion") or report.options.get("opset_conversion")
    MATRIX[fixture, sku] = f"passed, p50 {manifest.benchmark.engine_only.p50_ms:.3g} ms" + (
        f" (opset {record['from_opset']}->{record['to_opset']})" if record else ""
    )
    if record:  # recorded where the manifest carries it: the build's warnings
        assert any(
            w.startswith(f"opset converted from {record['from_opset']} to {record['to_opset']}")
            for w in manifest.build.warnings
        ), manifest.build.warnings


def test_openvino_int8_gather_workaround(tmp_path):
    """The known OpenVINO INT8 gate failure above goes away with the option it names."""
    if not _available("openvino"):
        pytest.skip("openvino is not installed")
    builder, spec = FIXTURES["multi_output"]
    builder(tmp_path / spec["dir"] / spec["source"])
    sku = models.cpu_sku("openvino", "int8", {"device": "CPU", "per_channel": True, "nodes_to_exclude": ["embed"]})
    reg = load_registry(models.write_project(tmp_path, {"multi_output": spec}, {"ov_int8": sku}))
    for stage in (prepare, make_data, reference, calibrate):
        stage(reg, "multi_output")
    build(reg.pair("multi_output", "ov_int8"))
    assert validate(reg.pair("multi_output", "ov_int8")).passed
