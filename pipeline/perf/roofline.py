"""Roofline of an engine: its FLOPs and bytes (``pipeline.perf.cost``) against this host's measured peaks.

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

import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from pipeline.host.peaks import Peaks
from pipeline.perf.cost import FUSABLE, GraphCost, LayerCost, ratio
from pipeline.results.reports import LayerInfo, Result

if TYPE_CHECKING:
    from pipeline.host.peaks import Peaks

# FLOPs per output element (per input element for the reductions, see _PER_INPUT).


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
                for n in c.inputs if c.op in FUSABLE else ():
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
                        if x not in claimed and by_name[x].op in FUSABLE and all(f in nodes for f in fed):
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
    intensity = ratio(flops + int_ops, moved)
    attainable = min(layer_peak, intensity * peak_gbs)
    time_ms = times.get(key)
    achieved = ratio(flops + int_ops, time_ms * 1e6) if time_ms else None
    return RooflineLayer(
        name=key,
        nodes=[m.node for m in members],
        op=max(members, key=lambda m: m.flops + m.int_ops).op,
        flops=flops,
        int_ops=int_ops,
        bytes=moved,
        intensity=intensity,
        share_of_ops=ratio(flops + int_ops, total_ops),
        peak_kind=layer_kind,
        peak_gflops=layer_peak,
        bound="memory" if intensity < ratio(layer_peak, peak_gbs) else "compute",
        attainable_gflops=attainable,
        time_ms=time_ms,
        time_share=ratio(time_ms, profiled) if time_ms is not None and profiled else None,
        achieved_gflops=achieved,
        efficiency=ratio(achieved, attainable) if achieved is not None else None,
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
    ridge = ratio(peak_gflops, peak_gbs)
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
    achieved_gflops = ratio(total_ops, seconds * 1e9)
    achieved_gbs = ratio(cost.bytes, seconds * 1e9)
    intensity = ratio(total_ops, cost.bytes)
    share = ratio(int8_ops, total_ops)
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
        compute_fraction=ratio(achieved_gflops, peak_gflops),
        bandwidth_fraction=ratio(achieved_gbs, peak_gbs),
        bound="memory" if intensity < ridge else "compute",
        layers=entries,
        listed_share_of_ops=ratio(sum(e.flops + e.int_ops for e in entries), total_ops),
        profiled_ms=profiled,
        unmatched_ms=unmatched,
        uncounted=cost.uncounted,
    )
