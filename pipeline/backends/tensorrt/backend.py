"""The TensorRT backend: build (parse, configure, build, inspect, timing cache) and load."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.backends.base import Backend, onnx_version
from pipeline.backends.contract import BuildContext, BuildOutcome, Capabilities, EngineMeta, Runner, Staged
from pipeline.backends.quantize import to_fp16
from pipeline.backends.tensorrt.common import (
    AMPERE_CC,
    ENGINE_FILE,
    FP8_MIN_CC,
    INSTALL_HINT,
    LAYERS_FILE,
    NAME,
    TIMING_CACHE,
    HardwareCompatibility,
    TensorRtOptions,
    check_sku,
    optimization_profile,
    requested_devices,
)
from pipeline.backends.tensorrt.inspector import builder_failure, parse_engine_information, parser_error, parser_failure
from pipeline.backends.tensorrt.int8 import quantize_for_tensorrt
from pipeline.backends.tensorrt.runner import TensorRtRunner, deserialize, io_names
from pipeline.backends.tensorrt.sdk import (
    TimingCache,
    configure,
    cuda_runtime_version,
    cudart_module,
    keep_fp32,
    trt_logger,
    trt_module,
    version_compatible_runtime,
)
from pipeline.core.errors import EnvironmentProblem, InputError
from pipeline.core.io import atomic_write_bytes
from pipeline.host.probe import NO_GPU, gpu_info
from pipeline.model.graph import signature
from pipeline.results.reports import Signature

if TYPE_CHECKING:
    from pipeline.project.config import SkuSpec

log = logging.getLogger(__name__)

log = logging.getLogger(__name__)


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
            trt = trt_module()
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
                cudart_module()
            except EnvironmentProblem as exc:
                problems.append(exc.message)
        if trt is not None and gpu is not None and opts.dla_core is not None:
            cores = trt.Builder(trt_logger(trt)).num_DLA_cores
            if opts.dla_core >= cores:
                problems.append(f"options.dla_core {opts.dla_core}: this host has {cores} DLA cores")
        return problems

    def versions(self) -> dict[str, str]:
        trt = trt_module()
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
            "tensorrt": trt_module().__version__,
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
        trt = trt_module()
        sig = signature(staged.model)
        shapes = optimization_profile(sig.inputs, ctx.pins, ctx.profiles)
        precision = ctx.sku_spec.precision
        calibration = staged.calibration
        logger = trt_logger(trt)
        mark = logger.mark()
        source = staged.source
        onnx_ops = {n.name: n.op_type for n in staged.model.graph.node if n.name}
        builder = trt.Builder(logger)
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if opts.strongly_typed else 0
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(source)):
            raise parser_failure([parser_error(parser.get_error(i)) for i in range(parser.num_errors)])
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
        cache = TimingCache(staged.cache, config)
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
        runtime, engine = deserialize(trt, blob, opts.version_compatible, opts.dla_core, ctx.engine_dir / ENGINE_FILE)
        names = io_names(trt, engine)
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
        built, have = meta.versions.get("tensorrt", ""), trt_module().__version__
        if not version_compatible_runtime(built, have):
            raise InputError(
                f"{engine_dir} is a version-compatible engine of TensorRT {built}; TensorRT {have} cannot load it "
                "(a later runtime of the same major version can)",
                hint="install that TensorRT version or a later one of its major version, or rebuild",
            )
        return self._loaded(engine_dir, meta, sku)

    def _load_impl(self, engine_dir: Path, meta: TensorRtMeta, sku: SkuSpec) -> Runner:
        trt = trt_module()
        cudart = cudart_module()
        built_cc, gpu = meta.compute_capability, gpu_info()
        have_cc = gpu.compute_capability if gpu else None
        if built_cc and gpu and have_cc and meta.hardware_compatibility != "ampere_plus" and built_cc != have_cc:
            raise InputError(
                f"{engine_dir} was built for compute capability {built_cc} ({meta.gpu}); "
                f"this host's {gpu.name} has {have_cc}",
                hint="run it on the SKU's GPU, or build with options.hardware_compatibility: ampere_plus",
            )
        path = engine_dir / ENGINE_FILE
        runtime, engine = deserialize(trt, path.read_bytes(), meta.version_compatible, meta.dla_core, path)
        return TensorRtRunner(trt, cudart, runtime, engine, meta.signature)
