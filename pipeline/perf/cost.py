"""The cost of an ONNX graph: FLOPs and bytes per node.

**Cost model** (``graph_cost``), per node of the prepared, static-shaped ONNX graph, shapes from
``onnx.shape_inference``:

- A multiply-add is 2 FLOPs. Conv: ``2 · |Y| · C_in/group · Πkernel`` (+ ``|Y|`` with a bias);
  ConvTranspose: ``2 · |X| · C_out/group · Πkernel`` (+ bias); MatMul: ``2 · |Y| · K`` (batch dims
  broadcast into ``|Y|``); Gemm: ``2 · M·N·K`` (+ ``M·N`` with C); Einsum: ``2 · |Y| · Π(contracted
  dims)``; Attention / MultiHeadAttention (com.microsoft): the QKV projection (Attention), the two
  batched products and the softmax.
- Integer kernels (ConvInteger, QLinearConv, MatMulInteger, QLinearMatMul) count ``int_ops``, not
  ``flops``: they run on other units, at another peak.
- Elementwise, normalisation, softmax, quantization: FLOPs per element of the output (per element
  of the input for reductions), from ``PER_ELEMENT``: each primitive of the op's definition (add,
  mul, exp, erf, ...) is one FLOP, so Relu is 1, Sigmoid 4 (neg, exp, add, div), Softmax 5,
  LayerNormalization 8, BatchNormalization 2 (runtimes apply it as one scale and shift).
- Pooling: ``Πkernel`` per output element; global pooling one per input element. Resize: nearest
  0, linear ``2 · 2^d`` and cubic ``2 · 4^d`` per output element (``d`` resized axes).
- Data movement (Reshape, Transpose, Concat, Gather, Cast, ...) has 0 FLOPs and its bytes.
- Bytes: each distinct input (activations and weights) and each output at its dtype, as if every
  tensor came from and went to memory (no fusion, no cache reuse): an upper bound on traffic.
- Other ops count their bytes and 0 FLOPs and are listed in ``GraphCost.uncounted``; nodes with a
  tensor of unknown shape in ``GraphCost.unshaped``.

Node names are ``node.name``, or the first output's name where the node has none (as elsewhere in
skuforge).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from pipeline.model.graph import _dims, infer_shapes, pin_axes
from pipeline.results.reports import Result

if TYPE_CHECKING:
    import onnx


# FLOPs per output element (per input element for the reductions, see _PER_INPUT).


PER_ELEMENT: dict[str, int] = {
    # arithmetic, comparison, selection
    **dict.fromkeys(
        (
            "Add",
            "Sub",
            "Mul",
            "Div",
            "Pow",
            "Mod",
            "Max",
            "Min",
            "Sum",
            "Mean",
            "Neg",
            "Abs",
            "Sign",
            "Floor",
            "Ceil",
            "Round",
            "Reciprocal",
            "Sqrt",
            "Exp",
            "Log",
            "Erf",
            "Tanh",
            "Sin",
            "Cos",
            "Tan",
            "Asin",
            "Acos",
            "Atan",
            "Sinh",
            "Cosh",
            "Asinh",
            "Acosh",
            "Atanh",
            "Relu",
            "ThresholdedRelu",
            "Equal",
            "Greater",
            "Less",
            "GreaterOrEqual",
            "LessOrEqual",
            "Where",
            "IsNaN",
            "IsInf",
            "BiasAdd",
        ),
        1,
    ),
    **dict.fromkeys(("LeakyRelu", "PRelu", "Clip", "Shrink"), 2),
    **dict.fromkeys(("Elu", "Softplus", "Softsign"), 3),
    "Sigmoid": 4,
    "HardSigmoid": 4,
    "Selu": 4,
    "Celu": 4,
    "HardSwish": 5,
    "Mish": 5,
    "Gelu": 5,
    "QuickGelu": 5,
    "FastGelu": 9,
    "BiasGelu": 6,
    # softmax: max, subtract, exp, sum, divide (log)
    "Softmax": 5,
    "LogSoftmax": 5,
    # normalisation
    "BatchNormalization": 2,
    "LayerNormalization": 8,
    "InstanceNormalization": 8,
    "GroupNormalization": 8,
    "MeanVarianceNormalization": 7,
    "LpNormalization": 3,
    "SkipLayerNormalization": 9,
    "SimplifiedLayerNormalization": 5,
    "SkipSimplifiedLayerNormalization": 6,
    "RMSNormalization": 5,
    # quantization: scale, round, zero point, saturate / subtract zero point, scale
    "QuantizeLinear": 4,
    "DequantizeLinear": 2,
    "DynamicQuantizeLinear": 6,
    # reductions (per input element)
    **dict.fromkeys(
        (
            "ReduceSum",
            "ReduceMean",
            "ReduceMax",
            "ReduceMin",
            "ReduceProd",
            "ReduceL1",
            "GlobalAveragePool",
            "GlobalMaxPool",
            "ArgMax",
            "ArgMin",
        ),
        1,
    ),
    **dict.fromkeys(("ReduceL2", "ReduceSumSquare", "GlobalLpPool"), 2),
    **dict.fromkeys(("ReduceLogSum", "ReduceLogSumExp"), 3),
}
_PER_INPUT = {
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceSumSquare",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "GlobalAveragePool",
    "GlobalMaxPool",
    "GlobalLpPool",
    "ArgMax",
    "ArgMin",
    "BatchNormalization",
    "LayerNormalization",
    "InstanceNormalization",
    "GroupNormalization",
    "SkipLayerNormalization",
}
# Ops that only move, reinterpret or convert data: bytes, no FLOPs.
DATA_MOVEMENT = frozenset(
    {
        "Reshape",
        "Transpose",
        "Concat",
        "Flatten",
        "Squeeze",
        "Unsqueeze",
        "Identity",
        "Gather",
        "GatherElements",
        "GatherND",
        "Slice",
        "Split",
        "Pad",
        "Expand",
        "Tile",
        "Shape",
        "Size",
        "Cast",
        "CastLike",
        "DepthToSpace",
        "SpaceToDepth",
        "ScatterND",
        "ScatterElements",
        "Constant",
        "ConstantOfShape",
        "Range",
        "Dropout",
        "Not",
        "And",
        "Or",
        "Xor",
        "OneHot",
        "Trilu",
        "ReverseSequence",
        "Compress",
        "NonZero",
        "EyeLike",
        "ReorderInput",
        "ReorderOutput",
        "MemcpyToHost",
        "MemcpyFromHost",
    }
)
# What counts as an elementwise neighbour when a joined group grows forward (rule 4).
FUSABLE = frozenset(op for op in PER_ELEMENT if op not in _PER_INPUT or op == "BatchNormalization") - {
    "Softmax",
    "LogSoftmax",
}


class LayerCost(Result):
    node: str
    op: str
    flops: int = Field(description="floating-point operations (a multiply-add is 2)")
    int_ops: int = Field(0, description="integer operations of integer kernels (QLinearConv, MatMulInteger, ...)")
    bytes: int = Field(description="bytes of every distinct input (weights included) and output at its dtype")
    weight_bytes: int = Field(0, description="bytes of the inputs that are initializers")
    intensity: float = Field(description="flops / bytes (FLOP per byte)")
    counted: bool = Field(True, description="False: no FLOP formula for this op (0 FLOPs, bytes counted)")
    shaped: bool = Field(True, description="False: a tensor of the node has no static shape; its cost is partial")
    inputs: list[str] = Field(default_factory=list)
    outputs: list[str] = Field(default_factory=list)


class GraphCost(Result):
    layers: list[LayerCost]
    flops: int
    int_ops: int
    bytes: int = Field(description="sum over the layers: every tensor read and written once per node that uses it")
    weight_bytes: int = Field(description="bytes of the distinct initializers the nodes read")
    intensity: float
    uncounted: list[str] = Field(default_factory=list, description="nodes of ops without a FLOP formula")
    unshaped: list[str] = Field(default_factory=list, description="nodes with a tensor of unknown shape")

    def layer(self, node: str) -> LayerCost:
        return next(layer for layer in self.layers if layer.node == node)


def ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


# --- cost per node ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    shape: tuple[int, ...] | None  # None: unknown rank or a dynamic dim
    elem: int  # onnx.TensorProto data type (0: unknown)

    @property
    def size(self) -> int | None:
        return math.prod(self.shape) if self.shape is not None else None


_SUB_BYTE = {"INT4": 4, "UINT4": 4, "FLOAT4E2M1": 4}


def _elem_bits(elem: int) -> int | None:
    import onnx

    if not elem:
        return None
    name = onnx.TensorProto.DataType.Name(elem)
    if name in _SUB_BYTE:
        return _SUB_BYTE[name]
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem).itemsize * 8
    except (KeyError, TypeError, ValueError):  # STRING, or a type numpy cannot hold
        return None


def _nbytes(t: _Tensor | None) -> int | None:
    if t is None or t.size is None:
        return None
    bits = _elem_bits(t.elem)
    return None if bits is None else (t.size * bits + 7) // 8


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    import onnx

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


class _Unknown(Exception):
    """A shape the formula needs is not known."""


def _shape(t: _Tensor | None) -> tuple[int, ...]:
    if t is None or t.shape is None:
        raise _Unknown
    return t.shape


def _size(t: _Tensor | None) -> int:
    return math.prod(_shape(t))


def _present(ins: list[_Tensor | None], i: int) -> bool:
    return len(ins) > i and ins[i] is not None


def _conv(ins, outs, w_index: int, bias_index: int | None) -> int:
    w = _shape(ins[w_index])
    ops = 2 * _size(outs[0]) * math.prod(w[1:])
    return ops + (_size(outs[0]) if bias_index is not None and _present(ins, bias_index) else 0)


def _conv_transpose(ins, outs, attrs) -> int:
    w = _shape(ins[1])
    return 2 * _size(ins[0]) * math.prod(w[1:]) + (_size(outs[0]) if _present(ins, 2) else 0)


def _matmul(ins, outs) -> int:
    a = _shape(ins[0])
    return 2 * _size(outs[0]) * a[-1]


def _gemm(ins, outs, attrs) -> int:
    a = _shape(ins[0])
    k = a[0] if attrs.get("transA", 0) else a[-1]
    return 2 * _size(outs[0]) * k + (_size(outs[0]) if _present(ins, 2) else 0)


def _einsum(ins, outs, attrs) -> int:
    eq = attrs["equation"].decode() if isinstance(attrs["equation"], bytes) else attrs["equation"]
    lhs, arrow, rhs = eq.replace(" ", "").partition("->")
    terms = lhs.split(",")
    sizes: dict[str, int] = {}
    for term, t in zip(terms, ins, strict=True):
        dims = _shape(t)
        head, _, tail = term.partition("...")
        sizes.update(zip(head, dims[: len(head)], strict=True))
        sizes.update(zip(tail, dims[len(dims) - len(tail) :], strict=True))
    if not arrow:  # implicit output: the letters that occur once
        rhs = "".join(c for c in sizes if lhs.count(c) == 1)
    contracted = math.prod(sizes[c] for c in sizes if c not in rhs)
    if len(terms) == 1:
        return _size(ins[0]) if contracted > 1 else 0
    return 2 * (len(terms) - 1) * _size(outs[0]) * contracted


def _attention(ins, outs, attrs) -> int:
    """com.microsoft Attention: input [B, S, D], packed QKV weights [D, Dq+Dk+Dv]."""
    b, s, d = _shape(ins[0])
    cols = _shape(ins[1])[-1]
    dq, _, dv = attrs.get("qkv_hidden_sizes") or [cols // 3] * 3
    heads = attrs.get("num_heads", 1)
    ops = 2 * b * s * d * cols + (b * s * cols if _present(ins, 2) else 0)
    return ops + 2 * b * s * s * dq + PER_ELEMENT["Softmax"] * b * heads * s * s + 2 * b * s * s * dv


def _multi_head_attention(ins, outs, attrs) -> int:
    """com.microsoft MultiHeadAttention: query [B, S, D], key [B, L, D], value [B, L, Dv]; or packed
    QKV in query [B, S, N, 3, H]."""
    heads = attrs.get("num_heads", 1)
    q = _shape(ins[0])
    if len(q) == 5:
        b, s, n, _, h = q
        kv, d, dv = s, n * h, n * h
    else:
        b, s, d = q
        k = _shape(ins[1])
        kv = k[1] if len(k) == 3 else k[2]  # L: [B, L, D] or [B, N, L, H] (past key)
        dv = _shape(ins[2])[-1] * (1 if len(k) == 3 else k[1])
    return 2 * b * s * kv * d + PER_ELEMENT["Softmax"] * b * heads * s * kv + 2 * b * s * kv * dv


def _pool(ins, outs, attrs) -> int:
    return _size(outs[0]) * math.prod(attrs["kernel_shape"])


def _resize(ins, outs, attrs) -> int:
    mode = attrs.get("mode", b"nearest")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode == "nearest":
        return 0
    x, y = _shape(ins[0]), _shape(outs[0])
    resized = sum(1 for a, b in zip(x, y, strict=True) if a != b)
    taps = (4 if mode == "cubic" else 2) ** resized
    return 2 * taps * _size(outs[0])


# op -> (flops, int_ops) from (inputs, outputs, attributes)
_FORMULAS = {
    "Conv": lambda i, o, a: (_conv(i, o, 1, 2), 0),
    "FusedConv": lambda i, o, a: (_conv(i, o, 1, 2) + _size(o[0]), 0),
    "ConvTranspose": lambda i, o, a: (_conv_transpose(i, o, a), 0),
    "ConvInteger": lambda i, o, a: (0, _conv(i, o, 1, None)),
    "QLinearConv": lambda i, o, a: (0, _conv(i, o, 3, 8)),
    "MatMul": lambda i, o, a: (_matmul(i, o), 0),
    "FusedMatMul": lambda i, o, a: (2 * _size(o[0]) * _shape(i[0])[-2 if a.get("transA", 0) else -1], 0),
    "MatMulInteger": lambda i, o, a: (0, _matmul(i, o)),
    "QLinearMatMul": lambda i, o, a: (0, 2 * _size(o[0]) * _shape(i[0])[-1]),
    "Gemm": lambda i, o, a: (_gemm(i, o, a), 0),
    "FusedGemm": lambda i, o, a: (_gemm(i, o, a) + _size(o[0]), 0),
    "Einsum": lambda i, o, a: (_einsum(i, o, a), 0),
    "Attention": lambda i, o, a: (_attention(i, o, a), 0),
    "MultiHeadAttention": lambda i, o, a: (_multi_head_attention(i, o, a), 0),
    "MaxPool": lambda i, o, a: (_pool(i, o, a), 0),
    "AveragePool": lambda i, o, a: (_pool(i, o, a), 0),
    "LpPool": lambda i, o, a: (2 * _pool(i, o, a), 0),
    "Resize": lambda i, o, a: (_resize(i, o, a), 0),
    "Upsample": lambda i, o, a: (_resize(i, o, a), 0),
}


def node_cost(
    op: str, ins: list[_Tensor | None], outs: list[_Tensor | None], attrs: dict[str, Any]
) -> tuple[int, int] | None:
    """(flops, int_ops) of one node; None: no formula for the op. Raises _Unknown where a shape
    the formula needs is not static."""
    if op in _FORMULAS:
        return _FORMULAS[op](ins, outs, attrs)
    if op in PER_ELEMENT:
        return PER_ELEMENT[op] * _size(ins[0] if op in _PER_INPUT else outs[0]), 0
    if op in DATA_MOVEMENT:
        return 0, 0
    return None


# --- the graph --------------------------------------------------------------------------------


def _tensors(model: onnx.ModelProto) -> dict[str, _Tensor]:

    out: dict[str, _Tensor] = {}
    for vi in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        tt = vi.type.tensor_type
        dims = _dims(vi) if tt.HasField("shape") else None
        fixed = [d for d in dims or () if isinstance(d, int)]
        static = dims is not None and len(fixed) == len(dims)
        out[vi.name] = _Tensor(tuple(fixed) if static else None, tt.elem_type)
    for init in model.graph.initializer:
        out[init.name] = _Tensor(tuple(init.dims), init.data_type)
    return out


def _attention_shapes(model: onnx.ModelProto) -> bool:
    """Give the outputs of contrib attention nodes their shapes (ONNX's inference does not know
    the ops), so inference can carry shapes past them. True when one was added."""
    import onnx

    known = _tensors(model)
    added = False
    for node in model.graph.node:
        if (
            node.op_type not in ("Attention", "MultiHeadAttention")
            or not node.output
            or (node.output[0] in known and known[node.output[0]].shape is not None)
        ):
            continue
        attrs = _attrs(node)
        q = known.get(node.input[0])
        if q is None or q.shape is None or len(q.shape) not in (3, 5):
            continue
        if node.op_type == "Attention":
            w = known.get(node.input[1])
            if w is None or w.shape is None:
                continue
            dv = (attrs.get("qkv_hidden_sizes") or [w.shape[-1] // 3] * 3)[2]
        elif len(q.shape) == 5:
            dv = q.shape[2] * q.shape[4]
        else:
            v = known.get(node.input[2]) if len(node.input) > 2 else None
            if v is None or v.shape is None:
                continue
            dv = v.shape[-1] * (v.shape[1] if len(v.shape) == 4 else 1)
        model.graph.value_info.append(onnx.helper.make_tensor_value_info(node.output[0], q.elem, [*q.shape[:2], dv]))
        added = True
    return added


def graph_cost(model: onnx.ModelProto | str | Path, pins: dict[str, int] | None = None) -> GraphCost:
    """FLOPs and bytes of each node of a prepared ONNX model (a path or a ModelProto, left
    unchanged), with the named dims of ``pins`` fixed first (the SKU's shapes)."""
    import onnx

    path = Path(model) if isinstance(model, (str, Path)) else Path("<model>")
    if isinstance(model, (str, Path)):
        model = onnx.load(str(model))
    else:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
    model = pin_axes(model, pins, path) if pins else infer_shapes(model, path)
    for _ in range(4):  # each round carries shapes past one more attention node
        if not _attention_shapes(model):
            break
        model = infer_shapes(model, path)
    tensors = _tensors(model)
    initializers = {i.name for i in model.graph.initializer}
    layers, uncounted, unshaped, weights = [], [], [], {}
    for node in model.graph.node:
        name = node.name or node.output[0]
        ins = [tensors.get(n) if n else None for n in node.input]
        outs = [tensors.get(n) if n else None for n in node.output]
        moved, weight, shaped = 0, 0, True
        for n in dict.fromkeys([*node.input, *node.output]):
            if not n:
                continue
            size = _nbytes(tensors.get(n))
            if size is None:
                shaped = False
                continue
            moved += size
            if n in initializers:
                weight += size
                weights[n] = size
        try:
            counted = node_cost(node.op_type, ins, outs, _attrs(node))
        except (_Unknown, KeyError, ValueError, IndexError, TypeError):  # a shape or attribute the formula lacks
            counted, shaped = (0, 0), False
        if counted is None:
            uncounted.append(name)
        if not shaped:
            unshaped.append(name)
        flops, int_ops = counted or (0, 0)
        layers.append(
            LayerCost(
                node=name,
                op=node.op_type,
                flops=flops,
                int_ops=int_ops,
                bytes=moved,
                weight_bytes=weight,
                intensity=ratio(flops, moved),
                counted=counted is not None,
                shaped=shaped,
                inputs=[n for n in node.input if n],
                outputs=list(node.output),
            )
        )
    flops, int_ops, moved = (sum(getattr(x, f) for x in layers) for f in ("flops", "int_ops", "bytes"))
    return GraphCost(
        layers=layers,
        flops=flops,
        int_ops=int_ops,
        bytes=moved,
        weight_bytes=sum(weights.values()),
        intensity=ratio(flops, moved),
        uncounted=uncounted,
        unshaped=unshaped,
    )
