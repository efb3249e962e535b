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

from pipeline.verify.bisect.diagnosis import (
    FINITE_MAX,
    OUTLIER_RATIO,
    REDUCTIONS,
    RELATIVE_LIMIT,
    classify,
    engine_layers,
    outlier_channels,
    overflow_source,
    reference_abs_max,
    remedy_nodes,
    tensor_error,
    unkeepable,
)
from pipeline.verify.bisect.graph import (
    CONTROL_FLOW,
    Graph,
    channel_axis,
    float_node_inputs,
    inner_nodes,
    outer_reads,
    subgraphs,
)
from pipeline.verify.bisect.search import (
    MAX_INTERMEDIATE_BYTES,
    MAX_SAMPLES,
    SCAN_MARKS,
    Bisection,
    bisect,
    scan_builds,
    scan_candidates,
    scratch_build,
)

__all__ = [
    "CONTROL_FLOW",
    "FINITE_MAX",
    "MAX_INTERMEDIATE_BYTES",
    "MAX_SAMPLES",
    "OUTLIER_RATIO",
    "REDUCTIONS",
    "RELATIVE_LIMIT",
    "SCAN_MARKS",
    "Bisection",
    "Graph",
    "bisect",
    "channel_axis",
    "classify",
    "engine_layers",
    "float_node_inputs",
    "inner_nodes",
    "outer_reads",
    "outlier_channels",
    "overflow_source",
    "reference_abs_max",
    "remedy_nodes",
    "scan_builds",
    "scan_candidates",
    "scratch_build",
    "subgraphs",
    "tensor_error",
    "unkeepable",
]
