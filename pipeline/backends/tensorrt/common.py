"""TensorRT options, their config-time checks (no SDK) and the optimization profile of a SKU's shapes."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.core.errors import ConfigError
from pipeline.results.reports import TensorSig

if TYPE_CHECKING:
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
