"""TensorRT: an engine plan built on an NVIDIA GPU (x86-64 or Jetson) from the prepared ONNX model.

Build: ONNX parser -> network (weakly typed with precision flags, or strongly typed), one
optimization profile from the SKU's pins and profiles, the SKU's timing cache read and written
back, then the engine inspector's DETAILED JSON for per-layer precision, kernel, fusion and
device. INT8 is explicit quantization: the shared QDQ graph from the calibrate stage's table,
adjusted to what TensorRT takes (zero-point-0 int8, float biases). Run: the engine plan, device
buffers and a stream through cuda-python's runtime API, ``execute_async_v3``.

Everything that needs no GPU (options and their checks, profiles, the QDQ adjustment, inspector
parsing, error mapping, cache files, version rules) is a plain function here so it is tested on
any host; TensorRT and cuda-python are imported inside functions only.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import re
import threading
from collections.abc import Set
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.backends.base import Backend, onnx_version
from pipeline.backends.contract import BuildContext, BuildOutcome, Capabilities, EngineMeta, Runner, Staged
from pipeline.backends.quantize import QdqSettings, quantize_qdq, to_fp16
from pipeline.core.errors import ConfigError, EnvironmentProblem, InputError, SkuforgeError, UnsupportedOp
from pipeline.core.io import atomic_write_bytes
from pipeline.core.versions import UnreadableVersion, normalize
from pipeline.host.probe import NO_GPU, GpuInfo, cuda_runtime_api, gpu_info, jetson_gpu, parse_nvidia_smi  # noqa: F401 (re-exported)
from pipeline.model.graph import signature
from pipeline.results.reports import LayerInfo, Signature, TensorSig

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from pipeline.backends.caches import CacheSession
    from pipeline.project.config import SkuSpec

log = logging.getLogger(__name__)

NAME = "tensorrt"
ENGINE_FILE = "engine.plan"
LAYERS_FILE = "layers.json"  # the engine inspector's JSON, kept for review (trex reads it too)
TIMING_CACHE = "timing.cache"
NOT_INSTALLED = "tensorrt is not installed (pip install tensorrt on a host with an NVIDIA GPU and driver)"
INSTALL_HINT = (
    "pip install tensorrt cuda-python on a host with an NVIDIA GPU and driver; "
    "on Jetson use the TensorRT that JetPack installs (python3-libnvinfer)"
)

HardwareCompatibility = Literal["none", "ampere_plus", "same_compute_capability"]
TacticSource = Literal["cublas", "cublas_lt", "cudnn", "edge_mask_convolutions", "jit_convolutions"]

FP8_MIN_CC = 8.9  # Ada and Hopper: the first GPUs with FP8 tensor cores
AMPERE_CC = 8.0


class TensorRtOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    workspace_mb: int | None = Field(None, ge=1, description="builder scratch memory limit (default: TensorRT's)")
    builder_optimization_level: int = Field(3, ge=0, le=5, description="0 builds fastest, 5 searches longest")
    hardware_compatibility: HardwareCompatibility = Field(
        "none",
        description="none: this GPU model only; ampere_plus: any GPU of compute capability 8.0+; "
        "same_compute_capability: GPUs of the build GPU's compute capability",
    )
    version_compatible: bool = Field(
        False, description="later TensorRT 10.x runtimes may load the engine (lean runtime inside)"
    )
    strongly_typed: bool = Field(
        False, description="layer types follow the ONNX types (fp16 SKUs convert the model first); no precision flags"
    )
    tf32: bool = Field(False, description="allow TF32 kernels in fp32 layers (off: fp32 means fp32)")
    fp8: bool = Field(
        False, description="allow FP8 kernels for FP8 Q/DQ nodes already in the model (compute capability 8.9+)"
    )
    timing_cache: bool = Field(True, description="read and update caches/<sku>/timing.cache")
    dla_core: int | None = Field(None, ge=0, description="run on this DLA core (Jetson Xavier/Orin)")
    allow_gpu_fallback: bool = Field(False, description="with dla_core: layers DLA cannot run go to the GPU")
    tactic_sources: list[TacticSource] | None = Field(
        None, description="restrict kernel libraries (default: TensorRT's)"
    )
    min_compute_capability: float | None = Field(
        None,
        ge=5.0,
        le=20.0,
        description="oldest GPU of the SKU's fleet, e.g. 8.7 for Jetson Orin; checked on the host",
    )


# --- config-time checks (no SDK) -----------------------------------------------------------------


def check_sku(sku: SkuSpec, opts: TensorRtOptions) -> list[str]:
    """What is wrong with a TensorRT SKU, each line starting with its key path under the SKU."""
    problems = []
    if sku.target.device != "gpu":
        problems.append(
            f"target.device: tensorrt builds for NVIDIA GPUs (a Jetson's DLA through options.dla_core), "
            f"got {sku.target.device!r}; set device: gpu"
        )
    if sku.target.os not in ("linux", "windows"):
        problems.append(f"target.os: TensorRT runs on linux and windows, not {sku.target.os}")
    jetson = sku.target.arch == "aarch64"
    min_cc = opts.min_compute_capability
    if opts.fp8:
        if opts.strongly_typed:
            problems.append("options.fp8: a strongly typed network takes FP8 from the model's Q/DQ types; drop fp8")
        if min_cc is None or min_cc < FP8_MIN_CC:
            problems.append(
                f"options.fp8: FP8 kernels need compute capability {FP8_MIN_CC}+ (Ada, Hopper); set "
                f"options.min_compute_capability to {FP8_MIN_CC} or higher to say the SKU's GPUs have them"
                + (f" (it says {min_cc})" if min_cc is not None else "")
            )
        if opts.dla_core is not None:
            problems.append("options.fp8: DLA runs fp16 and int8 only")
    if opts.hardware_compatibility != "none":
        if jetson:
            problems.append("options.hardware_compatibility: not supported on JetPack (aarch64 Jetson); use none")
        if opts.hardware_compatibility == "ampere_plus" and min_cc is not None and min_cc < AMPERE_CC:
            problems.append(
                f"options.hardware_compatibility: ampere_plus engines need compute capability {AMPERE_CC}+, "
                f"options.min_compute_capability says {min_cc}"
            )
    if opts.dla_core is not None:
        if not jetson:
            problems.append("options.dla_core: DLA cores exist only on Jetson Xavier/Orin (target.arch aarch64)")
        if sku.precision == "fp32":
            problems.append("precision: DLA runs fp16 and int8 only; use fp16 or int8 with options.dla_core")
    elif opts.allow_gpu_fallback:
        problems.append("options.allow_gpu_fallback: only applies with options.dla_core")
    return problems


def requested_devices(opts: TensorRtOptions) -> list[str]:
    """Device names as ``LayerInfo.device`` reports them: ``gpu``, or ``dla:<core>`` first."""
    if opts.dla_core is None:
        return ["gpu"]
    return [f"dla:{opts.dla_core}", "gpu"] if opts.allow_gpu_fallback else [f"dla:{opts.dla_core}"]


# --- shapes --------------------------------------------------------------------------------------

Shape = tuple[int, ...]


def optimization_profile(
    inputs: list[TensorSig], pins: dict[str, int], profiles: dict[str, Any]
) -> dict[str, tuple[Shape, Shape, Shape]]:
    """min, opt and max shape of every input: fixed dims and pinned axes are the same in all three,
    a profile axis spans its {min, opt, max}. A dynamic dim with neither is a config error."""
    table, problems = {}, []
    for sig in inputs:
        lo: list[int] = []
        mid: list[int] = []
        hi: list[int] = []
        for i, dim in enumerate(sig.shape):
            if isinstance(dim, int) and dim > 0:
                dims = (dim, dim, dim)
            elif isinstance(dim, str) and dim in pins:
                dims = (pins[dim],) * 3
            elif isinstance(dim, str) and dim in profiles:
                p = profiles[dim]
                dims = (p.min, p.opt, p.max)
            else:
                problems.append(
                    f"input {sig.name!r} dim {i} ({dim or 'unnamed'}) is dynamic and has neither a pin nor a profile"
                )
                continue
            for acc, value in zip((lo, mid, hi), dims, strict=True):
                acc.append(value)
        table[sig.name] = (tuple(lo), tuple(mid), tuple(hi))
    if problems:
        raise ConfigError(
            "; ".join(problems),
            hint="give the axis a value under the SKU's `shapes` (or the model's `pins`), "
            "or a range under the SKU's `profiles: {axis: {min, opt, max}}`",
        )
    return table


# --- INT8: what TensorRT's explicit quantization takes -------------------------------------------


def nonzero_zero_points(model: onnx.ModelProto) -> list[str]:
    """Q/DQ nodes whose zero point is not all zeros (TensorRT refuses them)."""
    import numpy as np
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    return [
        n.name
        for n in model.graph.node
        if n.op_type in ("QuantizeLinear", "DequantizeLinear")
        and len(n.input) > 2
        and n.input[2]
        and (n.input[2] not in inits or np.any(numpy_helper.to_array(inits[n.input[2]])))
    ]


def quantize_for_tensorrt(source: Path, out: Path, ctx: BuildContext) -> dict[str, Any]:
    """The shared INT8 QDQ graph as TensorRT's explicit quantization takes it: symmetric int8
    activations and weights (zero point 0), biases left in float (TensorRT quantizes them)."""
    import onnx

    calibration = quantize_qdq(
        source,
        out,
        ctx,
        QdqSettings(
            per_channel=True,
            reduce_range=False,
            activation_type="int8",
            weight_type="int8",
            symmetric_activations=True,
            quantize_bias=False,
        ),
    )
    left = nonzero_zero_points(onnx.load(str(out)))
    if left:
        raise InputError(
            f"Q/DQ nodes {left} have nonzero zero points, which TensorRT refuses",
            hint="quantize the model with symmetric int8 activations",
        )
    return {**calibration, "quantization": "explicit (Q/DQ), symmetric int8"}


# --- the engine inspector's JSON -----------------------------------------------------------------

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


# --- versions, GPU and timing cache ------------------------------------------------------------


def cuda_version_string(version: int) -> str:
    """CUDA's integer version (12040) as "12.4"."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def _cudart() -> Any:
    """cuda-python's runtime API, or an EnvironmentProblem saying how to get it."""
    runtime = cuda_runtime_api()
    if runtime is None:
        raise EnvironmentProblem(
            "cuda-python is not installed (the TensorRT runner's device buffers use it)",
            hint="pip install cuda-python, the CUDA major version of your TensorRT",
        )
    return runtime


def _cuda(result: tuple, what: str) -> Any:
    err, rest = result[0], result[1:]
    if getattr(err, "value", err) != 0:  # cudaSuccess
        raise EnvironmentProblem(
            f"CUDA {what} failed: {getattr(err, 'name', err)}",
            hint="check the GPU with nvidia-smi; another process may hold its memory",
        )
    return rest[0] if len(rest) == 1 else rest


def cuda_runtime_version() -> str | None:
    try:
        return cuda_version_string(_cuda(_cudart().cudaRuntimeGetVersion(), "cudaRuntimeGetVersion"))
    except EnvironmentProblem:
        pass
    from importlib import metadata

    for dist in ("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu11"):
        try:
            return ".".join(metadata.version(dist).split(".")[:2])
        except metadata.PackageNotFoundError:
            continue
    return None


def version_compatible_runtime(built: str, have: str) -> bool:
    """Whether a version-compatible engine built with TensorRT ``built`` loads in ``have``: same
    major version, same or newer runtime."""
    try:
        b, h = normalize(built), normalize(have)
    except UnreadableVersion:
        return False
    return b.major == h.major and h >= b


# --- the SDK -------------------------------------------------------------------------------------


def _trt() -> Any:
    try:
        import tensorrt
    except (ImportError, OSError) as exc:  # OSError: the wheel is there but libnvinfer or the driver is not
        raise EnvironmentProblem(NOT_INSTALLED, hint=INSTALL_HINT) from exc
    return tensorrt


@functools.cache
def _logger(trt: Any) -> Any:
    """The process's TensorRT logger (one for every builder and runtime, valid while they live):
    forwards warnings and errors to logging and keeps the recent errors for messages."""

    class Recorder(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self._errors: collections.deque[tuple[int, str]] = collections.deque(maxlen=200)
            self._count = 0
            self._lock = threading.Lock()  # TensorRT may log from several threads

        def log(self, severity: Any, msg: str) -> None:
            S = trt.ILogger.Severity
            if severity in (S.ERROR, S.INTERNAL_ERROR):
                with self._lock:
                    self._errors.append((self._count, msg))
                    self._count += 1
                log.error("tensorrt: %s", msg)
            elif severity == S.WARNING:
                log.warning("tensorrt: %s", msg)

        def mark(self) -> int:
            with self._lock:
                return self._count

        def errors_since(self, mark: int) -> list[str]:
            with self._lock:
                return [msg for n, msg in self._errors if n >= mark]

    return Recorder()


def _flag(trt: Any, name: str) -> Any:
    try:
        return getattr(trt.BuilderFlag, name)
    except AttributeError:
        raise EnvironmentProblem(
            f"TensorRT {trt.__version__} has no builder flag {name}",
            hint="install TensorRT 10.x (the SKU's toolchain pin)",
        ) from None


def configure(trt: Any, config: Any, opts: TensorRtOptions, precision: str) -> dict[str, Any]:
    """Set the builder config from the SKU; returns what was set (recorded in engine.json)."""
    applied: dict[str, Any] = {"builder_optimization_level": opts.builder_optimization_level, "flags": []}
    config.builder_optimization_level = opts.builder_optimization_level
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # the inspector's per-layer JSON needs it
    if opts.workspace_mb is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, opts.workspace_mb << 20)
        applied["workspace_mb"] = opts.workspace_mb

    def flag(name: str) -> None:
        config.set_flag(_flag(trt, name))
        applied["flags"].append(name)

    if not opts.tf32:
        config.clear_flag(_flag(trt, "TF32"))  # on by default: fp32 layers would run TF32 on Ampere+
    if not opts.strongly_typed:  # a strongly typed network refuses precision flags
        if precision == "fp16":
            flag("FP16")
        elif precision == "int8" and hasattr(trt.BuilderFlag, "INT8"):
            flag("INT8")  # explicit quantization: scales come from the Q/DQ nodes, no calibrator
        if opts.fp8:
            flag("FP8")
    if opts.version_compatible:
        flag("VERSION_COMPATIBLE")
    if opts.hardware_compatibility != "none":
        level = getattr(trt.HardwareCompatibilityLevel, opts.hardware_compatibility.upper(), None)
        if level is None:
            raise EnvironmentProblem(
                f"TensorRT {trt.__version__} has no hardware compatibility level {opts.hardware_compatibility}",
                hint="use a newer TensorRT 10.x or options.hardware_compatibility: ampere_plus",
            )
        config.hardware_compatibility_level = level
        applied["hardware_compatibility"] = opts.hardware_compatibility
    if opts.tactic_sources is not None:
        mask = 0
        for source in opts.tactic_sources:
            member = getattr(trt.TacticSource, source.upper(), None)
            if member is None:
                raise EnvironmentProblem(
                    f"TensorRT {trt.__version__} has no tactic source {source}",
                    hint="drop it from options.tactic_sources",
                )
            mask |= 1 << int(member)
        config.set_tactic_sources(mask)
        applied["tactic_sources"] = list(opts.tactic_sources)
    if opts.dla_core is not None:
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = opts.dla_core
        applied["dla_core"] = opts.dla_core
        if opts.allow_gpu_fallback:
            flag("GPU_FALLBACK")
    return applied


def keep_fp32(trt: Any, network: Any, config: Any, nodes: tuple[str, ...], applied: dict[str, Any]) -> list[str]:
    """Constrain the layers the ONNX parser made from the named nodes to FP32 (precision and output
    types) and make the builder obey it (UNVERIFIED here: no GPU). The parser names a layer after
    its ONNX node, with a suffix where one node became several layers."""
    found = set()
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        node = next((n for n in nodes if layer.name == n or layer.name.startswith(f"{n}_")), None)
        if node is None:
            continue
        found.add(node)
        layer.precision = trt.float32
        for j in range(layer.num_outputs):
            if layer.get_output(j).dtype in (trt.float32, trt.float16):
                layer.set_output_type(j, trt.float32)
    config.set_flag(_flag(trt, "OBEY_PRECISION_CONSTRAINTS"))
    applied["flags"].append("OBEY_PRECISION_CONSTRAINTS")
    applied["fp32_layers_for"] = sorted(found)
    missing = [n for n in nodes if n not in found]
    return [f"no TensorRT layer was made from {', '.join(missing)}: not kept in fp32"] if missing else []


class _TimingCache:
    """The build's timing cache: the checked-in one when the cache policy trusts it and TensorRT
    accepts it (a cache from another GPU or TensorRT version is refused: rebuilt, reported),
    else an empty one; written back through the cache session after a successful build."""

    def __init__(self, session: CacheSession | None, config: Any):
        self.session, self.config = session, config
        source = session.file(TIMING_CACHE) if session is not None else None
        cache = self._load(source.read_bytes()) if source is not None else None
        if session is not None and source is not None:
            if cache is None:
                session.reject("TensorRT refused it: made on another GPU or TensorRT version, or damaged")
            else:
                session.hit()
        if cache is None:
            cache = config.create_timing_cache(b"")
            config.set_timing_cache(cache, ignore_mismatch=False)

    def _load(self, data: bytes) -> Any:
        try:
            cache = self.config.create_timing_cache(data)
        except Exception:  # a damaged file: TensorRT raises its own error types
            return None
        if cache is None or not self.config.set_timing_cache(cache, ignore_mismatch=False):
            return None
        return cache

    def save(self) -> None:
        if self.session is not None:
            self.session.write(TIMING_CACHE, bytes(self.config.get_timing_cache().serialize()))


# --- the backend ---------------------------------------------------------------------------------


class TensorRtMeta(EngineMeta):
    signature: Signature
    version_compatible: bool
    dla_core: int | None
    hardware_compatibility: HardwareCompatibility
    compute_capability: str | None
    gpu: str | None
    builder: dict[str, Any]
    profile: dict[str, list[list[int]]]


class TensorRtBackend(Backend):
    name = NAME
    Options = TensorRtOptions
    Meta = TensorRtMeta
    capabilities = Capabilities(
        precisions=("fp32", "fp16", "int8"),
        devices=("gpu",),
        runtime_package="tensorrt",
        per_node_precision=True,
        cache="timing-cache",
    )
    cache_files = (TIMING_CACHE,)
    install_hint = INSTALL_HINT
    engine_format = "skuforge-tensorrt/1"
    runtime_keys = ("tensorrt",)

    @classmethod
    def _check_sku_impl(cls, sku: SkuSpec, options: TensorRtOptions) -> list[str]:
        return check_sku(sku, options)

    def environment_problems(self, sku: SkuSpec, purpose: str = "run") -> list[str]:
        opts: TensorRtOptions = self.options(sku)
        problems = []
        try:
            trt = _trt()
        except EnvironmentProblem as exc:
            trt, problems = None, [exc.message]
        gpu = gpu_info()
        if gpu is None:
            problems.append(NO_GPU)
        elif gpu.cc is not None:
            wants = [
                (opts.min_compute_capability, "options.min_compute_capability"),
                (FP8_MIN_CC if opts.fp8 else None, "options.fp8"),
                (AMPERE_CC if opts.hardware_compatibility == "ampere_plus" else None, "options.hardware_compatibility"),
            ]
            problems += [
                f"{gpu.name} has compute capability {gpu.compute_capability}; {key} needs {need}+"
                for need, key in wants
                if need is not None and gpu.cc < need
            ]
        if purpose == "run":
            try:
                _cudart()
            except EnvironmentProblem as exc:
                problems.append(exc.message)
        if trt is not None and gpu is not None and opts.dla_core is not None:
            cores = trt.Builder(_logger(trt)).num_DLA_cores
            if opts.dla_core >= cores:
                problems.append(f"options.dla_core {opts.dla_core}: this host has {cores} DLA cores")
        return problems

    def versions(self) -> dict[str, str]:
        trt = _trt()
        gpu = gpu_info()
        # str values only (the build report's schema): "unknown" where the host does not say
        return {
            "tensorrt": trt.__version__,
            "onnx": onnx_version(),
            "cuda_runtime": cuda_runtime_version() or "unknown",
            "nvidia_driver": (gpu.driver if gpu else None) or "unknown",
            "gpu": gpu.name if gpu else "unknown",
            "compute_capability": (gpu.compute_capability if gpu else None) or "unknown",
        }

    def uses_cache(self, options: TensorRtOptions) -> bool:
        return options.timing_cache

    def cache_key(self, sku: SkuSpec) -> dict[str, str]:
        """A timing cache holds tactic timings of one GPU model under one TensorRT version."""
        gpu = gpu_info()
        return {
            "tensorrt": _trt().__version__,
            "gpu": gpu.name if gpu else "unknown",
            "compute_capability": (gpu.compute_capability if gpu else None) or "unknown",
        }

    def _convert_precision(self, ctx: BuildContext, staged: Staged) -> None:
        """INT8: the QDQ graph adjusted to TensorRT's explicit quantization; FP16: converted in the
        graph only when strongly typed (else the builder's FP16 flag decides per layer)."""
        precision = ctx.sku_spec.precision
        if precision == "int8":
            staged.calibration = quantize_for_tensorrt(staged.source, staged.work / "qdq.onnx", ctx)
            staged.replace(staged.work / "qdq.onnx")
        elif precision == "fp16" and staged.options.strongly_typed:
            staged.replace(to_fp16(staged.source, staged.work / "fp16.onnx", ctx.keep_precise))

    def _build_impl(self, ctx: BuildContext, staged: Staged) -> BuildOutcome:

        opts: TensorRtOptions = staged.options
        trt = _trt()
        sig = signature(staged.model)
        shapes = optimization_profile(sig.inputs, ctx.pins, ctx.profiles)
        precision = ctx.sku_spec.precision
        calibration = staged.calibration
        logger = _logger(trt)
        mark = logger.mark()
        source = staged.source
        onnx_ops = {n.name: n.op_type for n in staged.model.graph.node if n.name}
        builder = trt.Builder(logger)
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if opts.strongly_typed else 0
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(source)):
            raise parser_failure([_parser_error(parser.get_error(i)) for i in range(parser.num_errors)])
        config = builder.create_builder_config()
        applied = configure(trt, config, opts, precision)
        warnings = []
        if precision == "fp16" and ctx.keep_precise and not opts.strongly_typed:
            warnings += keep_fp32(trt, network, config, ctx.keep_precise, applied)
        if precision == "fp16" and getattr(builder, "platform_has_fast_fp16", True) is False:
            warnings.append(
                "this GPU has no fast FP16: TensorRT keeps layers in fp32 where fp16 is slower "
                "(the precision gate lists them)"
            )
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            if tensor.is_shape_tensor:
                raise InputError(
                    f"input {tensor.name!r} is a shape tensor; skuforge's TensorRT backend feeds data tensors only",
                    hint="export the model with the shape as a constant or pin the axis",
                )
            if tensor.name in shapes:
                profile.set_shape(tensor.name, *shapes[tensor.name])
        config.add_optimization_profile(profile)
        cache = _TimingCache(staged.cache, config)
        if ctx.progress:
            ctx.progress("tensorrt build", 0.0)
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise builder_failure(logger.errors_since(mark), onnx_ops)
        if ctx.progress:
            ctx.progress("tensorrt build", 1.0)
        cache.save()
        blob = bytes(plan)
        atomic_write_bytes(ctx.engine_dir / ENGINE_FILE, blob)
        runtime, engine = _deserialize(trt, blob, opts.version_compatible, opts.dla_core, ctx.engine_dir / ENGINE_FILE)
        names = _io_names(trt, engine)
        expected = {t.name for t in [*sig.inputs, *sig.outputs]}
        if set(names) != expected:
            raise InputError(
                f"the engine's I/O tensors {sorted(names)} differ from the model's {sorted(expected)}",
                hint="the ONNX parser renamed or dropped a graph input or output; check the model's I/O",
            )
        info = engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)
        atomic_write_bytes(ctx.engine_dir / LAYERS_FILE, info.encode())
        del engine, runtime  # the engine before its runtime
        described = parse_engine_information(info, set(onnx_ops), opts.dla_core)
        gpu = gpu_info()
        meta = TensorRtMeta(
            signature=sig,
            version_compatible=opts.version_compatible,
            dla_core=opts.dla_core,
            hardware_compatibility=opts.hardware_compatibility,
            compute_capability=gpu.compute_capability if gpu else None,
            gpu=gpu.name if gpu else None,
            builder=applied,
            profile={k: [list(s) for s in v] for k, v in shapes.items()},
        )
        return BuildOutcome(
            files=[ENGINE_FILE, LAYERS_FILE],
            layers=described.layers,
            requested_devices=requested_devices(opts),
            partition_boundaries=described.partition_boundaries,
            options={**opts.model_dump(mode="json"), "applied": applied},
            calibration=calibration,
            hardware_specific=opts.hardware_compatibility == "none",
            warnings=warnings,
            meta=meta,
        )

    def load(self, engine_dir: Path, sku: SkuSpec) -> Runner:
        """A version-compatible engine loads in any same-major, same-or-newer TensorRT; others need
        the exact version (the base class's check)."""
        meta: TensorRtMeta = self.read_meta(engine_dir)
        if not meta.version_compatible:
            return super().load(engine_dir, sku)
        built, have = meta.versions.get("tensorrt", ""), _trt().__version__
        if not version_compatible_runtime(built, have):
            raise InputError(
                f"{engine_dir} is a version-compatible engine of TensorRT {built}; TensorRT {have} cannot load it "
                "(a later runtime of the same major version can)",
                hint="install that TensorRT version or a later one of its major version, or rebuild",
            )
        return self._loaded(engine_dir, meta, sku)

    def _load_impl(self, engine_dir: Path, meta: TensorRtMeta, sku: SkuSpec) -> Runner:
        trt = _trt()
        cudart = _cudart()
        built_cc, gpu = meta.compute_capability, gpu_info()
        have_cc = gpu.compute_capability if gpu else None
        if built_cc and gpu and have_cc and meta.hardware_compatibility != "ampere_plus" and built_cc != have_cc:
            raise InputError(
                f"{engine_dir} was built for compute capability {built_cc} ({meta.gpu}); "
                f"this host's {gpu.name} has {have_cc}",
                hint="run it on the SKU's GPU, or build with options.hardware_compatibility: ampere_plus",
            )
        path = engine_dir / ENGINE_FILE
        runtime, engine = _deserialize(trt, path.read_bytes(), meta.version_compatible, meta.dla_core, path)
        return TensorRtRunner(trt, cudart, runtime, engine, meta.signature)


def _parser_error(err: Any) -> ParserError:
    def text(method: str) -> str | None:
        fn = getattr(err, method, None)
        value = fn() if callable(fn) else None
        return str(value) if value not in (None, "") else None

    code = str(err.code()).rsplit(".", 1)[-1]
    return ParserError(code=code, desc=err.desc(), node_name=text("node_name"), node_operator=text("node_operator"))


def _deserialize(trt: Any, blob: bytes, host_code: bool, dla_core: int | None, path: Path) -> tuple[Any, Any]:
    """(runtime, engine); the runtime must outlive its engine."""
    logger = _logger(trt)
    mark = logger.mark()
    runtime = trt.Runtime(logger)
    if host_code:
        runtime.engine_host_code_allowed = True  # a version-compatible plan carries the lean runtime
    if dla_core is not None:
        runtime.DLA_core = dla_core
    engine = runtime.deserialize_cuda_engine(blob)
    if engine is None:
        why = "; ".join(logger.errors_since(mark)[-3:]) or "no reason logged"
        raise InputError(
            f"TensorRT {trt.__version__} could not load {path}: {why}",
            hint="the plan is damaged, or was built by another TensorRT version or for another GPU: "
            "rebuild it on the SKU's runner",
        )
    return runtime, engine


def _io_names(trt: Any, engine: Any) -> dict[str, bool]:
    """I/O tensor name -> is an input."""
    names = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        names[name] = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
    return names


def cast_feed(array: np.ndarray, dtype: np.dtype, name: str) -> np.ndarray:
    """An input as the engine's dtype, C-contiguous (0-d arrays stay 0-d); int64 values outside
    int32 are refused when the engine takes int32."""
    import numpy as np

    if array.dtype == dtype:
        return np.asarray(array, order="C")
    if np.issubdtype(array.dtype, np.integer) and np.issubdtype(dtype, np.integer) and array.size:
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise InputError(
                f"input {name!r} holds values outside {dtype} (the engine's type for it)",
                hint="the values cannot reach TensorRT unchanged: change the model's input type",
            )
    return np.asarray(array.astype(dtype), order="C")


@dataclass
class _Slot:
    """One thread's execution context, stream and device buffers."""

    context: Any
    stream: Any
    buffers: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # name -> (pointer, bytes)

    def device(self, cudart: Any, name: str, nbytes: int) -> int:
        ptr, size = self.buffers.get(name, (0, 0))
        if size < max(nbytes, 1):
            if ptr:
                _cuda(cudart.cudaFree(ptr), "cudaFree")
            size = max(nbytes, 1)
            ptr = int(_cuda(cudart.cudaMalloc(size), "cudaMalloc"))
            self.buffers[name] = (ptr, size)
        return ptr


class TensorRtRunner(Runner):
    """An engine with one execution context, stream and buffers per calling thread (a context
    runs one inference at a time; the bench stage calls from several threads)."""

    def __init__(self, trt: Any, cudart: Any, runtime: Any, engine: Any, sig: Signature):
        import numpy as np

        super().__init__(sig.inputs, [o.name for o in sig.outputs])
        names = _io_names(trt, engine)
        want = {t.name: True for t in sig.inputs} | {t.name: False for t in sig.outputs}
        if names != want:
            raise InputError(
                f"the engine's I/O tensors {sorted(names)} differ from its recorded signature {sorted(want)}",
                hint="rebuild the engine",
            )
        try:
            self._dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}
        except TypeError as exc:  # bf16, fp8, int4 have no numpy type
            raise InputError(
                f"an engine I/O tensor has a type numpy cannot hold: {exc}",
                hint="keep the model's inputs and outputs in fp32, fp16 or integer types",
            ) from exc
        self._out_dtypes = {o.name: np.dtype(o.dtype) for o in sig.outputs}
        self._cudart, self._runtime, self._engine = cudart, runtime, engine
        self._local = threading.local()
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()

    def _slot(self) -> _Slot:
        slot = getattr(self._local, "slot", None)
        if slot is None:
            context = self._engine.create_execution_context()
            if context is None:
                raise EnvironmentProblem(
                    "TensorRT could not create an execution context", hint="free GPU memory and retry"
                )
            slot = _Slot(context, _cuda(self._cudart.cudaStreamCreate(), "cudaStreamCreate"))
            with self._lock:
                self._slots.append(slot)
            self._local.slot = slot
        return slot

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import numpy as np

        cudart, slot = self._cudart, self._slot()
        to_device = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        held = []  # host arrays stay alive until the stream is synchronised
        for sig in self.inputs:
            arr = cast_feed(feeds[sig.name], self._dtypes[sig.name], sig.name)
            if not slot.context.set_input_shape(sig.name, arr.shape):
                raise InputError(
                    f"input {sig.name!r} shape {list(arr.shape)} is outside the engine's optimization profile",
                    hint="run at the SKU's batch, or widen the SKU's profiles and rebuild",
                )
            ptr = slot.device(cudart, sig.name, arr.nbytes)
            _cuda(cudart.cudaMemcpyAsync(ptr, arr.ctypes.data, arr.nbytes, to_device, slot.stream), "cudaMemcpyAsync")
            slot.context.set_tensor_address(sig.name, ptr)
            held.append(arr)
        outputs = {}
        for name in self.output_names:
            shape = tuple(slot.context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise UnsupportedOp(
                    NAME,
                    None,
                    name,
                    f"output {name!r} has a data-dependent shape {list(shape)}",
                    hint="skuforge's TensorRT runner needs output shapes known from the input shapes",
                )
            host = np.empty(shape, self._dtypes[name])
            ptr = slot.device(cudart, name, host.nbytes)
            slot.context.set_tensor_address(name, ptr)
            outputs[name] = (host, ptr)
        if not slot.context.execute_async_v3(int(slot.stream)):
            raise EnvironmentProblem("TensorRT failed to run the engine", hint="see the tensorrt errors logged above")
        to_host = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        for host, ptr in outputs.values():
            _cuda(cudart.cudaMemcpyAsync(host.ctypes.data, ptr, host.nbytes, to_host, slot.stream), "cudaMemcpyAsync")
        _cuda(cudart.cudaStreamSynchronize(slot.stream), "cudaStreamSynchronize")
        del held
        return {name: host.astype(self._out_dtypes[name], copy=False) for name, (host, _) in outputs.items()}

    def close(self) -> None:
        with self._lock:
            slots, self._slots = self._slots, []
        for slot in slots:
            for ptr, _ in slot.buffers.values():
                _cuda(self._cudart.cudaFree(ptr), "cudaFree")
            _cuda(self._cudart.cudaStreamDestroy(slot.stream), "cudaStreamDestroy")
            slot.context = None  # contexts go before their engine
        self._local = threading.local()
        self._engine = self._runtime = None  # the engine before its runtime
