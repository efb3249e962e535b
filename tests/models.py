"""Tiny real ONNX models for the tests, built with onnx.helper (no exporter, deterministic)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def save_graph(graph: onnx.GraphProto, path: Path, opset: int = OPSET) -> Path:
    """The graph as a checked model file at ``path`` (opset ``opset``, IR 8)."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="skuforge-tests")
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
        helper.make_node(
            "Constant", [], ["two"], value=numpy_helper.from_array(np.array(2.0, np.float32)), name="const_two"
        ),
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
        nodes,
        "conv_bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8, 8])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [batch, 4])],
        init,
    )
    return save_graph(graph, path)


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
        nodes,
        "multi_io",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 3]),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, []),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("cls", TensorProto.INT64, ["batch"]),
        ],
        init,
    )
    return save_graph(graph, path)


def nan_model(path: Path) -> Path:
    """y = sqrt(x - 10): NaN for inputs in the default [0, 1] range."""
    init = [numpy_helper.from_array(np.array(10.0, np.float32), "ten")]
    nodes = [
        helper.make_node("Sub", ["x", "ten"], ["d"], name="sub"),
        helper.make_node("Sqrt", ["d"], ["y"], name="sqrt"),
    ]
    graph = helper.make_graph(
        nodes,
        "nan",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        init,
    )
    return save_graph(graph, path)


def conv_bn_spec(dir_: str = "models/conv", batch: str | int = "batch") -> dict:
    """The params.yaml entry for conv_bn_model (generated data, no metric)."""
    return {
        "dir": dir_,
        "source": "model.onnx",
        "inputs": [{"name": "x", "dtype": "float32", "shape": [batch, 3, 8, 8]}],
    }


def multi_io_spec(dir_: str = "models/multi") -> dict:
    return {
        "dir": dir_,
        "source": "model.onnx",
        "inputs": [
            {"name": "x", "dtype": "float32", "shape": ["batch", 6], "range": [-1.0, 1.0]},
            {"name": "ids", "dtype": "int64", "shape": ["batch", 3], "range": [0, 10]},
            {"name": "scale", "dtype": "float32", "shape": [], "range": [0.5, 2.0]},
        ],
    }


# A test's benchmark: a few calls, a short warm-up, no roofline (its layer profiling and this host's
# peaks). The defaults.bench of every project write_project makes; ort_sku's bench, into which a test's
# own ``bench=`` merges (the keys it names win, the rest stay fast). A test of the defaults writes its own.
FAST_BENCH = {
    "warmup": 2,
    "steady_window": 5,
    "max_warmup_seconds": 1.0,
    "roofline": False,
    "iterations": 10,
    "min_seconds": 0.0,
}


def ort_sku(precision: str = "fp32", **extra) -> dict:
    """A SKU this x86-64 Linux host can build with ONNX Runtime CPU, benchmarked briefly (``bench=``
    merges into FAST_BENCH)."""
    import platform

    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
    sku = {
        "backend": "onnxruntime",
        "precision": precision,
        "target": {"arch": arch, "device": "cpu", "os": "linux"},
        "runner_labels": ["self-hosted", "linux"],
        "shapes": {"batch": 1},
        "bench": {**FAST_BENCH, **extra.pop("bench", {})},
    }
    sku.update(extra)
    return sku


def one_sku_params(**sku) -> dict:
    """params.yaml of one model (conv_bn) and one ONNX Runtime FP32 SKU ``s`` with ``sku``'s keys."""
    return {"defaults": {}, "examples": {}, "models": {"m": conv_bn_spec()}, "skus": {"s": ort_sku("fp32", **sku)}}


def cpu_sku(backend: str, precision: str, options: dict) -> dict:
    """A SKU of ``backend`` for this host's CPU, benchmarked briefly."""
    import platform

    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
    return {
        "backend": backend,
        "precision": precision,
        "target": {"arch": arch, "device": "cpu", "os": "linux"},
        "runner_labels": ["self-hosted", "linux"],
        "shapes": {"batch": 1},
        "options": options,
        "bench": {
            "warmup": 1,
            "steady_window": 5,
            "max_warmup_seconds": 1.0,
            "roofline": False,
            "iterations": 3,
            "min_seconds": 0.0,
        },
    }


def _iree_cpu() -> str:
    """A portable CPU where params.yaml names one; elsewhere the build host's own."""
    import platform

    return "x86-64-v3" if platform.machine().lower() in ("x86_64", "amd64") else "host"


# every CPU SKU kind this host builds (tests/test_corpus.py, tests/test_bisect.py)
CPU_SKUS = {
    "ort_fp32": cpu_sku("onnxruntime", "fp32", {}),
    "ort_int8": cpu_sku("onnxruntime", "int8", {"per_channel": True}),
    "ov_fp32": cpu_sku("openvino", "fp32", {"device": "CPU"}),
    "ov_int8": cpu_sku("openvino", "int8", {"device": "CPU", "per_channel": True}),
    "iree_fp32": cpu_sku("iree", "fp32", {"target_device": "local", "target_cpu": _iree_cpu()}),
    "iree_fp16": cpu_sku("iree", "fp16", {"target_device": "local", "target_cpu": _iree_cpu()}),
}


def write_project(root: Path, models: dict, skus: dict, **top) -> Path:
    """Write params.yaml for a project rooted at ``root`` (defaults.bench: FAST_BENCH, unless ``defaults`` is given)."""
    import yaml

    root.mkdir(parents=True, exist_ok=True)
    doc = {"defaults": {"bench": dict(FAST_BENCH)}, "examples": {}, "models": models, "skus": skus, **top}
    (root / "params.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return root / "params.yaml"


def external_data_model(path: Path, location: str = "weights.bin", seed: int = 0) -> Path:
    """y[batch,4] = x[batch,4] @ W + B, with W and B stored in the side file ``location`` (ONNX external data)."""
    rng = np.random.default_rng(seed)
    init = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.normal(0, 0.1, (4,)).astype(np.float32), "B"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"], name="matmul"),
        helper.make_node("Add", ["xw", "B"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "external",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        init,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="skuforge-tests")
    model.ir_version = 8
    (path.parent / location).parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(
        model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=location, size_threshold=0
    )
    return path


def relu_model(path: Path, opset: int = OPSET, custom_domain: str | None = None) -> Path:
    """y[batch,4] = Relu(x), at ``opset``; with ``custom_domain`` a MyOp node of that domain follows (node 'my_op')."""
    nodes = [helper.make_node("Relu", ["x"], ["r" if custom_domain else "y"], name="relu")]
    opsets = [helper.make_opsetid("", opset)]
    if custom_domain:
        nodes.append(helper.make_node("MyOp", ["r"], ["y"], name="my_op", domain=custom_domain))
        opsets.append(helper.make_opsetid(custom_domain, 1))
    graph = helper.make_graph(
        nodes,
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
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


# --- the corpus: models as other exporters write them (tests/test_corpus.py) --------------------


def _float_data(name: str, array: np.ndarray) -> onnx.TensorProto:
    """An initializer in ``float_data`` (a list, not raw bytes), as older exporters store weights."""
    return helper.make_tensor(
        name, TensorProto.FLOAT, list(array.shape), vals=array.astype(np.float32).flatten().tolist()
    )


def _save_at(graph: onnx.GraphProto, path: Path, opset: int) -> Path:
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="skuforge-tests-corpus"
    )
    model.ir_version = min(onnx.IR_VERSION, max(v[1] for v in helper.VERSION_TABLE if v[2] <= opset))
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def conv_pool_slice_model(path: Path, opset: int = OPSET, seed: int = 0) -> Path:
    """x[batch,3,8,8] -> Conv -> BatchNormalization -> Relu -> MaxPool -> Slice (channels 0:4)
    -> Flatten -> y[batch,16], at ``opset`` with every weight in ``float_data``."""
    rng = np.random.default_rng(seed)
    init = [
        _float_data("W", rng.normal(0, 0.3, (6, 3, 3, 3))),
        _float_data("B", rng.normal(0, 0.1, (6,))),
        _float_data("bn_scale", rng.uniform(0.5, 1.5, (6,))),
        _float_data("bn_bias", rng.normal(0, 0.1, (6,))),
        _float_data("bn_mean", rng.normal(0, 0.1, (6,))),
        _float_data("bn_var", rng.uniform(0.5, 1.5, (6,))),
        helper.make_tensor("starts", TensorProto.INT64, [1], vals=[0]),
        helper.make_tensor("ends", TensorProto.INT64, [1], vals=[4]),
        helper.make_tensor("axes", TensorProto.INT64, [1], vals=[1]),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["conv"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("BatchNormalization", ["conv", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["bn"], name="bn"),
        helper.make_node("Relu", ["bn"], ["relu"], name="relu"),
        helper.make_node("MaxPool", ["relu"], ["pool"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
        helper.make_node("Slice", ["pool", "starts", "ends", "axes"], ["sliced"], name="slice"),
        helper.make_node("Flatten", ["sliced"], ["y"], name="flatten"),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_pool_slice",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])],
        init,
    )
    return _save_at(graph, path, opset)


def paddle_softmax_model(path: Path, seed: int = 0) -> Path:
    """A PaddlePaddle-style classifier head at opset 11: tensors named as paddle2onnx names them
    (``conv2d_0.tmp_0``, ``softmax_9.tmp_0``), x[batch,3,8,8] -> Conv -> Relu -> GlobalAveragePool
    -> Reshape [0,2,3] -> Softmax over axis 1 (opset-11 Softmax: the trailing axes flattened)
    -> y[batch,2,3].
    Converting it to opset 13+ for QDQ rewrites the Softmax as Flatten -> Softmax -> Reshape and
    names the new Softmax output ``softmax_9.tmp_0_intermediate``, a tensor the calibration table
    (taken on the opset-11 model) does not have."""
    rng = np.random.default_rng(seed)
    init = [
        _float_data("conv2d_0.w_0", rng.normal(0, 1.5, (6, 3, 3, 3))),
        _float_data("conv2d_0.b_0", rng.normal(0, 1.0, (6,))),
        helper.make_tensor("reshape2_0.shape", TensorProto.INT64, [3], vals=[0, 2, 3]),
    ]
    nodes = [
        helper.make_node(
            "Conv", ["x", "conv2d_0.w_0", "conv2d_0.b_0"], ["conv2d_0.tmp_0"], pads=[1, 1, 1, 1], name="conv2d_0"
        ),
        helper.make_node("Relu", ["conv2d_0.tmp_0"], ["relu_0.tmp_0"], name="relu_0"),
        helper.make_node("GlobalAveragePool", ["relu_0.tmp_0"], ["pool2d_0.tmp_0"], name="pool2d_0"),
        helper.make_node("Reshape", ["pool2d_0.tmp_0", "reshape2_0.shape"], ["reshape2_0.tmp_0"], name="reshape2_0"),
        helper.make_node("Softmax", ["reshape2_0.tmp_0"], ["softmax_9.tmp_0"], axis=1, name="softmax_9"),
    ]
    graph = helper.make_graph(
        nodes,
        "paddle_softmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("softmax_9.tmp_0", TensorProto.FLOAT, ["batch", 2, 3])],
        init,
    )
    return _save_at(graph, path, 11)


def if_model(path: Path) -> Path:
    """y[batch,4] = x * 2 if flag > 0 else x - 1, flag a scalar input (If with Constant nodes in
    float_data in both branches)."""

    def branch(name: str, op: str, value: float) -> onnx.GraphProto:
        const = helper.make_node(
            "Constant",
            [],
            [f"{name}_c"],
            name=f"{name}_const",
            value=helper.make_tensor(f"{name}_v", TensorProto.FLOAT, [], vals=[value]),
        )
        return helper.make_graph(
            [const, helper.make_node(op, ["x", f"{name}_c"], [f"{name}_out"], name=f"{name}_op")],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, ["batch", 4])],
        )

    nodes = [
        helper.make_node("Greater", ["flag", "zero"], ["positive"], name="positive"),
        helper.make_node(
            "If",
            ["positive"],
            ["y"],
            then_branch=branch("then", "Mul", 2.0),
            else_branch=branch("else", "Sub", 1.0),
            name="if",
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "if_model",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("flag", TensorProto.FLOAT, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], vals=[0.0])],
    )
    return _save_at(graph, path, OPSET)


def loop_model(path: Path) -> Path:
    """y[batch,4] = x * W^3 by a Loop of three MatMuls (W in float_data, outside the body)."""
    w = np.random.default_rng(0).normal(0, 0.5, (4, 4))
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep_going"),
            helper.make_node("MatMul", ["acc_in", "W"], ["acc_out"], name="step"),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, ["batch", 4]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, ["batch", 4]),
        ],
    )
    nodes = [helper.make_node("Loop", ["trips", "cond", "x"], ["y"], body=body, name="loop")]
    graph = helper.make_graph(
        nodes,
        "loop_model",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor("trips", TensorProto.INT64, [], vals=[3]),
            helper.make_tensor("cond", TensorProto.BOOL, [], vals=[True]),
            _float_data("W", w),
        ],
    )
    return _save_at(graph, path, OPSET)


def rnn_model(path: Path, cell: str = "LSTM", seq: int = 5, hidden: int = 8) -> Path:
    """x[5,batch,4] with state h0[1,batch,8] (and c0 for LSTM) -> LSTM or GRU -> Y[5,1,batch,8],
    Y_h[1,batch,8] (and Y_c): the state in and out, as a streaming exporter writes it."""
    rng = np.random.default_rng(0)
    gates = {"LSTM": 4, "GRU": 3}[cell]
    init = [
        _float_data("W", rng.normal(0, 0.3, (1, gates * hidden, 4))),
        _float_data("R", rng.normal(0, 0.3, (1, gates * hidden, hidden))),
        _float_data("Bias", rng.normal(0, 0.1, (1, 2 * gates * hidden))),
    ]
    state = [("h0", "Y_h")] + ([("c0", "Y_c")] if cell == "LSTM" else [])
    inputs = ["x", "W", "R", "Bias", "", "h0"] + (["c0"] if cell == "LSTM" else [])
    nodes = [helper.make_node(cell, inputs, ["Y"] + [o for _, o in state], hidden_size=hidden, name=cell.lower())]
    graph = helper.make_graph(
        nodes,
        f"{cell.lower()}_model",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, "batch", 4])]
        + [helper.make_tensor_value_info(i, TensorProto.FLOAT, [1, "batch", hidden]) for i, _ in state],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [seq, 1, "batch", hidden])]
        + [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1, "batch", hidden]) for _, o in state],
        init,
    )
    return _save_at(graph, path, OPSET)


def rnn_spec(dir_: str, cell: str = "LSTM", seq: int = 5, hidden: int = 8) -> dict:
    """The params.yaml entry for rnn_model: the batch axis is axis 1 of every input."""
    state = ["h0"] + (["c0"] if cell == "LSTM" else [])
    return {
        "dir": dir_,
        "source": "model.onnx",
        "inputs": [{"name": "x", "dtype": "float32", "shape": [seq, "batch", 4], "range": [-1.0, 1.0]}]
        + [{"name": s, "dtype": "float32", "shape": [1, "batch", hidden], "range": [-0.5, 0.5]} for s in state],
    }


# --- exporter-style shapes: -1, 0, unnamed and per-tensor dim names (tests/test_exporter_shapes.py) -----


def value_info(name: str, dims: list, elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    """A tensor value info written as exporters do: a dim is an int (-1 and 0 included), a name, or
    None (neither value nor name)."""
    info = helper.make_tensor_value_info(name, elem, None)
    shape = info.type.tensor_type.shape
    shape.SetInParent()
    for d in dims:
        dim = shape.dim.add()
        if isinstance(d, int):
            dim.dim_value = d
        elif isinstance(d, str):
            dim.dim_param = d
    return info


def exporter_dense_model(path: Path, x_dims: list | None = None, y_dims: list | None = None, seed: int = 0) -> Path:
    """y = relu(x @ W + B), x[?,6] -> y[?,4], with the dims written as given (default: torch-style
    per-tensor names, ``batch_size`` in, ``output_dim_0`` out)."""
    rng = np.random.default_rng(seed)
    init = [
        numpy_helper.from_array(rng.normal(0, 0.5, (6, 4)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.normal(0, 0.1, (4,)).astype(np.float32), "B"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"], name="matmul"),
        helper.make_node("Add", ["xw", "B"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "exporter_dense",
        [value_info("x", x_dims if x_dims is not None else ["batch_size", 6])],
        [value_info("y", y_dims if y_dims is not None else ["output_dim_0", 4])],
        init,
    )
    return save_graph(graph, path)


def dense_spec(dir_: str, x_shape: list | None = None) -> dict:
    """The params.yaml entry for exporter_dense_model."""
    return {
        "dir": dir_,
        "source": "model.onnx",
        "inputs": [{"name": "x", "dtype": "float32", "shape": x_shape or ["batch", 6], "range": [-1.0, 1.0]}],
    }


def batch_positions_model(path: Path, seed: int = 0) -> Path:
    """x[-1,6] -> h = x @ W [N,4] and four outputs whose batch axis sits elsewhere, all dims
    unnamed or exporter-named: y = h [N,4]; t = h^T [4,N]; r = Reshape(h, [-1,2,2]) [N,2,2]
    (inference cannot name N); rt = Transpose(r) [2,N,2]; total = sum(h), a scalar with no batch axis."""
    rng = np.random.default_rng(seed)
    init = [
        numpy_helper.from_array(rng.normal(0, 0.5, (6, 4)).astype(np.float32), "W"),
        numpy_helper.from_array(np.array([-1, 2, 2], np.int64), "shape3"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["y"], name="matmul"),
        helper.make_node("Transpose", ["y"], ["t"], perm=[1, 0], name="transpose"),
        helper.make_node("Reshape", ["y", "shape3"], ["r"], name="reshape"),
        helper.make_node("Transpose", ["r"], ["rt"], perm=[1, 0, 2], name="transpose3"),
        helper.make_node("ReduceSum", ["y"], ["total"], keepdims=0, name="total"),
    ]
    graph = helper.make_graph(
        nodes,
        "batch_positions",
        [value_info("x", [-1, 6])],
        [
            value_info("y", ["output_dim_0", "output_dim_1"]),
            value_info("t", [None, None]),
            value_info("r", [-1, 2, 2]),
            value_info("rt", [None, None, None]),
            value_info("total", []),
        ],
        init,
    )
    return save_graph(graph, path)


def upsample_model(path: Path, seed: int = 0) -> Path:
    """x[N,2,H,W] -> Conv 3x3 -> Resize x2 (nearest) -> ConvTranspose stride 2 -> y[N,2,4H,4W], every
    dynamic dim unnamed or -1 in the file."""
    rng = np.random.default_rng(seed)
    init = [
        numpy_helper.from_array(rng.normal(0, 0.3, (3, 2, 3, 3)).astype(np.float32), "Wc"),
        numpy_helper.from_array(rng.normal(0, 0.3, (3, 2, 2, 2)).astype(np.float32), "Wt"),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "Wc"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Resize", ["c", "", "scales"], ["up"], mode="nearest", name="resize"),
        helper.make_node("ConvTranspose", ["up", "Wt"], ["y"], strides=[2, 2], name="deconv"),
    ]
    graph = helper.make_graph(
        nodes, "upsample", [value_info("x", [-1, 2, None, 0])], [value_info("y", [None, 2, -1, -1])], init
    )
    return save_graph(graph, path)


def upsample_spec(dir_: str, height: int = 6, width: int = 5) -> dict:
    return {
        "dir": dir_,
        "source": "model.onnx",
        "pins": {"height": height, "width": width},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 2, "height", "width"], "range": [-1.0, 1.0]}],
    }


def sequence_model(path: Path, seed: int = 0) -> Path:
    """tokens[batch_size, sequence] (int64) and an int64 scalar ``k`` -> E[tokens] * k: per-token
    emb[batch_size, sequence, 4] and pooled[batch_size, 4] (the mean over the sequence)."""
    rng = np.random.default_rng(seed)
    init = [
        numpy_helper.from_array(rng.normal(0, 0.5, (11, 4)).astype(np.float32), "E"),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
    ]
    nodes = [
        helper.make_node("Gather", ["E", "tokens"], ["g"], axis=0, name="embed"),
        helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("Mul", ["g", "kf"], ["emb"], name="scale"),
        helper.make_node("ReduceMean", ["emb", "axis1"], ["pooled"], keepdims=0, name="pool"),
    ]
    graph = helper.make_graph(
        nodes,
        "sequence",
        [value_info("tokens", ["batch_size", "sequence"], TensorProto.INT64), value_info("k", [], TensorProto.INT64)],
        [value_info("emb", ["emb_dim_0", "emb_dim_1", 4]), value_info("pooled", [None, 4])],
        init,
    )
    return save_graph(graph, path, opset=18)


def sequence_spec(dir_: str, seq: int = 7) -> dict:
    return {
        "dir": dir_,
        "source": "model.onnx",
        "pins": {"seq": seq},
        "inputs": [
            {"name": "tokens", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, 10]},
            {"name": "k", "dtype": "int64", "shape": [], "range": [1, 3]},
        ],
    }


def torch_dense_model(path: Path, dynamo: bool, seed: int = 0) -> Path:
    """A tiny Conv + Linear network exported by PyTorch: x[N,1,8,8] -> probs[N,3]. TorchScript
    (``dynamo=False``) names the batch per tensor (``batch_size`` in, ``output_dim_0`` out); the
    dynamo exporter names it after a ``torch.export.Dim`` called ``N``."""
    import torch

    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
            self.fc = torch.nn.Linear(4 * 4 * 4, 3)

        def forward(self, x):
            h = torch.nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
            return torch.softmax(self.fc(torch.flatten(h, 1)), -1)

    net, x = Net().eval(), torch.rand(2, 1, 8, 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    if dynamo:
        program = torch.onnx.export(
            net,
            (x,),
            dynamo=True,
            input_names=["x"],
            output_names=["probs"],
            dynamic_shapes={"x": {0: torch.export.Dim("N")}},
            opset_version=18,
        )
        program.save(str(path))
    else:
        torch.onnx.export(
            net,
            (x,),
            str(path),
            dynamo=False,
            input_names=["x"],
            output_names=["probs"],
            opset_version=17,
            dynamic_axes={"x": {0: "batch_size"}, "probs": {0: "output_dim_0"}},
        )
    return path


def torch_dense_spec(dir_: str) -> dict:
    return {
        "dir": dir_,
        "source": "model.onnx",
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 1, 8, 8], "range": [0.0, 1.0]}],
    }


def batch_mixing_model(path: Path) -> Path:
    """y[N,6] = x - mean(x over the batch): all zeros when run one sample at a time, so the
    outputs show the batch the model ran at."""
    init = [numpy_helper.from_array(np.array([0], np.int64), "axis0")]
    nodes = [
        helper.make_node("ReduceMean", ["x", "axis0"], ["m"], keepdims=1, name="batch_mean"),
        helper.make_node("Sub", ["x", "m"], ["y"], name="sub"),
    ]
    graph = helper.make_graph(nodes, "batch_mixing", [value_info("x", ["N", 6])], [value_info("y", ["N", 6])], init)
    return save_graph(graph, path, opset=18)


def batch_one_reshape_model(path: Path) -> Path:
    """x[-1,6] @ W, then Reshape to a constant [1,4]: the batch is dynamic in the file but only 1 runs
    (as an exporter writes a model traced at batch 1 with a dynamic input)."""
    w = np.random.default_rng(0).normal(0, 0.5, (6, 4)).astype(np.float32)
    init = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([1, 4], np.int64), "shape")]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"], name="matmul"),
        helper.make_node("Reshape", ["xw", "shape"], ["y"], name="reshape"),
    ]
    graph = helper.make_graph(
        nodes, "batch_one_reshape", [value_info("x", [-1, 6])], [value_info("y", [None, None])], init
    )
    return save_graph(graph, path)


# --- planted defects for bisection (tests/test_bisect.py) ---------------------------------------


def _outlier_weights(seed: int, factor: float) -> list[onnx.TensorProto]:
    """conv1, ``channel_scale`` (channel 7 times ``factor``), conv2 (dividing it back) and fc weights."""
    rng = np.random.default_rng(seed)
    scale = np.ones((1, 8, 1, 1), np.float32)
    scale[0, 7] = factor
    w2 = rng.normal(0, 0.4, (8, 8, 1, 1)).astype(np.float32)
    w2[:, 7] /= factor
    w1 = rng.normal(0, 0.4, (8, 4, 3, 3)).astype(np.float32)
    b1 = rng.normal(0.1, 0.05, (8,)).astype(np.float32)
    return [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(b1, "b1"),
        numpy_helper.from_array(scale, "channel_scale"),
        numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array(rng.normal(0, 0.05, (8,)).astype(np.float32), "b2"),
        numpy_helper.from_array(rng.normal(0, 2.0, (10, 8)).astype(np.float32), "fc_w"),
        numpy_helper.from_array(np.zeros((10,), np.float32), "fc_b"),
    ]


def outlier_channel_model(path: Path, seed: int = 0, factor: float = 500.0) -> Path:
    """An INT8 defect in one named node. x[batch,4,8,8] -> conv1 -> relu1 -> ``outlier_scale`` (Mul:
    channel 7 times ``factor``) -> conv2 (divides channel 7 back) -> relu2 -> GAP -> fc -> probs[batch,10].

    In FP32 nothing is wrong. Quantized with one scale per activation tensor, ``outlier_scale``'s
    output spends its 255 levels on channel 7: the seven other channels fall to a level or two."""
    init = _outlier_weights(seed, factor)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Mul", ["r1", "channel_scale"], ["scaled"], name="outlier_scale"),
        helper.make_node("Conv", ["scaled", "w2", "b2"], ["c2"], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
    ]
    return _classifier(nodes + _head("r2"), "outlier_channel", init, path)


def _head(features: str) -> list[onnx.NodeProto]:
    """GlobalAveragePool -> Flatten -> Gemm (fc_w, fc_b) -> Softmax: ``features`` to ``probs``."""
    return [
        helper.make_node("GlobalAveragePool", [features], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1, name="fc"),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1, name="softmax"),
    ]


def _classifier(nodes: list[onnx.NodeProto], name: str, init: list, path: Path) -> Path:
    """x[batch,4,8,8] -> ``nodes`` -> probs[batch,10], saved at ``path``."""
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8, 8])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 10])],
        init,
    )
    return save_graph(graph, path)


def outlier_channel_spec(dir_: str = "m") -> dict:
    return {
        "dir": dir_,
        "source": "model.onnx",
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4, 8, 8], "range": [0.0, 1.0]}],
    }


def fp16_overflow_model(path: Path, seed: int = 0, factor: float = 4000.0) -> Path:
    """An FP16 defect in one named node. x[batch,16] -> fc1 -> ``overflow_scale`` (Mul by ``factor``:
    values past FP16's 65504) -> relu -> ``rescale`` (Mul by 1/factor, back in range) -> fc2 -> y[batch,8].

    In FP32 the scaling cancels; in FP16 ``overflow_scale``'s output is Inf, and fc2 turns Inf into NaN."""
    rng = np.random.default_rng(seed)
    init = [
        numpy_helper.from_array(rng.normal(0, 6.0, (16, 32)).astype(np.float32), "w1"),
        numpy_helper.from_array(np.array(factor, np.float32), "up"),
        numpy_helper.from_array(np.array(1.0 / factor, np.float32), "down"),
        numpy_helper.from_array(rng.normal(0, 0.3, (32, 8)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Mul", ["h", "up"], ["big"], name="overflow_scale"),
        helper.make_node("Relu", ["big"], ["big_relu"], name="relu"),
        helper.make_node("Mul", ["big_relu", "down"], ["small"], name="rescale"),
        helper.make_node("MatMul", ["small", "w2"], ["y"], name="fc2"),
    ]
    graph = helper.make_graph(
        nodes,
        "fp16_overflow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        init,
    )
    return save_graph(graph, path)


def fp16_overflow_spec(dir_: str = "m") -> dict:
    return {
        "dir": dir_,
        "source": "model.onnx",
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 16], "range": [-1.0, 1.0]}],
    }


def decomposed_layernorm_model(path: Path, blocks: int = 12, width: int = 256, seed: int = 0) -> Path:
    """``blocks`` layer norms written out op by op (ReduceMean, Sub, Pow, ...), as exporters emit
    them: ONNX Runtime fuses each into one kernel at level ``extended``/``all`` and runs nine nodes
    per block at ``disable``. A model whose speed depends on one SKU option, many times over."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
        numpy_helper.from_array(np.array([-1], np.int64), "axes"),
    ]
    nodes, x = [], "x"
    for b in range(blocks):
        g, bias = f"g{b}", f"b{b}"
        inits += [
            numpy_helper.from_array(rng.uniform(0.5, 1.5, width).astype(np.float32), g),
            numpy_helper.from_array(rng.normal(0, 0.1, width).astype(np.float32), bias),
        ]
        p = f"ln{b}_"
        nodes += [
            helper.make_node("ReduceMean", [x, "axes"], [p + "mean"], keepdims=1, name=p + "mean"),
            helper.make_node("Sub", [x, p + "mean"], [p + "d"], name=p + "sub"),
            helper.make_node("Pow", [p + "d", "two"], [p + "sq"], name=p + "pow"),
            helper.make_node("ReduceMean", [p + "sq", "axes"], [p + "var"], keepdims=1, name=p + "var"),
            helper.make_node("Add", [p + "var", "eps"], [p + "ve"], name=p + "add_eps"),
            helper.make_node("Sqrt", [p + "ve"], [p + "std"], name=p + "sqrt"),
            helper.make_node("Div", [p + "d", p + "std"], [p + "n"], name=p + "div"),
            helper.make_node("Mul", [p + "n", g], [p + "s"], name=p + "scale"),
            helper.make_node("Add", [p + "s", bias], [p + "out"], name=p + "shift"),
        ]
        x = p + "out"
    nodes.append(helper.make_node("Softmax", [x], ["probs"], axis=-1, name="softmax"))
    graph = helper.make_graph(
        nodes,
        "decomposed_layernorm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", width])],
        inits,
    )
    return save_graph(graph, path, opset=18)


def vector_model_spec(dir_: str, width: int = 256) -> dict:
    return {
        "dir": dir_,
        "source": "model.onnx",
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", width]}],
    }


# --- ops a backend lacks (tests/backends/test_contract.py's UnsupportedOp cases) ------------------


def det_model(path: Path) -> Path:
    """y[batch] = det(2 * x[batch,3,3]): ONNX Runtime runs Det; OpenVINO's ONNX frontend and TensorRT's
    parser have none."""
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["x2"], name="double"),
        helper.make_node("Det", ["x2"], ["y"], name="determinant"),
    ]
    graph = helper.make_graph(
        nodes,
        "det",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch"])],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    return save_graph(graph, path)


def det_spec(dir_: str = "models/det") -> dict:
    return {"dir": dir_, "source": "model.onnx", "inputs": [{"name": "x", "shape": ["batch", 3, 3]}]}


def dft_model(path: Path) -> Path:
    """x[batch,8] -> Relu -> Unsqueeze -> DFT: IREE's ONNX lowering has no DFT."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="act"),
        helper.make_node("Unsqueeze", ["r", "axes"], ["u"], name="unsqueeze"),
        helper.make_node("DFT", ["u"], ["y"], name="spectrum", onesided=0),
    ]
    graph = helper.make_graph(
        nodes,
        "dft",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 2])],
        [numpy_helper.from_array(np.array([2], np.int64), "axes")],
    )
    return save_graph(graph, path)


def dft_spec(dir_: str = "models/dft") -> dict:
    return {"dir": dir_, "source": "model.onnx", "inputs": [{"name": "x", "shape": ["batch", 8]}]}


def int16_relu_model(path: Path) -> Path:
    """Relu on int16: valid ONNX, but ONNX Runtime's CPU provider has no int16 Relu kernel."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu_int16")],
        "int16_relu",
        [helper.make_tensor_value_info("x", TensorProto.INT16, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.INT16, ["batch", 4])],
    )
    return save_graph(graph, path)


def int16_relu_spec(dir_: str = "models/int16") -> dict:
    return {"dir": dir_, "source": "model.onnx", "inputs": [{"name": "x", "dtype": "int16", "shape": ["batch", 4]}]}


def if_outer_scope_model(path: Path, seed: int = 0, factor: float = 500.0) -> Path:
    """An INT8 defect feeding an ``If`` through outer scope. x[batch,4,8,8] -> conv1 -> relu1 ->
    ``outlier_scale`` (Mul: channel 7 times ``factor``) -> conv2 -> c2; ``branch`` (If on
    mean(x) > 0.5) reads c2 from the outer scope (then: Relu, else: Abs) -> GAP -> fc -> probs[batch,10].

    The If's only explicit input is its condition: a search that follows node inputs alone never
    reaches conv2 or ``outlier_scale`` and blames the If. The defect is ``outlier_scale``'s range,
    as in ``outlier_channel_model``."""
    init = [*_outlier_weights(seed, factor), numpy_helper.from_array(np.array(0.5, np.float32), "half")]

    def branch(name: str, op: str) -> onnx.GraphProto:
        return helper.make_graph(
            [helper.make_node(op, ["c2"], [f"{name}_out"], name=f"{name}_{op.lower()}")],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, ["batch", 8, 8, 8])],
        )

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Mul", ["r1", "channel_scale"], ["scaled"], name="outlier_scale"),
        helper.make_node("Conv", ["scaled", "w2", "b2"], ["c2"], name="conv2"),
        helper.make_node("ReduceMean", ["x"], ["x_mean"], keepdims=0, name="x_mean"),
        helper.make_node("Greater", ["x_mean", "half"], ["bright"], name="bright"),
        helper.make_node(
            "If",
            ["bright"],
            ["r2"],
            then_branch=branch("then", "Relu"),
            else_branch=branch("else", "Abs"),
            name="branch",
        ),
    ]
    return _classifier(nodes + _head("r2"), "if_outer_scope", init, path)


def if_outer_scope_spec(dir_: str = "m") -> dict:
    """if_outer_scope_model at batch 1 (the If's condition is one sample's mean)."""
    return outlier_channel_spec(dir_) | {"pins": {"batch": 1}}


def shape_chain_model(path: Path, opset: int = 11, upsample: bool = False, seed: int = 0) -> Path:
    """x[batch,3,8,8] -> Conv -> Relu [-> Resize x2 with opset 10's two inputs (X, scales)] -> y =
    Reshape(r, Concat(Gather(Shape(r), [0, 1]), [-1])) [batch,4,HW]: the new shape computed from the
    tensor's own shape, as Paddle and PyTorch export ``x.reshape(n, c, -1)``."""
    rng = np.random.default_rng(seed)
    init = [
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32), "W"),
        numpy_helper.from_array(np.array([0, 1], np.int64), "nc_index"),
        numpy_helper.from_array(np.array([-1], np.int64), "rest"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["conv"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["conv"], ["r"], name="relu"),
    ]
    if upsample:
        init.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"))
        nodes.append(helper.make_node("Resize", ["r", "scales"], ["up"], mode="nearest", name="upsample"))
    src = "up" if upsample else "r"
    nodes += [
        helper.make_node("Shape", [src], ["shape"], name="shape"),
        helper.make_node("Gather", ["shape", "nc_index"], ["nc"], axis=0, name="gather_nc"),
        helper.make_node("Concat", ["nc", "rest"], ["new_shape"], axis=0, name="concat_shape"),
        helper.make_node("Reshape", [src, "new_shape"], ["y"], name="reshape_seq"),
    ]
    graph = helper.make_graph(
        nodes,
        "shape_chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 256 if upsample else 64])],
        init,
    )
    return _save_at(graph, path, opset)


def feature_map_model(path: Path, seed: int = 0) -> Path:
    """x[batch,3,8,6] -> ``conv1`` 3x3 -> ``relu1`` -> ``conv2`` 1x1 -> y[batch,4,8,6]: a 4-D NCHW
    output (channels, height and width all differ, so a layout transpose left in shows)."""
    rng = np.random.default_rng(seed)
    init = [
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32), "W1"),
        numpy_helper.from_array(rng.normal(0, 0.1, (8,)).astype(np.float32), "B1"),
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 8, 1, 1)).astype(np.float32), "W2"),
        numpy_helper.from_array(rng.normal(0, 0.1, (4,)).astype(np.float32), "B2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "W2", "B2"], ["y"], name="conv2"),
    ]
    graph = helper.make_graph(
        nodes,
        "feature_map",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 8, 6])],
        init,
    )
    return save_graph(graph, path)


def feature_map_spec(dir_: str = "m") -> dict:
    return {
        "dir": dir_,
        "source": "model.onnx",
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 3, 8, 6], "range": [-1.0, 1.0]}],
    }


def foreign_names_model(path: Path, seed: int = 0) -> Path:
    """Names as other exporters write them: inputs ``input.1`` [batch,3,6,6] and ``x:0`` [batch,4,6,6]
    (TensorFlow's tensor names), a node ``conv@0`` (PaddlePaddle's) and an output ``out/1``:
    out = Conv(input.1) + x:0."""
    rng = np.random.default_rng(seed)
    init = [numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32), "W")]
    nodes = [
        helper.make_node("Conv", ["input.1", "W"], ["c"], pads=[1, 1, 1, 1], name="conv@0"),
        helper.make_node("Add", ["c", "x:0"], ["out/1"], name="add@1"),
    ]
    graph = helper.make_graph(
        nodes,
        "foreign_names",
        [
            helper.make_tensor_value_info("input.1", TensorProto.FLOAT, ["batch", 3, 6, 6]),
            helper.make_tensor_value_info("x:0", TensorProto.FLOAT, ["batch", 4, 6, 6]),
        ],
        [helper.make_tensor_value_info("out/1", TensorProto.FLOAT, ["batch", 4, 6, 6])],
        init,
    )
    return save_graph(graph, path)


def foreign_names_spec(dir_: str = "m") -> dict:
    return {
        "dir": dir_,
        "source": "model.onnx",
        "inputs": [
            {"name": "input.1", "dtype": "float32", "shape": ["batch", 3, 6, 6], "range": [-1.0, 1.0]},
            {"name": "x:0", "dtype": "float32", "shape": ["batch", 4, 6, 6], "range": [-1.0, 1.0]},
        ],
    }


def bias_outlier_model(path: Path, seed: int = 0, outlier: float = 1e4, opset: int = OPSET) -> Path:
    """An INT8 defect that only the consumer can undo. x[batch,4,8,8] -> conv1 -> relu1 -> conv2 ->
    relu2 -> conv3 -> ``outlier_bias`` (Add: channel 5 plus ``outlier``) -> relu3 -> ``drop`` (1x1
    Conv whose weights for channel 5 are 0) -> relu4 -> GAP -> fc -> probs[batch,10].

    In FP32 ``drop`` ignores channel 5. Quantized with one scale per activation tensor, relu3's
    output spends its levels on channel 5 and the other channels fall to zero. ``drop`` quantizes
    its input whatever its producers keep: the Add, relu3 and ``drop`` must all stay float."""
    rng = np.random.default_rng(seed)
    bias = np.zeros((1, 8, 1, 1), np.float32)
    bias[0, 5] = outlier
    w4 = rng.normal(0, 0.4, (8, 8, 1, 1)).astype(np.float32)
    w4[:, 5] = 0.0
    init = [
        numpy_helper.from_array(rng.normal(0, 0.4, (8, 4, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 8, 3, 3)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 8, 3, 3)).astype(np.float32), "w3"),
        numpy_helper.from_array(bias, "outlier"),
        numpy_helper.from_array(w4, "w4"),
        numpy_helper.from_array(rng.normal(0, 2.0, (10, 8)).astype(np.float32), "fc_w"),
        numpy_helper.from_array(np.zeros((10,), np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3"], ["c3"], pads=[1, 1, 1, 1], name="conv3"),
        helper.make_node("Add", ["c3", "outlier"], ["biased"], name="outlier_bias"),
        helper.make_node("Relu", ["biased"], ["r3"], name="relu3"),
        helper.make_node("Conv", ["r3", "w4"], ["c4"], name="drop"),
        helper.make_node("Relu", ["c4"], ["r4"], name="relu4"),
    ]
    graph = helper.make_graph(
        nodes + _head("r4"),
        "bias_outlier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8, 8])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 10])],
        init,
    )
    return save_graph(graph, path, opset)


def unknown_rank_model(path: Path, opset: int = 11, seed: int = 0) -> Path:
    """x[batch,4,8,8] -> conv1 -> relu1 -> ``reshape`` (to relu1's own shape, read back through a Cast
    to float and back, as exporters write a size computed in float) -> conv2 -> relu2 -> GAP -> fc ->
    probs[batch,10], at ``opset``. Shape inference cannot tell ``reshaped``'s rank: its value info
    (and the exporter's own entry for ``c1``) carries an element type and no shape."""
    rng = np.random.default_rng(seed)
    init = [
        numpy_helper.from_array(rng.normal(0, 0.4, (8, 4, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 8, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.normal(0, 2.0, (10, 8)).astype(np.float32), "fc_w"),
        numpy_helper.from_array(np.zeros((10,), np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Shape", ["r1"], ["r1_shape"], name="shape"),
        helper.make_node("Cast", ["r1_shape"], ["r1_shape_f"], to=TensorProto.FLOAT, name="to_float"),
        helper.make_node("Cast", ["r1_shape_f"], ["r1_shape_i"], to=TensorProto.INT64, name="to_int"),
        helper.make_node("Reshape", ["r1", "r1_shape_i"], ["reshaped"], name="reshape"),
        helper.make_node("Conv", ["reshaped", "w2"], ["c2"], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
    ]
    graph = helper.make_graph(
        nodes + _head("r2"),
        "unknown_rank",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8, 8])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 10])],
        init,
        value_info=[helper.make_tensor_value_info("c1", TensorProto.FLOAT, None)],
    )
    return _save_at(graph, path, opset)
