"""The engine inspector's JSON (per-layer precision, fusion, device) and the parser's and builder's errors, mapped."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.backends.tensorrt.common import NAME
from pipeline.core.errors import EnvironmentProblem, InputError, SkuforgeError, UnsupportedOp
from pipeline.results.reports import LayerInfo

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

# Datatype words in "Format/Datatype" ("Row major linear FP32", "Channel major FP16 format where
# channel % 8 == 0", "Half", "Int8", ...) and the precisions they mean.
_DATATYPES = {
    "FP32": "fp32",
    "FLOAT": "fp32",
    "FP16": "fp16",
    "HALF": "fp16",
    "BF16": "bf16",
    "BFLOAT16": "bf16",
    "FP8": "fp8",
    "E4M3": "fp8",
    "INT8": "int8",
    "INT4": "int4",
    "FP4": "fp4",
    "DOUBLE": "fp64",
    "INT32": "int32",
    "INT64": "int64",
    "INT16": "int16",
    "UINT8": "uint8",
    "BOOL": "bool",
}
_FLOATS = ("fp32", "fp16", "bf16")
_QUANTIZED = ("fp8", "int4", "fp4", "int8")
# Layers that move or reshape data; a layer's precision is judged on the others ("n/a").
DATA_MOVEMENT = frozenset(
    {
        "Reformat",
        "NoOp",
        "Shuffle",
        "Constant",
        "Slice",
        "Concatenation",
        "Identity",
        "Copy",
        "Gather",
        "Cast",
        "Shape",
        "Squeeze",
        "Unsqueeze",
    }
)
# Separators TensorRT 8.6+ puts between entries of a layer's Metadata (and in some names).
_SEPARATORS = re.compile("[\x1e\x1f]")
_ONNX_LAYER = re.compile(r"\[ONNX Layer: ([^|\]]+?)\s*(?:\|[^\]]*)?\]")
_PROFILE_SUFFIX = re.compile(r" \[profile \d+\]$")
# Transfers in and out of a DLA subgraph ("images to nvm", "head_3 from nvm", "x copy finish").
_DLA_TRANSFER = re.compile(r" (to nvm|from nvm|copy finish)$")


@dataclass
class EngineLayers:
    layers: list[LayerInfo]
    partition_boundaries: int
    bindings: list[str]

    @property
    def fused(self) -> list[LayerInfo]:
        return [layer for layer in self.layers if len(layer.fused_from) > 1]


def format_precision(description: str) -> str | None:
    """The datatype named in a tensor's "Format/Datatype" description, as a precision."""
    for word in re.split(r"[\s,()/]+", description.upper()):
        if word in _DATATYPES:
            return _DATATYPES[word]
    return None


def layer_precision(layer: dict[str, Any]) -> str | None:
    """What a layer computes in: "n/a" for data movement; a quantized type when any of its tensors
    carries one (explicit quantization fuses Q/DQ into the kernels); else its first float input's
    type, the compute type of TensorRT's kernels; "n/a" for layers with integer tensors only."""
    if layer.get("LayerType") in DATA_MOVEMENT or layer.get("ParameterType") in DATA_MOVEMENT:
        return "n/a"
    kinds = [
        format_precision(t.get("Format/Datatype", "")) for t in [*layer.get("Inputs", []), *layer.get("Outputs", [])]
    ]
    for quantized in _QUANTIZED:
        if quantized in kinds:
            return quantized
    floats = [k for k in kinds if k in _FLOATS]
    if floats:
        return floats[0]
    return "n/a" if any(kinds) else None


def onnx_nodes_of(layer: dict[str, Any], known: set[str]) -> list[str]:
    """The ONNX nodes a layer implements: from its Metadata ("[ONNX Layer: conv]\\x1e[ONNX Layer:
    relu]"), else from its name when it joins known ONNX node names with " + "."""
    names = [m.strip() for m in _ONNX_LAYER.findall(layer.get("Metadata") or "")]
    if not names and layer.get("LayerType") not in DATA_MOVEMENT:
        names = [p.strip() for p in re.split(r" \+ |[\x1e\x1f]", str(layer.get("Name", ""))) if p.strip() in known]
    return list(dict.fromkeys(names))


def parse_engine_information(
    text: str, onnx_nodes: Set[str] = frozenset(), dla_core: int | None = None
) -> EngineLayers:
    """Per-layer facts from ``IEngineInspector.get_engine_information(LayerInformationFormat.JSON)``
    of an engine built with DETAILED profiling verbosity: {"Layers": [...], "Bindings": [...]}.
    Layers of optimization profiles other than the first ("... [profile N]") and multi-stream
    signal/wait layers are skipped."""
    try:
        doc = json.loads(text, strict=False)  # names may hold raw control characters
    except ValueError as exc:
        raise InputError(f"the engine inspector's output is not JSON: {exc}", hint="rebuild the engine") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("Layers"), list):
        raise InputError("the engine inspector's output has no 'Layers' list", hint="rebuild the engine")
    layers: list[LayerInfo] = []
    device_of: dict[Any, str] = {}  # tensor name -> the device that writes it
    boundaries = 0
    for raw in doc["Layers"]:
        if isinstance(raw, str):  # built without DETAILED verbosity: names only
            raw = {"Name": raw}
        name = _SEPARATORS.sub(" + ", str(raw.get("Name", "")))
        if _PROFILE_SUFFIX.search(name) or raw.get("LayerType") in ("signal", "wait"):
            continue
        op_type = str(raw.get("LayerType") or raw.get("ParameterType") or "unknown")
        on_dla = dla_core is not None and ("DLA" in op_type.upper() or bool(_DLA_TRANSFER.search(name)))
        device = f"dla:{dla_core}" if on_dla else "gpu"
        tactic = raw.get("TacticName") or raw.get("TacticValue")
        for tensor in raw.get("Inputs", []):
            producer = device_of.get(tensor.get("Name"))
            boundaries += producer is not None and producer != device
        device_of.update({t.get("Name"): device for t in raw.get("Outputs", [])})
        layers.append(
            LayerInfo(
                name=name,
                op_type=op_type,
                device=device,
                kernel=str(tactic) if tactic else None,
                precision="n/a" if on_dla and _DLA_TRANSFER.search(name) else layer_precision(raw),
                fused_from=onnx_nodes_of(raw, set(onnx_nodes)),
            )
        )
    bindings = [b for b in doc.get("Bindings", []) if isinstance(b, str) and not _PROFILE_SUFFIX.search(b)]
    return EngineLayers(layers=layers, partition_boundaries=boundaries, bindings=bindings)


# --- errors from the parser and the builder ------------------------------------------------------


@dataclass(frozen=True)
class ParserError:
    """One ``trt.OnnxParser`` error, as plain data."""

    code: str  # ErrorCode name, e.g. UNSUPPORTED_NODE
    desc: str
    node_name: str | None = None
    node_operator: str | None = None


def parser_failure(errors: list[ParserError]) -> SkuforgeError:
    """The user-facing error for a failed parse: an unsupported op names the op and node."""
    if not errors:
        return InputError(
            "TensorRT's ONNX parser failed without saying why",
            hint="run polygraphy inspect model on the prepared model",
        )
    unsupported = [e for e in errors if e.code.startswith("UNSUPPORTED")]
    if unsupported:
        first = unsupported[0]
        more = f" (and {len(errors) - 1} more parser errors)" if len(errors) > 1 else ""
        return UnsupportedOp(NAME, first.node_operator or None, first.node_name or None, first.desc + more)
    details = "; ".join(f"{e.code}: {e.desc}" + (f" (node {e.node_name!r})" if e.node_name else "") for e in errors)
    return InputError(
        f"TensorRT's ONNX parser refused the model: {details}",
        hint="check the model's opset and types against TensorRT's ONNX operator support",
    )


_NO_IMPLEMENTATION = re.compile(r"[Cc]ould not find any implementation for node (.+?)\.?\)?$")


def builder_failure(messages: list[str], onnx_ops: dict[str, str]) -> SkuforgeError:
    """The user-facing error when ``build_serialized_network`` returned nothing, from the logged errors."""
    for message in messages:
        found = _NO_IMPLEMENTATION.search(message.strip())
        if found:
            node = found.group(1).strip()
            parts = [p for p in re.split(r" \+ |[\x1e\x1f]", node) if p in onnx_ops]
            op = onnx_ops[parts[0]] if parts else None
            return UnsupportedOp(
                NAME,
                op,
                parts[0] if parts else node,
                message.strip(),
                hint="no TensorRT kernel fits this layer with the SKU's precision, shapes and workspace: "
                "raise options.workspace_mb, change the precision, or replace the op",
            )
    text = "; ".join(m.strip() for m in messages[-5:]) or "no error was logged"
    return EnvironmentProblem(
        f"TensorRT could not build the engine: {text}",
        hint="see the errors above; out-of-memory errors need a larger options.workspace_mb or a smaller profile max",
    )


def parser_error(err: Any) -> ParserError:
    def text(method: str) -> str | None:
        fn = getattr(err, method, None)
        value = fn() if callable(fn) else None
        return str(value) if value not in (None, "") else None

    code = str(err.code()).rsplit(".", 1)[-1]
    return ParserError(code=code, desc=err.desc(), node_name=text("node_name"), node_operator=text("node_operator"))
