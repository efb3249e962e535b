"""ONNX -> .tflite, run by pipeline.backends.litert in the converter's own environment (the pinned
onnx2tf/TensorFlow venv of requirements.lock, whose versions clash with skuforge's), as
``python convert.py REQUEST.json`` (or many requests through ``server.py``, which calls ``main``).
skuforge never imports this module; it imports nothing of
skuforge's. Every value arrives in the request file (paths, names, flags), none as command text.

1. onnx2tf turns the (pinned, static) ONNX model into a TensorFlow SavedModel, NCHW inputs kept
   as they are (``keep_ncw_or_nchw_or_ncdhw_input_names``) so the engine takes the ONNX tensors.
2. TensorFlow's TFLite converter turns the SavedModel into an FP32 flatbuffer (always: it names
   the tensors and maps them to the ONNX graph), and FP16 (weights) or INT8 where asked: INT8 is
   calibrated on the request's calibration samples, then quantized with every op int8 but the
   ops made from the ONNX nodes to keep in float (``denylisted_nodes``); int8 inputs and
   outputs where asked (``fully_quantize``).
   Where ``xnnpack_rewrites`` asks (the default), what would become ops XNNPACK has no kernel for is
   rewritten as equal ops it has: HardSigmoid in the ONNX model, nearest resizes by 2^k in each
   flatbuffer (``hardsigmoid_rewrite``, ``nearest_resize_rewrite``); and a transposed convolution
   whose kernel is its stride, which XNNPACK runs at a tenth of a convolution's speed, as a 1x1
   convolution and DEPTH_TO_SPACE (``transpose_conv_rewrite``).
3. The FP32 flatbuffer and ONNX Runtime run one probe sample with every intermediate kept: each
   TFLite op's output is matched by value to an ONNX tensor (up to an NHWC<->NCHW permutation),
   which maps the op back to the ONNX nodes it computes, and each ONNX output to the TFLite
   output and the transpose that gives it back in ONNX layout.

The result file holds either {"ok": true, ...} or {"ok": false, "error": {...}}; exit status 0
in both cases (1: the request itself was unreadable).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ANSI = re.compile(r"\x1b\[[0-9;]*m")
ONNX_OP = re.compile(r"onnx_op_type:\s*(\S+)\s+onnx_op_name:\s*(\S+)")
ONNX_NODE = re.compile(r"onnx_op_name:\s*(\S+)")  # at verbosity info, a failed op's error names its node only
SELECT_OPS = re.compile(r"TF Select ops:\s*([^\n]+)")
CUSTOM_OPS = re.compile(r"Custom ops:\s*([^\n]+)")
# an MLIR location: fused["MatrixDeterminant:", "model_1/<layer>/MatrixDeterminant@__inference_..."]
LOCATION = re.compile(r'fused\["(\w+):", "([^"@]+)')


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in ANSI.sub("", text).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(("Traceback", "File ", "WARNING", "INFO"))]
    return (useful or lines or ["no message"])[0][:400]


def _sanitize(name: str) -> str:
    """A name compared the way onnx2tf and TensorFlow may spell it (``x:0`` becomes ``x__0``, a leading
    ``/`` gets a prefix): its letters and digits only."""
    return re.sub(r"[^0-9a-z]", "", name.lower())


# what TensorFlow takes in a name scope after the first character (onnx2tf names layers after nodes)
UNSAFE = re.compile(r"[^A-Za-z0-9_./>-]")


def step(name: str) -> None:
    """Say on stderr which step runs: a converter that dies of a signal leaves it in the log's tail."""
    print(f"skuforge-convert: {name}", file=sys.stderr, flush=True)


# what an input name may hold for onnx2tf to keep it as it is (``x:0`` becomes ``x__0``, and its
# keep-NCHW list then misses it)
SAFE_INPUT = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


def _fresh(base: str, taken: set[str]) -> str:
    new, i = base, 1
    while new in taken:
        new, i = f"{base}_{i}", i + 1
    taken.add(new)
    return new


def _rename_uses(graph: Any, old: str, new: str) -> None:
    """Every read of tensor ``old`` in ``graph`` and its subgraphs (If/Loop bodies read outer names)."""
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        for attr in node.attribute:
            for sub in [attr.g, *attr.graphs]:
                if sub is not None and len(sub.node):
                    _rename_uses(sub, old, new)


def _tf_safe(model: Any) -> tuple[dict[str, str], dict[str, str]]:
    """Rename the nodes whose names TensorFlow refuses as a scope (PaddlePaddle's ``Softmax@0``) and
    the inputs onnx2tf would rename itself (``x:0``); returns ({new node: ONNX node}, {ONNX input: new})."""
    graph = model.graph
    taken = {n.name for n in graph.node}
    renamed = {}
    for node in graph.node:
        if node.name and UNSAFE.search(node.name):
            new = _fresh(UNSAFE.sub("_", node.name), taken)
            renamed[new] = node.name
            node.name = new
    tensors = {name for n in graph.node for name in (*n.input, *n.output)} | {i.name for i in graph.input}
    inputs = {}
    for value in graph.input:
        if not SAFE_INPUT.match(value.name):
            new = _fresh("in_" + re.sub(r"[^A-Za-z0-9_]", "_", value.name), tensors)
            _rename_uses(graph, value.name, new)
            inputs[value.name] = new
            value.name = new
    return renamed, inputs


def _find_node(name: str, model: Any, renamed: dict[str, str]) -> str | None:
    """The ONNX node a converter message names by its name or an output's, as renamed here or as
    onnx2tf spells it; None when no node matches."""
    nodes = {key: n.name or n.output[0] for n in model.graph.node for key in (n.name, *n.output) if key}
    name = renamed.get(name, name)
    if name in nodes:
        return nodes[name]
    wanted = _sanitize(name)
    found = {nodes[k] for k in nodes if _sanitize(k) == wanted}
    # onnx2tf prefixes names that start with '/' ("wa/model/If_1" for "/model/If_1")
    found = found or {nodes[k] for k in nodes if k.startswith("/") and wanted.endswith(_sanitize(k))}
    return found.pop() if len(found) == 1 else None


def onnx_node(name: str | None, model: Any, renamed: dict[str, str]) -> str | None:
    """The ONNX node an onnx2tf message names (the name as given where none matches)."""
    return (_find_node(name, model, renamed) or renamed.get(name, name)) if name else None


# XNNPACK 2.3's delegate has no kernel for two TFLite ops onnx2tf makes; each is rewritten into ops
# it has that compute the same values (tests/backends/test_litert_rewrites.py):
#   HardSigmoid (RELU_0_TO_1), before onnx2tf: Mul(alpha), Add(beta), Clip(0, 1) -> MUL, ADD, MINIMUM, RELU
#   RESIZE_NEAREST_NEIGHBOR by 2^k on H and W (not align_corners), in the flatbuffer: k times
#     CONCATENATION of 4 copies on the channel axis, DEPTH_TO_SPACE 2: out[2h+i, 2w+j, c] = x[h, w, c]
#     (copies of the same values, bit for bit). In the flatbuffer, not before onnx2tf: onnx2tf's
#     layout heuristics transpose the Add after an ONNX DepthToSpace the wrong way (a detector's FPN).
# and one it runs slowly: TRANSPOSE_CONV with kernel = stride = b (a DBNet head's k2 s2), whose
#   output pixels each come from one input pixel, in the flatbuffer: CONV_2D 1x1 to b*b*O channels,
#   DEPTH_TO_SPACE b. XNNPACK 2.3 ran the ship detector's two at 0.7-9 GMAC/s against 37-44 for its
#   convolutions (docs/backends/litert.md); the same products and sums, bit for bit in FP32 and INT8.
MAX_NEAREST_STEPS = 6  # x64


def _attr(node: Any, name: str, default: Any) -> Any:
    import onnx

    for a in node.attribute:
        if a.name == name:
            value = onnx.helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default


def hardsigmoid_rewrite(model: Any) -> list[str]:
    """Each HardSigmoid of ``model`` rewritten in place as Mul(alpha), Add(beta), Clip(0, 1) (onnx2tf
    makes RELU_0_TO_1 of a HardSigmoid, MINIMUM and RELU of a Clip); returns the nodes rewritten."""
    from onnx import TensorProto, helper

    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    taken = {n.name for n in graph.node} | {i.name for i in graph.initializer}
    taken |= {t for n in graph.node for t in (*n.input, *n.output)}
    done, nodes = [], []
    for node in graph.node:
        if node.op_type != "HardSigmoid" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        label = node.name or node.output[0]
        x, y = node.input[0], node.output[0]
        alpha, beta = _fresh(f"{label}__alpha", taken), _fresh(f"{label}__beta", taken)
        scaled, shifted = _fresh(f"{label}__scaled", taken), _fresh(f"{label}__shifted", taken)
        graph.initializer.extend(
            [
                helper.make_tensor(alpha, TensorProto.FLOAT, [], [float(_attr(node, "alpha", 0.2))]),
                helper.make_tensor(beta, TensorProto.FLOAT, [], [float(_attr(node, "beta", 0.5))]),
            ]
        )
        if opset >= 11:
            lo, hi = _fresh(f"{label}__zero", taken), _fresh(f"{label}__one", taken)
            graph.initializer.extend(
                [
                    helper.make_tensor(lo, TensorProto.FLOAT, [], [0.0]),
                    helper.make_tensor(hi, TensorProto.FLOAT, [], [1.0]),
                ]
            )
            clip = helper.make_node("Clip", [shifted, lo, hi], [y], name=_fresh(f"{label}__clip", taken))
        else:  # Clip's bounds were attributes before opset 11
            clip = helper.make_node("Clip", [shifted], [y], min=0.0, max=1.0, name=_fresh(f"{label}__clip", taken))
        nodes += [
            helper.make_node("Mul", [x, alpha], [scaled], name=_fresh(f"{label}__mul", taken)),
            helper.make_node("Add", [scaled, beta], [shifted], name=_fresh(f"{label}__add", taken)),
            clip,
        ]
        done.append(label)
    if done:
        del graph.node[:]
        graph.node.extend(nodes)
    return done


def _opcode(model: Any, code: int) -> int:
    """The index of builtin op ``code`` in the model's operator codes (added when absent)."""
    from tensorflow.lite.python import schema_py_generated as fb

    for i, opcode in enumerate(model.operatorCodes):
        if max(opcode.builtinCode, opcode.deprecatedBuiltinCode) == code:
            return i
    opcode = fb.OperatorCodeT()
    opcode.builtinCode, opcode.deprecatedBuiltinCode, opcode.version = code, min(code, 127), 1
    model.operatorCodes.append(opcode)
    return len(model.operatorCodes) - 1


def _nearest_steps(options: Any, src: list[int], dst: list[int]) -> int | None:
    """k when a RESIZE_NEAREST_NEIGHBOR from NHWC ``src`` to ``dst`` scales H and W by the same 2**k
    and picks pixel floor(i / 2**k) (not align_corners: with or without half-pixel centers), else None."""
    if options is None or options.alignCorners or len(src) != 4 or len(dst) != 4 or min(src) <= 0:
        return None
    if dst[0] != src[0] or dst[3] != src[3] or dst[1] % src[1] or dst[2] % src[2]:
        return None
    scale = dst[1] // src[1]
    if scale != dst[2] // src[2] or scale < 2 or scale & (scale - 1):
        return None
    steps = scale.bit_length() - 1
    return steps if steps <= MAX_NEAREST_STEPS else None


def nearest_resize_rewrite(flatbuffer: bytes) -> tuple[bytes, list[str]]:
    """The flatbuffer with each RESIZE_NEAREST_NEIGHBOR that ``_nearest_steps`` takes rewritten as
    CONCATENATION + DEPTH_TO_SPACE steps; returns it and the output tensors of the resizes rewritten."""
    import copy

    from tensorflow.lite.python import schema_py_generated as fb
    from tensorflow.lite.tools import flatbuffer_utils

    model = flatbuffer_utils.convert_bytearray_to_object(bytearray(flatbuffer))
    codes = [max(c.builtinCode, c.deprecatedBuiltinCode) for c in model.operatorCodes]
    if fb.BuiltinOperator.RESIZE_NEAREST_NEIGHBOR not in codes:
        return flatbuffer, []
    done = []
    for graph in model.subgraphs:
        ops = []
        for op in graph.operators or []:
            if codes[op.opcodeIndex] != fb.BuiltinOperator.RESIZE_NEAREST_NEIGHBOR:
                ops.append(op)
                continue
            src, dst = graph.tensors[op.inputs[0]], graph.tensors[op.outputs[0]]
            shape = [int(d) for d in src.shape]
            steps = _nearest_steps(op.builtinOptions, shape, [int(d) for d in dst.shape])
            if steps is None:
                ops.append(op)
                continue
            name = dst.name.decode() if isinstance(dst.name, bytes) else str(dst.name)
            current = op.inputs[0]
            for k in range(steps):
                tiled = copy.deepcopy(dst)
                tiled.shape, tiled.shapeSignature, tiled.buffer = [shape[0], shape[1], shape[2], 4 * shape[3]], None, 0
                tiled.name = f"{name}/xnnpack_tiled{k}"
                graph.tensors.append(tiled)
                concat = fb.OperatorT()
                concat.opcodeIndex = _opcode(model, fb.BuiltinOperator.CONCATENATION)
                concat.inputs, concat.outputs = [current] * 4, [len(graph.tensors) - 1]
                concat.builtinOptionsType = fb.BuiltinOptions.ConcatenationOptions
                concat.builtinOptions = fb.ConcatenationOptionsT()
                concat.builtinOptions.axis = 3
                shape = [shape[0], 2 * shape[1], 2 * shape[2], shape[3]]
                if k == steps - 1:
                    out = op.outputs[0]
                else:
                    step = copy.deepcopy(dst)
                    step.shape, step.shapeSignature, step.buffer = list(shape), None, 0
                    step.name = f"{name}/xnnpack_up{k}"
                    graph.tensors.append(step)
                    out = len(graph.tensors) - 1
                d2s = fb.OperatorT()
                d2s.opcodeIndex = _opcode(model, fb.BuiltinOperator.DEPTH_TO_SPACE)
                d2s.inputs, d2s.outputs = [concat.outputs[0]], [out]
                d2s.builtinOptionsType = fb.BuiltinOptions.DepthToSpaceOptions
                d2s.builtinOptions = fb.DepthToSpaceOptionsT()
                d2s.builtinOptions.blockSize = 2
                ops += [concat, d2s]
                current = out
            done.append(name)
        graph.operators = ops
    if not done:
        return flatbuffer, []
    return bytes(flatbuffer_utils.convert_object_to_bytearray(model)), done


def _patch_block(options: Any, weights: list[int], out_shape: list[int] | None, src: list[int]) -> int | None:
    """b when a TRANSPOSE_CONV with these options, weights [O, kh, kw, I], output shape and NHWC input
    has kernel = stride = b on H and W: the outputs of different input pixels do not overlap (no
    padding is then cut either way), so it is a 1x1 convolution to b*b*O channels and DEPTH_TO_SPACE b."""
    if options is None or len(weights) != 4 or len(src) != 4 or out_shape is None or len(out_shape) != 4:
        return None
    block = weights[1]
    if block < 2 or weights[2] != block or options.strideH != block or options.strideW != block:
        return None
    want = [src[0], src[1] * block, src[2] * block, weights[0]]
    return block if list(out_shape) == want and weights[3] == src[3] else None


def _constant(model: Any, graph: Any, index: int) -> np.ndarray | None:
    """The value of tensor ``index`` when it is a constant held in the flatbuffer (else None)."""
    from tensorflow.lite.python import schema_py_generated as fb

    if index < 0:
        return None
    tensor = graph.tensors[index]
    data = model.buffers[tensor.buffer].data if tensor.buffer else None
    dtypes = {fb.TensorType.FLOAT32: np.float32, fb.TensorType.INT8: np.int8, fb.TensorType.INT32: np.int32}
    if data is None or len(data) == 0 or tensor.type not in dtypes:
        return None
    return np.frombuffer(bytes(np.asarray(data, np.uint8)), dtypes[tensor.type]).reshape([int(d) for d in tensor.shape])


def _constant_tensor(model: Any, graph: Any, like: int, value: np.ndarray, name: str, repeat: int) -> int:
    """A new constant tensor of ``value`` typed as tensor ``like``, its per-channel quantization (on
    axis 0) repeated ``repeat`` times, as the channels are; returns its index."""
    import copy

    from tensorflow.lite.python import schema_py_generated as fb

    tensor = copy.deepcopy(graph.tensors[like])
    buffer = fb.BufferT()
    buffer.data = np.frombuffer(np.ascontiguousarray(value).tobytes(), np.uint8)
    model.buffers.append(buffer)
    tensor.buffer, tensor.name = len(model.buffers) - 1, name
    tensor.shape, tensor.shapeSignature = list(value.shape), None
    quant = tensor.quantization
    if quant is not None and quant.scale is not None and len(quant.scale) > 1:
        for field in ("scale", "zeroPoint", "min", "max"):
            values = getattr(quant, field)
            if values is not None and len(values) > 1:
                setattr(quant, field, np.tile(np.asarray(values), repeat))
    graph.tensors.append(tensor)
    return len(graph.tensors) - 1


def transpose_conv_rewrite(flatbuffer: bytes) -> tuple[bytes, list[str]]:
    """The flatbuffer with each TRANSPOSE_CONV that ``_patch_block`` takes (constant FP32 or INT8
    weights and bias) rewritten as CONV_2D 1x1 to b*b*O channels + DEPTH_TO_SPACE b; returns it and the
    output tensors of the ops rewritten. Channel (i*b + j)*O + o of the convolution holds output pixel
    (b*h + i, b*w + j, o): its weights are W[o, i, j, :], its bias (and per-channel scales) bias[o]."""
    import copy

    from tensorflow.lite.python import schema_py_generated as fb
    from tensorflow.lite.tools import flatbuffer_utils

    model = flatbuffer_utils.convert_bytearray_to_object(bytearray(flatbuffer))
    codes = [max(c.builtinCode, c.deprecatedBuiltinCode) for c in model.operatorCodes]
    if fb.BuiltinOperator.TRANSPOSE_CONV not in codes:
        return flatbuffer, []
    done = []
    for graph in model.subgraphs:
        ops = []
        for op in graph.operators or []:
            if codes[op.opcodeIndex] != fb.BuiltinOperator.TRANSPOSE_CONV or len(op.inputs) < 4:
                ops.append(op)
                continue
            shape, weights, source, bias = op.inputs[:4]
            kernel, bias_value = _constant(model, graph, weights), _constant(model, graph, bias)
            out_shape = _constant(model, graph, shape)
            quant = graph.tensors[weights].quantization
            per_channel_axis = quant.quantizedDimension if quant is not None and quant.scale is not None else 0
            if kernel is None or bias_value is None or out_shape is None or per_channel_axis != 0:
                ops.append(op)
                continue
            src = [int(d) for d in graph.tensors[source].shape]
            block = _patch_block(op.builtinOptions, list(kernel.shape), out_shape.tolist(), src)
            if block is None:
                ops.append(op)
                continue
            out = graph.tensors[op.outputs[0]]
            name = out.name.decode() if isinstance(out.name, bytes) else str(out.name)
            count, cin = kernel.shape[0], kernel.shape[3]
            repeat = block * block
            dense = kernel.transpose(1, 2, 0, 3).reshape(repeat * count, 1, 1, cin)
            conv = fb.OperatorT()
            conv.opcodeIndex = _opcode(model, fb.BuiltinOperator.CONV_2D)
            conv.inputs = [
                source,
                _constant_tensor(model, graph, weights, dense, f"{name}/xnnpack_weights", repeat),
                _constant_tensor(model, graph, bias, np.tile(bias_value, repeat), f"{name}/xnnpack_bias", repeat),
            ]
            patches = copy.deepcopy(out)
            patches.shape, patches.shapeSignature, patches.buffer = [*src[:3], repeat * count], None, 0
            patches.name = f"{name}/xnnpack_patches"
            graph.tensors.append(patches)
            conv.outputs = [len(graph.tensors) - 1]
            conv.builtinOptionsType = fb.BuiltinOptions.Conv2DOptions
            conv.builtinOptions = fb.Conv2DOptionsT()
            conv.builtinOptions.padding = fb.Padding.VALID
            conv.builtinOptions.strideH = conv.builtinOptions.strideW = 1
            conv.builtinOptions.fusedActivationFunction = op.builtinOptions.fusedActivationFunction
            d2s = fb.OperatorT()
            d2s.opcodeIndex = _opcode(model, fb.BuiltinOperator.DEPTH_TO_SPACE)
            d2s.inputs, d2s.outputs = list(conv.outputs), [op.outputs[0]]
            d2s.builtinOptionsType = fb.BuiltinOptions.DepthToSpaceOptions
            d2s.builtinOptions = fb.DepthToSpaceOptionsT()
            d2s.builtinOptions.blockSize = block
            ops += [conv, d2s]
            done.append(name)
        graph.operators = ops
    if not done:
        return flatbuffer, []
    return bytes(flatbuffer_utils.convert_object_to_bytearray(model)), done


# the flatbuffer rewrites, in order: (name, function, what the build report says it did)
FLATBUFFER_REWRITES: list[tuple[str, Callable[[bytes], tuple[bytes, list[str]]], str, str]] = [
    (
        "nearest_resize",
        nearest_resize_rewrite,
        "RESIZE_NEAREST_NEIGHBOR x2^k",
        "k x (CONCATENATION of 4 copies on channels, DEPTH_TO_SPACE 2)",
    ),
    ("transpose_conv", transpose_conv_rewrite, "TRANSPOSE_CONV kernel = stride", "CONV_2D 1x1 + DEPTH_TO_SPACE"),
]


def flatbuffer_rewrites(flatbuffer: bytes) -> tuple[bytes, dict[str, list[str]]]:
    """The flatbuffer with every rewrite of FLATBUFFER_REWRITES made; {rewrite: output tensors rewritten}."""
    done = {}
    for name, rewrite, _, _ in FLATBUFFER_REWRITES:
        flatbuffer, tensors = rewrite(flatbuffer)
        if tensors:
            done[name] = tensors
    return flatbuffer, done


def _onnx2tf(req: dict[str, Any], saved_model: Path) -> tuple[dict[str, str], dict[str, str], list[dict[str, Any]]]:
    """The SavedModel; returns {ONNX input: the name onnx2tf was given} (inputs renamed to be kept),
    {node name given: ONNX node name} (nodes renamed for TensorFlow) and the XNNPACK rewrites made."""
    import onnx
    import onnx2tf

    model = onnx.load(req["onnx"])
    init = {i.name for i in model.graph.initializer}
    renamed, inputs = _tf_safe(model)
    rewrites = []
    if req.get("xnnpack_rewrites", True):
        hardsigmoids = [renamed.get(n, n) for n in hardsigmoid_rewrite(model)]  # as the ONNX model names them
        if hardsigmoids:
            rewrites.append(
                {
                    "rewrite": "hardsigmoid",
                    "from": "HardSigmoid (RELU_0_TO_1)",
                    "to": "Mul, Add, Clip(0, 1) (MUL, ADD, MINIMUM, RELU)",
                    "nodes": hardsigmoids,
                }
            )
    keep = [i.name for i in model.graph.input if i.name not in init and len(i.type.tensor_type.shape.dim) in (3, 4, 5)]
    source = req["onnx"]
    if renamed or inputs or rewrites:
        source = str(saved_model.parent / "tf_safe.onnx")
        onnx.save(model, source)
    original = onnx.load(req["onnx"], load_external_data=False)
    log = io.StringIO()
    step("onnx2tf")
    try:
        with contextlib.redirect_stdout(log):
            onnx2tf.convert(
                input_onnx_file_path=source,
                output_folder_path=str(saved_model),
                keep_ncw_or_nchw_or_ncdhw_input_names=keep or None,
                output_signaturedefs=True,
                copy_onnx_input_output_names_to_tflite=True,
                replace_to_pseudo_operators=[op.lower() for op in req.get("pseudo_ops", [])],
                verbosity="info",
            )
    except BaseException as exc:  # onnx2tf raises anything from any op's converter, or sys.exit(1)
        text = ANSI.sub("", log.getvalue())
        ops = ONNX_OP.findall(text)
        nodes = ONNX_NODE.findall(text)
        raise ConversionError(
            "onnx2tf",
            f"onnx2tf could not convert the model: {_first_line(str(exc) or type(exc).__name__)}",
            op=ops[-1][0] if ops else None,
            node=onnx_node(nodes[-1] if nodes else None, original, renamed),
        ) from exc
    if not (saved_model / "saved_model.pb").is_file():
        text = ANSI.sub("", log.getvalue())
        ops = ONNX_OP.findall(text)
        errors = [ln for ln in text.splitlines() if "ERROR" in ln]
        raise ConversionError(
            "onnx2tf",
            f"onnx2tf wrote no SavedModel: {_first_line(errors[-1] if errors else text[-400:])}",
            op=ops[-1][0] if ops else None,
            node=onnx_node(ops[-1][1] if ops else None, original, renamed),
        )
    return inputs, renamed, rewrites


class ConversionError(Exception):
    def __init__(self, stage: str, message: str, op: str | None = None, node: str | None = None, **extra: Any):
        super().__init__(message)
        self.record = {"stage": stage, "message": message, "op": op, "node": node, **extra}


def _tflite(convert: Any, what: str, locate: Callable[[str], str | None]) -> bytes:
    """``convert()``'s flatbuffer; an op it cannot lower is named with the ONNX node ``locate`` finds
    for the layers around it."""
    try:
        return convert()
    except Exception as exc:
        text = str(exc)
        select = SELECT_OPS.search(text)
        custom = CUSTOM_OPS.search(text)
        missing = [o.strip() for o in (select.group(1) if select else custom.group(1) if custom else "").split(",")]
        missing = [o for o in missing if o]
        # the Keras layers around the first missing op: onnx2tf names them after the ONNX node or its output
        scopes: list[str] = next(
            (path.split("/")[1:-1] for op, path in LOCATION.findall(text) if missing and op == missing[0]), []
        )
        node = next((found for found in map(locate, scopes) if found), None)
        raise ConversionError(
            "tflite",
            f"the TFLite converter could not make the {what} model: "
            + (
                f"TensorFlow ops with no LiteRT built-in kernel: {', '.join(missing)}" if missing else _first_line(text)
            ),
            op=missing[0] if missing else None,
            node=node,
            tf_ops=missing,
        ) from exc


def _signature(model: bytes) -> tuple[dict[str, int], dict[str, int]]:
    import tensorflow as tf

    sig = tf.lite.Interpreter(model_content=model)._get_full_signature_list()["serving_default"]
    return sig["inputs"], sig["outputs"]


def _input_keys(onnx_inputs: list[str], sig_inputs: dict[str, int], given: dict[str, str]) -> dict[str, str]:
    """ONNX input name -> the flatbuffer signature's key for it (``given``: inputs renamed for onnx2tf)."""
    keys = {}
    for name in onnx_inputs:
        if given.get(name, name) in sig_inputs:
            keys[name] = given.get(name, name)
            continue
        want = _sanitize(given.get(name, name))
        found = [k for k in sig_inputs if _sanitize(k) == want and k not in keys.values()]
        if len(found) != 1:
            raise ConversionError(
                "io",
                f"the TFLite model's inputs ({', '.join(sorted(sig_inputs))}) have "
                f"{'several' if found else 'none'} for ONNX input {name!r}",
            )
        keys[name] = found[0]
    return keys


def _onnx_all(req: dict[str, Any], probe: dict[str, np.ndarray]) -> tuple[Any, dict[str, np.ndarray], list[str]]:
    """ONNX Runtime's value of every float tensor of the model on the probe sample, and the model."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(req["onnx"])
    inferred = onnx.shape_inference.infer_shapes(model)
    floats = {
        v.name
        for v in [*inferred.graph.value_info, *inferred.graph.output]
        if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    }
    existing = {o.name for o in model.graph.output}
    order = []
    for node in model.graph.node:
        for out in node.output:
            if out and out in floats:
                order.append(out)
                if out not in existing:
                    model.graph.output.append(onnx.helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    values = dict(zip(names, session.run(names, probe), strict=True))
    return model, values, order


def _perms(rank: int) -> list[tuple[int, ...]]:
    """The identity, then channels-last -> channels-first (what onnx2tf's layout change does)."""
    ident = tuple(range(rank))
    if rank < 3:
        return [ident]
    return [ident, (0, rank - 1, *range(1, rank - 1))]


def _match(
    value: np.ndarray, candidates: dict[str, np.ndarray], order: list[str]
) -> tuple[str, tuple[int, ...]] | None:
    """The latest ONNX tensor (topological order) equal to ``value`` up to a layout permutation."""
    best = None
    for name in order:
        ref = candidates.get(name)
        if ref is None or ref.size != value.size or ref.size == 0:
            continue
        for perm in _perms(value.ndim):
            arr = np.transpose(value, perm) if perm != tuple(range(value.ndim)) else value
            if arr.shape != ref.shape:
                continue
            scale = 1.0 + float(np.max(np.abs(ref)))
            if float(np.max(np.abs(arr.astype(np.float64) - ref))) <= 1e-4 * scale:
                best = (name, perm)
                break
    return best


def _ancestors(model: Any) -> dict[str, set[str]]:
    """tensor -> the names of the nodes it depends on (its producer included)."""
    producer = {}
    for i, node in enumerate(model.graph.node):
        for out in node.output:
            producer[out] = (node.name or f"{node.op_type}@{i}", node)
    memo: dict[str, set[str]] = {}

    def of(tensor: str) -> set[str]:
        if tensor in memo:
            return memo[tensor]
        memo[tensor] = set()
        if tensor not in producer:
            return memo[tensor]
        name, node = producer[tensor]
        found = {name}
        for inp in node.input:
            if inp:
                found |= of(inp)
        memo[tensor] = found
        return found

    sys.setrecursionlimit(max(10000, 4 * len(model.graph.node)))
    return {t: of(t) for t in producer}


def _map_ops(req: dict[str, Any], float_model: bytes, probe: dict[str, np.ndarray], keys: dict[str, str]) -> dict:
    """Each TFLite op of the FP32 model -> the ONNX tensor it computes and the ONNX nodes between
    its inputs and its output; each ONNX output -> the TFLite output key and the permutation that
    gives it back in ONNX layout."""
    import tensorflow as tf

    onnx_model, values, order = _onnx_all(req, probe)
    interp = tf.lite.Interpreter(
        model_content=float_model,
        experimental_op_resolver_type=tf.lite.experimental.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        experimental_preserve_all_tensors=True,
    )
    interp.allocate_tensors()
    sig_in, sig_out = _signature(float_model)
    shapes = _shapes(float_model)
    for name, key in keys.items():
        interp.set_tensor(sig_in[key], _feed(probe[name], shapes[key]))
    interp.invoke()
    tensors = {d["index"]: d for d in interp.get_tensor_details()}
    ancestors = _ancestors(onnx_model)
    matched: dict[int, tuple[str, tuple[int, ...]]] = {}
    for name, key in keys.items():
        matched[sig_in[key]] = (name, tuple(range(probe[name].ndim)))
    ops = []
    # tensor -> the ONNX nodes already computed when it is: a matched tensor's ancestors; an unmatched
    # one's (glue, as the copies a rewritten Resize concatenates) those of the tensors it is made from
    computed: dict[int, set[str]] = {}
    for op in interp._get_ops_details():
        outs = [int(i) for i in op["outputs"] if i >= 0]
        found = None
        for i in outs:
            if tensors[i]["dtype"] == np.float32:
                found = _match(interp.get_tensor(i), values, order)
                if found:
                    matched[i] = found
        bound: set[str] = set()
        for i in op["inputs"]:
            if int(i) in matched:
                bound |= ancestors.get(matched[int(i)][0], set())
            else:
                bound |= computed.get(int(i), set())
        for i in outs:
            computed[i] = ancestors.get(matched[i][0], set()) if i in matched else bound
        nodes = sorted(ancestors.get(found[0], set()) - bound) if found else []
        ops.append(
            {
                "index": int(op["index"]),
                "op": op["op_name"],
                "tensor": tensors[outs[0]]["name"] if outs else None,
                "onnx_tensor": found[0] if found else None,
                "nodes": nodes,
                "inputs": [int(i) for i in op["inputs"] if i >= 0],
                "outputs": outs,
            }
        )
    outputs = []
    for i, name in enumerate(req["outputs"]):
        out_key = f"output_{i}" if f"output_{i}" in sig_out else None
        perm, checked = None, False
        if out_key is not None:
            got = interp.get_tensor(sig_out[out_key])
            ref = values.get(name)
            if ref is not None:
                # another rank (a scalar as [1]): compared reshaped; the runner reshapes, it has nothing to transpose
                reshaped = got.size == ref.size and got.ndim != ref.ndim
                hit = _match(got.reshape(ref.shape) if reshaped else got, {name: ref}, [name])
                perm, checked = (list(hit[1]) if hit and not reshaped else None), hit is not None
        outputs.append({"name": name, "key": out_key, "perm": perm, "checked": checked})
    return {"ops": ops, "outputs": outputs}


def _shapes(model: bytes) -> dict[str, tuple[int, ...]]:
    """Signature input key -> the shape the flatbuffer's input has (onnx2tf makes a scalar [1])."""
    import tensorflow as tf

    interp = tf.lite.Interpreter(model_content=model)
    sig_in, _ = _signature(model)
    shape = {d["index"]: tuple(int(x) for x in d["shape"]) for d in interp.get_input_details()}
    return {key: shape[index] for key, index in sig_in.items()}


def _same_but_ones(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """The shapes hold the same data in the same order, up to axes of size 1 (a scalar as [1])."""
    return [d for d in a if d != 1] == [d for d in b if d != 1]


def _feed(value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    value = np.asarray(value)
    return value.reshape(shape) if value.shape != shape and _same_but_ones(value.shape, shape) else value


def _check_layouts(keys: dict[str, str], shapes: dict[str, tuple[int, ...]], probe: dict[str, np.ndarray]) -> None:
    """Every input of the flatbuffer takes the ONNX input as it is (onnx2tf was told to keep it)."""
    for name, key in keys.items():
        want = tuple(np.asarray(probe[name]).shape)
        if not _same_but_ones(want, shapes[key]):
            raise ConversionError(
                "io",
                f"the TFLite model takes input {name!r} as {list(shapes[key])}, not in the ONNX model's "
                f"layout {list(want)}",
            )


def _samples(path: str, keys: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> list[dict[str, np.ndarray]]:
    """The calibration batches (stacked on a new first axis) as the flatbuffer's inputs take them."""
    data = np.load(path, allow_pickle=False)
    n = min(len(data[name]) for name in keys)
    return [{keys[name]: _feed(data[name][i], shapes[keys[name]]) for name in keys} for i in range(n)]


def _denylist(ops: list[dict[str, Any]], keep: set[str]) -> list[str]:
    """The output tensors of the ops to keep in float: those computing a kept ONNX node, and the ops
    with no ONNX value of their own that a kept op reads (onnx2tf's glue, as the PAD it splits out of
    a padded strided Conv): quantized, their INT8 output is what the kept node reads."""
    kept = {op["index"] for op in ops if keep & set(op["nodes"]) and op["tensor"]}
    by_index = {op["index"]: op for op in ops}
    producer = {t: op for op in ops for t in op["outputs"]}
    todo = list(kept)
    while todo:
        for t in by_index[todo.pop()]["inputs"]:
            glue = producer.get(t)
            if glue and glue["index"] not in kept and glue["onnx_tensor"] is None and glue["tensor"]:
                kept.add(glue["index"])
                todo.append(glue["index"])
    return [op["tensor"] for op in ops if op["index"] in kept]


def convert(req: dict[str, Any]) -> dict[str, Any]:
    import onnx
    import tensorflow as tf
    from tensorflow.lite.python import convert as tfl_convert

    work = Path(req["work"])
    saved_model = work / "saved_model"
    inputs, renamed, rewrites = _onnx2tf(req, saved_model)
    original = onnx.load(req["onnx"], load_external_data=False)

    def locate(scope: str) -> str | None:
        return _find_node(scope, original, renamed)

    def converter() -> Any:
        return tf.lite.TFLiteConverter.from_saved_model(str(saved_model))

    step("tflite fp32")
    float_model = _tflite(converter().convert, "FP32", locate)
    rewrite = bool(req.get("xnnpack_rewrites", True))
    rewritten: dict[str, list[str]] = {}
    if rewrite:
        step("xnnpack rewrites")
        float_model, rewritten = flatbuffer_rewrites(float_model)
    (work / "float32.tflite").write_bytes(float_model)
    sig_in, sig_out = _signature(float_model)
    probe = {k: v for k, v in np.load(req["probe"], allow_pickle=False).items()}
    keys = _input_keys(req["inputs"], sig_in, inputs)
    _check_layouts(keys, _shapes(float_model), probe)
    step("map ops to onnx nodes")
    mapping = _map_ops(req, float_model, probe, keys)
    for name, _, before, after in FLATBUFFER_REWRITES:
        tensors = rewritten.get(name)
        if tensors:
            nodes = sorted({n for op in mapping["ops"] if op["tensor"] in tensors for n in op["nodes"]})
            rewrites.append(
                {"rewrite": name, "from": before, "to": after, "nodes": nodes or tensors, "ops": len(tensors)}
            )
    precision = req["precision"]
    denylisted: list[str] = []
    unmatched: list[str] = []
    if precision == "fp32":
        model = float_model
    elif precision == "fp16":
        conv = converter()
        conv.optimizations = [tf.lite.Optimize.DEFAULT]
        conv.target_spec.supported_types = [tf.float16]
        model = _tflite(conv.convert, "FP16", locate)
        model = flatbuffer_rewrites(model)[0] if rewrite else model
    else:
        keep = set(req.get("keep_nodes", []))
        # the tensors the flatbuffer rewrites added are not in the model quantized (it is rewritten after)
        denylisted = [t for t in _denylist(mapping["ops"], keep) if "/xnnpack_" not in t]
        covered = {n for op in mapping["ops"] for n in op["nodes"]}
        unmatched = sorted(keep - covered)
        samples = _samples(req["calibration"], keys, _shapes(float_model))
        conv = converter()
        conv.optimizations = [tf.lite.Optimize.DEFAULT]
        conv.representative_dataset = lambda: iter(samples)
        conv._experimental_calibrate_only = True
        step(f"calibrate on {len(samples)} batches")
        calibrated = _tflite(conv.convert, "calibrated", locate)
        int8_io = bool(req.get("int8_io"))
        step("quantize int8")
        try:
            model = tfl_convert.mlir_quantize(
                calibrated,
                disable_per_channel=not req.get("per_channel", True),
                fully_quantize=int8_io,
                input_data_type=tf.int8 if int8_io else tf.float32,
                output_data_type=tf.int8 if int8_io else tf.float32,
                denylisted_nodes=denylisted or None,
            )
        except Exception as exc:
            raise ConversionError("quantize", f"INT8 quantization failed: {_first_line(str(exc))}") from exc
        if rewrite:
            model = flatbuffer_rewrites(model)[0]
    Path(req["out"]).write_bytes(model)
    return {
        "ok": True,
        "inputs": keys,
        "outputs": mapping["outputs"],
        "ops": mapping["ops"],
        "denylisted": denylisted,
        "keep_not_found": unmatched,
        "rewrites": rewrites,
        "versions": _versions(),
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {pkg: version(pkg) for pkg in ("onnx2tf", "tensorflow", "onnx", "onnxruntime")}


def main(argv: list[str]) -> int:
    try:
        req = json.loads(Path(argv[1]).read_text())
    except (IndexError, OSError, ValueError) as exc:
        print(f"convert.py: cannot read the request: {exc}", file=sys.stderr)
        return 1
    try:
        result = convert(req)
    except ConversionError as exc:
        result = {"ok": False, "error": exc.record}
    except Exception as exc:  # a converter bug: its traceback goes to the build log
        traceback.print_exc()
        result = {
            "ok": False,
            "error": {"stage": "internal", "message": f"{type(exc).__name__}: {_first_line(str(exc))}"},
        }
    Path(req["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
