"""Tiny real ONNX models for the tests, built with onnx.helper (no exporter, deterministic)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="skuforge-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def conv_bn_model(path: Path, batch: str | int = "batch", seed: int = 0) -> Path:
    """x[batch,3,8,8] -> Conv -> BatchNormalization -> Relu -> GAP -> Flatten -> Gemm -> Softmax -> probs[batch,4].

    Also holds a Constant node, a constant-foldable Mul of two initializers, and a dead branch,
    so every prepare pass has something to do.
    """
    rng = np.random.default_rng(seed)
    init = [
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.normal(0, 0.1, (8,)).astype(np.float32), "B"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, (8,)).astype(np.float32), "bn_scale"),
        numpy_helper.from_array(rng.normal(0, 0.1, (8,)).astype(np.float32), "bn_bias"),
        numpy_helper.from_array(rng.normal(0, 0.1, (8,)).astype(np.float32), "bn_mean"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, (8,)).astype(np.float32), "bn_var"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 8)).astype(np.float32), "fc_w_half"),
        numpy_helper.from_array(np.full((4,), 0.05, np.float32), "fc_b"),
        numpy_helper.from_array(rng.normal(0, 1, (8,)).astype(np.float32), "unused_init"),
    ]
    nodes = [
        helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(np.array(2.0, np.float32)), name="const_two"),
        helper.make_node("Mul", ["fc_w_half", "two"], ["fc_w"], name="fold_me"),
        helper.make_node("Conv", ["x", "W", "B"], ["conv"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("BatchNormalization", ["conv", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["bn"], name="bn"),
        helper.make_node("Relu", ["bn"], ["relu"], name="relu"),
        helper.make_node("GlobalAveragePool", ["relu"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1, name="fc"),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1, name="softmax"),
        helper.make_node("Sigmoid", ["relu"], ["dead"], name="dead_branch"),
    ]
    graph = helper.make_graph(
        nodes, "conv_bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8, 8])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [batch, 4])],
        init,
    )
    return _save(graph, path)


def multi_io_model(path: Path, seed: int = 0) -> Path:
    """Several inputs (float, int64 ids, a float scalar) and several outputs (float, int64).

    y[batch,4] = (x @ W) * scale + sum_k E[ids[:, k]];  cls[batch] = argmax(y)
    """
    rng = np.random.default_rng(seed)
    init = [
        numpy_helper.from_array(rng.normal(0, 0.5, (6, 4)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.normal(0, 0.5, (11, 4)).astype(np.float32), "E"),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"], name="matmul"),
        helper.make_node("Mul", ["xw", "scale"], ["scaled"], name="scale"),
        helper.make_node("Gather", ["E", "ids"], ["emb"], axis=0, name="embed"),
        helper.make_node("ReduceSum", ["emb", "axis1"], ["emb_sum"], keepdims=0, name="pool"),
        helper.make_node("Add", ["scaled", "emb_sum"], ["y"], name="add"),
        helper.make_node("ArgMax", ["y"], ["cls"], axis=-1, keepdims=0, name="argmax"),
    ]
    graph = helper.make_graph(
        nodes, "multi_io",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 3]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("cls", TensorProto.INT64, ["batch"])],
        init,
    )
    return _save(graph, path)


def nan_model(path: Path) -> Path:
    """y = sqrt(x - 10): NaN for inputs in the default [0, 1] range."""
    init = [numpy_helper.from_array(np.array(10.0, np.float32), "ten")]
    nodes = [helper.make_node("Sub", ["x", "ten"], ["d"], name="sub"), helper.make_node("Sqrt", ["d"], ["y"], name="sqrt")]
    graph = helper.make_graph(nodes, "nan", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], init)
    return _save(graph, path)


def conv_bn_spec(dir_: str = "models/conv", batch: str | int = "batch") -> dict:
    """The params.yaml entry for conv_bn_model (generated data, no metric)."""
    return {"dir": dir_, "source": "model.onnx",
            "inputs": [{"name": "x", "dtype": "float32", "shape": [batch, 3, 8, 8]}]}


def multi_io_spec(dir_: str = "models/multi") -> dict:
    return {"dir": dir_, "source": "model.onnx",
            "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 6], "range": [-1.0, 1.0]},
                       {"name": "ids", "dtype": "int64", "shape": ["batch", 3], "range": [0, 10]},
                       {"name": "scale", "dtype": "float32", "shape": [], "range": [0.5, 2.0]}]}


def ort_sku(precision: str = "fp32", **extra) -> dict:
    """A SKU this x86-64 Linux host can build with ONNX Runtime CPU."""
    import platform

    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
    sku = {"backend": "onnxruntime", "precision": precision, "target": {"arch": arch, "device": "cpu", "os": "linux"},
           "runner_labels": ["self-hosted", "linux"], "shapes": {"batch": 1},
           "bench": {"warmup": 2, "iterations": 10, "min_seconds": 0.0}}
    sku.update(extra)
    return sku


def write_project(root: Path, models: dict, skus: dict, **top) -> Path:
    """Write params.yaml for a project rooted at ``root``."""
    import yaml

    root.mkdir(parents=True, exist_ok=True)
    doc = {"defaults": {}, "examples": {}, "models": models, "skus": skus, **top}
    (root / "params.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return root / "params.yaml"


def external_data_model(path: Path, location: str = "weights.bin", seed: int = 0) -> Path:
    """y[batch,4] = x[batch,4] @ W + B, with W and B stored in the side file ``location`` (ONNX external data)."""
    rng = np.random.default_rng(seed)
    init = [numpy_helper.from_array(rng.normal(0, 0.5, (4, 4)).astype(np.float32), "W"),
            numpy_helper.from_array(rng.normal(0, 0.1, (4,)).astype(np.float32), "B")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"], name="matmul"), helper.make_node("Add", ["xw", "B"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "external", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="skuforge-tests")
    model.ir_version = 8
    (path.parent / location).parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=location,
                    size_threshold=0)
    return path


def relu_model(path: Path, opset: int = OPSET, custom_domain: str | None = None) -> Path:
    """y[batch,4] = Relu(x), at ``opset``; with ``custom_domain`` a MyOp node of that domain follows (node 'my_op')."""
    nodes = [helper.make_node("Relu", ["x"], ["r" if custom_domain else "y"], name="relu")]
    opsets = [helper.make_opsetid("", opset)]
    if custom_domain:
        nodes.append(helper.make_node("MyOp", ["r"], ["y"], name="my_op", domain=custom_domain))
        opsets.append(helper.make_opsetid(custom_domain, 1))
    graph = helper.make_graph(nodes, "relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    model = helper.make_model(graph, opset_imports=opsets, producer_name="skuforge-tests")
    model.ir_version = 8 if opset >= 7 else 3
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))  # unchecked: the checker's view of these is what the tests are about
    return path


def vector_spec(dir_: str) -> dict:
    """The params.yaml entry for external_data_model and relu_model."""
    return {"dir": dir_, "source": "model.onnx", "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]}


def set_external_location(path: Path, location: str) -> None:
    """Point every external-data tensor of the ONNX file at ``location`` (as a hostile or careless
    exporter could write it)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(model, str(path))
