"""ONNX graph handling shared by the stages: load and check, signatures, pinning, graph passes.

Every pass is a function ``ModelProto -> list[str]`` that edits the model in place and says what
it changed, so the prepare report can list each change.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.core.errors import InputError
from pipeline.core.io import sha256_bytes, sha256_file
from pipeline.results.reports import PassRecord, Signature, TensorSig

if TYPE_CHECKING:
    import onnx

# Ops whose output is not a pure function of their inputs: never constant-fold them.
_NONDETERMINISTIC = {
    "RandomNormal",
    "RandomNormalLike",
    "RandomUniform",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
}


# ONNX Runtime (the reference) implements ai.onnx from opset 7 on, up to the opset of the onnx
# package it is installed with; other domains it implements. Any other domain is a custom op.
MIN_OPSET = 7
SUGGESTED_OPSET = 17
_STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml", "com.microsoft")


def load_model(path: Path, what: str = "model", root: Path | None = None) -> onnx.ModelProto:
    """Load and check an ONNX file and its external data; a missing, truncated or invalid file, an
    external-data file outside ``root`` (default: the model's folder), a custom op or an opset
    the reference runtime lacks is an InputError."""
    import onnx

    if not path.is_file():
        raise InputError(
            f"{what} file {path} does not exist",
            hint="check models.<name>.dir and .source in params.yaml, or run the export stage",
        )
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError, RuntimeError or others on truncation
        raise InputError(
            f"{path} is not a readable ONNX file ({type(exc).__name__}: {exc})",
            hint="the file is truncated or not ONNX: re-export it",
        ) from exc
    if not model.graph.node and not model.graph.output:
        raise InputError(f"{path} holds no ONNX graph (empty or not a model)", hint="re-export the model")
    if external_data_files(model, path, root or path.parent):
        try:
            onnx.load_external_data_for_model(model, str(path.parent))
        except Exception as exc:  # a short or unreadable side file
            raise InputError(
                f"{path}: its external data cannot be read ({type(exc).__name__}: {exc})",
                hint="the external-data file is truncated or from another export: re-export the model",
            ) from exc
    check_ops(model, path)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise InputError(
            f"{path} fails the ONNX checker: {str(exc).strip().splitlines()[0]}",
            hint="fix the exporter settings (opset, op domains) and re-export",
        ) from exc
    return model


def _all_tensors(graph: onnx.GraphProto):
    """Every TensorProto of a graph: initializers, sparse ones, node attributes, subgraphs."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from _all_tensors(sub)


def external_data_files(model: onnx.ModelProto, path: Path, root: Path) -> list[Path]:
    """The external-data files ``model`` (loaded from ``path`` without them) references, sorted by
    location, each once; every one must exist inside ``root``."""
    import onnx

    files: dict[str, Path] = {}
    tensors = [
        *_all_tensors(model.graph),
        *(t for f in model.functions for n in f.node for a in n.attribute for t in ([a.t] if a.HasField("t") else [])),
    ]
    inside = root.resolve()
    for tensor in tensors:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        if location in files:
            continue
        target = (path.parent / location).resolve()
        if not location or Path(location).is_absolute() or not target.is_relative_to(inside) or target == inside:
            raise InputError(
                f"{path}: tensor {tensor.name!r} keeps its data in {location!r}, outside the model's folder {root}",
                hint="keep external-data files inside models.<name>.dir: re-save with "
                "onnx.save_model(model, path, save_as_external_data=True, location='<file name>')",
            )
        if not target.is_file():
            raise InputError(
                f"{path}: external-data file {path.parent / location} (tensor {tensor.name!r}) does not exist",
                hint="copy it next to the model (ONNX resolves 'location' relative to the .onnx file), or re-export",
            )
        files[location] = target
    return [files[k] for k in sorted(files)]


def source_sha256(path: Path, root: Path) -> str:
    """sha256 of an ONNX file; with external data, of the list '<sha256>  <location>' of the
    file and then each external-data file in location order, so a change to any one shows."""
    import onnx

    externals = external_data_files(onnx.load(str(path), load_external_data=False), path, root)
    if not externals:
        return sha256_file(path)
    lines = [f"{sha256_file(path)}  {path.name}"]
    lines += [f"{sha256_file(f)}  {f.relative_to(path.parent.resolve()).as_posix()}" for f in externals]
    return sha256_bytes("\n".join(lines).encode())


def check_ops(model: onnx.ModelProto, path: Path) -> None:
    """Refuse what no runtime here can run: ops of a custom domain, an ai.onnx opset out of range."""
    import onnx

    opsets = {o.domain or "": o.version for o in model.opset_import}
    version = opsets.get("", opsets.get("ai.onnx"))
    newest = onnx.defs.onnx_opset_version()
    if version is not None and version < MIN_OPSET:
        raise InputError(
            f"{path}: the model imports ai.onnx opset {version}; supported opsets are {MIN_OPSET} to {newest}",
            hint="convert it: onnx.save(onnx.version_converter.convert_version("
            f"onnx.load('{path.name}'), {SUGGESTED_OPSET}), '{path.name}'), or re-export at opset {SUGGESTED_OPSET}",
        )
    if version is not None and version > newest:  # the converter knows no opset newer than its onnx either
        raise InputError(
            f"{path}: the model imports ai.onnx opset {version}; supported opsets are {MIN_OPSET} to {newest}",
            hint=f"re-export at opset {newest} or lower (the exporter's opset setting), "
            "or upgrade onnx and onnxruntime together to versions that know it",
        )
    local = {(f.domain, f.name) for f in model.functions}  # model-local functions are defined in the file
    for node in all_nodes(model.graph):
        if (node.domain or "") not in _STANDARD_DOMAINS and (node.domain, node.op_type) not in local:
            raise InputError(
                f"{path}: node {node.name or node.output[0]!r} is op {node.op_type!r} of the custom domain "
                f"{node.domain!r}, which has no implementation in ONNX Runtime (the reference runtime) or any backend",
                hint="export the model without it (decompose it into standard ONNX ops); "
                "registering a custom op library is not supported yet",
            )


def all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from all_nodes(sub)


def infer_shapes(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    import onnx

    try:
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as exc:
        raise InputError(
            f"{path}: shape inference failed: {str(exc).strip().splitlines()[0]}",
            hint="the graph is inconsistent; check the input shapes in params.yaml and the exporter",
        ) from exc


def _dims(value_info: onnx.ValueInfoProto) -> list[int | str | None]:
    """A tensor's dims: an int where fixed (>= 1), the name where named, None where unnamed. Exporters
    write a dynamic dim as -1, 0, no value at all, or a name of their own: all are dynamic."""
    dims: list[int | str | None] = []
    for d in value_info.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value if d.dim_value >= 1 else None)
        else:
            dims.append(d.dim_param or None)
    return dims


def _tensor_sig(value_info: onnx.ValueInfoProto) -> TensorSig:
    import onnx

    tt = value_info.type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name if tt.elem_type else "unknown"
    return TensorSig(name=value_info.name, dtype=dtype, shape=_dims(value_info))


def signature(model: onnx.ModelProto) -> Signature:
    inits = {i.name for i in model.graph.initializer}
    return Signature(
        inputs=[_tensor_sig(v) for v in model.graph.input if v.name not in inits],
        outputs=[_tensor_sig(v) for v in model.graph.output],
    )


def suggested_shape(
    model_shape: list[int | str | None], spec_shape: list[int | str] | None = None, batch_axis: str | None = "batch"
) -> list[int | str]:
    """A params.yaml ``shape`` the model accepts: its fixed dims, and for each dynamic dim the spec's
    entry at that position when the ranks agree, else ``batch_axis`` for the first dim and the
    exporter's name (or ``dim<i>``) for the others."""
    out: list[int | str] = []
    for i, mdim in enumerate(model_shape):
        if isinstance(mdim, int):
            out.append(mdim)
        elif spec_shape is not None and len(spec_shape) == len(model_shape):
            out.append(spec_shape[i])
        elif i == 0 and batch_axis:
            out.append(batch_axis)
        else:
            out.append(mdim if isinstance(mdim, str) and mdim.isidentifier() else f"dim{i}")
    return out


def _flow(shape: list[int | str]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def rename_axes(model: onnx.ModelProto, spec_inputs: list, path: Path, batch_axis: str | None = "batch") -> None:
    """Check the model's inputs against the spec; give the model's dynamic dims the spec's names.

    A dynamic dim of the model (-1, 0, unnamed or any name) takes the spec's axis name, or its
    value where the spec gives an int; a fixed dim the spec contradicts, an unknown or missing
    input, a wrong rank or dtype is an InputError whose hint is a params.yaml entry that works.
    Dynamic output dims and intermediate shapes are dropped: shape inference then derives them
    from the spec's names, so an exporter's per-tensor names (``output_dim_0``) cannot hide which
    output dim is the batch.
    """
    sig = {t.name: t for t in signature(model).inputs}
    declared = {s.name for s in spec_inputs}
    missing = [n for n in sig if n not in declared]
    pin_rest = f"pin any axis but {batch_axis!r} under pins" if batch_axis else "pin every axis under pins"
    if missing:
        entries = "; ".join(
            f"{{name: {n}, dtype: {sig[n].dtype}, shape: {_flow(suggested_shape(sig[n].shape, None, batch_axis))}}}"
            for n in missing
        )
        raise InputError(
            f"{path}: model inputs {missing} are not declared in params.yaml",
            hint=f"add under models.<name>.inputs: {entries} (and {pin_rest})",
        )
    inputs = {v.name: v for v in model.graph.input}
    for spec in spec_inputs:
        if spec.name not in sig:
            raise InputError(
                f"{path}: params.yaml declares input {spec.name!r} but the model has none",
                hint=f"remove it from models.<name>.inputs (model inputs: {sorted(sig)})",
            )
        have = sig[spec.name]
        if have.dtype != spec.dtype:
            raise InputError(
                f"{path}: input {spec.name!r} is {have.dtype} in the model but {spec.dtype} in params.yaml",
                hint=f"set dtype: {have.dtype}",
            )
        dims = inputs[spec.name].type.tensor_type.shape.dim
        want = suggested_shape(have.shape, list(spec.shape), batch_axis)
        if len(have.shape) != len(spec.shape):
            raise InputError(
                f"{path}: input {spec.name!r} has rank {len(have.shape)} {have.shape} in the model "
                f"but params.yaml gives {list(spec.shape)}",
                hint=f"set shape: {_flow(want)} (one entry per model dimension; {pin_rest})",
            )
        for i, (mdim, sdim) in enumerate(zip(have.shape, spec.shape, strict=True)):
            if isinstance(mdim, int) and mdim != sdim:
                raise InputError(
                    f"{path}: input {spec.name!r} dim {i} is fixed to {mdim} in the model "
                    f"but params.yaml gives {sdim!r}",
                    hint=f"set shape: {_flow(want)}",
                )
            d = dims[i]
            if isinstance(sdim, str):
                d.dim_param = sdim
            else:
                d.dim_value = sdim
    for value in model.graph.output:
        for d in value.type.tensor_type.shape.dim:
            if not (d.HasField("dim_value") and d.dim_value >= 1):
                d.Clear()
    del model.graph.value_info[:]


def output_batch_axes(model: onnx.ModelProto, batch_axis: str | None, axes: set[str]) -> dict[str, int | None]:
    """Each output's batch axis as shape inference propagated it from the inputs (``model`` inferred
    after rename_axes): the first dim inferred as ``batch_axis``; None where every dim is fixed or
    another of the spec's ``axes``. Outputs with an unknown dim and no batch dim are left out:
    inference cannot tell, the caller probes them."""
    found: dict[str, int | None] = {}
    for value in model.graph.output:
        dims = _dims(value)
        if batch_axis is not None and batch_axis in dims:
            found[value.name] = dims.index(batch_axis)
        elif value.type.tensor_type.HasField("shape") and all(isinstance(d, int) or d in axes for d in dims):
            found[value.name] = None
    return found


def mark_batch_axes(model: onnx.ModelProto, batch_axis: str, found: dict[str, int | None]) -> None:
    """Name each output's batch dim ``batch_axis`` (the signature then carries it)."""
    for value in model.graph.output:
        index = found.get(value.name)
        if index is None:
            continue
        shape = value.type.tensor_type.shape
        while len(shape.dim) <= index:  # an output inference left without a shape
            shape.dim.add()
        shape.dim[index].dim_param = batch_axis


def pin_axes(model: onnx.ModelProto, pins: dict[str, int], path: Path) -> onnx.ModelProto:
    """Fix named dynamic dims of inputs (and outputs) to values, the same dims inside subgraphs
    (If branches, Loop and Scan bodies), then re-infer shapes."""
    for value in [*model.graph.input, *model.graph.output]:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param in pins:
                d.dim_value = pins[d.dim_param]
    pin_subgraph_axes(model, pins)
    del model.graph.value_info[:]
    return infer_shapes(model, path)


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(Counter(n.op_type for n in model.graph.node).items()))


# --- graph passes ------------------------------------------------------------------------------


def constants_to_initializers(model: onnx.ModelProto) -> list[str]:
    import onnx

    kept, moved = [], []
    for node in model.graph.node:
        if (
            node.op_type == "Constant"
            and node.domain in ("", "ai.onnx")
            and len(node.attribute) == 1
            and node.attribute[0].name == "value"
        ):
            tensor = onnx.TensorProto()
            tensor.CopyFrom(node.attribute[0].t)
            tensor.name = node.output[0]
            model.graph.initializer.append(tensor)
            moved.append(node.output[0])
        else:
            kept.append(node)
    if moved:
        del model.graph.node[:]
        model.graph.node.extend(kept)
    return [f"{len(moved)} Constant nodes became initializers"] if moved else []


def fold_constants(model: onnx.ModelProto) -> list[str]:
    """Evaluate nodes whose inputs are all constant and replace them by initializers."""
    import onnx
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    graph_inputs = {i.name for i in model.graph.input}
    opset = [o for o in model.opset_import]
    kept: list[onnx.NodeProto] = []
    folded: Counter[str] = Counter()
    for node in model.graph.node:
        foldable = (
            node.domain in ("", "ai.onnx")
            and node.op_type not in _NONDETERMINISTIC
            and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
            and all((not n) or (n in values and n not in graph_inputs) for n in node.input)
            and len(node.input) > 0
        )
        if foldable:
            try:
                single = onnx.helper.make_model(
                    onnx.helper.make_graph(
                        [node], "fold", [], [onnx.helper.make_tensor_value_info(o, 0, None) for o in node.output]
                    ),
                    opset_imports=opset,
                )
                outs = ReferenceEvaluator(single).run(None, {n: values[n] for n in node.input if n})
            except Exception:  # leave anything the reference evaluator cannot run to the backend
                kept.append(node)
                continue
            for name, arr in zip(node.output, outs, strict=True):
                values[name] = arr
                model.graph.initializer.append(numpy_helper.from_array(arr, name))
            folded[node.op_type] += 1
        else:
            kept.append(node)
    if folded:
        del model.graph.node[:]
        model.graph.node.extend(kept)
    return [f"folded {n} {op}" for op, n in sorted(folded.items())]


def fold_batchnorm(model: onnx.ModelProto) -> list[str]:
    """Fold BatchNormalization (inference form) into the Conv that feeds it."""
    import numpy as np
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    consumers = Counter(n for node in model.graph.node for n in node.input)
    outputs = {o.name for o in model.graph.output}
    producer = {o: node for node in model.graph.node for o in node.output}
    removed, details = set(), []
    for bn in model.graph.node:
        if bn.op_type != "BatchNormalization" or len(bn.output) != 1 or bn.domain not in ("", "ai.onnx"):
            continue
        conv = producer.get(bn.input[0])
        if conv is None or conv.op_type != "Conv" or consumers[conv.output[0]] != 1 or conv.output[0] in outputs:
            continue
        if not all(n in inits for n in bn.input[1:5]) or conv.input[1] not in inits:
            continue
        if len(conv.input) > 2 and conv.input[2] and conv.input[2] not in inits:
            continue
        eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
        scale, bias, mean, var = (numpy_helper.to_array(inits[n]).astype(np.float64) for n in bn.input[1:5])
        w = numpy_helper.to_array(inits[conv.input[1]])
        b = (
            numpy_helper.to_array(inits[conv.input[2]])
            if len(conv.input) > 2 and conv.input[2]
            else np.zeros(w.shape[0])
        )
        factor = scale / np.sqrt(var + eps)
        new_w = (w.astype(np.float64) * factor.reshape(-1, *([1] * (w.ndim - 1)))).astype(w.dtype)
        new_b = ((b.astype(np.float64) - mean) * factor + bias).astype(w.dtype)
        w_name, b_name = f"{conv.name or conv.output[0]}_bnfolded_W", f"{conv.name or conv.output[0]}_bnfolded_B"
        model.graph.initializer.extend([numpy_helper.from_array(new_w, w_name), numpy_helper.from_array(new_b, b_name)])
        del conv.input[1:]
        conv.input.extend([w_name, b_name])
        conv.output[0] = bn.output[0]
        removed.add(id(bn))
        details.append(f"{bn.name or bn.output[0]} folded into {conv.name or 'Conv'}")
    if removed:
        kept = [n for n in model.graph.node if id(n) not in removed]
        del model.graph.node[:]
        model.graph.node.extend(kept)
    return details


def eliminate_dead_code(model: onnx.ModelProto) -> list[str]:
    """Drop nodes that no graph output depends on, then unused initializers."""
    needed = {o.name for o in model.graph.output}
    kept = []
    for node in reversed(list(model.graph.node)):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(n for n in node.input if n)
            for attr in node.attribute:  # subgraphs may read outer-scope names
                for g in [attr.g] if attr.HasField("g") else list(attr.graphs):
                    needed.update(n for sub in g.node for n in sub.input)
    dead_nodes = len(model.graph.node) - len(kept)
    if dead_nodes:
        kept.reverse()
        del model.graph.node[:]
        model.graph.node.extend(kept)
    inits = [i for i in model.graph.initializer if i.name in needed]
    dead_inits = len(model.graph.initializer) - len(inits)
    if dead_inits:
        del model.graph.initializer[:]
        model.graph.initializer.extend(inits)
    details = []
    if dead_nodes:
        details.append(f"removed {dead_nodes} dead nodes")
    if dead_inits:
        details.append(f"removed {dead_inits} unused initializers")
    return details


PASSES: tuple[tuple[str, Callable[[onnx.ModelProto], list[str]]], ...] = (
    ("constants_to_initializers", constants_to_initializers),
    ("constant_folding", fold_constants),
    ("batchnorm_folding", fold_batchnorm),
    ("dead_code_elimination", eliminate_dead_code),
)


def run_passes(model: onnx.ModelProto) -> list[PassRecord]:
    records = []
    for name, fn in PASSES:
        before = len(model.graph.node)
        details = fn(model)
        records.append(
            PassRecord(
                name=name,
                changed=bool(details),
                nodes_before=before,
                nodes_after=len(model.graph.node),
                details=details,
            )
        )
    return records


# --- tensor storage and opset conversion (for the backends' importers) --------------------------

# outputs of an opset conversion may differ from the original's by this much, relative to the
# largest output magnitude (at least 1): an adapter that changes the function is refused
_TYPED_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")


def tensors_to_raw(model: onnx.ModelProto) -> int:
    """Store every initializer and Constant tensor (subgraphs included) as ``raw_data``; returns
    how many moved. Importers differ in which typed fields they read (IREE's refuses FP16 in
    ``int32_data``, where converters put it); all of them read raw_data. External data is left as is."""
    from onnx import TensorProto, numpy_helper

    moved = 0
    for tensor in _all_tensors(model.graph):
        if tensor.data_location == TensorProto.EXTERNAL or tensor.data_type == TensorProto.STRING:
            continue
        if not any(len(getattr(tensor, f)) for f in _TYPED_FIELDS if f != "string_data"):
            continue
        array = numpy_helper.to_array(tensor)
        tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
        moved += 1
    return moved


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


# ops whose ``axis`` meant "flatten from here to the end" before opset 13, and "this one axis" from 13
COERCED_AXIS_OPS = frozenset({"Softmax", "LogSoftmax", "Hardmax"})


def coerced_axis_nodes(model: onnx.ModelProto) -> list[str]:
    """Softmax/LogSoftmax/Hardmax nodes of a model older than opset 13 whose result depends on the
    pre-13 meaning of ``axis`` (the input coerced to 2-D at ``axis``): the axis is not the input's
    last one, or the input's rank is unknown. An importer that reads them with opset 13's meaning
    computes something else. Node names (or ``op_type#index`` for unnamed nodes)."""
    import onnx

    if default_opset(model) >= 13:
        return []
    if not any(n.op_type in COERCED_AXIS_OPS for n in all_nodes(model.graph)):
        return []
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001  (no shapes: every such node counts)
        inferred = model
    ranks = {
        v.name: len(v.type.tensor_type.shape.dim)
        for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
        if v.type.tensor_type.HasField("shape")
    }
    found = []
    for index, node in enumerate(all_nodes(inferred.graph)):
        if node.op_type not in COERCED_AXIS_OPS or not node.input:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        rank = ranks.get(node.input[0])
        if rank is None or (axis % rank if rank else axis) != rank - 1:
            found.append(node.name or f"{node.op_type}#{index}")
    return found


def pin_subgraph_axes(model: onnx.ModelProto, pins: dict[str, int]) -> int:
    """Fix the pinned named dims inside subgraphs (If branches, Loop and Scan bodies), for
    ``pin_axes``: a body that keeps ``batch`` dynamic while its inputs are pinned has mismatched
    types (IREE's importer refused such a Loop). Returns how many dims were fixed."""
    fixed = 0

    def visit(graph: onnx.GraphProto) -> None:
        nonlocal fixed
        for node in graph.node:
            for attr in node.attribute:
                for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                    for value in [*sub.input, *sub.output, *sub.value_info]:
                        for d in value.type.tensor_type.shape.dim:
                            if d.dim_param in pins:
                                d.dim_value = pins[d.dim_param]
                                fixed += 1
                    visit(sub)

    visit(model.graph)
    return fixed


def fold_static_shapes(model: onnx.ModelProto) -> list[str]:
    """Shape and Size nodes (top-level graph) of tensors whose shape is fixed (every dim a number,
    as after pinning the axes) become initializers; what computes only on them and on constants
    (the Shape -> Gather -> Concat -> Reshape chains exporters write) is folded, and what is left
    dead is removed. For importers that need a new shape as a constant. Returns what changed."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001  (the shapes the model already declares)
        inferred = model
    static: dict[str, list[int]] = {i.name: list(i.dims) for i in model.graph.initializer}
    for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        tensor = value.type.tensor_type
        if tensor.HasField("shape") and all(d.HasField("dim_value") for d in tensor.shape.dim):
            static.setdefault(value.name, [d.dim_value for d in tensor.shape.dim])
    outputs = {o.name for o in model.graph.output}
    kept: list[onnx.NodeProto] = []
    replaced: Counter[str] = Counter()
    for node in model.graph.node:
        dims = static.get(node.input[0]) if node.input else None
        if node.op_type not in ("Shape", "Size") or node.domain not in ("", "ai.onnx") or dims is None:
            kept.append(node)
            continue
        if node.output[0] in outputs:  # a graph output stays computed
            kept.append(node)
            continue
        if node.op_type == "Shape":  # start/end (opset 15) clamp as Python's slicing does
            attrs = {a.name: a.i for a in node.attribute}
            value = np.array(dims[attrs.get("start", 0) : attrs.get("end", len(dims))], np.int64)
        else:
            value = np.array(int(np.prod(dims, dtype=np.int64)), np.int64)
        model.graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
        replaced[node.op_type] += 1
    if not replaced:
        return []
    del model.graph.node[:]
    model.graph.node.extend(kept)
    details = [f"{n} {op} of a fixed shape became constants" for op, n in sorted(replaced.items())]
    return details + fold_constants(model) + eliminate_dead_code(model)
