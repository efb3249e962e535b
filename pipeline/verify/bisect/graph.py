"""The graph bisection searches: its nodes in order, the float tensors it can mark, control flow."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx


FOLDED_ACTIVATIONS = frozenset({"Relu", "Clip"})
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


def numel(value: Any) -> int:
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
