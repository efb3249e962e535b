"""Bisection: the first node whose output leaves tolerance against the reference, and why.

The search works on every backend the same way, through the backend's own build. The anchor is
the engine with nothing marked, judged by the validate gate itself (its samples, its criteria):
what the search explains. The graph searched is the one that build compiled (the prepared model,
at the opset the build converted it to); it gets a few intermediate tensors marked as extra graph
outputs, the SKU's backend builds it exactly as the build stage does (precision, calibration
table, options, nodes kept precise) into a scratch folder, the engine runs the gate's golden
samples (those whose outputs fail most when not all fit in memory), and the marked tensors are
compared with ONNX Runtime CPU FP32 (optimisations off) running the same graph with them marked.
Marking every tensor at once changes what the compiler fuses and can hide the
fault (OpenVINO's CPU plugin computes one QDQ Gather path wrong only when its result is not an
output), so each build marks only ``marks_per_build`` tensors and the search narrows by parts:
about log_(k+1)(n) builds for n candidates.

Candidates are the float outputs of the top-level nodes that lead to a failing output, in graph
(topological) order. A control-flow node (If, Loop, Scan) reads, besides its explicit inputs, the
outer-scope tensors its subgraphs name: the search follows those too, so the outer node feeding a
branch is a candidate and a subgraph's outputs (the node's outputs) are judged against them.
Tensors inside a subgraph cannot be marked as outputs; a divergence that arises there names the
control-flow node and the nodes inside it. A tensor diverges when it holds NaN/Inf where the
reference is finite, or when its error relative to its own magnitude is beyond what the precision explains
(``RELATIVE_LIMIT``): per engine run, over the tensor and per channel (an INT8 scale stretched by
one outlier channel wipes out the others while the tensor-wide error stays small), then the median
run (hard-tail samples saturate any INT8 engine; a defect in a node shows on every sample).
docs/bisect.md has the figures behind the limits.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.backends import backend_class, get_backend
from pipeline.backends.opset import convert_opset, recorded_conversion
from pipeline.backends.reference import reference_runner
from pipeline.core.errors import ConfigError, EnvironmentProblem, SkuforgeError
from pipeline.engine.build import Built, build_engine
from pipeline.model.graph import default_opset, pin_axes
from pipeline.project.artifacts import layout, load_arrays, read_report, run_plan
from pipeline.project.data import LABELS, iter_batches, run_dataset
from pipeline.results.reports import Bisection, BuildReport, EngineLayer, PrepareReport, Probe, Suspect, TensorError
from pipeline.verify.check import correctness, correctness_failures
from pipeline.verify.compare import output_error, output_problems

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from pipeline.project.config import Registry
    from pipeline.verify.check import Judgement

LOG = logging.getLogger("skuforge.bisect")

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
FOLDED_ACTIVATIONS = frozenset({"Relu", "Clip"})
OUTLIER_RATIO = 10.0  # channel abs-max over the median channel's: beyond it, one channel sets an INT8 scale
MAX_SAMPLES = 256
SCAN_MARKS = 8  # tensors marked per build when scanning every candidate
MAX_INTERMEDIATE_BYTES = 1 << 30
CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


def subgraphs(node: Any) -> list[Any]:
    """The GraphProtos a node holds (If's branches, Loop's and Scan's bodies)."""
    return [g for a in node.attribute for g in ([a.g] if a.HasField("g") else list(a.graphs))]


def outer_reads(node: Any) -> list[str]:
    """The outer-scope tensors ``node``'s subgraphs read (nested subgraphs included), in order:
    what the node depends on besides its explicit inputs."""
    found: list[str] = []
    for g in subgraphs(node):
        defined = {i.name for i in g.input} | {t.name for t in g.initializer}
        defined |= {o for n in g.node for o in n.output}
        for n in g.node:
            for name in [*n.input, *outer_reads(n)]:
                if name and name not in defined and name not in found:
                    found.append(name)
        found += [o.name for o in g.output if o.name not in defined and o.name not in found]
    return found


def inner_nodes(node: Any) -> list[Any]:
    """Every node inside ``node``'s subgraphs, nested ones included."""
    return [m for g in subgraphs(node) for n in g.node for m in (n, *inner_nodes(n))]


# --- graph ----------------------------------------------------------------------------------------


@dataclass
class Graph:
    """The prepared model's top-level dataflow: producers, consumers, float tensors in order."""

    model: onnx.ModelProto
    producer: dict[str, Any] = field(default_factory=dict)  # tensor -> node
    consumers: dict[str, list[Any]] = field(default_factory=dict)
    float_values: dict[str, Any] = field(default_factory=dict)  # tensor -> ValueInfoProto (float tensors)
    order: list[str] = field(default_factory=list)  # float node outputs in node order
    implicit: dict[str, list[str]] = field(default_factory=dict)  # control-flow node -> outer-scope reads

    @classmethod
    def of(cls, model: onnx.ModelProto) -> Graph:
        import onnx

        inferred = onnx.shape_inference.infer_shapes(model)
        g = cls(model=model)
        floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
        for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type in floats:
                g.float_values[vi.name] = vi
        constant = {i.name for i in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type in CONTROL_FLOW and node.name:
                g.implicit[node.name] = outer_reads(node)
            reads = g.inputs(node)
            for name in dict.fromkeys(reads):
                if name:
                    g.consumers.setdefault(name, []).append(node)
            is_constant = node.op_type == "Constant" or (reads and all(not i or i in constant for i in reads))
            for name in node.output:
                if not name:
                    continue
                g.producer[name] = node
                if is_constant:
                    constant.add(name)
                elif name in g.float_values:
                    g.order.append(name)
        return g

    def inputs(self, node: Any) -> list[str]:
        """A node's explicit inputs, then (control flow) the outer-scope tensors its subgraphs read."""
        extra = self.implicit.get(node.name) if node.name else None
        if extra is None and node.op_type in CONTROL_FLOW:
            extra = outer_reads(node)
        return [*node.input, *(i for i in extra or [] if i not in node.input)]

    def inputs_of_graph(self) -> list[str]:
        return [i.name for i in self.model.graph.input]

    def folded_activation(self, tensor: str) -> bool:
        """True for a tensor read only by a Relu or Clip: INT8 quantizers fold the activation into
        the producer's output range (a Conv's output is quantized to [0, max]), so the engine's value
        of the tensor is the activated one. The activation's output stands for it."""
        readers = self.consumers.get(tensor, [])
        return bool(readers) and all(n.op_type in FOLDED_ACTIVATIONS for n in readers)

    def node_name(self, tensor: str) -> str:
        node = self.producer[tensor]
        return node.name or tensor

    def ancestors(self, outputs: list[str]) -> set[str]:
        seen, stack = set(), list(outputs)
        while stack:
            t = stack.pop()
            if t in seen or t not in self.producer:
                continue
            seen.add(t)
            stack.extend(i for i in self.inputs(self.producer[t]) if i)
        return seen

    def with_outputs(self, tensors: list[str]) -> onnx.ModelProto:
        import onnx

        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        have = {o.name for o in model.graph.output}
        for t in tensors:
            if t not in have:
                vi = onnx.ValueInfoProto()
                vi.CopyFrom(self.float_values[t])
                model.graph.output.append(vi)
        return model


def _numel(value: Any) -> int:
    dims = [d.dim_value if d.HasField("dim_value") else 1 for d in value.type.tensor_type.shape.dim]
    total = 1
    for d in dims:
        total *= max(d, 1)
    return total


def float_node_inputs(graph: Graph, tensor: str) -> list[str]:
    """The suspect node's inputs that are computed float tensors (not weights, not graph inputs)."""
    node = graph.producer[tensor]
    return [i for i in graph.inputs(node) if i in graph.float_values and i in graph.producer and i in graph.order]


# --- statistics -----------------------------------------------------------------------------------


def channel_axis(rank: int) -> int | None:
    """The channel axis of a tensor of ``rank`` (sample axis included): NCHW/NCDHW -> 1, [N, C]
    and [N, T, C] -> last."""
    if rank >= 4:
        return 1
    if rank >= 2:
        return rank - 1
    return None


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


# --- running ----------------------------------------------------------------------------------------


def scratch_build(
    registry: Registry,
    model: str,
    sku: str,
    folder: Path,
    keep: tuple[str, ...] | list[str],
    prepared: Path | None = None,
) -> Built:
    """The build stage's engine, built into ``folder/engine`` with a copy of the SKU's cache (the
    real engine and cache are never touched); returns what the build reported."""

    real = layout(registry).cache_dir(model, sku)
    if real.is_dir() and not real.is_symlink():
        shutil.copytree(real, folder / "cache", symlinks=True)  # a link stays a link: the copy is as untrusted
    # the marked outputs make new tuning tasks: a scratch build may miss the cache without failing, and
    # takes the compiler's default schedules for them rather than searching (numerics, not speed, matter here)
    return build_engine(
        registry,
        model,
        sku,
        folder / "engine",
        prepared=prepared,
        cache_dir=folder / "cache",
        cache_required=False,
        search=False,
        keep_precise=tuple(keep),
    )


def run_engine(registry: Registry, sku: str, engine: Path, feeds: dict[str, np.ndarray], in_idx: dict, batch: int):
    """An engine's every output on ``feeds``, stacked per run (one batch per run)."""
    sku_spec = registry.sku(sku)
    with get_backend(sku_spec.backend).load(engine, sku_spec) as runner:
        return run_dataset(runner.infer, feeds, in_idx, {t: None for t in runner.output_names}, batch)


class ReferenceValues(Mapping[str, "np.ndarray"]):
    """The graph inputs and any float tensor of the graph as ONNX Runtime CPU FP32 (optimisations
    off, so marking changes nothing) computes it on the bisection's samples, stacked per run. A
    tensor is computed when first asked for, with the others asked for at once: every tensor of
    every sample would not fit in memory, the few a build marks do. Kept while they fit
    MAX_INTERMEDIATE_BYTES."""

    def __init__(self, graph: Graph, feeds: dict[str, np.ndarray], in_idx: dict[str, int | None], batch: int) -> None:
        self.graph, self.feeds, self.in_idx, self.batch = graph, feeds, in_idx, batch
        self.known = {*graph.float_values, *(o.name for o in graph.model.graph.output)}  # outputs of any type
        self._values: dict[str, np.ndarray] = {}
        self.runs = 0  # reference runs over the samples, for the log

    def fetch(self, tensors: list[str]) -> None:
        want = [t for t in dict.fromkeys(tensors) if t not in self._values and t in self.known]
        want = [t for t in want if t not in self.feeds]
        if not want:
            return
        with reference_runner(self.graph.with_outputs(want).SerializeToString()) as runner:
            got = run_dataset(runner.infer, self.feeds, self.in_idx, {t: None for t in runner.output_names}, self.batch)
        self.runs += 1
        held = sum(a.nbytes for a in self._values.values())
        for old in list(self._values):  # the oldest go first, never what was just asked for
            if held + sum(got[t].nbytes for t in want) <= MAX_INTERMEDIATE_BYTES:
                break
            if old not in tensors:
                held -= self._values.pop(old).nbytes
        self._values.update({t: got[t] for t in want})

    def __getitem__(self, tensor: str) -> np.ndarray:
        if tensor in self.feeds:
            return self.feeds[tensor]
        if tensor not in self.known:
            raise KeyError(tensor)
        self.fetch([tensor])
        return self._values[tensor]

    def __contains__(self, tensor: object) -> bool:
        return tensor in self.feeds or tensor in self.known

    def __iter__(self) -> Iterator[str]:
        return iter([*self.feeds, *(t for t in self.known if t not in self.feeds)])

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass
class Session:
    """One bisection's fixed inputs: the graph the build compiles, the samples, their reference."""

    registry: Registry
    model: str
    sku: str
    graph: Graph
    feeds: dict[str, np.ndarray]
    in_idx: dict[str, int | None]
    batch: int
    reference: ReferenceValues
    keep: tuple[str, ...]
    work: Path
    builds: int = 0
    probes: list[Probe] = field(default_factory=list)
    measured: dict[str, TensorError] = field(default_factory=dict)  # every tensor's latest measurement

    @property
    def precision(self) -> str:
        return self.registry.sku(self.sku).precision

    def run_engine(self, marked: list[str]) -> dict[str, np.ndarray]:
        """Build the SKU's engine of the model with ``marked`` as extra outputs, run the samples."""
        import onnx

        self.builds += 1
        folder = Path(tempfile.mkdtemp(prefix="build-", dir=self.work))
        try:
            prepared = folder / "marked.onnx"
            onnx.save(self.graph.with_outputs(marked), str(prepared))
            scratch_build(self.registry, self.model, self.sku, folder, self.keep, prepared)
            got = run_engine(self.registry, self.sku, folder / "engine", self.feeds, self.in_idx, self.batch)
            missing = [t for t in marked if t not in got]
            if missing:
                raise EnvironmentProblem(
                    f"the {self.registry.sku(self.sku).backend} engine does not expose {missing} as outputs",
                    hint="this backend renames or drops marked outputs: bisection cannot read them",
                )
            return got
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def probe(self, marked: list[str]) -> dict[str, TensorError]:
        self.reference.fetch(marked)
        got = self.run_engine(marked)
        errors = {t: tensor_error(self.graph, t, got[t], self.reference[t], self.precision) for t in marked}
        self.probes.append(Probe(marked=marked, divergent=[t for t in marked if errors[t].divergent]))
        self.measured.update(errors)
        LOG.info(
            "bisect %s/%s build %d: %s",
            self.model,
            self.sku,
            self.builds,
            ", ".join(f"{t} {'DIVERGES' if e.divergent else 'ok'}" for t, e in errors.items()),
        )
        return errors


def _samples(registry: Registry, model: str, sku: str) -> tuple[dict, dict, int]:
    """Golden inputs, their batch axes and the SKU's batch."""

    out = layout(registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    arrays = load_arrays(out.split(model, "golden"), "data")
    arrays.pop(LABELS, None)
    in_idx, _, batch = run_plan(registry, model, prep.signature, sku)
    return arrays, in_idx, batch


@dataclass(frozen=True)
class Anchor:
    """The SKU's engine with nothing marked, judged by the validate gate itself (its samples, its
    criteria): what the search has to explain."""

    engine: Path
    built: Built
    judgement: Judgement
    failures: list[str]

    def samples(self) -> str:
        return ", ".join(f"{n} {split}" for split, n in self.judgement.samples.items()) or "no samples"

    def failing_outputs(self) -> list[str]:
        """The outputs the gate's tensor checks find off (diagnostics beside a task verdict included)."""
        return [e.output for e in self.judgement.errors if output_problems(e)]


def judge_anchor(registry: Registry, model: str, sku: str, folder: Path, keep: tuple[str, ...]) -> Anchor:
    built = scratch_build(registry, model, sku, folder, keep)
    sku_spec = registry.sku(sku)
    with get_backend(sku_spec.backend).load(folder / "engine", sku_spec) as runner:
        judgement = correctness(registry, model, sku, runner)
    return Anchor(folder / "engine", built, judgement, correctness_failures(registry, model, judgement))


def as_built(model: onnx.ModelProto, built: Built, probe: dict[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` at the opset the build converted it to (the same conversion), so the reference,
    the candidates and the marked builds are those of the graph the engine was compiled from."""
    conversion = recorded_conversion(built.outcome.calibration, built.outcome.options)
    if conversion is None or conversion.to_opset == default_opset(model):
        return model
    converted, _ = convert_opset(model, conversion.to_opset, probe, conversion.reason)
    return converted


def pick_samples(
    anchor: Anchor, reference: dict[str, np.ndarray], outputs: list[str], total: int, n: int, batch: int
) -> list[int]:
    """The golden samples to bisect on: all of them when ``n`` covers them, else the ``n`` (whole
    batches) whose ``outputs`` the anchor engine gets most wrong (relative error, NaN/Inf first),
    in their order in the set."""
    import numpy as np

    if n >= total:
        return list(range(total))
    n = max(batch, n - n % batch)
    score = np.zeros(total)
    for name in outputs:
        got, ref = anchor.judgement.golden.get(name), reference.get(name)
        if got is None or ref is None or got.shape != ref.shape or len(got) != total:
            continue
        g, r = got.reshape(total, -1).astype(np.float64), ref.reshape(total, -1).astype(np.float64)
        bad = (~np.isfinite(g) & np.isfinite(r)).any(axis=1)
        d = np.where(np.isfinite(g) & np.isfinite(r), g - r, 0.0)
        rel = np.linalg.norm(d, axis=1) / np.maximum(np.linalg.norm(np.where(np.isfinite(r), r, 0.0), axis=1), 1e-12)
        score = np.maximum(score, np.where(bad, np.inf, rel))
    worst = np.argsort(-score, kind="stable")[:n]
    return sorted(int(i) for i in worst)


def bisect(
    registry: Registry,
    model: str,
    sku: str,
    *,
    keep: tuple[str, ...] | None = None,
    max_builds: int | None = None,
    marks_per_build: int | None = None,
    scan: bool = False,
    progress: Callable[[str, float], None] | None = None,
) -> Bisection:
    """Search the first divergent node of ``model``'s engine for ``sku`` (see the module doc).
    ``scan``: measure every candidate instead (a few marked per build), failing or not: the
    per-layer error profile, and a check that a passing engine has no divergent tensor."""
    import numpy as np
    import onnx

    spec = registry.sku(sku)
    if not backend_class(spec.backend).capabilities.intermediate_outputs:
        raise ConfigError(
            f"the {spec.backend} backend of SKU {sku} cannot build a model with intermediate tensors "
            "marked as outputs: bisection needs that",
            hint="skuforge backends lists what each supports",
        )
    settings = spec.bisect
    max_builds = max_builds or settings.max_builds
    k = marks_per_build or settings.marks_per_build
    keep = tuple(registry.higher_precision(model, sku)) if keep is None else tuple(keep)
    out = layout(registry)
    with tempfile.TemporaryDirectory(prefix="skuforge-bisect-") as tmp:
        work = Path(tmp)
        arrays, in_idx, batch = _samples(registry, model, sku)
        # the anchor: the engine as the build stage makes it, judged by the validate gate itself
        anchor = judge_anchor(registry, model, sku, work / "anchor", keep)
        prepared = out.prepared_model(model)
        pinned = pin_axes(
            onnx.load(str(prepared)),
            {k_: v for k_, v in registry.pins(model, sku).items() if k_ not in spec.profiles},
            prepared,
        )
        graph = Graph.of(as_built(pinned, anchor.built, next(iter_batches(arrays, in_idx, batch))[1]))
        outputs = [o.name for o in graph.model.graph.output]
        # as many of the gate's golden samples as the tensors a build marks (and the outputs) fit
        # MAX_INTERMEDIATE_BYTES for, engine and reference; the ones that fail most when not all fit
        marks = max(k, SCAN_MARKS) if scan else k
        sizes = sorted(_numel(graph.float_values[t]) for t in [*graph.order, *outputs] if t in graph.float_values)
        per_run = 2 * 8 * (sum(sizes[-(marks + 2) :]) + sum(_numel(v) for v in graph.model.graph.output)) or 1
        total = len(next(iter(arrays.values())))
        cap = min(MAX_SAMPLES, batch * max(1, MAX_INTERMEDIATE_BYTES // per_run))
        expected = load_arrays(out.reference_dir(model) / "golden.npz", "reference")
        gate_off = anchor.failing_outputs() or outputs
        picked = pick_samples(anchor, expected, gate_off, total, cap, batch)
        feeds = {name: np.take(a, picked, axis=0) for name, a in arrays.items()}
        n = len(picked)
        reference = ReferenceValues(graph, feeds, in_idx, batch)
        session = Session(
            registry=registry,
            model=model,
            sku=sku,
            graph=graph,
            feeds=feeds,
            in_idx=in_idx,
            batch=batch,
            reference=reference,
            keep=keep,
            work=work,
            builds=1,
        )
        got = run_engine(registry, sku, anchor.engine, feeds, in_idx, batch)
        reference.fetch(outputs)
        tol = registry.tolerance(model, sku)
        out_errors = [tensor_error(graph, o, got[o], reference[o], spec.precision) for o in outputs]
        # the outputs off on the samples bisected, by the gate's tolerance or beyond the precision
        here = [o for o in outputs if output_problems(output_error(o, got[o], reference[o], tol))]
        here += [e.tensor for e in out_errors if e.divergent and e.tensor not in here]
        failing = list(dict.fromkeys([*anchor.failing_outputs(), *here])) or (outputs if anchor.failures else [])
        note = ""
        if anchor.failures and not here:
            note = (
                f"the validate gate fails on the anchor engine ({anchor.samples()}: {anchor.failures[0]}), "
                f"but on the {n} golden sample(s) bisected no output is off: the search runs toward "
                f"{', '.join(failing)} on the samples whose outputs fail most; "
            )
        base = dict(
            model=model,
            sku=sku,
            backend=spec.backend,
            precision=spec.precision,
            marks_per_build=k,
            max_builds=max_builds,
            samples=n,
            keep_precise=list(keep),
            outputs=out_errors,
            gate_samples=anchor.judgement.samples,
            gate_failures=anchor.failures,
            golden_indices=picked if n < total else [],
            opset=default_opset(graph.model),
        )
        if not anchor.failures and not scan:
            return Bisection(
                **base,
                verdict="clean",
                failing_outputs=[],
                candidates=0,
                builds=session.builds,
                summary=f"the validate gate passes on the anchor engine ({anchor.samples()}): nothing to bisect",
                probes=session.probes,
            )
        if scan:
            return _scan(session, base, failing, max(k, SCAN_MARKS))
        wanted = graph.ancestors(failing)
        candidates = [
            t
            for t in graph.order
            if t in wanted and t not in outputs and not (spec.precision == "int8" and graph.folded_activation(t))
        ]
        lo, hi = _search(session, candidates, k, max_builds, lambda e: e.divergent, progress)
        base.update(failing_outputs=failing, candidates=len(candidates))
        if lo < hi:
            # the best found so far: the earliest tensor measured divergent (the range ends before it)
            known = session.measured.get(candidates[hi]) if hi < len(candidates) else None
            best = (
                f"; the earliest divergent tensor measured so far: {known.tensor} ({known.node}, {known.op_type}, "
                f"relative error {f'{known.relative_error:.3g}' if known.relative_error is not None else 'non-finite'}"
                f"{f', max abs {known.max_abs_error:.4g}' if known.max_abs_error is not None else ''})"
                if known is not None
                else ""
            )
            return Bisection(
                **base,
                verdict="inconclusive",
                builds=session.builds,
                probes=session.probes,
                search_range=candidates[lo:hi],
                summary=f"{note}build cap reached ({session.builds} of {max_builds} builds) with {hi - lo} candidates "
                f"left: {candidates[lo]} .. {candidates[hi - 1]}{best}; raise skus.{sku}.bisect.max_builds "
                "or --max-builds",
            )
        # the first divergent tensor: a candidate, or (none diverged) the failing output itself
        tensor = candidates[lo] if lo < len(candidates) else failing[0]
        errors = {e.tensor: e for e in out_errors}
        # confirm with the node's own inputs marked beside it; an input that diverges too moves
        # the search back to it (fusion differs between builds, so a neighbour can hide a fault)
        while True:
            ins = [i for i in float_node_inputs(graph, tensor) if i not in errors or i in outputs]
            marked = ([] if tensor in errors else [tensor]) + ins
            if marked and session.builds < max_builds:
                errors.update(session.probe(marked))
            back = next((i for i in float_node_inputs(graph, tensor) if i in errors and errors[i].divergent), None)
            if back is None or session.builds >= max_builds:
                break
            tensor = back
        # a node reading values the precision cannot hold is not where they went wrong: blame their maker
        source = overflow_source(graph, tensor, spec.precision, reference_abs_max(reference))
        reader = None
        if source != tensor:
            reader, tensor = tensor, source
            todo = [t for t in [tensor, *float_node_inputs(graph, tensor)] if t in graph.producer and t not in errors]
            if todo and session.builds < max_builds:
                errors.update(session.probe(todo))
            if tensor not in errors:  # a graph input, or no build left: what the reference shows
                errors[tensor] = tensor_error(graph, tensor, None, reference[tensor], spec.precision)
        ins = [i for i in float_node_inputs(graph, tensor) if i in errors]
        suspect = _suspect(
            registry, model, sku, graph, tensor, errors[tensor], [errors[i] for i in ins], reference, reader
        )
        first_nonfinite = suspect.node if (errors[tensor].nan or errors[tensor].inf) else None
        if first_nonfinite is None and any(e.nan or e.inf for e in out_errors) and session.builds < max_builds:
            later = candidates[lo + 1 :] if lo < len(candidates) else []
            a, b = _search(session, later, k, max_builds, lambda e: bool(e.nan or e.inf), None)
            if a == b:
                first_nonfinite = graph.node_name(later[a]) if a < len(later) else graph.node_name(failing[0])
        summary = f"{note}first divergent node {suspect.node} ({suspect.op_type}), likely cause {suspect.cause}: " + (
            f"{suspect.explanation}; an FP32 engine has no higher precision to keep it in"
            if spec.precision == "fp32"
            else f"{suspect.explanation}; keep {suspect.keep} in higher precision"
            if suspect.keep
            else f"{suspect.explanation}; no node to keep in higher precision"
        )
        return Bisection(
            **base,
            verdict="diverges",
            builds=session.builds,
            probes=session.probes,
            suspects=[suspect],
            first_nonfinite=first_nonfinite,
            summary=summary,
        )


def scan_candidates(graph: Graph, precision: str) -> list[str]:
    """What a scan measures: every candidate tensor (a folded activation's input left out for INT8)."""
    outputs = {o.name for o in graph.model.graph.output}
    return [t for t in graph.order if t not in outputs and not (precision == "int8" and graph.folded_activation(t))]


def scan_builds(graph: Graph, precision: str, per_build: int = SCAN_MARKS) -> int:
    """The builds a scan takes, the anchor included."""
    return 1 + -(-len(scan_candidates(graph, precision)) // per_build)


def _scan(session: Session, base: dict[str, Any], failing: list[str], per_build: int) -> Bisection:
    """Every candidate tensor's error, ``per_build`` marked per build (all builds, no budget)."""
    graph = session.graph
    candidates = scan_candidates(graph, session.precision)
    errors: dict[str, TensorError] = {}
    for start in range(0, len(candidates), per_build):
        errors.update(session.probe(candidates[start : start + per_build]))
    divergent = [t for t in candidates if errors[t].divergent]
    first = divergent[0] if divergent else None
    nonfinite = next((t for t in candidates if errors[t].nan or errors[t].inf), None)
    suspects = []
    if first is not None:
        ins = [i for i in float_node_inputs(graph, first) if i in errors]
        suspects.append(
            _suspect(
                session.registry,
                session.model,
                session.sku,
                graph,
                first,
                errors[first],
                [errors[i] for i in ins],
                session.reference,
            )
        )
    summary = f"scanned {len(candidates)} tensors in {session.builds} builds: " + (
        f"{len(divergent)} diverge, the first at {graph.node_name(first)}" if first else "none diverges"
    )
    return Bisection(
        **base,
        verdict="diverges" if first else "clean",
        failing_outputs=failing,
        candidates=len(candidates),
        builds=session.builds,
        probes=session.probes,
        suspects=suspects,
        first_nonfinite=graph.node_name(nonfinite) if nonfinite else None,
        summary=summary,
        tensors=[errors[t] for t in candidates],
    )


def _search(
    session: Session,
    candidates: list[str],
    k: int,
    max_builds: int,
    diverges: Callable[[TensorError], bool],
    progress: Callable[[str, float], None] | None,
) -> tuple[int, int]:
    """Narrow [lo, hi) to the first candidate that diverges (hi == len: none before the anchor).
    Each build marks k evenly spaced candidates; returns (lo, hi) with lo == hi when found."""
    lo, hi = 0, len(candidates)
    while lo < hi and session.builds < max_builds:
        width = hi - lo
        marks = list(range(lo, hi)) if width <= k else sorted({lo + (width * (j + 1)) // (k + 1) for j in range(k)})
        errors = session.probe([candidates[m] for m in marks])
        first = next((m for m in marks if diverges(errors[candidates[m]])), None)
        if first is None:
            lo = marks[-1] + 1
        else:
            lo, hi = max([m + 1 for m in marks if m < first], default=lo), first
        if progress is not None:
            progress("bisect", 1 - (hi - lo) / max(len(candidates), 1))
    return lo, hi


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


def _suspect(
    registry: Registry,
    model: str,
    sku: str,
    graph: Graph,
    tensor: str,
    error: TensorError,
    inputs: list[TensorError],
    reference: Mapping[str, np.ndarray],
    reader: str | None = None,
) -> Suspect:
    """``reader``: the tensor bisection first blamed, whose node reads ``tensor`` (beyond the precision)."""
    precision = registry.sku(sku).precision
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
        engine_layers=engine_layers(registry, model, sku, error.node, tensor),
        keep=keep,
    )


def engine_layers(registry: Registry, model: str, sku: str, node: str, tensor: str) -> list[EngineLayer]:
    """The layers of the SKU's built engine (build.json) that hold ``node``: a fused layer lists
    the ONNX nodes it came from; a layer named after the node (or its output) is the node itself."""

    try:
        build = read_report(layout(registry).report(model, sku, "build"), BuildReport, "build")
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
