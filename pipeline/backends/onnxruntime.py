"""ONNX Runtime as a backend (the reference runtime it shares its session code with: reference.py).

The engine is the model as ONNX Runtime optimised it for the SKU's providers (saved with
``optimized_model_filepath``) plus the session options to load it with. INT8 is static QDQ
quantization with the calibration table of the calibrate stage.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from pipeline.backends.base import Backend, onnx_version
from pipeline.backends.contract import BuildContext, BuildOutcome, Capabilities, EngineMeta, Runner, Staged
from pipeline.backends.emulated import EmulatedSession, Worker, check_versions, emulated_runner
from pipeline.backends.quantize import QdqOptions, conversion_warnings, quantize_lstm_dynamic
from pipeline.backends.reference import (
    CPU,
    SessionRunner,
    create_session,
    newest_qdq_opset,
    node_events,
    ort_module,
    runtime_version,
    session_options,
)
from pipeline.core.errors import EnvironmentProblem
from pipeline.host import probe
from pipeline.results.reports import LayerInfo

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    import onnxruntime as ort

    from pipeline.project.config import SkuSpec


# Precisions each execution provider runs natively. ONNX Runtime's CPU provider has FP16
# kernels for a few ops only and otherwise inserts casts, so FP16 there is refused as config.
PROVIDER_PRECISIONS: dict[str, frozenset[str]] = {
    CPU: frozenset({"fp32", "int8"}),
    "CUDAExecutionProvider": frozenset({"fp32", "fp16", "int8"}),
    "TensorrtExecutionProvider": frozenset({"fp32", "fp16", "int8"}),
    "OpenVINOExecutionProvider": frozenset({"fp32", "fp16", "int8"}),
    "DmlExecutionProvider": frozenset({"fp32", "fp16"}),
    "CoreMLExecutionProvider": frozenset({"fp32", "fp16"}),
    "XnnpackExecutionProvider": frozenset({"fp32", "int8"}),
    "QNNExecutionProvider": frozenset({"fp16", "int8"}),
    "ROCMExecutionProvider": frozenset({"fp32", "fp16", "int8"}),
    # In the CPU wheel; it forwards to a remote endpoint and runs no node locally, so every node
    # of a local model falls back to the next provider (the tests plant exactly that).
    "AzureExecutionProvider": frozenset({"fp32", "fp16", "int8"}),
}

# Profiler type names (both spellings occur) to precisions; uint8 and int8 are both "int8" kernels.
_ORT_TYPES = {
    "float": "fp32",
    "float16": "fp16",
    "MLFloat16": "fp16",
    "double": "fp64",
    "int8_t": "int8",
    "int8": "int8",
    "uint8_t": "int8",
    "uint8": "int8",
    "int32_t": "int32",
    "int32": "int32",
    "int64_t": "int64",
    "int64": "int64",
    "bool": "bool",
    "int16_t": "int16",
    "uint16_t": "int16",
}
# Ops that move or reinterpret data; a layer's precision is judged on the others.
_PRECISION_NEUTRAL = {
    "QuantizeLinear",
    "DequantizeLinear",
    "Cast",
    "Reshape",
    "Shape",
    "Transpose",
    "Flatten",
    "Squeeze",
    "Unsqueeze",
    "Gather",
    "Concat",
    "Identity",
    "MemcpyToHost",
    "MemcpyFromHost",
}


class OnnxRuntimeOptions(QdqOptions):
    providers: list[str] = Field(default_factory=lambda: [CPU], min_length=1, description="in priority order")
    require_all_providers: bool = Field(
        True,
        description="false: providers this onnxruntime build lacks are skipped (recorded); the placement gate judges",
    )
    provider_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = "all"
    # the saved engine is the graph at graph_optimization_level; a portable engine (no contrib or NCHWc
    # ops) loaded at "all" gets the device's own fusions and NCHWc blocks (1.3-2.6x, benchmarks/speedup.py)
    load_optimization_level: Literal["disable", "basic", "extended", "all"] = Field(
        "disable",
        description="what ONNX Runtime optimises when the engine loads on the device (disable: the "
        "engine is already optimised)",
    )
    intra_op_num_threads: int = Field(0, ge=0, description="0: ONNX Runtime's default")
    inter_op_num_threads: int = Field(0, ge=0)
    recurrent: Literal["auto", "dynamic", "float"] = Field(
        "auto",
        description="INT8: the LSTM layers static QDQ leaves in float. dynamic: INT8 weights, activations "
        "quantized per call (com.microsoft.DynamicQuantizeLSTM, a CPU kernel); float: kept FP32; "
        "auto: dynamic when the CPU provider is the first",
    )

    def dynamic_recurrent(self) -> bool:
        return self.recurrent == "dynamic" or (self.recurrent == "auto" and self.providers[0] == CPU)


def _session_options(opts: OnnxRuntimeOptions, level: str, profile_dir: Path | None = None) -> ort.SessionOptions:
    return session_options(
        level,
        intra_op_num_threads=opts.intra_op_num_threads,
        inter_op_num_threads=opts.inter_op_num_threads,
        cpu_fallback=CPU in opts.providers,
        profile_dir=profile_dir,
    )


class OnnxRuntimeMeta(EngineMeta):
    providers: list[str]
    provider_options: dict[str, dict[str, Any]]
    load_optimization_level: Literal["disable", "basic", "extended", "all"]
    intra_op_num_threads: int
    inter_op_num_threads: int
    nchwc_block: int | None = None  # the channel block of NCHWc ops, where the engine holds them


class OnnxRuntimeRunner(SessionRunner):
    """A built engine's session, run through the binding's own ``run``: ``InferenceSession.run``
    checks the feed's names and OrtValue ownership again in Python (~2-3 us a call, the bench
    stage's whole budget over a bare loop) after ``Runner.infer`` checked every input. An EP
    failure goes through ``InferenceSession.run`` again, which falls back to the session's
    fallback providers once, as it does for any caller; a session of a provider that captures
    graphs (WebGPU) always does."""

    def __init__(
        self, session: ort.InferenceSession, reopen: Callable[[Path], ort.InferenceSession] | None = None
    ) -> None:
        super().__init__(session, reopen)
        binding = getattr(session, "_sess", None)
        capturing = any("WebGpu" in p for p in session.get_providers())
        self._run = binding.run if binding is not None and not capturing else None
        state = getattr(getattr(ort_module(), "capi", None), "onnxruntime_pybind11_state", None)
        self._ep_failure: type[BaseException] | tuple[()] = getattr(state, "EPFail", ())

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._run is None:
            return super()._infer_impl(feeds)
        # as SessionRunner: feeds of the inputs' number hold nothing else; run() returns new arrays
        if len(feeds) != len(self.inputs) or type(feeds) is not dict:
            feeds = {i.name: feeds[i.name] for i in self.inputs}
        names = self.output_names
        try:
            outputs = self._run(names, feeds, None)
        except self._ep_failure:
            outputs = self.session.run(names, feeds)
        return dict(zip(names, outputs))  # noqa: B905 (one output per name; the keyword alone costs ~1 us a call)


class EmulatedOnnxRuntimeRunner(OnnxRuntimeRunner):
    """The same runner on an aarch64 ONNX Runtime under emulation (pipeline/backends/emulated)."""

    def __init__(self, session: EmulatedSession) -> None:
        super().__init__(session)  # the parts of InferenceSession the runner uses
        self._worker = session.worker

    def close(self) -> None:
        self._worker.close()


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    Options = OnnxRuntimeOptions
    Meta = OnnxRuntimeMeta
    capabilities = Capabilities(
        precisions=("fp32", "fp16", "int8"),
        devices=("cpu", "gpu", "npu"),
        runtime_package="onnxruntime",
        per_node_precision=True,
    )
    install_hint = "pip install onnxruntime (CPU) or onnxruntime-gpu (CUDA, TensorRT)"
    engine_format = "skuforge-onnxruntime/1"
    runtime_keys = ("onnxruntime",)
    emulation = True

    @classmethod
    def _check_sku_impl(cls, sku: SkuSpec, options: OnnxRuntimeOptions) -> list[str]:
        primary = options.providers[0]
        supported = PROVIDER_PRECISIONS.get(primary)
        if supported is None:
            return [
                f"options.providers: unknown execution provider {primary!r}; known: {', '.join(PROVIDER_PRECISIONS)}"
            ]
        if sku.precision not in supported:
            others = [p for p, precs in PROVIDER_PRECISIONS.items() if sku.precision in precs]
            return [
                f"precision: {sku.precision} is not supported by onnxruntime on {primary} "
                f"(it runs {', '.join(sorted(supported))}); "
                f"list a provider that runs {sku.precision} first: {', '.join(others)}"
            ]
        return []

    def cross_compiles(self, sku: SkuSpec) -> bool:
        """A CPU engine saved below level "all" holds no layout ops of the building CPU (NCHWc, in
        blocks of its vector width): the same ONNX Runtime release runs it on any CPU, so it is
        built on any host and validated where its CPU runs (natively, or under emulation)."""
        opts = self.options(sku)
        return sku.target.device == "cpu" and opts.providers == [CPU] and opts.graph_optimization_level != "all"

    def environment_problems(self, sku: SkuSpec, purpose: str = "run") -> list[str]:
        try:
            ort = ort_module()
        except EnvironmentProblem as exc:
            return [f"{exc.message} ({self.install_hint})"]
        available = set(ort.get_available_providers())
        opts = self.options(sku)
        missing = [p for p in opts.providers if p not in available]
        if not opts.require_all_providers and len(missing) < len(opts.providers):
            return []
        return [
            f"execution provider {p} is not in this onnxruntime build (available: {', '.join(sorted(available))})"
            for p in missing
        ]

    def versions(self) -> dict[str, str]:
        return {"onnxruntime": runtime_version(), "onnx": onnx_version()}

    def _qdq_arguments(self) -> dict[str, Any]:
        return {"newest_opset": newest_qdq_opset()}

    def _convert_precision(self, ctx: BuildContext, staged: Staged) -> None:
        """The calibrated QDQ graph, then (options.recurrent) its LSTMs quantized dynamically; what
        was quantized and what was kept in float, with why, is in the build report's calibration."""
        super()._convert_precision(ctx, staged)
        opts: OnnxRuntimeOptions = staged.options
        if ctx.sku_spec.precision != "int8" or staged.calibration is None or not opts.dynamic_recurrent():
            return
        record = quantize_lstm_dynamic(
            staged.source,
            staged.work / "recurrent.onnx",
            staged.calibration.get("nodes_to_exclude") or [],
            reduce_range=bool(opts.reduce_range),
            per_channel=opts.per_channel,
        )
        if record is None:  # no LSTM
            return
        staged.calibration["dynamic"] = record
        if record["nodes"]:
            staged.replace(staged.work / "recurrent.onnx")

    def _build_impl(self, ctx: BuildContext, staged: Staged) -> BuildOutcome:
        import onnx

        requested: list[str] = staged.options.providers
        available = set(ort_module().get_available_providers())
        skipped = [p for p in requested if p not in available]
        opts: OnnxRuntimeOptions = staged.options.model_copy(
            update={"providers": [p for p in requested if p in available]}
        )
        engine = ctx.engine_dir / "model.onnx"
        so = _session_options(opts, opts.graph_optimization_level)
        so.optimized_model_filepath = str(engine)
        create_session(staged.source, so, opts.providers, opts.provider_options)
        if not engine.is_file():  # ORT writes nothing at level "disable" on some versions
            shutil.copyfile(staged.source, engine)
        optimized = onnx.load(str(engine), load_external_data=False)
        hardware_specific = any(n.domain == "com.microsoft.nchwc" for n in optimized.graph.node)
        meta = OnnxRuntimeMeta(
            providers=opts.providers,
            provider_options=opts.provider_options,
            load_optimization_level=opts.load_optimization_level,
            intra_op_num_threads=opts.intra_op_num_threads,
            inter_op_num_threads=opts.inter_op_num_threads,
            host_cpu=probe.cpu_record(),
            nchwc_block=nchwc_block() if hardware_specific else None,
            # standard ONNX ops only: any ONNX Runtime with the opset runs it, so loading does not insist
            # on the version that built it (the rollout's portable fallback relies on this)
            portable=all(n.domain in ("", "ai.onnx") for n in optimized.graph.node),
        )
        layers, boundaries = self._probe(optimized, engine, opts, ctx.probe_inputs)
        warnings = [f"execution provider {p} is not in this onnxruntime build: skipped" for p in skipped]
        warnings += conversion_warnings(staged.calibration)
        if hardware_specific:
            warnings.append(
                "optimized at level 'all': the engine holds NCHWc layout ops specific to this CPU's vector width"
            )
        return BuildOutcome(
            files=["model.onnx"],
            layers=layers,
            requested_devices=requested,
            partition_boundaries=boundaries,
            options=opts.model_dump(mode="json"),
            calibration=staged.calibration,
            hardware_specific=hardware_specific,
            warnings=warnings,
            meta=meta,
        )

    def _probe(
        self, graph: Any, engine: Path, opts: OnnxRuntimeOptions, feeds: dict[str, np.ndarray]
    ) -> tuple[list[LayerInfo], int]:
        """Run the engine once with profiling on: which provider ran each node, on which types."""
        with tempfile.TemporaryDirectory(prefix="skuforge-prof-") as tmp:
            so = _session_options(opts, "disable", profile_dir=Path(tmp))
            runner = OnnxRuntimeRunner(create_session(engine, so, opts.providers, opts.provider_options))
            runner.infer(feeds)
            trace = json.loads(Path(runner.session.end_profiling()).read_text())
        seen = {name: ev.get("args", {}) for name, ev in node_events(trace)}
        layers, device_of = [], {}
        for node in graph.graph.node:
            args = seen.get(node.name, {})
            device = args.get("provider")
            device_of.update({out: device for out in node.output})
            layers.append(
                LayerInfo(
                    name=node.name,
                    op_type=node.op_type,
                    device=device,
                    precision=_layer_precision(node.op_type, args.get("input_type_shape", [])) if args else None,
                    kernel=f"{node.domain + '.' if node.domain else ''}{node.op_type}",
                )
            )
        # a tensor made on one device and read on another is a copy between partitions
        boundaries = sum(
            1
            for node, layer in zip(graph.graph.node, layers, strict=True)
            for name in node.input
            if layer.device and device_of.get(name) and device_of[name] != layer.device
        )
        return layers, boundaries

    def _load_impl(self, engine_dir: Path, meta: OnnxRuntimeMeta, sku: SkuSpec) -> Runner:
        problem = nchwc_problem(meta.nchwc_block)
        if problem:
            raise EnvironmentProblem(
                f"{engine_dir}: {problem}",
                hint="rebuild the engine on this CPU, or build it with "
                "options.graph_optimization_level: extended (portable, no NCHWc ops)",
            )
        opts = self.options(sku).model_copy(
            update={
                "intra_op_num_threads": meta.intra_op_num_threads,
                "inter_op_num_threads": meta.inter_op_num_threads,
            }
        )

        def open_session(profile_dir: Path | None = None) -> ort.InferenceSession:
            so = _session_options(opts, meta.load_optimization_level, profile_dir=profile_dir)
            return create_session(engine_dir / "model.onnx", so, meta.providers, meta.provider_options, engine=True)

        return OnnxRuntimeRunner(open_session(), reopen=open_session)

    def _load_emulated_impl(self, engine_dir: Path, meta: OnnxRuntimeMeta, sku: SkuSpec) -> Runner:
        load = {
            "runtime": "onnxruntime",
            "model": str(engine_dir / "model.onnx"),
            "providers": meta.providers,
            "level": meta.load_optimization_level,
            "intra": meta.intra_op_num_threads,
            "inter": meta.inter_op_num_threads,
        }
        worker = Worker(load, str(engine_dir))
        try:
            check_versions(worker, meta.versions, () if meta.portable else self.runtime_keys, engine_dir)
            return emulated_runner(EmulatedOnnxRuntimeRunner(EmulatedSession(worker)), worker)
        except BaseException:
            worker.close()
            raise


def nchwc_block(flags: Any = None, arch: str | None = None) -> int | None:
    """The channel block of ONNX Runtime's NCHWc ops on a CPU (MLAS: 16 floats with AVX-512F, 8 on
    other x86-64 CPUs), from the flags the host reports; None where it is not known."""
    if (arch or probe.host_arch()) != "x86_64":
        return None
    return 16 if "avx512f" in (probe.cpu_features() if flags is None else set(flags)) else 8


def nchwc_problem(built: int | None, flags: Any = None, arch: str | None = None) -> str | None:
    """Why an engine with NCHWc ops cannot run on this CPU: its weights and channel padding are laid
    out in blocks of the build CPU's vector width and ORT reads them in this CPU's. ORT does not
    check at load; at run time a ReorderOutput may fail its channel assertion, or, where the
    channel counts are multiples of both blocks, the engine silently computes wrong numbers."""
    have = nchwc_block(flags, arch)
    if built is None or have is None or built == have:
        return None
    decided = "avx512f" if built == 16 else "no avx512f"
    return (
        f"the engine holds NCHWc ops in blocks of {built} channels (built on a CPU with {decided}); this CPU "
        f"{'has' if have == 16 else 'lacks'} avx512f and uses blocks of {have}"
    )


def _layer_precision(op_type: str, type_shapes: list[dict[str, Any]]) -> str | None:
    kinds = [_ORT_TYPES.get(next(iter(ts)), next(iter(ts))) for ts in type_shapes if ts]
    if op_type in _PRECISION_NEUTRAL:
        return "n/a"
    for want in ("int8", "fp16", "fp32", "fp64"):
        if want in kinds:
            return want
    return kinds[0] if kinds else None
