"""Graph handling: loading and checking, signatures, axis naming and pinning, graph passes."""

from __future__ import annotations

import copy
from itertools import pairwise
from pathlib import Path

import models
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from pipeline.core.errors import InputError
from pipeline.model.graph import (
    MIN_OPSET,
    PASSES,
    check_ops,
    eliminate_dead_code,
    external_data_files,
    fold_batchnorm,
    fold_constants,
    infer_shapes,
    load_model,
    mark_batch_axes,
    op_counts,
    output_batch_axes,
    pin_axes,
    rename_axes,
    run_passes,
    signature,
    source_sha256,
)
from pipeline.project.config import InputSpec


@pytest.fixture(scope="module")
def conv_path(tmp_path_factory) -> Path:
    return models.conv_bn_model(tmp_path_factory.mktemp("conv") / "model.onnx")


@pytest.fixture(scope="module")
def multi_path(tmp_path_factory) -> Path:
    return models.multi_io_model(tmp_path_factory.mktemp("multi") / "model.onnx")


@pytest.fixture(scope="module")
def prepared(conv_path):
    source = load_model(conv_path)
    work = copy.deepcopy(source)
    records = run_passes(work)
    return source, work, records


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def specs(*inputs: dict) -> list[InputSpec]:
    return [InputSpec.model_validate(i) for i in inputs]


MULTI_INPUTS = models.multi_io_spec()["inputs"]


# --- passes -------------------------------------------------------------------------------------


def test_passes_run_in_order_and_record_node_counts(prepared):
    _, _, records = prepared
    assert (
        [r.name for r in records]
        == [name for name, _ in PASSES]
        == ["constants_to_initializers", "constant_folding", "batchnorm_folding", "dead_code_elimination"]
    )
    assert all(r.changed for r in records)
    assert [(r.nodes_before, r.nodes_after) for r in records] == [(10, 9), (9, 8), (8, 7), (7, 6)]
    for before, after in pairwise(records):
        assert before.nodes_after == after.nodes_before


def test_constant_becomes_an_initializer(prepared):
    _, _, records = prepared
    assert records[0].details == ["1 Constant nodes became initializers"]


def test_mul_of_constants_is_folded(prepared):
    _, work, records = prepared
    assert records[1].details == ["folded 1 Mul"]
    assert "fc_w" in {i.name for i in work.graph.initializer}
    assert "Mul" not in op_counts(work)


def test_folded_constant_has_the_right_value(prepared):
    source, work, _ = prepared
    half = next(numpy_helper.to_array(i) for i in source.graph.initializer if i.name == "fc_w_half")
    folded = next(numpy_helper.to_array(i) for i in work.graph.initializer if i.name == "fc_w")
    np.testing.assert_array_equal(folded, half * 2)


def test_batchnorm_is_folded_into_the_conv(prepared):
    _, work, records = prepared
    assert records[2].details == ["bn folded into conv"]
    conv = next(n for n in work.graph.node if n.op_type == "Conv")
    assert conv.output[0] == "bn"  # the Conv now produces what the BatchNormalization did
    assert len(conv.input) == 3 and all(n in {i.name for i in work.graph.initializer} for n in conv.input[1:])


def test_dead_branch_and_unused_initializers_are_removed(prepared):
    _, work, records = prepared
    assert records[3].details == ["removed 1 dead nodes", "removed 9 unused initializers"]
    names = {i.name for i in work.graph.initializer}
    assert not names & {"unused_init", "W", "B", "bn_scale", "bn_bias", "bn_mean", "bn_var", "fc_w_half", "two"}
    assert len(names) == 4 and {"fc_w", "fc_b"} <= names


def test_op_counts_before_and_after(prepared):
    source, work, _ = prepared
    assert op_counts(source) == {
        "BatchNormalization": 1,
        "Constant": 1,
        "Conv": 1,
        "Flatten": 1,
        "Gemm": 1,
        "GlobalAveragePool": 1,
        "Mul": 1,
        "Relu": 1,
        "Sigmoid": 1,
        "Softmax": 1,
    }
    assert op_counts(work) == {"Conv": 1, "Flatten": 1, "Gemm": 1, "GlobalAveragePool": 1, "Relu": 1, "Softmax": 1}


def test_prepared_model_is_valid_and_computes_the_same_function(prepared):
    source, work, _ = prepared
    onnx.checker.check_model(work, full_check=True)
    x = np.random.default_rng(7).uniform(-3, 3, (5, 3, 8, 8)).astype(np.float32)
    (want,) = run(source, {"x": x})
    (got,) = run(work, {"x": x})
    assert got.shape == (5, 4)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_passes_are_idempotent(prepared):
    _, work, _ = prepared
    again = copy.deepcopy(work)
    records = run_passes(again)
    assert not any(r.changed for r in records) and all(r.details == [] for r in records)
    assert again == work


def test_source_without_work_records_no_changes(multi_path):
    model = load_model(multi_path)
    records = run_passes(model)
    assert [r.changed for r in records] == [False] * 4


def _tiny(nodes, inputs, outputs, inits) -> onnx.ModelProto:
    model = helper.make_model(
        helper.make_graph(nodes, "t", inputs, outputs, inits), opset_imports=[helper.make_opsetid("", models.OPSET)]
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def test_nondeterministic_ops_are_not_folded():
    model = _tiny(
        [helper.make_node("RandomUniformLike", ["c"], ["r"], seed=1.0), helper.make_node("Add", ["x", "r"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.zeros(2, np.float32), "c")],
    )
    assert fold_constants(model) == []
    assert op_counts(model) == {"Add": 1, "RandomUniformLike": 1}


def test_overridable_initializer_is_not_folded():
    """An initializer also listed as a graph input can be fed at run time, so it is not constant."""
    model = _tiny(
        [helper.make_node("Neg", ["c"], ["n"]), helper.make_node("Add", ["x", "n"], ["y"])],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("c", TensorProto.FLOAT, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.ones(2, np.float32), "c")],
    )
    assert fold_constants(model) == []


def test_batchnorm_is_kept_when_the_conv_output_is_also_read_elsewhere():
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(2, 1, 1, 1)).astype(np.float32), "W")] + [
        numpy_helper.from_array(v, n)
        for n, v in [
            ("s", np.ones(2, np.float32)),
            ("b", np.zeros(2, np.float32)),
            ("m", np.zeros(2, np.float32)),
            ("v", np.ones(2, np.float32)),
        ]
    ]
    model = _tiny(
        [
            helper.make_node("Conv", ["x", "W"], ["c"]),
            helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 2, 2]),
            helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 2, 2, 2]),
        ],
        inits,
    )
    assert fold_batchnorm(model) == []
    assert op_counts(model) == {"BatchNormalization": 1, "Conv": 1}


def test_dead_code_keeps_what_outputs_need(multi_path):
    model = load_model(multi_path)
    assert eliminate_dead_code(model) == []
    assert len(model.graph.node) == 6


# --- signatures, axis names, pins ---------------------------------------------------------------


def test_signature_of_a_multi_io_model(multi_path):
    sig = signature(load_model(multi_path))
    assert [(t.name, t.dtype, t.shape) for t in sig.inputs] == [
        ("x", "float32", ["batch", 6]),
        ("ids", "int64", ["batch", 3]),
        ("scale", "float32", []),
    ]
    assert [(t.name, t.dtype, t.shape) for t in sig.outputs] == [
        ("y", "float32", ["batch", 4]),
        ("cls", "int64", ["batch"]),
    ]
    assert sig.inputs[2].batch_index("batch") is None and sig.inputs[0].batch_index("batch") == 0


def test_rename_axes_gives_dynamic_dims_the_spec_names(tmp_path):
    path = models.conv_bn_model(tmp_path / "model.onnx", batch="N")
    model = load_model(path)
    rename_axes(model, specs({"name": "x", "shape": ["batch", 3, 8, 8]}), path)
    sig = signature(infer_shapes(model, path))
    assert sig.inputs[0].shape == ["batch", 3, 8, 8]
    assert sig.outputs[0].shape == ["batch", 4]


def test_rename_axes_pins_a_dynamic_dim_the_spec_fixes(conv_path):
    model = load_model(conv_path)
    rename_axes(model, specs({"name": "x", "shape": [2, 3, 8, 8]}), conv_path)
    assert signature(model).inputs[0].shape == [2, 3, 8, 8]


def test_pin_axes_fixes_inputs_and_outputs(conv_path):
    model = pin_axes(load_model(conv_path), {"batch": 3}, conv_path)
    sig = signature(model)
    assert sig.inputs[0].shape == [3, 3, 8, 8] and sig.outputs[0].shape == [3, 4]


@pytest.mark.parametrize(
    "spec_inputs, words",
    [
        # a fixed dim of the model contradicted
        ([{"name": "x", "shape": ["batch", 3, 8, 9]}], ["'x'", "dim 3", "fixed to 8", "9"]),
        ([{"name": "x", "shape": ["batch", "channels", 8, 8]}], ["'x'", "dim 1", "fixed to 3"]),
        # wrong rank
        ([{"name": "x", "shape": ["batch", 3, 8]}], ["'x'", "rank 4"]),
        # wrong dtype
        ([{"name": "x", "dtype": "float16", "shape": ["batch", 3, 8, 8]}], ["'x'", "float32", "float16"]),
        # declared in params.yaml, absent from the model
        ([{"name": "x", "shape": ["batch", 3, 8, 8]}, {"name": "mask", "shape": ["batch", 8]}], ["'mask'", "declares"]),
        ([{"name": "image", "shape": ["batch", 3, 8, 8]}], ["'x'"]),
    ],
)
def test_rename_axes_refuses_a_spec_contradicting_the_model(conv_path, spec_inputs, words):
    with pytest.raises(InputError) as info:
        rename_axes(load_model(conv_path), specs(*spec_inputs), conv_path)
    for word in words:
        assert word in info.value.message, (word, info.value.message)
    assert str(conv_path) in info.value.message and info.value.hint
    assert info.value.exit_code == 2


def test_rename_axes_refuses_an_undeclared_model_input(multi_path):
    with pytest.raises(InputError) as info:
        rename_axes(load_model(multi_path), specs(*MULTI_INPUTS[:2]), multi_path)
    assert "'scale'" in info.value.message and "not declared" in info.value.message


def test_rename_axes_refuses_a_wrong_scalar_rank(multi_path):
    wrong = [*MULTI_INPUTS[:2], {**MULTI_INPUTS[2], "shape": ["batch"]}]
    with pytest.raises(InputError) as info:
        rename_axes(load_model(multi_path), specs(*wrong), multi_path)
    assert "'scale'" in info.value.message and "rank 0" in info.value.message


def test_rename_axes_refuses_a_wrong_integer_dtype(multi_path):
    wrong = [MULTI_INPUTS[0], {**MULTI_INPUTS[1], "dtype": "int32"}, MULTI_INPUTS[2]]
    with pytest.raises(InputError) as info:
        rename_axes(load_model(multi_path), specs(*wrong), multi_path)
    assert "'ids'" in info.value.message and "int64" in info.value.message and "int32" in info.value.message


DENSE_X = {"name": "x", "shape": ["batch", 6]}


@pytest.mark.parametrize("dim", [-1, 0, None, "batch_size", "s0"])
def test_exporter_dynamic_dims_take_the_spec_name(tmp_path, dim):
    path = models.exporter_dense_model(tmp_path / "model.onnx", [dim, 6], [dim, 4])
    model = load_model(path)
    assert signature(model).inputs[0].shape == [dim if isinstance(dim, str) else None, 6]  # -1 and 0 read as dynamic
    rename_axes(model, specs(DENSE_X), path)
    sig = signature(infer_shapes(model, path))
    assert sig.inputs[0].shape == ["batch", 6] and sig.outputs[0].shape == ["batch", 4]


@pytest.mark.parametrize("dim", [-1, 0, None, "batch_size"])
def test_exporter_dynamic_dims_can_be_pinned(tmp_path, dim):
    path = models.exporter_dense_model(tmp_path / "model.onnx", [dim, 6], [dim, 4])
    model = load_model(path)
    rename_axes(model, specs({"name": "x", "shape": [2, 6]}), path)
    assert signature(infer_shapes(model, path)).outputs[0].shape == [2, 4]


def test_rename_axes_drops_per_tensor_output_names_and_stale_value_info(tmp_path):
    path = models.exporter_dense_model(tmp_path / "model.onnx")  # batch_size in, output_dim_0 out
    model = load_model(path)
    model.graph.value_info.append(models.value_info("xw", ["s0", 4]))
    rename_axes(model, specs(DENSE_X), path)
    assert signature(model).outputs[0].shape == [None, 4] and not model.graph.value_info
    inferred = infer_shapes(model, path)
    assert signature(inferred).outputs[0].shape == ["batch", 4]
    assert {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.graph.value_info
    }["xw"] == ["batch", 4]


def test_output_batch_axes_by_inference_leaves_unknown_dims_to_the_probe(tmp_path):
    path = models.batch_positions_model(tmp_path / "model.onnx")
    model = load_model(path)
    rename_axes(model, specs(DENSE_X), path)
    model = infer_shapes(model, path)
    # y and t propagate the name; r and rt pass through a Reshape(-1): unknown, left for the probe
    assert output_batch_axes(model, "batch", {"batch"}) == {"y": 0, "t": 1, "total": None}
    mark_batch_axes(model, "batch", {"r": 0, "rt": 1, "total": None})
    shapes = {t.name: t.shape for t in signature(model).outputs}
    assert shapes["r"] == ["batch", 2, 2] and shapes["rt"] == [2, "batch", 2] and shapes["total"] == []
    assert output_batch_axes(model, "batch", {"batch"}) == {"y": 0, "t": 1, "r": 0, "rt": 1, "total": None}


@pytest.mark.parametrize(
    "spec_shape, hint",
    [
        (["batch", 3, 8, 9], "set shape: [batch, 3, 8, 8]"),
        (["n", 3, 8], "set shape: [batch, 3, 8, 8]"),
        ([4, 3, 8, 9], "set shape: [4, 3, 8, 8]"),
    ],
)
def test_rename_axes_hints_give_a_shape_that_works(conv_path, spec_shape, hint):
    with pytest.raises(InputError) as info:
        rename_axes(load_model(conv_path), specs({"name": "x", "shape": spec_shape}), conv_path)
    assert hint in info.value.hint
    fixed = yaml.safe_load(hint.removeprefix("set shape: "))
    model = load_model(conv_path)
    rename_axes(model, specs({"name": "x", "shape": fixed}), conv_path)  # followed: accepted
    infer_shapes(model, conv_path)


def test_rename_axes_hint_for_an_undeclared_input_is_an_entry(multi_path):
    with pytest.raises(InputError) as info:
        rename_axes(load_model(multi_path), specs(MULTI_INPUTS[0]), multi_path)
    assert "{name: ids, dtype: int64, shape: [batch, 3]}; {name: scale, dtype: float32, shape: []}" in info.value.hint


def test_infer_shapes_reports_an_inconsistent_graph(tmp_path):
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("Add", ["a", "b"], ["y"])],
            "bad",
            [
                helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3]),
                helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, 5]),
            ],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        ),
        opset_imports=[helper.make_opsetid("", models.OPSET)],
    )
    with pytest.raises(InputError) as info:
        infer_shapes(model, tmp_path / "bad.onnx")
    assert "shape inference failed" in info.value.message


# --- loading ------------------------------------------------------------------------------------


def test_load_model_reads_a_good_file(conv_path):
    model = load_model(conv_path)
    assert model.producer_name == "skuforge-tests" and len(model.graph.node) == 10


def test_load_model_missing_file(tmp_path):
    with pytest.raises(InputError) as info:
        load_model(tmp_path / "nope.onnx")
    assert "does not exist" in info.value.message and info.value.hint


@pytest.mark.parametrize("fraction", [0.5, 0.9])
def test_load_model_truncated_file(conv_path, tmp_path, fraction):
    data = conv_path.read_bytes()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(InputError) as info:
        load_model(path)
    assert str(path) in info.value.message and info.value.hint


@pytest.mark.parametrize("data", [b"", b"this is not an onnx model at all", bytes(range(256)) * 4])
def test_load_model_garbage(tmp_path, data):
    path = tmp_path / "garbage.onnx"
    path.write_bytes(data)
    with pytest.raises(InputError) as info:
        load_model(path)
    assert str(path) in info.value.message


def test_load_model_fails_the_checker(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["x"], ["y"])],
        "bad",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    path = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", models.OPSET)]), str(path))
    with pytest.raises(InputError) as info:
        load_model(path)
    assert "checker" in info.value.message


# --- external data ------------------------------------------------------------------------------


def test_external_data_is_loaded_and_listed(tmp_path):
    path = models.external_data_model(tmp_path / "m" / "model.onnx")
    model = load_model(path)
    assert {i.name for i in model.graph.initializer} == {"W", "B"}
    assert all(i.data_location == TensorProto.DEFAULT and i.raw_data for i in model.graph.initializer)
    bare = onnx.load(str(path), load_external_data=False)
    assert external_data_files(bare, path, path.parent) == [(tmp_path / "m" / "weights.bin").resolve()]


def test_source_sha256_covers_the_external_data(tmp_path, conv_path):
    from pipeline.core.io import sha256_file

    assert source_sha256(conv_path, conv_path.parent) == sha256_file(conv_path)  # no external data: the file's hash
    path = models.external_data_model(tmp_path / "m" / "model.onnx", location="sub/weights.bin")
    before = source_sha256(path, path.parent)
    assert before != sha256_file(path)
    weights = tmp_path / "m" / "sub" / "weights.bin"
    weights.write_bytes(weights.read_bytes()[::-1])
    assert source_sha256(path, path.parent) != before


def test_external_data_in_a_sibling_folder_of_the_model_dir_is_refused(tmp_path):
    path = models.external_data_model(tmp_path / "m" / "model.onnx", location="weights.bin")
    (tmp_path / "other").mkdir()
    (tmp_path / "m" / "weights.bin").rename(tmp_path / "other" / "weights.bin")
    models.set_external_location(path, "../other/weights.bin")
    with pytest.raises(InputError, match="outside the model's folder"):
        load_model(path)
    model = onnx.load(str(path), load_external_data=False)
    # a model in a subfolder of the model dir may reach up into the dir, not out of it
    assert external_data_files(model, path, tmp_path) == [(tmp_path / "other" / "weights.bin").resolve()]


def test_truncated_external_data_is_an_input_error(tmp_path):
    path = models.external_data_model(tmp_path / "m" / "model.onnx")
    weights = tmp_path / "m" / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:8])
    with pytest.raises(InputError, match="external data cannot be read"):
        load_model(path)


# --- ops and opsets -----------------------------------------------------------------------------


def test_check_ops_accepts_standard_domains_and_model_local_functions(tmp_path):
    load_model(models.relu_model(tmp_path / "a.onnx", opset=MIN_OPSET))
    func = helper.make_function(
        "my.funcs", "Twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])], [helper.make_opsetid("", 17)]
    )
    graph = helper.make_graph(
        [helper.make_node("Twice", ["x"], ["y"], domain="my.funcs", name="twice")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(
        graph, functions=[func], opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.funcs", 1)]
    )
    check_ops(model, tmp_path / "f.onnx")


def test_check_ops_finds_a_custom_op_inside_a_subgraph(tmp_path):
    inner = helper.make_graph(
        [helper.make_node("MyOp", ["x"], ["z"], domain="com.example", name="deep")],
        "then",
        [],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])],
    )
    outer = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=inner, else_branch=inner, name="if")],
        "g",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(outer, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    with pytest.raises(InputError, match="node 'deep' is op 'MyOp' of the custom domain 'com.example'"):
        check_ops(model, tmp_path / "m.onnx")


@pytest.mark.parametrize("opset", [MIN_OPSET - 1, onnx.defs.onnx_opset_version() + 1])
def test_check_ops_refuses_an_opset_out_of_range(tmp_path, opset):
    with pytest.raises(InputError) as info:
        load_model(models.relu_model(tmp_path / "m.onnx", opset=opset))
    assert f"opset {opset}" in info.value.message and "skuforge prepare" not in info.value.hint
