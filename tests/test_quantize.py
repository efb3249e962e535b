"""Tensor storage and opset conversion for the backends' importers (pipeline/model/graph.py,
pipeline/backends/quantize.py) on tiny real models, and how IREE's importer failures are classified."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import models
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.backends import opset
from pipeline.backends.quantize import conversion_warnings, derive_missing_ranges, to_fp16
from pipeline.backends.reference import newest_qdq_opset, reference_runner
from pipeline.core.errors import InputError, UnsupportedOp
from pipeline.model import graph

HAS_IREE = importlib.util.find_spec("iree") is not None and importlib.util.find_spec("iree.compiler") is not None
_TYPED = ("float_data", "int32_data", "int64_data", "double_data")
X = {"x": np.random.default_rng(1).uniform(-1, 1, (1, 3, 8, 8)).astype(np.float32)}


def _tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return list(graph._all_tensors(model.graph))


def _run(model: onnx.ModelProto, feeds: dict) -> dict:
    with reference_runner(model.SerializeToString()) as runner:
        return runner.infer(feeds)


def _pinned(path: Path) -> onnx.ModelProto:
    model = onnx.load(str(path))
    return graph.pin_axes(model, {"batch": 1}, path)


def test_tensors_to_raw_moves_every_typed_field_in_graphs_and_subgraphs(tmp_path):
    model = onnx.load(str(models.if_model(tmp_path / "if.onnx")))
    # an FP16 initializer as converters write it (int32_data), read by a node
    half = helper.make_tensor(
        "half", TensorProto.FLOAT16, [4], vals=np.array([1, 2, 3, 4], np.float16).view(np.uint16).tolist()
    )
    model.graph.initializer.append(half)
    model.graph.node.append(helper.make_node("Cast", ["half"], ["half_f"], to=TensorProto.FLOAT, name="cast_half"))
    model.graph.output.append(helper.make_tensor_value_info("half_f", TensorProto.FLOAT, [4]))
    before = {t.name: numpy_helper.to_array(t).copy() for t in _tensors(model)}
    feeds = {"x": np.array([[0.5, -1.0, 2.0, 0.0]], np.float32), "flag": np.array(1.0, np.float32)}
    want = _run(model, feeds)

    moved = graph.tensors_to_raw(model)

    assert moved == len(before)  # zero, then_v, else_v (in the If branches) and half
    for tensor in _tensors(model):
        assert tensor.raw_data and not any(len(getattr(tensor, f)) for f in _TYPED), tensor.name
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), before[tensor.name])
    got = _run(model, feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    assert graph.tensors_to_raw(model) == 0


def test_tensors_to_raw_leaves_external_data_alone(tmp_path):
    path = models.external_data_model(tmp_path / "m" / "model.onnx")
    model = onnx.load(str(path), load_external_data=False)
    assert graph.tensors_to_raw(model) == 0
    assert all(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer)


def test_to_fp16_writes_raw_data_and_a_sorted_graph(tmp_path):
    source = tmp_path / "fp32.onnx"
    onnx.save(_pinned(models.conv_pool_slice_model(tmp_path / "src.onnx", 17)), str(source))

    out = onnx.load(str(to_fp16(source, tmp_path / "fp16.onnx")))

    assert any(t.data_type == TensorProto.FLOAT16 for t in out.graph.initializer)
    assert all(not any(len(getattr(t, f)) for f in _TYPED) for t in _tensors(out))
    known = {i.name for i in out.graph.input} | {t.name for t in out.graph.initializer}
    for node in out.graph.node:
        assert all(not name or name in known for name in node.input), f"{node.name} reads a tensor made later"
        known.update(node.output)
    got, want = _run(out, X)["y"], _run(onnx.load(str(source)), X)["y"]
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not HAS_IREE, reason="iree-base-compiler is not installed")
def test_fp16_model_is_accepted_by_iree_importer(tmp_path):
    """The FP16 graph of an old exporter's model (weights in float_data) imports; before the
    raw_data step IREE refused it ('Unhandled ONNX TensorProto data')."""
    from pipeline.backends.iree import import_onnx

    source = tmp_path / "fp32.onnx"
    onnx.save(_pinned(models.conv_pool_slice_model(tmp_path / "src.onnx", 17)), str(source))
    fp16 = to_fp16(source, tmp_path / "fp16.onnx")
    nodes = {n.name: n.op_type for n in onnx.load(str(fp16)).graph.node if n.name}
    import_onnx(fp16, tmp_path / "m.mlir", nodes)
    assert "f16" in (tmp_path / "m.mlir").read_text()


@pytest.mark.skipif(not HAS_IREE, reason="iree-base-compiler is not installed")
def test_iree_importer_failure_names_the_node_reading_the_tensor(tmp_path):
    """A tensor the importer cannot read is UnsupportedOp naming the node that reads it (not an
    environment problem); the message names the tensor."""
    from pipeline.backends.iree import import_onnx

    model = _pinned(models.conv_pool_slice_model(tmp_path / "src.onnx", 17))
    w = next(t for t in model.graph.initializer if t.name == "W")
    halves = numpy_helper.to_array(w).astype(np.float16)
    w.CopyFrom(
        helper.make_tensor("W", TensorProto.FLOAT16, list(halves.shape), vals=halves.view(np.uint16).flatten().tolist())
    )
    cast = helper.make_node("Cast", ["W"], ["W32"], to=TensorProto.FLOAT, name="w_cast")
    conv = next(n for n in model.graph.node if n.name == "conv")
    conv.input[1] = "W32"
    model.graph.node.insert(0, cast)
    path = tmp_path / "int32_data.onnx"
    onnx.save(model, str(path))
    nodes = {n.name: n.op_type for n in model.graph.node}

    with pytest.raises(UnsupportedOp) as info:
        import_onnx(path, tmp_path / "m.mlir", nodes)

    assert (info.value.backend, info.value.op_type, info.value.node) == ("iree", "Cast", "w_cast")
    assert "'W'" in info.value.message and info.value.exit_code == 3
    # the hint (another backend) works: ONNX Runtime runs the model
    assert _run(model, X)["y"].shape == (1, 64)


def test_iree_importer_failure_without_a_node_is_an_input_error():
    from pipeline.backends.iree import import_error

    model = onnx.load_from_string(helper.make_model(helper.make_graph([], "g", [], [])).SerializeToString())
    err = import_error("Unsupported ONNX TypeProto: sequence_type {}", model, {})
    assert isinstance(err, InputError) and "refused the model" in err.message and "another backend" in err.hint


@pytest.mark.parametrize("from_opset", [11, 12])
def test_convert_opset_converts_checks_and_records(tmp_path, from_opset):
    model = _pinned(models.conv_pool_slice_model(tmp_path / "m.onnx", from_opset))

    converted, record = opset.convert_opset(model, 17, X, "a test")

    assert graph.default_opset(converted) == 17 and graph.default_opset(model) == from_opset
    assert (record.from_opset, record.to_opset) == (from_opset, 17)
    assert record.relative_error <= opset.OPSET_CONVERSION_RTOL
    assert record.warning().startswith(f"opset converted from {from_opset} to 17 (a test)")
    assert all(not any(len(getattr(t, f)) for f in _TYPED) for t in _tensors(converted))
    np.testing.assert_allclose(_run(converted, X)["y"], _run(model, X)["y"], rtol=1e-5, atol=1e-6)
    assert opset.convert_opset(converted, 17, X, "a test") == (converted, None)


def test_convert_opset_down_for_a_runtime_that_lags_onnx(tmp_path):
    newest = onnx.defs.onnx_opset_version()
    model = _pinned(models.conv_pool_slice_model(tmp_path / "m.onnx", newest))
    converted, record = opset.convert_opset(model, 21, X, "a test")
    assert (record.from_opset, record.to_opset) == (newest, 21) and graph.default_opset(converted) == 21


def test_convert_opset_refuses_a_conversion_that_changes_outputs(tmp_path, monkeypatch):
    """An adapter that changed the function (planted: the converted model's weights scaled) is
    refused with the opsets and the error, and the hint works: the model exported at the target
    opset needs no conversion."""
    from onnx import version_converter

    real = version_converter.convert_version

    def drifting(model, target):
        out = real(model, target)
        w = next(t for t in out.graph.initializer if t.name == "W")
        w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * 1.01, "W"))
        return out

    monkeypatch.setattr(version_converter, "convert_version", drifting)
    model = _pinned(models.conv_pool_slice_model(tmp_path / "m.onnx", 11))
    with pytest.raises(InputError, match=r"from opset 11 to 17 \(a test\) changed its outputs .*max abs error") as info:
        opset.convert_opset(model, 17, X, "a test")
    assert info.value.exit_code == 2 and "at opset 17" in info.value.hint
    reexported = _pinned(models.conv_pool_slice_model(tmp_path / "m17.onnx", 17))
    assert opset.convert_opset(reexported, 17, X, "a test")[1] is None


def test_convert_opset_refuses_when_the_converter_fails(tmp_path, monkeypatch):
    from onnx import version_converter

    def failing(model, target):
        raise RuntimeError("adapt_thing: Assertion `inputs.size() >= 3` failed")

    monkeypatch.setattr(version_converter, "convert_version", failing)
    model = _pinned(models.conv_pool_slice_model(tmp_path / "m.onnx", 11))
    with pytest.raises(InputError, match=r"from opset 11 to 17 \(a test\) failed: adapt_thing") as info:
        opset.convert_opset(model, 17, X, "a test")
    assert info.value.exit_code == 2


def test_newest_qdq_opset_runs_quantize_linear():
    import onnxruntime as ort

    newest = newest_qdq_opset()
    assert newest is not None and 13 <= newest <= onnx.defs.onnx_opset_version()
    q = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s"], ["y"])],
        "q",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [2])],
        [helper.make_tensor("s", TensorProto.FLOAT, [], [0.5])],
    )
    session = ort.InferenceSession(
        helper.make_model(q, opset_imports=[helper.make_opsetid("", newest)]).SerializeToString()
    )
    assert session.run(None, {"x": np.array([1.0, 2.0], np.float32)})[0].tolist() == [2, 4]


def test_conversion_warnings_from_the_qdq_record():
    record = opset.OpsetConversion(
        from_opset=11, to_opset=17, reason="INT8 QDQ needs opset 13 or newer", max_abs_error=0.0, relative_error=0.0
    )
    assert conversion_warnings({"format": "QDQ", "opset_conversion": record.to_json()}) == [record.warning()]
    assert conversion_warnings({"format": "QDQ"}) == [] and conversion_warnings(None) == []


HAS_OPENVINO = importlib.util.find_spec("openvino") is not None


@pytest.mark.skipif(not HAS_OPENVINO, reason="openvino is not installed")
def test_openvino_frontend_failure_names_op_node_and_reason(tmp_path):
    """A per-channel QDQ graph left at opset 11 (what quantize_qdq now converts first) failed in
    OpenVINO with "OpConversionFailure:" and nothing after it: the refusal names the ops, their
    nodes and the frontend's reasons."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        quantize_static,
    )

    from pipeline.backends.openvino import _read_model

    source = tmp_path / "m.onnx"
    onnx.save(_pinned(models.conv_pool_slice_model(tmp_path / "src.onnx", 11)), str(source))

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._it = iter([X])

        def get_next(self):
            return next(self._it, None)

    quantize_static(str(source), str(tmp_path / "q.onnx"), Reader(), quant_format=QuantFormat.QDQ, per_channel=True)
    with pytest.raises(UnsupportedOp) as info:
        _read_model(tmp_path / "q.onnx", onnx.load(str(tmp_path / "q.onnx")))
    err = info.value
    assert err.backend == "openvino" and err.op_type and err.node
    assert "could not convert" in err.message and "OpConversionFailure" not in err.message


def test_ranges_a_conversion_adds_are_derived_so_the_quantizer_takes_paddle_names(tmp_path):
    """paddle2onnx's opset-11 Softmax over a non-last axis becomes Flatten -> Softmax -> Reshape at
    opset 13+, its output ``softmax_9.tmp_0_intermediate`` missing from the calibration table taken
    on the opset-11 model: ONNX Runtime's quantizer raised RuntimeError ("Only an existing tensor can
    be modified") on it. The missing ranges are derived from the graph, and the QDQ graph runs."""
    from onnxruntime.quantization import QuantFormat, quantize_static
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData, save_tensors_data

    source = _pinned(models.paddle_softmax_model(tmp_path / "m.onnx"))
    names = [o for n in source.graph.node for o in n.output] + ["x"]
    table = TensorsData(
        CalibrationMethod.MinMax,
        {n: TensorData(lowest=np.float32(-2.0), highest=np.float32(2.0)) for n in names},
    )
    converted, _ = opset.convert_opset(source, 17, X, "test")
    assert "softmax_9.tmp_0_intermediate" in {o for n in converted.graph.node for o in n.output}
    onnx.save(converted, str(tmp_path / "c.onnx"))
    save_tensors_data(table, tmp_path / "plain.json")
    with pytest.raises(RuntimeError, match="softmax_9.tmp_0_intermediate"):
        quantize_static(
            str(tmp_path / "c.onnx"), str(tmp_path / "q0.onnx"), None,
            quant_format=QuantFormat.QDQ, calibration_cache_path=str(tmp_path / "plain.json"),
        )  # fmt: skip
    derived = derive_missing_ranges(converted, table)
    assert derived["softmax_9.tmp_0_intermediate"].startswith("Softmax")
    added = {o for n in converted.graph.node for o in n.output if o not in names and n.op_type != "Shape"}
    assert set(derived) == added
    assert (table["softmax_9.tmp_0_intermediate"].lowest, table["softmax_9.tmp_0_intermediate"].highest) == (0.0, 1.0)
    save_tensors_data(table, tmp_path / "derived.json")
    quantize_static(
        str(tmp_path / "c.onnx"), str(tmp_path / "q.onnx"), None,
        quant_format=QuantFormat.QDQ, calibration_cache_path=str(tmp_path / "derived.json"),
    )  # fmt: skip
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    assert any(n.op_type == "QuantizeLinear" for n in quantized.graph.node)
    out = _run(quantized, X)["softmax_9.tmp_0"]
    np.testing.assert_allclose(out.reshape(1, -1).sum(axis=1), 1.0, atol=0.05)
