"""Import and lowering: the ONNX model through the Relax frontend, fused into primitive functions,
each traced back to the ONNX nodes it came from."""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.backends.opset import OPSET_CONVERSION_RTOL, OpsetConversion, convert_opset, probe_difference
from pipeline.backends.tvm.common import NOT_OPS, tvm_version
from pipeline.backends.tvm.loading import import_tvm
from pipeline.core.errors import InputError, UnsupportedOp
from pipeline.model.graph import default_opset, fold_static_shapes

if TYPE_CHECKING:
    import numpy as np
    import onnx


# The opset a refused model is converted to before the import is given up: the frontend picks each
# op's newest converter up to the model's opset and falls back to its oldest, so an op older than
# every converter (Resize at opset 10 with its two inputs) is read with a newer op's inputs.
RETRY_OPSET = 18
_FAILED_OP = re.compile(r"Error converting operator (\w+)")


@dataclass(frozen=True)
class Refusal:
    """Why the frontend refused one graph: the op and node it failed at (None where unknown)."""

    op: str | None
    node: str | None
    detail: str

    def __str__(self) -> str:
        where = f"{self.op} node {self.node!r}" if self.node else (self.op or "the graph")
        return f"{where}: {self.detail}"


@dataclass
class Imported:
    """The Relax module, the ONNX node each binding of main came from, the graph it was imported
    from, and, when the model as exported was refused, what was refused and what the graph
    imported went through."""

    mod: Any
    node_of: dict[Any, str]
    model: onnx.ModelProto
    refused: Refusal | None = None
    steps: list[str] = field(default_factory=list)
    conversion: OpsetConversion | None = None

    def record(self) -> dict[str, Any] | None:
        if self.refused is None:
            return None
        return {
            "refused": {"op": self.refused.op, "node": self.refused.node, "detail": self.refused.detail},
            "steps": self.steps,
            "opset_conversion": self.conversion.to_json() if self.conversion else None,
        }

    def warning(self) -> str | None:
        if self.refused is None:
            return None
        return (
            f"TVM's Relax ONNX frontend refused the model as exported ({self.refused}); built from the graph "
            f"{' then '.join(self.steps)}, its outputs on the probe batch checked against the model's"
        )


def import_onnx(model: onnx.ModelProto, probe_inputs: dict[str, np.ndarray]) -> Imported:
    """The Relax module of the ONNX model (static shapes, weights bound as constants). When the
    frontend refuses the model as exported, it is tried again on the graph with its fixed shapes
    folded to constants, then converted to RETRY_OPSET, each checked on ``probe_inputs`` with ONNX
    Runtime; UnsupportedOp (naming the op and node of the first refusal) when every graph is refused."""
    import onnx

    names = [n.name or f"{n.op_type}_{i}" for i, n in enumerate(model.graph.node)]
    foreign = [
        (f"{n.domain}.{n.op_type}", name)
        for n, name in zip(model.graph.node, names, strict=True)
        if n.domain not in ("", "ai.onnx")
    ]
    if foreign:  # no rewrite of the standard graph reaches them
        (op, node), *_ = foreign
        listed = ", ".join(f"{o} (node {n!r})" for o, n in foreign[:10])
        raise UnsupportedOp(
            "tvm", op, node, f"TVM {tvm_version()}'s Relax ONNX frontend has no conversion for {listed}"
        )
    shapes = _static_input_shapes(model)
    first = _import_once(model, shapes)
    if not isinstance(first, Refusal):
        return Imported(*first, model=model)
    tried = [f"as exported: {first}"]
    current, steps, conversion = model, [], None
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    changes = fold_static_shapes(folded)
    if changes:
        step = f"with its fixed shapes folded to constants ({'; '.join(changes)})"
        try:
            worst_abs, worst_rel = probe_difference(model, folded, probe_inputs)
        except InputError as exc:
            tried.append(f"{step}: does not run ({exc.message})")
        else:
            if worst_rel <= OPSET_CONVERSION_RTOL:
                current, steps = folded, [step]
                outcome = _import_once(current, shapes)
                if not isinstance(outcome, Refusal):
                    return Imported(*outcome, model=current, refused=first, steps=steps)
                tried.append(f"{step}: {outcome}")
            else:
                tried.append(f"{step}: changed the outputs on the probe batch (max abs error {worst_abs:.3g})")
    if default_opset(current) < RETRY_OPSET:
        reason = f"TVM's Relax ONNX frontend refused the model at opset {default_opset(current)}"
        step = f"converted from opset {default_opset(current)} to {RETRY_OPSET}"
        try:
            converted, conversion = convert_opset(current, RETRY_OPSET, probe_inputs, reason)
        except InputError as exc:
            tried.append(f"{' then '.join([*steps, step])}: {exc.message}")
        else:
            steps = [*steps, step]
            outcome = _import_once(converted, shapes)
            if not isinstance(outcome, Refusal):
                return Imported(*outcome, model=converted, refused=first, steps=steps, conversion=conversion)
            tried.append(f"{' then '.join(steps)}: {outcome}")
    raise UnsupportedOp(
        "tvm",
        first.op,
        first.node,
        f"TVM {tvm_version()}'s Relax ONNX frontend cannot convert the model, which ONNX Runtime runs. Tried the graph "
        + "; the graph ".join(tried),
        hint="build this model with another backend, or replace the op before export (upgrading apache-tvm "
        "may add the conversion)",
    )


def _static_input_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    initializers = {i.name for i in model.graph.initializer}
    shapes = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        if any(not d.HasField("dim_value") for d in dims):
            raise InputError(
                f"input {value.name!r} has a dynamic axis: the tvm backend compiles static shapes",
                hint="pin the axis in the SKU's shapes (profiles are not supported by tvm)",
            )
        shapes[value.name] = [d.dim_value for d in dims]
    return shapes


def _import_once(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> tuple[Any, dict[Any, str]] | Refusal:
    """The module and each binding's ONNX node, or where and why the frontend refused the graph."""
    import_tvm()
    from tvm.relax.frontend.onnx import onnx_frontend as frontend

    convert = frontend._get_convert_map()
    names = [n.name or f"{n.op_type}_{i}" for i, n in enumerate(model.graph.node)]
    unsupported = [
        (n.op_type, name) for n, name in zip(model.graph.node, names, strict=True) if n.op_type not in convert
    ]
    if unsupported:
        (op, node), *_ = unsupported
        listed = ", ".join(f"{o} (node {n!r})" for o, n in unsupported[:10])
        return Refusal(op, node, f"TVM {tvm_version()}'s Relax ONNX frontend has no conversion for {listed}")
    importer = frontend.ONNXGraphImporter(shapes, "float32", keep_params_in_input=False, sanitize=True)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):  # the frontend prints the failing op's inputs to stdout
            mod = importer.from_onnx(model.graph, default_opset(model))
    except Exception as exc:  # the frontend raises whatever its converters raise
        return _refusal(model, names, importer, exc, printed.getvalue())
    producer = {out: name for node, name in zip(model.graph.node, names, strict=True) for out in node.output if out}
    outputs = [(importer._nodes[o], n) for o, n in producer.items() if o in getattr(importer, "_nodes", {})]
    node_of: dict[Any, str] = {}
    pending: list[Any] = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            pending.append(binding.var)
            made = next((n for expr, n in outputs if binding.value.same_as(expr)), None)
            if made is not None:  # the bindings since the last node's output were emitted for this node
                node_of.update({v: made for v in pending})
                pending = []
    return mod, node_of


def _refusal(model: onnx.ModelProto, names: list[str], importer: Any, exc: Exception, printed: str) -> Refusal:
    """The node the frontend failed at: it converts in graph order and records each node's outputs
    as it goes, so the first node with an output it never recorded (of the op it printed, when it
    did) is the one."""
    detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    said = _FAILED_OP.search(printed)
    op = said.group(1) if said else None
    done = getattr(importer, "_nodes", {})
    for node, name in zip(model.graph.node, names, strict=True):
        if any(out and out not in done for out in node.output) and op in (None, node.op_type):
            return Refusal(node.op_type, name, detail)
    return Refusal(op, None, detail)


def lower(mod: Any, target: Any, node_of: dict[Any, str]) -> tuple[Any, dict[str, list[str]]]:
    """Decompose, legalize, fold and fuse: each fused group becomes one TIR primitive function.
    Returns the module and, per primitive function, the ONNX nodes fused into it."""
    tvm = import_tvm()
    from tvm import relax

    with tvm.target.Target(target):
        mod = tvm.transform.Sequential(
            [
                relax.transform.DecomposeOpsForInference(),
                relax.transform.CanonicalizeBindings(),
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FoldConstant(),
            ]
        )(mod)
        before = _calls(mod["main"])
        mod = relax.transform.FuseOps()(mod)
        origins = _fused_origins(mod, node_of, before)
        mod = relax.transform.FuseTIR()(mod)
        mod = relax.transform.DeadCodeElimination()(mod)
    return mod, origins


def _calls(func: Any) -> list[tuple[Any, str, list[Any]]]:
    """(variable, primitive function, arguments) of each call_tir binding of ``func``."""
    from tvm import relax

    out = []
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.call_tir":
                out.append((binding.var, value.args[0].name_hint, _call_args(value)))
    return out


def _fused_origins(mod: Any, node_of: dict[Any, str], before: list[tuple[Any, str, list[Any]]]) -> dict[str, list[str]]:
    """ONNX nodes per fused group (named as FuseTIR names its primitive function) and per unfused
    primitive call. FuseOps keeps the variables of a group's inner bindings but binds the group's
    output to a new one, so a binding whose variable is unknown is found again in the module
    before fusion: the call of the same primitive function on the same arguments."""
    from tvm import relax

    def same(a: list[Any], b: list[Any]) -> bool:
        return len(a) == len(b) and all(x.same_as(y) for x, y in zip(a, b, strict=True))

    def traced(var: Any, prim: str, args: list[Any]) -> str | None:
        if var in node_of:
            return node_of[var]
        for old_var, old_prim, old_args in before:
            if old_prim == prim and same(old_args, args):
                return node_of.get(old_var)
        return None

    origins: dict[str, list[str]] = {}
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not isinstance(value, relax.Call):
                continue
            callee = value.op
            if isinstance(callee, relax.GlobalVar) and isinstance(mod[callee], relax.Function):
                group = mod[callee]
                outer = dict(zip(group.params, value.args, strict=True))  # the group's parameters are main's arguments
                names = []
                for var, prim, args in _calls(group):
                    names.append(traced(var, prim, [outer.get(a, a) for a in args]))
                origins.setdefault(callee.name_hint, list(dict.fromkeys(n for n in names if n)))
            elif getattr(callee, "name", "") == "relax.call_tir":
                name = traced(binding.var, value.args[0].name_hint, _call_args(value))
                origins.setdefault(value.args[0].name_hint, [name] if name else [])
    return origins


def _call_args(call: Any) -> list[Any]:
    """The arguments a call_tir passes to its primitive function."""
    from tvm import relax

    args = call.args[1]
    return list(args.fields) if isinstance(args, relax.Tuple) else [args]


def primitive_functions(mod: Any) -> dict[str, str]:
    """The TIR functions main calls, in call order, with the precision of what they compute (the
    element type of their output)."""
    out: dict[str, str] = {}
    for var, name, _ in _calls(mod["main"]):
        if name not in out:
            out[name] = _precision(str(getattr(var.ty, "dtype", "")))
    return out


_PRECISIONS = {
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
    "int8": "int8",
    "uint8": "int8",
    "float64": "fp64",
    "int32": "int32",
    "int64": "int64",
    "bool": "bool",
}


def _precision(dtype: str) -> str:
    return _PRECISIONS.get(dtype, dtype or "n/a")


def op_type_of(function: str) -> str:
    """The leading op of a primitive function's name: fused_conv2d1_add1_relu1 -> conv2d."""
    tokens = [t.rstrip("0123456789") or t for t in function.split("_")]
    ops = [t for t in tokens if t and t not in NOT_OPS]
    return ops[0] if ops else function
