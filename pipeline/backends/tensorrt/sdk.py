"""The TensorRT and CUDA SDKs: versions, the builder configuration, layers kept in FP32, the timing cache."""

from __future__ import annotations

import collections
import functools
import logging
import threading
from typing import TYPE_CHECKING, Any

from pipeline.backends.tensorrt.common import INSTALL_HINT, NOT_INSTALLED, TIMING_CACHE, TensorRtOptions
from pipeline.core.errors import EnvironmentProblem
from pipeline.core.versions import UnreadableVersion, normalize
from pipeline.host.probe import cuda_runtime_api

if TYPE_CHECKING:
    from pipeline.backends.caches import CacheSession

log = logging.getLogger(__name__)

log = logging.getLogger(__name__)


def cuda_version_string(version: int) -> str:
    """CUDA's integer version (12040) as "12.4"."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def cudart_module() -> Any:
    """cuda-python's runtime API, or an EnvironmentProblem saying how to get it."""
    runtime = cuda_runtime_api()
    if runtime is None:
        raise EnvironmentProblem(
            "cuda-python is not installed (the TensorRT runner's device buffers use it)",
            hint="pip install cuda-python, the CUDA major version of your TensorRT",
        )
    return runtime


def cuda_call(result: tuple, what: str) -> Any:
    err, rest = result[0], result[1:]
    if getattr(err, "value", err) != 0:  # cudaSuccess
        raise EnvironmentProblem(
            f"CUDA {what} failed: {getattr(err, 'name', err)}",
            hint="check the GPU with nvidia-smi; another process may hold its memory",
        )
    return rest[0] if len(rest) == 1 else rest


def cuda_runtime_version() -> str | None:
    try:
        return cuda_version_string(cuda_call(cudart_module().cudaRuntimeGetVersion(), "cudaRuntimeGetVersion"))
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


def trt_module() -> Any:
    try:
        import tensorrt
    except (ImportError, OSError) as exc:  # OSError: the wheel is there but libnvinfer or the driver is not
        raise EnvironmentProblem(NOT_INSTALLED, hint=INSTALL_HINT) from exc
    return tensorrt


@functools.cache
def trt_logger(trt: Any) -> Any:
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


class TimingCache:
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
