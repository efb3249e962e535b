"""Roofline of an engine: FLOPs and bytes per ONNX node, against this host's measured peaks.

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

**Join rule for per-layer times** (``join_layer_times``): the runners' ``profile_layers`` key
their times by the engine's layer names, which are the names of build.json ``layers`` (LayerInfo):
ONNX Runtime: node names of the optimized engine graph; OpenVINO: runtime layer names; TVM:
primitive function names. A key is joined to ONNX nodes of the prepared graph, in this order:

1. the LayerInfo of that name in build.json ``layers`` has ``fused_from``: each name in it that is
   a node name or a tensor a node produces (OpenVINO, TVM);
2. the key is a node name;
3. the key, without what ONNX Runtime adds when it rewrites a node (a ``fused `` prefix, a ``/Pass``
   suffix, a ``_nchwc`` suffix), is a node name or a tensor a node produces;
4. then each joined group grows over its fused neighbours that no key names: from an elementwise
   member backward to the producer whose outputs only the group reads, and forward to an
   elementwise consumer that only the group feeds (ONNX Runtime's FusedConv named after its Conv
   also covers the Relu; its NCHWc Conv named after the Relu's output also covers the Conv).

Keys joined to no node (a layout Reorder, a copy between devices) are reported with their time in
``RooflineReport.unmatched_ms``, so no time disappears.

**Which peak** (``roofline``): ops that run in INT8 are judged against the host's measured INT8
peak (u8 × s8 → s32 matmul, ``pipeline.host.peaks``), the others against its FP32 peak. A node runs
in INT8 where the build.json layer joined to it (the same join) says ``int8``, else where the
engine's precision (the SKU's) is ``int8``; integer kernels of the graph always do. An engine with
both is ``mixed``: its peak is the rate at which its ops would take their time at the two peaks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from pipeline.host.peaks import Peaks
from pipeline.model.graph import _dims, infer_shapes, pin_axes
from pipeline.results.reports import LayerInfo, Result

if TYPE_CHECKING:
    import onnx

    from pipeline.host.peaks import Peaks

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
_FUSABLE = frozenset(op for op in PER_ELEMENT if op not in _PER_INPUT or op == "BatchNormalization") - {
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


def _ratio(a: float, b: float) -> float:
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
                intensity=_ratio(flops, moved),
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
        intensity=_ratio(flops, moved),
        uncounted=uncounted,
        unshaped=unshaped,
    )


# --- joining per-layer times to nodes ------------------------------------------------------------

_ORT_REWRITES = (re.compile(r"^fused "), re.compile(r"/[A-Za-z]+$"), re.compile(r"_nchwc$"))


def join_layer_times(
    times: dict[str, float], cost: GraphCost, layers: list[LayerInfo] | None = None
) -> tuple[dict[str, list[str]], dict[str, float]]:
    """Each timed engine layer's ONNX nodes (the join rule in the module docstring), and the times
    of keys joined to no node."""
    by_name = {c.node: c for c in cost.layers}
    producer = {out: c.node for c in cost.layers for out in c.outputs}
    consumers: dict[str, list[str]] = {}
    for c in cost.layers:
        for n in dict.fromkeys(c.inputs):
            consumers.setdefault(n, []).append(c.node)
    fused = {layer.name: layer.fused_from for layer in layers or [] if layer.fused_from}

    def lookup(name: str) -> str | None:
        return name if name in by_name else producer.get(name)

    def exact(key: str) -> list[str]:
        found = [n for n in dict.fromkeys(map(lookup, fused.get(key, []))) if n]
        if found:
            return found
        if key in by_name:
            return [key]
        stripped = key
        for pattern in _ORT_REWRITES:
            stripped = pattern.sub("", stripped)
        one = lookup(stripped)
        return [one] if one else []

    groups = {key: exact(key) for key in times}
    claimed = {n for nodes in groups.values() for n in nodes}
    for nodes in groups.values():
        grew = bool(nodes)
        while grew:
            grew = False
            for node in list(nodes):
                c = by_name[node]
                # backward, from an elementwise node only: a producer whose outputs only this group reads
                for n in c.inputs if c.op in _FUSABLE else ():
                    p = producer.get(n)
                    if (
                        p
                        and p not in claimed
                        and all(x in nodes for o in by_name[p].outputs for x in consumers.get(o, []))
                    ):
                        nodes.append(p)
                        claimed.add(p)
                        grew = True
                # forward: an elementwise consumer that only this group feeds
                for o in c.outputs:
                    for x in consumers.get(o, []):
                        fed = [producer.get(i) for i in by_name[x].inputs if i in producer]
                        if x not in claimed and by_name[x].op in _FUSABLE and all(f in nodes for f in fed):
                            nodes.append(x)
                            claimed.add(x)
                            grew = True
    order = {c.node: i for i, c in enumerate(cost.layers)}
    joined = {k: sorted(v, key=order.__getitem__) for k, v in groups.items() if v}
    return joined, {k: times[k] for k in times if k not in joined}


# --- the roofline ---------------------------------------------------------------------------------

PeakKind = Literal["fp32", "int8", "mixed"]


class RooflineLayer(Result):
    name: str = Field(description="the engine layer's name where timed, else the ONNX node's")
    nodes: list[str] = Field(description="ONNX nodes of the prepared model it covers")
    op: str = Field(description="op of its costliest node")
    flops: int
    int_ops: int
    bytes: int
    intensity: float = Field(description="(flops + int_ops) / bytes")
    share_of_ops: float = Field(description="of the engine's flops + int_ops")
    peak_kind: PeakKind = Field("fp32", description="the compute peak its ops are judged against")
    peak_gflops: float | None = Field(None, description="that peak (GOP/s for INT8)")
    bound: Literal["memory", "compute"] = Field(description="left (memory) or right (compute) of its ridge")
    attainable_gflops: float = Field(description="min(its peak, intensity × peak bandwidth)")
    time_ms: float | None = None
    time_share: float | None = Field(None, description="of the summed layer times")
    achieved_gflops: float | None = None
    efficiency: float | None = Field(None, description="achieved / attainable")


class RooflineReport(Result):
    peak_gflops: float = Field(
        description="the compute peak the engine is judged against (peak_kind): the measured FP32 matmul peak, "
        "the INT8 one (GOP/s) for an INT8 engine, their blend by ops for a mixed one; all usable cores, at "
        "least the one-core figure"
    )
    peak_kind: PeakKind = Field(
        "fp32",
        description="fp32; int8: every op runs in INT8 (the SKU's precision, or build.json layers); mixed: some "
        "do (peak_gflops is then the rate at which the ops would take their time at the two peaks)",
    )
    peak_basis: str | None = Field(None, description="which measured peak, and why this engine is judged against it")
    precision: str | None = Field(None, description="the engine's precision (the SKU's), for ops no layer names")
    int8_share_of_ops: float = Field(0.0, description="of the engine's ops, judged against the INT8 peak")
    peak_gbs: float = Field(
        description="measured memory bandwidth (triad, all usable cores, at least the one-core figure)"
    )
    ridge: float = Field(description="peak_gflops / peak_gbs: op/byte where memory-bound turns compute-bound")
    ceilings_gflops: dict[str, float] = Field(
        description="compute ceilings, FP32: all_cores, one_core, nominal (where known); for an engine with INT8 "
        "ops also int8_all_cores, int8_one_core, int8_nominal (GOP/s)"
    )
    ceilings_gbs: dict[str, float] = Field(description="bandwidth ceilings: triad, copy, triad_one_core")
    latency_ms: float = Field(description="the engine latency the achieved figures divide by (p50)")
    flops: int
    int_ops: int
    bytes: int
    intensity: float = Field(description="(flops + int_ops) / bytes of the whole engine")
    achieved_gflops: float = Field(description="(flops + int_ops) per second at the p50, in G")
    achieved_gbs: float
    compute_fraction: float = Field(description="achieved_gflops / peak_gflops (the peak of peak_kind)")
    bandwidth_fraction: float = Field(description="achieved_gbs / peak_gbs")
    bound: Literal["memory", "compute"]
    layers: list[RooflineLayer] = Field(description="the heaviest layers by ops (and by time where timed)")
    listed_share_of_ops: float = Field(description="share of the engine's ops in ``layers``")
    profiled_ms: float | None = Field(None, description="sum of the per-layer times, where given")
    unmatched_ms: dict[str, float] = Field(default_factory=dict, description="timed layers joined to no ONNX node")
    uncounted: list[str] = Field(default_factory=list, description="nodes whose FLOPs are not modelled (0 counted)")


def _heaviest(values: dict[str, float], coverage: float, limit: int) -> list[str]:
    total, acc = sum(values.values()), 0.0
    picked: list[str] = []
    for key in sorted(values, key=lambda k: -values[k]):
        if acc >= coverage * total or len(picked) >= limit or values[key] <= 0:
            break
        picked.append(key)
        acc += values[key]
    return picked


def node_precisions(cost: GraphCost, layers: list[LayerInfo] | None) -> dict[str, str]:
    """The precision each ONNX node ran in, where build.json ``layers`` say: a layer's precision
    (not "n/a") on every node it is joined to by the join rule of per-layer times."""
    said = {layer.name: layer.precision for layer in layers or [] if layer.precision and layer.precision != "n/a"}
    joined, _ = join_layer_times(dict.fromkeys(said, 0.0), cost, layers)
    return {node: said[name] for name, nodes in joined.items() for node in nodes}


class _Peaks:
    """The two compute peaks and how ops of each kind blend into one."""

    def __init__(self, peaks: Peaks):
        fp32, int8 = peaks.compute_gflops, peaks.int8_gops
        # all cores can do what one does: a lower all-core figure was measured beside a busy neighbour
        self.fp32, self.int8 = max(fp32.all_cores, fp32.one_core), max(int8.all_cores, int8.one_core)
        self.fp32_where = "all cores" if fp32.all_cores >= fp32.one_core else "one core"
        self.int8_where = "all cores" if int8.all_cores >= int8.one_core else "one core"

    def of(self, int8_ops: float, ops: float, default: PeakKind) -> tuple[PeakKind, float]:
        """The kind and the peak of ``ops`` of which ``int8_ops`` run in INT8: at a mix, the rate at
        which each part takes its time at its own peak. ``default`` where there are no ops."""
        if ops <= 0:
            return default, self.int8 if default == "int8" else self.fp32
        if int8_ops >= ops:
            return "int8", self.int8
        if int8_ops <= 0:
            return "fp32", self.fp32
        return "mixed", ops / (int8_ops / self.int8 + (ops - int8_ops) / self.fp32)

    def basis(self, kind: PeakKind, precision: str | None, share: float, by_layer: bool) -> str:
        int8 = f"the INT8 peak ({self.int8:.4g} GOP/s: u8 × s8 → s32 MatMulInteger, ONNX Runtime, {self.int8_where})"
        fp32 = f"the FP32 peak ({self.fp32:.4g} GFLOP/s: BLAS sgemm, {self.fp32_where})"
        engine = f"the engine's precision ({precision or 'fp32'})"
        why = f"the precision of build.json layers, {engine} elsewhere" if by_layer else engine
        if kind == "int8":
            return f"{int8}, by {why}"
        if kind == "mixed":
            return f"{share:.1%} of the ops at {int8}, the rest at {fp32}, by {why}"
        return f"{fp32}, by {why}" + (" (no FP16 peak is measured)" if precision == "fp16" else "")


def _groups(
    cost: GraphCost, layer_times_ms: dict[str, float] | None, layers: list[LayerInfo] | None
) -> tuple[dict[str, list[str]], dict[str, float], dict[str, float]]:
    """The engine's layers as groups of ONNX nodes (a profiled layer's fused nodes, else each node
    alone), the time of each profiled one, and the profiled times no node joins."""
    groups: dict[str, list[str]] = {}
    times: dict[str, float] = {}
    unmatched: dict[str, float] = {}
    if layer_times_ms:
        joined, unmatched = join_layer_times(layer_times_ms, cost, layers)
        for key, nodes in joined.items():
            groups[key], times[key] = nodes, layer_times_ms[key]
    grouped = {n for nodes in groups.values() for n in nodes}
    for c in cost.layers:
        if c.node not in grouped:
            groups[c.node] = [c.node]
    return groups, times, unmatched


def _layer(
    key: str,
    members: list[LayerCost],
    int8: dict[str, bool],
    compute: _Peaks,
    default: PeakKind,
    peak_gbs: float,
    total_ops: int,
    times: dict[str, float],
    profiled: float | None,
) -> RooflineLayer:
    """One layer on the roofline: its ops and bytes, the peak that judges it, where it sits."""
    flops, int_ops, moved = (sum(getattr(m, f) for m in members) for f in ("flops", "int_ops", "bytes"))
    layer_kind, layer_peak = compute.of(
        sum(m.flops + m.int_ops for m in members if int8[m.node]), flops + int_ops, default
    )
    intensity = _ratio(flops + int_ops, moved)
    attainable = min(layer_peak, intensity * peak_gbs)
    time_ms = times.get(key)
    achieved = _ratio(flops + int_ops, time_ms * 1e6) if time_ms else None
    return RooflineLayer(
        name=key,
        nodes=[m.node for m in members],
        op=max(members, key=lambda m: m.flops + m.int_ops).op,
        flops=flops,
        int_ops=int_ops,
        bytes=moved,
        intensity=intensity,
        share_of_ops=_ratio(flops + int_ops, total_ops),
        peak_kind=layer_kind,
        peak_gflops=layer_peak,
        bound="memory" if intensity < _ratio(layer_peak, peak_gbs) else "compute",
        attainable_gflops=attainable,
        time_ms=time_ms,
        time_share=_ratio(time_ms, profiled) if time_ms is not None and profiled else None,
        achieved_gflops=achieved,
        efficiency=_ratio(achieved, attainable) if achieved is not None else None,
    )


def _ceilings(peaks: Peaks, kind: PeakKind) -> dict[str, float]:
    """The compute ceilings drawn: FP32 (all cores, one core, nominal) and, for an engine with INT8
    ops, the INT8 ones."""
    ceilings = {"all_cores": peaks.compute_gflops.all_cores, "one_core": peaks.compute_gflops.one_core}
    if peaks.compute_gflops.nominal is not None:
        ceilings["nominal"] = peaks.compute_gflops.nominal
    if kind != "fp32":
        ceilings |= {"int8_all_cores": peaks.int8_gops.all_cores, "int8_one_core": peaks.int8_gops.one_core}
        if peaks.int8_gops.nominal is not None:
            ceilings["int8_nominal"] = peaks.int8_gops.nominal
    return ceilings


def roofline(
    cost: GraphCost,
    latency_ms: float,
    peaks: Peaks | dict[str, Any],
    layer_times_ms: dict[str, float] | None = None,
    *,
    layers: list[LayerInfo] | None = None,
    precision: str | None = None,
    coverage: float = 0.9,
    max_layers: int = 25,
) -> RooflineReport:
    """The engine on this host's roofline: achieved op/s and bytes/s at ``latency_ms`` (p50),
    their fractions of the peaks, the ridge, and the heaviest layers (by ops until ``coverage`` of
    the total, at most ``max_layers``; with ``layer_times_ms``, also by time) on either side of it.

    Ops that run in INT8 are judged against the host's INT8 peak, the others against its FP32 peak:
    a node's precision is its build.json layer's (``layers``) where one names it, else the engine's
    ``precision`` (the SKU's); integer kernels of the graph (``int_ops``) are INT8 anyway.

    ``peaks`` is ``pipeline.host.peaks.Peaks`` or its JSON form; ``layer_times_ms`` is what a
    runner's ``profile_layers`` returns, joined to ONNX nodes with build.json ``layers`` where given
    (see the module docstring)."""

    peaks = peaks if isinstance(peaks, Peaks) else Peaks.model_validate(peaks)
    compute = _Peaks(peaks)
    peak_gbs = max(peaks.bandwidth_gbs.triad, peaks.bandwidth_gbs.triad_one_core)
    default: PeakKind = "int8" if precision == "int8" else "fp32"
    said = node_precisions(cost, layers)
    int8 = {c.node: c.int_ops > 0 or said.get(c.node, precision) == "int8" for c in cost.layers}
    total_ops = cost.flops + cost.int_ops
    int8_ops = sum(c.flops + c.int_ops for c in cost.layers if int8[c.node])
    kind, peak_gflops = compute.of(int8_ops, total_ops, default)
    ridge = _ratio(peak_gflops, peak_gbs)
    seconds = latency_ms / 1e3
    by_name = {c.node: c for c in cost.layers}

    groups, times, unmatched = _groups(cost, layer_times_ms, layers)
    ops = {k: float(sum(by_name[n].flops + by_name[n].int_ops for n in nodes)) for k, nodes in groups.items()}
    picked = _heaviest(ops, coverage, max_layers)
    picked += [k for k in _heaviest(times, coverage, max_layers) if k not in picked]
    profiled = sum(layer_times_ms.values()) if layer_times_ms else None

    entries = [
        _layer(key, [by_name[n] for n in groups[key]], int8, compute, default, peak_gbs, total_ops, times, profiled)
        for key in picked
    ]
    achieved_gflops = _ratio(total_ops, seconds * 1e9)
    achieved_gbs = _ratio(cost.bytes, seconds * 1e9)
    intensity = _ratio(total_ops, cost.bytes)
    share = _ratio(int8_ops, total_ops)
    return RooflineReport(
        peak_gflops=peak_gflops,
        peak_kind=kind,
        peak_basis=compute.basis(kind, precision, share, bool(said)),
        precision=precision,
        int8_share_of_ops=share,
        peak_gbs=peak_gbs,
        ridge=ridge,
        ceilings_gflops=_ceilings(peaks, kind),
        ceilings_gbs={
            "triad": peaks.bandwidth_gbs.triad,
            "copy": peaks.bandwidth_gbs.memcopy,
            "triad_one_core": peaks.bandwidth_gbs.triad_one_core,
        },
        latency_ms=latency_ms,
        flops=cost.flops,
        int_ops=cost.int_ops,
        bytes=cost.bytes,
        intensity=intensity,
        achieved_gflops=achieved_gflops,
        achieved_gbs=achieved_gbs,
        compute_fraction=_ratio(achieved_gflops, peak_gflops),
        bandwidth_fraction=_ratio(achieved_gbs, peak_gbs),
        bound="memory" if intensity < ridge else "compute",
        layers=entries,
        listed_share_of_ops=_ratio(sum(e.flops + e.int_ops for e in entries), total_ops),
        profiled_ms=profiled,
        unmatched_ms=unmatched,
        uncounted=cost.uncounted,
    )
