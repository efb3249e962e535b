"""OpenVINO: the ONNX model compiled by a device plugin (CPU; GPU and NPU through the same code).

The engine is the compiled model exported by the plugin (``compiled.export_model()``), re-imported
for validation and benchmarking. FP32 and FP16 are the plugin's ``INFERENCE_PRECISION_HINT``;
INT8 is the calibrated QDQ graph of ``pipeline.backends.quantize.quantize_qdq``, which the plugin reads as
FakeQuantize ops and runs in int8 through its low-precision transformations. What each layer ran
as (type, precision, kernel, the ONNX nodes fused into it) comes from the runtime model.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from pipeline.backends.base import Backend, onnx_version
from pipeline.backends.contract import (
    BuildContext,
    BuildOutcome,
    Capabilities,
    EngineMeta,
    Runner,
    Staged,
    median_per_run,
)
from pipeline.backends.opset import convert_opset
from pipeline.backends.quantize import QdqOptions, conversion_warnings
from pipeline.core.errors import EnvironmentProblem, InputError, UnsupportedOp
from pipeline.core.io import atomic_write_bytes
from pipeline.host import probe
from pipeline.model.graph import coerced_axis_nodes
from pipeline.results.reports import LayerInfo, TensorSig

if TYPE_CHECKING:
    import numpy as np
    import onnx
    import openvino as ov

    from pipeline.project.config import SkuSpec

log = logging.getLogger(__name__)

BLOB = "model.blob"
# Plugins whose compiled models can be exported; AUTO, MULTI and BATCH choose or wrap a device
# at load time and cannot export (AUTO: "Not Implemented" in 2026.4).
EXPORTABLE = ("CPU", "GPU", "NPU", "HETERO")
TARGET_DEVICES = {"cpu": "CPU", "gpu": "GPU", "npu": "NPU"}
PRECISION_HINTS = {"fp32": "f32", "fp16": "f16"}  # int8 comes from the QDQ graph; the rest stays f32
# runtimePrecision (rt_info of the runtime model's layers) to the precisions of LayerInfo
_OV_PRECISIONS = {
    "f32": "fp32",
    "f16": "fp16",
    "bf16": "bf16",
    "i8": "int8",
    "u8": "int8",
    "f8e4m3": "fp8",
    "f8e5m2": "fp8",
    "i4": "int4",
    "u4": "int4",
    "i32": "int32",
    "i64": "int64",
    "f64": "fp64",
    "boolean": "bool",
    "u1": "bool",
}
# Layers that are not executed kernels: graph inputs, outputs and weights are left out of the report.
_NOT_LAYERS = {"Input", "Output", "Const"}
# Layers that move, convert or reshape data: their precision is not a compute precision ("n/a").
_DATA_MOVEMENT = {
    "Reorder",
    "Reshape",
    "Transpose",
    "Concatenation",
    "Gather",
    "GatherND",
    "GatherElements",
    "Convert",
    "ShapeOf",
    "Split",
    "VariadicSplit",
    "StridedSlice",
    "Slice",
    "Broadcast",
    "Tile",
    "Squeeze",
    "Unsqueeze",
    "Pad",
    "DepthToSpace",
    "SpaceToDepth",
    "ScatterUpdate",
    "FakeQuantize",
}
# A layer made only of these ONNX ops is a quantization boundary, not compute (as in ONNX Runtime's report).
_QDQ = {"QuantizeLinear", "DequantizeLinear"}
# ONNX ops the CPU plugin computes only in float inside a fused subgraph
_FLOAT_ONLY = {
    "Erf",
    "Div",
    "Tanh",
    "Sigmoid",
    "Exp",
    "Log",
    "Sqrt",
    "Pow",
    "Reciprocal",
    "Softmax",
    "Gelu",
    "LayerNormalization",
    "ReduceMean",
    "HardSigmoid",
    "Softplus",
    "Mish",
    "HardSwish",
}


class OpenVinoOptions(QdqOptions):
    device: str | None = Field(
        None, description="OpenVINO device: CPU, GPU, GPU.1, NPU, HETERO:GPU,CPU (default: from target.device)"
    )
    performance_hint: Literal["LATENCY", "THROUGHPUT"] = "LATENCY"
    num_streams: int | None = Field(None, ge=1, description="None: what the performance hint picks")
    inference_num_threads: int = Field(0, ge=0, description="0: the plugin's default")
    enable_cpu_pinning: bool | None = Field(None, description="None: the plugin's default")


def _ov() -> Any:
    try:
        import openvino
    except ImportError as exc:
        raise EnvironmentProblem("openvino is not installed", hint=OpenVinoBackend.install_hint) from exc
    return openvino


@functools.lru_cache(maxsize=1)
def _core() -> ov.Core:
    return _ov().Core()


def _first_line(exc: BaseException) -> str:
    """OpenVINO messages start with 'Exception from src/...' lines; keep the first that says something."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(("Exception from ", "Check '"))]
    return (useful or lines or [type(exc).__name__])[0]


def device_of(sku: SkuSpec, options: OpenVinoOptions) -> str:
    return options.device or TARGET_DEVICES[sku.target.device]


def member_devices(device: str) -> list[str]:
    """The devices a device string names: 'HETERO:GPU,CPU' -> ['GPU', 'CPU'], 'GPU.1' -> ['GPU.1']."""
    plugin, _, rest = device.partition(":")
    return [d.strip() for d in rest.split(",") if d.strip()] if rest else [plugin]


def _base(device: str) -> str:
    return device.split(".")[0]


def _missing_devices(device: str, available: list[str]) -> list[str]:
    bases = {_base(a) for a in available}
    missing = []
    for d in member_devices(device):
        found = d in available if "." in d else d in bases
        # a lone device is listed without an index ("GPU"); "GPU.0" then names it
        if not found and d.endswith(".0") and _base(d) in available:
            found = True
        if not found:
            missing.append(d)
    return missing


def _compile_config(options: OpenVinoOptions, precision: str) -> dict[str, str]:
    config = {
        "PERFORMANCE_HINT": options.performance_hint,
        # set even for fp32: on CPUs with BF16 the plugin's default is bf16 (import_model
        # of a blob without this property ran bf16 here), so the hint is also passed at load
        "INFERENCE_PRECISION_HINT": PRECISION_HINTS.get(precision, "f32"),
    }
    if options.num_streams is not None:
        config["NUM_STREAMS"] = str(options.num_streams)
    if options.inference_num_threads:
        config["INFERENCE_NUM_THREADS"] = str(options.inference_num_threads)
    if options.enable_cpu_pinning is not None:
        config["ENABLE_CPU_PINNING"] = "YES" if options.enable_cpu_pinning else "NO"
    return config


def _supported_config(device: str, config: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The properties the device takes; the others are dropped with a warning. HETERO passes
    them to each member device, so only properties all members take are kept."""
    core = _core()
    devices = member_devices(device)
    keep, dropped = {}, []
    for key, value in config.items():
        takers = [d for d in devices if key in core.get_property(d, "SUPPORTED_PROPERTIES")]
        if len(takers) == len(devices):
            keep[key] = value
        else:
            dropped.append(
                f"{key}={value} ignored: device {', '.join(sorted(set(devices) - set(takers)))} does not support it"
            )
    return keep, dropped


def _device_properties(device: str) -> dict[str, Any]:
    core = _core()
    out = {}
    for d in member_devices(device):
        out[d] = {
            "full_device_name": str(core.get_property(d, "FULL_DEVICE_NAME")),
            "optimization_capabilities": [str(c) for c in core.get_property(d, "OPTIMIZATION_CAPABILITIES")],
        }
    return out


class OpenVinoRunner(Runner):
    """A compiled model; one infer request per calling thread (requests are not thread-safe)."""

    def __init__(
        self,
        compiled: ov.CompiledModel,
        input_names: list[str],
        output_names: list[str],
        reopen: Callable[[dict[str, str]], ov.CompiledModel] | None = None,
    ):
        """``reopen(config)``: the same engine loaded again with ``config`` added (profiling)."""
        inputs = []
        self._bounds: dict[str, list[tuple[int, int, int]]] = {}  # input -> (axis, min, max) of bounded dims
        # not strict: input_names are the ONNX graph's inputs, and an initializer listed among them (after
        # the data inputs, as exporters that keep weights as inputs write them) is a constant, not a port
        for name, port in zip(input_names, compiled.inputs, strict=False):
            pshape = port.get_partial_shape()
            shape = [d.get_length() if d.is_static else None for d in pshape]
            self._bounds[name] = [
                (i, d.get_min_length(), d.get_max_length())
                for i, d in enumerate(pshape)
                if d.is_dynamic and d.get_max_length() >= 0
            ]
            inputs.append(TensorSig(name=name, dtype=port.get_element_type().to_dtype().name, shape=shape))
        super().__init__(inputs, output_names)
        self.compiled = compiled
        self._local = threading.local()
        self._reopen = reopen
        self._bounded = [(name, bounds) for name, bounds in self._bounds.items() if bounds]
        self._input_names = [sig.name for sig in self.inputs]

    def profile_layers(self, feeds: dict[str, np.ndarray], iterations: int = 20) -> dict[str, float] | None:
        """Median ms per executed layer of the runtime model (build.json layer names; ``fused_from``
        holds their ONNX nodes) over ``iterations`` runs, from the plugin's performance counters on
        a second load of the engine with PERF_COUNT on; the first run is left out."""
        if self._reopen is None:
            return None
        try:
            compiled = self._reopen({"PERF_COUNT": "YES"})
        except InputError as exc:  # a plugin without performance counters
            log.warning("OpenVINO cannot profile this engine's layers: %s", exc.message)
            return None
        request = compiled.create_infer_request()
        named = {i: feeds[sig.name] for i, sig in enumerate(self.inputs)}
        runs: dict[str, list[float]] = {}
        for i in range(iterations + 1):
            request.infer(named)
            if i == 0:
                continue
            for info in request.get_profiling_info():
                if info.status == info.Status.EXECUTED:
                    runs.setdefault(info.node_name, []).append(info.real_time.total_seconds() * 1e3)
        return {name: median_per_run(times, iterations) for name, times in runs.items()}

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``Runner.infer``, but for the bench loop's case: the arrays this thread's request shares,
        given again as they were bound (the same objects, shapes and dtypes: they passed every
        check then, the profile's bounds included) run as they are, without checking them again.
        Written for the fewest interpreter steps: right after the plugin's threads ran each costs
        several times what it does in a tight loop (``zip``'s ``strict`` keyword alone ~1 us)."""
        slot = getattr(self._local, "slot", None)
        if slot is not None:
            try:
                for name, held in zip(self._input_names, slot[1]):  # noqa: B905 (as long: one per input)
                    arr = feeds[name]
                    if arr is not held[0] or arr.shape != held[1] or arr.dtype is not held[2]:
                        break
                else:
                    return dict(zip(self.output_names, slot[2]().values()))  # noqa: B905 (see _infer_impl)
            except (KeyError, TypeError):  # an input not given, or one not bound (None): the checks say
                pass
        return super().infer(feeds)

    def _request(self) -> tuple[ov.InferRequest, list[Any], Callable[[], dict[Any, np.ndarray]]]:
        """This thread's request, per input the array bound to it with its shape and dtype (or
        None), and the call that runs the request on what is bound and returns copies of its
        outputs."""
        slot = getattr(self._local, "slot", None)
        if slot is None:
            request = self.compiled.create_infer_request()
            slot = self._local.slot = (request, [None] * len(self.inputs), _run_bound(request))
        return slot

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for name, bounds in self._bounded:
            for axis, low, high in bounds:
                if not low <= feeds[name].shape[axis] <= high:
                    raise InputError(
                        f"engine input {name!r} dim {axis} must be in [{low}, {high}] (the SKU's profile), "
                        f"got {feeds[name].shape[axis]}"
                    )
        request, bound, run = self._request()
        # One request per thread, reused; each input bound once and without a copy (the array a
        # request shares is read again in place when it comes back); the request run as it is,
        # with no inputs to dispatch; the outputs copied once, by the binding, into new arrays (a
        # caller keeps them: the next call does not overwrite them). InferRequest.infer(dict)
        # costs about 3x the plugin's own time on a tiny model; binding again costs ~5 us a call.
        for i, sig in enumerate(self.inputs):
            arr = feeds[sig.name]
            held = bound[i]
            if held is None or held[0] is not arr or held[1] != arr.shape or held[2] is not arr.dtype:
                bound[i] = self._bind(request, i, arr)
        # not strict: an engine's output names are its ONNX outputs, which the compiled model has
        return dict(zip(self.output_names, run().values()))  # noqa: B905

    @staticmethod
    def _bind(request: ov.InferRequest, index: int, arr: np.ndarray) -> tuple[np.ndarray, tuple[int, ...], Any] | None:
        """Set ``arr`` as input ``index`` of ``request``; (arr, its shape, its dtype) when the tensor
        shares the array's memory, None when it holds a copy (a copy of another array, or made by
        OpenVINO)."""
        import numpy as np

        held = np.require(arr, requirements="C")
        tensor = _ov().Tensor(held, shared_memory=True)
        request.set_input_tensor(index, tensor)
        shared = held is arr and tensor.data.ctypes.data == arr.ctypes.data
        return (arr, arr.shape, arr.dtype) if shared else None


def _run_bound(request: ov.InferRequest) -> Callable[[], dict[Any, np.ndarray]]:
    """``request`` run on the tensors bound to it, its outputs copied into new arrays (in the
    compiled model's output order). The binding's own ``infer(inputs, share_outputs,
    decode_strings)`` with no inputs: ``InferRequest.infer()`` is the same call behind a Python
    dispatcher of inputs and an OVDict, ~5 us a call; where the binding is not found, that."""
    for cls in type(request).__mro__:
        if cls.__module__.startswith("openvino._pyopenvino") and "infer" in vars(cls):
            infer: Callable[..., dict[Any, np.ndarray]] = vars(cls)["infer"]
            return functools.partial(infer, request, {}, False, True)
    return request.infer


class OpenVinoMeta(EngineMeta):
    blob: str
    device: str
    config: dict[str, str]
    inputs: list[str]
    outputs: list[str]
    devices: dict[str, dict[str, Any]]
    execution_devices: list[str]
    inference_precision: str | None


class OpenVinoBackend(Backend):
    name = "openvino"
    Options = OpenVinoOptions
    Meta = OpenVinoMeta
    capabilities = Capabilities(
        precisions=("fp32", "fp16", "int8"),
        devices=("cpu", "gpu", "npu"),
        runtime_package="openvino",
        per_node_precision=True,
    )
    install_hint = "pip install openvino (CPU, Intel GPU and NPU plugins; GPU/NPU also need the device's driver)"
    engine_format = "skuforge-openvino/1"
    runtime_keys = ("openvino",)  # an exported blob loads only in the OpenVINO build that wrote it

    @classmethod
    def _check_sku_impl(cls, sku: SkuSpec, options: OpenVinoOptions) -> list[str]:
        device = device_of(sku, options)
        plugin = device.partition(":")[0]
        if _base(plugin) not in EXPORTABLE:
            return [
                f"options.device: {device!r} cannot be exported as an engine (OpenVINO plugins that export: "
                f"{', '.join(EXPORTABLE)}); name the device, e.g. {TARGET_DEVICES[sku.target.device]!r}"
            ]
        members = member_devices(device)
        if plugin == "HETERO" and (not members or any(_base(m) not in EXPORTABLE[:-1] for m in members)):
            return [f"options.device: {device!r}: HETERO needs its devices in priority order, e.g. 'HETERO:GPU,CPU'"]
        primary = _base(members[0])
        if primary != TARGET_DEVICES[sku.target.device]:
            return [
                f"options.device: {device!r} runs on {primary} but target.device is {sku.target.device!r} "
                f"(use {TARGET_DEVICES[sku.target.device]!r} or change target.device)"
            ]
        return []

    def environment_problems(self, sku: SkuSpec, purpose: str = "run") -> list[str]:
        try:
            _ov()
        except EnvironmentProblem as exc:
            return [f"{exc.message} ({self.install_hint})"]
        problems = []
        device = device_of(sku, self.options(sku))
        available = list(_core().available_devices)
        missing = _missing_devices(device, available)
        if missing:
            problems.append(
                f"OpenVINO device {', '.join(missing)} is not available on this host "
                f"(available: {', '.join(available) or 'none'}); install the device's driver or "
                f"build this SKU on its runner"
            )
        elif purpose == "build":
            no_export = [
                d
                for d, p in _device_properties(device).items()
                if "EXPORT_IMPORT" not in p["optimization_capabilities"]
            ]
            if no_export:
                problems.append(
                    f"OpenVINO device {', '.join(no_export)} cannot export compiled models "
                    f"(no EXPORT_IMPORT capability): the engine could not be saved"
                )
        if purpose == "build" and sku.precision == "int8":
            try:
                import onnxruntime.quantization  # noqa: F401  (quantize_qdq uses it)
            except ImportError:
                problems.append(
                    "INT8 builds quantize with onnxruntime, which is not installed (pip install onnxruntime)"
                )
        return problems

    def versions(self) -> dict[str, str]:
        return {"openvino": _ov().get_version(), "onnx": onnx_version()}

    def _adapt(self, model: onnx.ModelProto, ctx: BuildContext, staged: Staged) -> onnx.ModelProto:
        """A model before opset 13 with a Softmax/LogSoftmax/Hardmax over a non-last axis, converted
        to opset 13 (checked on the probe batch): OpenVINO 2026.4's ONNX frontend reads the old
        ``axis`` with opset 13's meaning (one axis, not the trailing axes flattened), so such a
        Softmax computes other numbers (measured: sums of 3.0 instead of 1.0 over a [2,3] slice)."""
        coerced = coerced_axis_nodes(model)
        if not coerced:
            return model
        model, conversion = convert_opset(
            model,
            13,
            ctx.probe_inputs,
            f"OpenVINO reads the pre-13 axis of {', '.join(coerced[:3])}{', ...' if len(coerced) > 3 else ''} wrongly",
        )
        if conversion is not None:
            staged.warnings.append(conversion.warning())
            staged.notes["opset_conversion"] = conversion.to_json()
        return model

    def _convert_precision(self, ctx: BuildContext, staged: Staged) -> None:
        """FP32 and FP16 are the plugin's inference precision hint; INT8 the QDQ graph (the base's)."""
        if ctx.sku_spec.precision == "int8":
            super()._convert_precision(ctx, staged)
            assert staged.calibration is not None, "the base's INT8 conversion records its calibration"
            staged.calibration["runtime"] = (
                "OpenVINO reads the QDQ pairs as FakeQuantize; its low-precision transformations run them in int8"
            )

    def _build_impl(self, ctx: BuildContext, staged: Staged) -> BuildOutcome:
        opts: OpenVinoOptions = staged.options
        device = device_of(ctx.sku_spec, opts)
        precision = ctx.sku_spec.precision
        onnx_model = staged.model
        input_names = [i.name for i in onnx_model.graph.input]
        output_names = [o.name for o in onnx_model.graph.output]
        model = _read_model(staged.source, onnx_model)
        _set_profiles(model, onnx_model, ctx.profiles)
        if precision != "int8" and ctx.keep_precise:  # INT8 keeps them out of the QDQ graph instead
            warnings_keep = keep_precise(model, onnx_model, ctx.keep_precise)
        else:
            warnings_keep = []
        affinity = _refuse_unsupported(model, device)
        config, warnings = _supported_config(device, _compile_config(opts, precision))
        warnings += warnings_keep
        warnings += conversion_warnings(staged.calibration)
        compiled = _compile(model, device, config)
        blob = compiled.export_model().getvalue()
        atomic_write_bytes(ctx.engine_dir / BLOB, blob)
        # report and probe the engine as it will be loaded: the re-imported blob
        engine = _import(blob, device, config, ctx.engine_dir / BLOB)
        runner = OpenVinoRunner(engine, input_names, output_names)
        got, want = (
            runner.infer(ctx.probe_inputs),
            OpenVinoRunner(compiled, input_names, output_names).infer(ctx.probe_inputs),
        )
        if any(got[k].tobytes() != want[k].tobytes() for k in output_names):
            warnings.append(
                "the re-imported engine's outputs differ from the freshly compiled model's on the probe batch"
            )
        props = _device_properties(device)
        inference_precision = _inference_precision(engine)
        if precision == "fp16" and inference_precision != "f16":
            caps = {d: p["optimization_capabilities"] for d, p in props.items()}
            warnings.append(
                f"FP16 was asked for but {device} compiled with inference precision {inference_precision} "
                f"(capabilities: {caps}); the precision gate lists the layers"
            )
        # the layers of the model as compiled: the same graph as the exported blob, but import keeps only
        # each fused layer's own name (38 of 42 in a small transformer), which hides what ran in fp32
        layers, boundaries = runtime_layers(compiled, affinity, onnx_op_types(onnx_model))
        meta = OpenVinoMeta(
            blob=BLOB,
            device=device,
            config=config,
            inputs=input_names,
            outputs=output_names,
            devices=props,
            execution_devices=[str(d) for d in engine.get_property("EXECUTION_DEVICES")],
            inference_precision=inference_precision,
            # the blob holds the transformed graph; the CPU plugin picks its kernels for the loading
            # CPU at import, so this is a record for people, not a load-time check
            host_cpu=probe.cpu_record(),
        )
        return BuildOutcome(
            files=[BLOB],
            layers=layers,
            requested_devices=member_devices(device),
            partition_boundaries=boundaries,
            options={**opts.model_dump(mode="json"), "opset_conversion": staged.notes.get("opset_conversion")},
            calibration=staged.calibration,
            warnings=warnings,
            meta=meta,
        )

    def _load_impl(self, engine_dir: Path, meta: OpenVinoMeta, sku: SkuSpec) -> Runner:
        blob = engine_dir / meta.blob
        compiled = _import(blob.read_bytes(), meta.device, meta.config, blob)
        return OpenVinoRunner(
            compiled,
            meta.inputs,
            meta.outputs,
            reopen=lambda extra: _import(blob.read_bytes(), meta.device, {**meta.config, **extra}, blob),
        )


def _read_model(path: Path, onnx_model: Any) -> ov.Model:
    """The ONNX file as an OpenVINO model; ops the ONNX frontend cannot convert are UnsupportedOp."""
    ov = _ov()
    try:
        return _core().read_model(str(path))
    except Exception as exc:  # the frontend raises RuntimeError or OpConversionFailure
        unconverted = _unconverted_ops(path)
        failures = _conversion_failures(str(exc))
        if not unconverted and failures:
            # ops the frontend knows but could not convert in this model (its detail says why)
            op_type, node, _ = failures[0]
            listed = "; ".join(f"{t} (node {n!r}): {d}" for t, n, d in failures)
            raise UnsupportedOp(
                "openvino", op_type, node, f"OpenVINO {ov.get_version()}'s ONNX frontend could not convert {listed}"
            ) from exc
        if not unconverted:
            raise InputError(
                f"OpenVINO could not read the model: {_first_line(exc)}",
                hint="the prepared model is valid ONNX but OpenVINO's ONNX frontend refuses it for the "
                "reason above: upgrade openvino, re-export at another opset, or use another backend",
            ) from exc
        found = [
            (op, node.name or node.output[0])
            for op in unconverted
            for node in onnx_model.graph.node
            if (node.domain or "", node.op_type) == op
        ]
        named = [f"{f'{d}.' if d else ''}{t} (node {n!r})" for (d, t), n in found] or [
            f"{f'{d}.' if d else ''}{t}" for d, t in unconverted
        ]
        (domain, op_type), node = found[0] if found else (unconverted[0], None)
        raise UnsupportedOp(
            "openvino",
            f"{domain}.{op_type}" if domain else op_type,
            node,
            f"OpenVINO {ov.get_version()} has no conversion for {', '.join(named)}",
        ) from exc


_FAILED_OP = re.compile(r"^-- (\S+?)-\d+ with a message:\n(.*?)(?=^-- |^Summary:|\Z)", re.S | re.M)
_FAILED_NODE = re.compile(r"ONNX node '<Node\(([^)]*)\): ([^>]*)>'")
_PLUMBING_LINES = ("While validating", "Check '", "FrontEnd API failed", "Exception from")


def _conversion_failures(message: str) -> list[tuple[str, str | None, str]]:
    """(op type, node, reason) of each op in the frontend's "Failed operations detailed log" (its
    first line alone, "OpConversionFailure:", says nothing)."""
    out = []
    for block in _FAILED_OP.finditer(message):
        node = _FAILED_NODE.search(block.group(2))
        lines = [ln.strip() for ln in block.group(2).splitlines() if ln.strip()]
        reasons = [ln for ln in lines if not ln.startswith(_PLUMBING_LINES)]
        out.append(
            (
                node.group(1) if node else block.group(1),
                node.group(2) if node else None,
                (reasons or lines or ["no reason given"])[-1],
            )
        )
    return out


def _unconverted_ops(path: Path) -> list[tuple[str, str]]:
    """(domain, op type) of the nodes the ONNX frontend leaves unconverted."""
    from openvino.frontend import FrontEndManager

    # the framework nodes point into the frontend's input model: keep it (and the frontend)
    # alive until the nodes are read and released, or reading them crashes (2026.4)
    manager = FrontEndManager()
    try:
        frontend = manager.load_by_framework("onnx")
        input_model = frontend.load(str(path))
        partial = frontend.convert_partially(input_model)
    except Exception:  # a model the frontend cannot even load: the caller reports the first error
        return []
    ops = []
    for op in partial.get_ops():
        if op.get_type_name() == "ONNXFrameworkNode":
            attrs = op.get_attributes()
            key = (str(attrs.get("ONNX_META_domain", "")), str(attrs.get("ONNX_META_type", op.get_friendly_name())))
            if key not in ops:
                ops.append(key)
        del op
    del partial
    del input_model, frontend, manager
    return ops


def _set_profiles(model: ov.Model, onnx_model: Any, profiles: dict[str, Any]) -> None:
    """Profile axes stay dynamic, bounded to [min, max]. OpenVINO drops ONNX dim names, so the
    axes are found on the ONNX graph's inputs (same order as the model's parameters)."""
    if not profiles:
        return
    ov = _ov()
    shapes = {}
    # initializers listed as graph inputs become constants, not parameters
    initializers = {i.name for i in onnx_model.graph.initializer}
    data_inputs = [v for v in onnx_model.graph.input if v.name not in initializers]
    for port, value in zip(model.inputs, data_inputs, strict=True):
        dims = [
            ov.Dimension(profiles[d.dim_param].min, profiles[d.dim_param].max)
            if d.dim_param in profiles
            else ov.Dimension(d.dim_value)
            if d.HasField("dim_value")
            else ov.Dimension()
            for d in value.type.tensor_type.shape.dim
        ]
        shapes[port] = ov.PartialShape(dims)
    model.reshape(shapes)


# OpenVINO's run-time attribute that keeps a node out of FP16 compression (ov::disable_fp16_compression);
# its own partial-upcast tooling sets it from Python under this name
DISABLE_FP16 = "disable_fp16_compression_0"


def keep_precise(model: ov.Model, onnx_model: Any, nodes: tuple[str, ...]) -> list[str]:
    """Mark the ops made from the named ONNX nodes to stay FP32 under an FP16 (or BF16) inference
    precision. The ONNX frontend names an op after its node or the node's output, so both are
    looked up. Whether the plugin honours the mark shows in the runtime layers' precision (the
    precision gate): OpenVINO 2026.4's CPU plugin under a bf16 hint did not, here."""
    wanted = set(nodes)
    for node in onnx_model.graph.node:
        if node.name in nodes:
            wanted.update(o for o in node.output if o)
    marked = 0
    for op in model.get_ordered_ops():
        if op.get_friendly_name() in wanted:
            op.get_rt_info()[DISABLE_FP16] = ""
            marked += 1
    if not marked:
        return [
            f"none of the nodes to keep in fp32 ({', '.join(nodes)}) is an op of the converted model: nothing marked"
        ]
    return []


def _refuse_unsupported(model: ov.Model, device: str) -> dict[str, str]:
    """Ask the plugin which ops it runs before compiling: an op it lacks is named, not a crash.
    Returns op name -> device (HETERO's split of the model)."""
    ov = _ov()
    try:
        supported = _core().query_model(model, device)
    except Exception as exc:
        raise UnsupportedOp("openvino", None, None, f"{device} could not check the model: {_first_line(exc)}") from exc
    missing = [
        op
        for op in model.get_ordered_ops()
        if op.get_type_name() not in ("Parameter", "Result", "Constant") and op.get_friendly_name() not in supported
    ]
    if missing:
        first = missing[0]
        listed = ", ".join(f"{op.get_type_name()} ({op.get_friendly_name()})" for op in missing[:10])
        raise UnsupportedOp(
            "openvino",
            first.get_type_name(),
            first.get_friendly_name(),
            f"device {device} (OpenVINO {ov.get_version()}) does not support {listed}",
        )
    return {name: str(dev) for name, dev in supported.items()}


def _compile(model: ov.Model, device: str, config: dict[str, str]) -> ov.CompiledModel:
    try:
        return _core().compile_model(model, device, config)
    except Exception as exc:  # every op passed query_model: a plugin limit, driver or property problem
        raise EnvironmentProblem(
            f"OpenVINO {_ov().get_version()} could not compile the model for {device}: {_first_line(exc)}",
            hint="check the SKU's OpenVINO options and the device's driver, or use another device",
        ) from exc


def _import(blob: bytes, device: str, config: dict[str, str], path: Path) -> ov.CompiledModel:
    try:
        return _core().import_model(BytesIO(blob), device, config)
    except Exception as exc:  # a blob from another OpenVINO build or device, or damaged contents
        raise InputError(
            f"OpenVINO {_ov().get_version()} could not import the engine {path} on {device}: {_first_line(exc)}",
            hint="the blob is specific to the OpenVINO build and device that wrote it: rebuild the engine "
            "(skuforge build, or dvc repro)",
        ) from exc


def _inference_precision(compiled: ov.CompiledModel) -> str | None:
    try:
        return str(compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name())
    except Exception:  # NPU and some plugins do not report it
        return None


def onnx_op_types(onnx_model: Any) -> dict[str, str]:
    """ONNX node name and output name -> op type: the plugin names layers after either."""
    types = {}
    for node in onnx_model.graph.node:
        types.update({name: node.op_type for name in (node.name, *node.output) if name})
    return types


def _precision(layer_type: str, runtime_precision: str, origins: list[str | None]) -> str | None:
    """``origins``: ONNX op types of the names fused into the layer (None for a name the plugin made)."""
    if layer_type in _DATA_MOVEMENT:
        return "n/a"
    if not runtime_precision or runtime_precision in ("undefined", "dynamic"):
        return None
    precision = _OV_PRECISIONS.get(runtime_precision, runtime_precision)
    # a layer made only of QuantizeLinear/DequantizeLinear converts between int8 and float at the QDQ
    # boundary (the plugin reports the precision it reads): data conversion, not compute
    if origins and set(origins) <= _QDQ:  # every fused name an ONNX Q/DQ node (None: a plugin-made name)
        return "n/a"
    # a fused elementwise subgraph reports the precision it reads (u8 after a quantized layer) but
    # dequantizes and computes in float where it holds ops with no integer form (GELU's Erf and Div)
    if precision == "int8" and layer_type == "Subgraph" and _FLOAT_ONLY & set(origins):
        return "fp32"
    return precision


def runtime_layers(
    compiled: ov.CompiledModel, affinity: dict[str, str], onnx_types: dict[str, str]
) -> tuple[list[LayerInfo], int]:
    """Each executed layer of the compiled model: type, precision, kernel, the ONNX nodes fused
    into it and the device that runs it; and how many edges cross between devices.

    On one execution device every layer runs there. On several (HETERO), a layer runs where the
    plugin's query put the original ops fused into it (``affinity``); a layer made up by the
    plugin (a Reorder) has no original op and is left without a device rather than guessed."""
    execution = [str(d) for d in compiled.get_property("EXECUTION_DEVICES")]
    if len(execution) == 1:
        affinity = {}
    ops = compiled.get_runtime_model().get_ordered_ops()
    layers, device_of_op = [], {}
    for op in ops:
        rt = op.get_rt_info()
        info = {
            k: rt[k].astype(str)
            for k in ("layerType", "runtimePrecision", "primitiveType", "originalLayersNames")
            if k in rt
        }
        fused = [n for n in info.get("originalLayersNames", "").split(",") if n]
        where = next((affinity[n] for n in fused if n in affinity), None) if affinity else next(iter(execution), None)
        device_of_op[op.get_friendly_name()] = where
        layer_type = info.get("layerType", op.get_type_name())
        if layer_type in _NOT_LAYERS:
            continue
        layers.append(
            LayerInfo(
                name=op.get_friendly_name(),
                op_type=layer_type,
                device=where,
                precision=_precision(layer_type, info.get("runtimePrecision", ""), [onnx_types.get(n) for n in fused]),
                kernel=info.get("primitiveType"),
                fused_from=fused,
            )
        )
    boundaries = 0
    for op in ops:
        here = device_of_op.get(op.get_friendly_name())
        for inp in op.inputs():
            there = device_of_op.get(inp.get_source_output().get_node().get_friendly_name())
            boundaries += int(here is not None and there is not None and here != there)
    return layers, boundaries
