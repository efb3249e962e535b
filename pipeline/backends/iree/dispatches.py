"""The dispatch report: the fusion groups iree-compile produced, their op, precision and the ONNX
nodes fused into each, read from the executable sources it dumps."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.results.reports import LayerInfo

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

logger = logging.getLogger(__name__)


_EXPORT = re.compile(r'hal\.executable\.export public @("(?:[^"\\]|\\.)*"|[\w$.\-]+)')
_VARIANT = re.compile(r'hal\.executable\.variant public @\S+ target\(<"([^"]+)", "([^"]+)"')
_LOC_ALIAS = re.compile(r"^(#loc\w*) = loc\((.*)\)\s*$")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_OP = re.compile(r'^(?:%[^=]+= )?"?([a-z_][\w]*\.[\w.]+)')
_SHAPE = re.compile(r"^(\d+|D)(x(\d+|D))*(x\w+)?$")
_ELEMENT = re.compile(r"^(bf16|f16|f32|f64|f8\w*|i1|i4|i8|i16|i32|i64)$")
# ops that bind, load, store, allocate or initialise: their locations name a neighbour, not a
# fused node (CSE merges identical empties and fills graph-wide, keeping the first node's location)
_PLUMBING = (
    "hal.",
    "iree_tensor_ext.",
    "arith.constant",
    "tensor.empty",
    "linalg.fill",
    "func.return",
    "linalg.yield",
    "scf.yield",
)
# conversions and layout ops: a dispatch made only of these moves data and has no compute precision
_MOVES = {
    "arith.extf",
    "arith.truncf",
    "arith.extsi",
    "arith.extui",
    "arith.trunci",
    "arith.index_cast",
    "arith.bitcast",
    "linalg.generic",
    "linalg.fill",
    "linalg.copy",
    "linalg.transpose",
    "linalg.broadcast",
}
_PRECISIONS = {"f16": "fp16", "bf16": "bf16", "f32": "fp32", "f64": "fp64"}
_NARROW_FIRST = ("f8", "bf16", "f16", "f32", "f64")
_CONTRACTIONS = ("conv", "matmul", "batch_matmul", "contract", "mmt4d", "depthwise")


def parse_dispatches(sources: Path, node_names: list[str], device: str) -> list[LayerInfo]:
    """One LayerInfo per dispatch in the executable sources iree-compile dumped; ``node_names``
    are the imported graph's nodes in graph order (the order of each ``fused_from``)."""
    order = {n: i for i, n in enumerate(node_names)}
    files = sorted(
        sources.glob("*.mlir"), key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]
    )
    layers = []
    for path in files:
        text = path.read_text()
        aliases = {m.group(1): m.group(2) for m in map(_LOC_ALIAS.match, text.splitlines()) if m}
        for export in _EXPORT.finditer(text):
            name = export.group(1).strip('"')
            body = _function_body(text, name)
            ops, fused, own = _body_ops_and_locs(body, aliases, order)
            layers.append(
                LayerInfo(
                    name=name,
                    op_type=dispatch_op_type(name),
                    precision=dispatch_precision(name, ops, body),
                    device=device,
                    kernel=name,
                    fused_from=sorted(fused, key=order.__getitem__) or own,
                )
            )
    return layers


def _function_body(text: str, name: str) -> list[str]:
    start = text.find(f"func.func @{name}(")
    if start < 0:
        start = text.find(f'func.func @"{name}"(')
    return text[start:].splitlines()[1:] if start >= 0 else []


def loc_names(line: str, aliases: dict[str, str] | None = None) -> list[str]:
    """Names in the location at the end of an MLIR line (aliases resolved)."""
    at = line.rfind(" loc(")
    if at < 0:
        at = line.find("loc(")
        if at < 0:
            return []
    loc = line[at:]
    for _ in range(8):  # aliases may refer to aliases
        refs = re.findall(r"#loc\w*", loc)
        if not refs or not aliases:
            break
        for ref in refs:
            loc = loc.replace(ref, aliases.get(ref, ""), 1)
    return _QUOTED.findall(loc)


def _body_ops_and_locs(
    body: list[str], aliases: dict[str, str], node_names: dict[str, int]
) -> tuple[list[str], list[str], list[str]]:
    """The compute ops of a dispatch, the ONNX nodes their locations name (in order) and the
    nodes the function itself is located at (the fallback for a pure copy)."""
    ops: list[str] = []
    fused: list[str] = []
    own: list[str] = []
    for raw in body:
        line = raw.strip()
        if line.startswith("^") or not line:
            continue
        if line.startswith("}"):
            target = fused if line.startswith("} ->") else own  # "} ->" closes a linalg op
            for n in loc_names(line, aliases):
                if n in node_names and n not in target:
                    target.append(n)
            continue
        match = _OP.match(line)
        if match is None or match.group(1).startswith(_PLUMBING) or match.group(1) == "return":
            continue
        ops.append(match.group(1))
        for n in loc_names(line, aliases):
            if n in node_names and n not in fused:
                fused.append(n)
    return ops, fused, own[-1:] if own else []


def _name_tokens(name: str) -> list[str]:
    tail = re.split(r"dispatch_\d+_?", name, maxsplit=1)
    return [t for t in (tail[1] if len(tail) > 1 else name).split("_") if t]


def dispatch_op_type(name: str) -> str:
    """The root op in a dispatch name: conv_8x8x8x3x3x3_f32 -> conv, matmul_like_... -> matmul_like."""
    words = []
    for token in _name_tokens(name):
        if _SHAPE.match(token) or _ELEMENT.match(token) or all(_ELEMENT.match(t) for t in token.split("x")):
            break
        words.append(token)
    return "_".join(words) or "dispatch"


def _element_types(tokens: list[str]) -> list[str]:
    types = []
    for token in tokens:
        types += [t for t in token.split("x") if _ELEMENT.match(t)]
    return types


def dispatch_precision(name: str, ops: list[str], body: list[str]) -> str:
    """The precision a dispatch computes in, from the element types in its name (IREE names a
    dispatch ``<root op>_<shape>_<operand types>``): a contraction (conv, matmul) by its narrowest
    float input (the accumulator is wider by design), any other root op by its result type (a
    reduction accumulates in it). Conversions and copies are "n/a"."""
    if not any(op not in _MOVES for op in ops):
        return "n/a"
    types = _element_types(_name_tokens(name))
    if not types:  # the name carries no types: take those the dispatch writes
        types = re.findall(r"writeonly:tensor<(?:[\dx?]*x)?(\w+)>", "\n".join(body))
    floats = [t for t in types if t.startswith(("f", "bf"))]
    if dispatch_op_type(name).startswith(_CONTRACTIONS) and len(floats) > 1:
        floats = floats[:-1]
        chosen = min(floats, key=lambda t: next(i for i, p in enumerate(_NARROW_FIRST) if t.startswith(p)))
    elif types and types[-1] in floats:
        chosen = types[-1]
    else:
        return "int8" if "i8" in types else "n/a"  # integer index arithmetic is not judged
    return "fp8" if chosen.startswith("f8") else _PRECISIONS.get(chosen, chosen)


def dispatch_sites(statistics: Path) -> int | None:
    """How many dispatches the program issues: more than its executables when one executable
    serves several identical call sites (reported once, under the site the compiler kept)."""
    import json

    try:
        return int(json.loads(statistics.read_text())["stream-aggregate"]["execution"]["dispatch-count"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resolved_target(sources: Path) -> dict[str, Any]:
    """What the compiler resolved the target to (e.g. target_cpu x86-64-v3 -> its features)."""
    for path in sorted(sources.glob("*.mlir")):
        text = path.read_text()
        variant = _VARIANT.search(text)
        if variant is None:
            continue
        out: dict[str, Any] = {"backend": variant.group(1), "format": variant.group(2)}
        for key, pattern in (
            ("cpu", r'\bcpu = "([^"]*)"'),
            ("cpu_features", r'\bcpu_features = "([^"]*)"'),
            ("triple", r'\btarget_triple = "([^"]*)"'),
            ("gpu_arch", r'iree_gpu\.target<arch = "([^"]*)"'),
            ("gpu_features", r'iree_gpu\.target<arch = "[^"]*", features = "([^"]*)"'),
        ):
            found = re.search(pattern, text)
            if found:
                out[key] = found.group(1)
        if "cpu_features" in out:
            # LLVM lists some features twice; keep the enabled ones, sorted, as the record
            out["cpu_features"] = sorted({f for f in out["cpu_features"].split(",") if f.startswith("+")})
        return out
    return {}
