"""What a divergent tensor means: its error against the reference, the likely cause, the nodes a remedy keeps."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pipeline.core.errors import SkuforgeError
from pipeline.project.artifacts import layout, read_report
from pipeline.results.reports import BuildReport, EngineLayer, Suspect, TensorError
from pipeline.verify.bisect.graph import CONTROL_FLOW, Graph, channel_axis, inner_nodes

if TYPE_CHECKING:
    import numpy as np

    from pipeline.project.config import Pair

# Relative error (L2 over the tensor, or the median channel's) a precision explains on its own.
# FP32 engines differ from the reference by reassociation (~1e-6 relative); FP16 rounds to 2^-11
# and accumulates; INT8 rounds to 1/255 of a tensor's range per step and compounds over layers.
RELATIVE_LIMIT = {"fp32": 1e-3, "fp16": 3e-2, "bf16": 6e-2, "int8": 0.25}
# Largest finite value per precision: a reference value beyond it cannot be represented.
FINITE_MAX = {"fp16": 65504.0}
# Ops whose output sums many products: error can grow along the reduction on its own.
REDUCTIONS = frozenset(
    {
        "MatMul",
        "Gemm",
        "Conv",
        "ConvTranspose",
        "ReduceSum",
        "ReduceMean",
        "ReduceL2",
        "ReduceProd",
        "ReduceLogSumExp",
        "Softmax",
        "LogSoftmax",
        "LayerNormalization",
        "BatchNormalization",
        "InstanceNormalization",
        "GroupNormalization",
        "GlobalAveragePool",
        "AveragePool",
        "Einsum",
        "MatMulInteger",
        "Attention",
        "CumSum",
        "LpNormalization",
    }
)
OUTLIER_RATIO = 10.0  # channel abs-max over the median channel's: beyond it, one channel sets an INT8 scale


def tensor_error(
    graph: Graph, tensor: str, got: np.ndarray | None, ref: np.ndarray, precision: str, channels: int = 8
) -> TensorError:
    """``got`` and ``ref`` are stacked per batch run: axis 0 is the run, then the tensor's own axes.
    ``got`` None: not measured, the reference alone (values beyond the precision's range)."""
    import numpy as np

    node = graph.producer.get(tensor)
    base = dict(
        tensor=tensor,
        node=graph.node_name(tensor) if node is not None else tensor,
        op_type=node.op_type if node is not None else ("input" if tensor in graph.inputs_of_graph() else "output"),
    )
    r = ref.astype(np.float64)
    finite_ref = np.isfinite(r)
    axis = channel_axis(r.ndim - 1)
    axis = None if axis is None else axis + 1  # the stacked runs come first
    ranges: dict[str, Any] = {}
    if finite_ref.any():
        ranges = dict(
            reference_min=float(r[finite_ref].min()),
            reference_max=float(r[finite_ref].max()),
            reference_abs_max=float(np.abs(r[finite_ref]).max()),
        )
    per_channel: dict[str, float] = {}
    if axis is not None and r.shape[axis] > 1:
        absmax = np.nanmax(
            np.abs(np.moveaxis(np.where(finite_ref, r, 0.0), axis, 0)).reshape(r.shape[axis], -1), axis=1
        )
        top = np.argsort(absmax)[::-1][:channels]
        per_channel = {str(int(c)): float(absmax[c]) for c in top}
        per_channel["median"] = float(np.median(absmax))
    if got is None:
        largest = FINITE_MAX.get(precision)
        beyond = largest is not None and ranges.get("reference_abs_max", 0.0) > largest
        return TensorError(**base, **ranges, channel_axis=axis, channel_abs_max=per_channel, divergent=beyond)
    if got.shape != ref.shape:
        return TensorError(
            **base, **ranges, channel_axis=axis, channel_abs_max=per_channel, divergent=True, relative_error=None
        )
    g = got.astype(np.float64)
    bad = ~np.isfinite(g) & finite_ref
    nan, inf = int(np.isnan(g[finite_ref]).sum()), int(np.isinf(g[finite_ref]).sum())
    first = [int(i) for i in np.argwhere(bad)[0]] if bad.any() else None
    ok = finite_ref & np.isfinite(g)
    diff = np.where(ok, g - r, 0.0)
    ref0 = np.where(ok, r, 0.0)
    # per run of the engine (one batch), then the median run: a few golden samples far outside the
    # calibrated range (the hard tail) saturate any INT8 engine and must not make every tensor look
    # divergent; a defect in the node shows on every sample
    runs = diff.shape[0]
    d2 = (diff.reshape(runs, -1) ** 2).sum(axis=1)
    r2 = (ref0.reshape(runs, -1) ** 2).sum(axis=1)
    per_run = np.sqrt(np.divide(d2, r2, out=np.where(d2 > 0, np.inf, 0.0), where=r2 > 0))
    rel = float(np.median(per_run))
    channel_rel = None
    if axis is not None and r.shape[axis] > 1:
        d = np.moveaxis(diff, axis, 1).reshape(runs, r.shape[axis], -1)
        e = np.moveaxis(ref0, axis, 1).reshape(runs, r.shape[axis], -1)
        energy = (e**2).sum(axis=2)
        err = (d**2).sum(axis=2)
        medians = []
        for run in range(runs):
            live = energy[run] > 1e-6 * max(float(np.median(energy[run])), 1e-30)  # channels that carry signal
            if live.any():
                medians.append(float(np.median(np.sqrt(err[run][live] / energy[run][live]))))
        channel_rel = float(np.median(medians)) if medians else None
    limit = RELATIVE_LIMIT.get(precision, RELATIVE_LIMIT["fp32"])
    worst = max(x for x in (rel, channel_rel or 0.0) if x == x)
    return TensorError(
        **base,
        **ranges,
        relative_error=_finite(rel),
        channel_relative_error=_finite(channel_rel),
        worst_run_relative_error=_finite(float(per_run.max())) if runs else None,
        max_abs_error=_finite(float(np.abs(diff).max())) if diff.size else 0.0,
        nan=nan,
        inf=inf,
        first_nonfinite=first,
        channel_axis=axis,
        channel_abs_max=per_channel,
        divergent=bool(bad.any()) or worst > limit,
    )


def _finite(x: float | None) -> float | None:
    return None if x is None or x != x or x in (float("inf"), float("-inf")) else x


def classify(error: TensorError, inputs: list[TensorError], op_type: str, precision: str) -> tuple[str, str]:
    """The likely cause of a suspect's divergence, and the evidence in words."""
    if error.nan or error.inf:
        return "overflow", (
            f"{error.nan} NaN and {error.inf} Inf where the reference is finite "
            f"(reference abs-max {error.reference_abs_max:.4g})"
        )
    top = FINITE_MAX.get(precision)
    if top is not None and error.reference_abs_max is not None and error.reference_abs_max > top:
        return "overflow", f"reference values reach {error.reference_abs_max:.4g}, beyond {precision}'s largest {top:g}"
    if precision == "int8" and error.channel_abs_max.get("median"):
        median = error.channel_abs_max["median"]
        biggest = max(v for k, v in error.channel_abs_max.items() if k != "median")
        if biggest > OUTLIER_RATIO * median:
            channel = next(k for k, v in error.channel_abs_max.items() if k != "median" and v == biggest)
            return "range", (
                f"channel {channel} reaches {biggest:.4g} against a median channel abs-max of {median:.4g} "
                f"({biggest / median:.0f}x): one INT8 scale for the tensor leaves the other channels a few "
                "levels, or none"
            )
    worst_in = max((x.relative_error or 0.0 for x in inputs), default=0.0)
    mine = max(error.relative_error or 0.0, error.channel_relative_error or 0.0)
    # low-precision accumulation blurs a result (error ~ sqrt(n) rounding steps); it does not replace it
    if op_type in REDUCTIONS and worst_in < mine / 4 and mine < 1.0:
        return "accumulation", (
            f"{op_type} takes inputs within {worst_in:.2g} relative error and gives {mine:.2g}: "
            "the error grows along the reduction"
        )
    return "compiler", (
        f"relative error {mine:.2g} from inputs within {worst_in:.2g}, without overflow, outlier range "
        "or a reduction to explain it: compare with another backend (skuforge compare) and report it"
    )


def unkeepable(graph: Graph, node: Any, precision: str) -> str | None:
    """Why keeping control-flow ``node`` precise cannot work (None when it can). Backends keep
    nodes precise through ONNX Runtime's tools, and neither reaches into subgraphs: the QDQ
    quantizer quantizes the top-level graph only, so a subgraph already runs in float; the FP16
    converter leaves a kept node's subgraphs in FP32 but casts only its explicit inputs, so those
    subgraphs would read the FP16 outer-scope tensors (the model no longer type-checks), and a node
    inside a subgraph gets its casts in the main graph."""
    if node.op_type not in CONTROL_FLOW:
        return None
    inner = [n.name or n.op_type for n in inner_nodes(node) if n.op_type != "Constant"]
    where = f"{node.name} ({node.op_type}; inside: {', '.join(inner[:6])}{', ...' if len(inner) > 6 else ''})"
    if precision == "int8":
        return (
            f"{where}: the QDQ quantizer quantizes the top-level graph only, so its subgraphs already run in "
            "float and keeping it precise changes nothing"
        )
    computed = [t for t in graph.implicit.get(node.name, []) if t in graph.producer and t in graph.float_values]
    if computed:
        return (
            f"{where}: the FP16 converter would keep its subgraphs FP32 while they read the FP16 outer-scope "
            f"tensors {', '.join(computed)} (the model no longer type-checks), and cannot keep a node inside a subgraph"
        )
    return None


def remedy_nodes(
    graph: Graph,
    suspect_tensor: str,
    cause: str,
    precision: str,
    reference_abs_max: Callable[[str], float | None],
    outlier: Callable[[str], set[str]] | None = None,
) -> list[str]:
    """Nodes to keep in higher precision so the suspect stops diverging. Overflow and range keep the
    tensor itself out of the low precision: its producer and every consumer (an FP16 value beyond
    65504 is also out of range for the node that reads it; an INT8-quantized tensor is quantized
    at its consumers' inputs too), following the overflow downstream while the reference values
    stay beyond the precision's range, and the range while ``outlier`` says a consumer's output
    still has the outlier channel, the same one (a Relu passes it on, and the node reading the Relu's
    output quantizes it again; a Conv that drops it may have wide channels of its own, which its INT8
    scale held before). Accumulation and compiler keep the node alone."""
    names: list[str] = []

    def add(node: Any) -> None:
        name = node.name
        if name and name not in names and unkeepable(graph, node, precision) is None:
            names.append(name)

    add(graph.producer[suspect_tensor])
    if cause in ("accumulation", "compiler"):
        return names
    top = FINITE_MAX.get(precision)
    todo, seen = [suspect_tensor], set()
    carried = {suspect_tensor: outlier(suspect_tensor)} if cause == "range" and outlier is not None else {}
    while todo:
        tensor = todo.pop(0)
        if tensor in seen:
            continue
        seen.add(tensor)
        add(graph.producer[tensor])
        for consumer in graph.consumers.get(tensor, []):
            add(consumer)
            if cause == "overflow" and top is not None:
                for out in consumer.output:
                    big = reference_abs_max(out)
                    if big is not None and big > top / 2:
                        todo.append(out)
            if cause == "range" and outlier is not None:
                for out in consumer.output:
                    if out in graph.float_values and out not in carried:
                        carried[out] = outlier(out) & carried[tensor]
                        todo += [out] if carried[out] else []
    return names


def outlier_channels(graph: Graph, reference: Mapping[str, np.ndarray]) -> Callable[[str], set[str]]:
    """The channels of a tensor's reference beyond OUTLIER_RATIO times the median channel's abs-max
    (what makes one INT8 scale for the tensor wipe out the others); none where it has none."""

    def outlier(tensor: str) -> set[str]:
        if tensor not in reference:
            return set()
        channels = tensor_error(graph, tensor, None, reference[tensor], "int8").channel_abs_max
        median = channels.get("median")
        if median is None or median <= 0:
            return set()
        return {k for k, v in channels.items() if k != "median" and v > OUTLIER_RATIO * median}

    return outlier


def reference_abs_max(reference: Mapping[str, np.ndarray]) -> Callable[[str], float | None]:
    """A tensor's finite reference abs-max (None when unknown or all non-finite)."""
    import numpy as np

    def absmax(t: str) -> float | None:
        arr = reference.get(t)
        if arr is None or not np.issubdtype(arr.dtype, np.floating) or not np.isfinite(arr).any():
            return None
        return float(np.abs(arr[np.isfinite(arr)]).max())

    return absmax


def overflow_source(graph: Graph, tensor: str, precision: str, absmax: Callable[[str], float | None]) -> str:
    """Walk up from ``tensor`` while its node reads a float tensor whose reference values are
    already beyond the precision's largest finite value: the node that made the value (or the
    graph input that holds it) is the culprit, not the nodes reading it. ``tensor`` itself when
    its inputs are within range (or the precision has no such limit)."""
    top = FINITE_MAX.get(precision)
    seen = {tensor}
    while top is not None and tensor in graph.producer:
        big = next(
            (
                i
                for i in graph.inputs(graph.producer[tensor])
                if i in graph.float_values and i not in seen and (absmax(i) or 0.0) > top
            ),
            None,
        )
        if big is None:
            break
        seen.add(big)
        tensor = big
    return tensor


def suspect_of(
    pair: Pair,
    graph: Graph,
    tensor: str,
    error: TensorError,
    inputs: list[TensorError],
    reference: Mapping[str, np.ndarray],
    reader: str | None = None,
) -> Suspect:
    """``reader``: the tensor bisection first blamed, whose node reads ``tensor`` (beyond the precision)."""
    precision = pair.precision
    node = graph.producer.get(tensor)
    op_type = node.op_type if node is not None else error.op_type
    cause, why = classify(error, inputs, op_type, precision)
    if reader is not None:
        why += (
            f"; {graph.node_name(reader)} ({graph.producer[reader].op_type}), where the search stopped, reads "
            f"{tensor}: its inputs are already beyond {precision}'s range in the reference, so the value is made here"
        )
    absmax = reference_abs_max(reference)
    keep = remedy_nodes(graph, tensor, cause, precision, absmax, outlier_channels(graph, reference)) if node else []
    if node is None:
        why += (
            f"; {tensor} is a graph input: no node can keep it precise (the converter casts graph inputs first): "
            "scale the input, or build this model in a wider precision"
        )
    elif node.op_type in CONTROL_FLOW:
        cannot = unkeepable(graph, node, precision)
        why += (
            f"; its inputs, outer-scope tensors included, are right: the divergence arises inside {cannot}"
            if cannot
            else f"; its inputs, outer-scope tensors included, are right: the divergence arises inside its subgraphs "
            f"({', '.join(n.name or n.op_type for n in inner_nodes(node))})"
        )
    return Suspect(
        node=error.node,
        op_type=op_type,
        tensor=tensor,
        error=error,
        inputs=inputs,
        cause=cause,
        explanation=why,
        engine_layers=engine_layers(pair, error.node, tensor),
        keep=keep,
    )


def engine_layers(pair: Pair, node: str, tensor: str) -> list[EngineLayer]:
    """The layers of the SKU's built engine (build.json) that hold ``node``: a fused layer lists
    the ONNX nodes it came from; a layer named after the node (or its output) is the node itself."""

    try:
        build = read_report(layout(pair.registry).report(pair.model, pair.sku, "build"), BuildReport, "build")
    except SkuforgeError:
        return []
    # the node, its output tensor, or the QDQ pair the quantizer put on that tensor (<tensor>_QuantizeLinear):
    # a plugin that folds the node into a neighbour (OpenVINO folds a Mul into the Conv before it)
    # keeps only the names of what it folded
    names = {node, tensor, f"{tensor}_QuantizeLinear", f"{tensor}_DequantizeLinear"}
    hits = [
        layer
        for layer in build.layers
        if names & set(layer.fused_from) or layer.name in names or layer.name.startswith(f"{node}_")
    ]
    return [EngineLayer(name=layer.name, op_type=layer.op_type, fused_from=layer.fused_from) for layer in hits]
