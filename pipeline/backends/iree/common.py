"""What every part of the IREE backend shares: the SKU options, the engine metadata, the versions,
what the host lacks to compile or run."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from importlib import metadata
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.backends.contract import BuildContext, EngineMeta
from pipeline.core.errors import first_line
from pipeline.host import probe
from pipeline.results.reports import TensorSig

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

logger = logging.getLogger(__name__)


VMFB = "module.vmfb"
# what the base class's precision conversion is called in an error that blames it
PRECISION_STEP = {"fp16": "FP16 conversion", "int8": "INT8 QDQ quantization"}
IMPORTER_MIN_OPSET = 17
COMPILE_TIMEOUT_S = 1800  # a hung compiler must not hang CI; tiny models compile in seconds
DRIVERS = {"local": ("local-task", "local-sync"), "vulkan": ("vulkan",), "cuda": ("cuda",)}
HOST_ALIGNMENT = 64  # IREE_HAL_HEAP_BUFFER_ALIGNMENT: what the CPU dispatches assume of a buffer
# the embedded-ELF triples IREE's llvm-cpu backend uses per SKU architecture
TRIPLES = {"x86_64": "x86_64-unknown-unknown-eabi-elf", "aarch64": "aarch64-unknown-unknown-eabi-elf"}
# flags the backend sets from the options: passing them in extra_flags would contradict the record
OWNED_FLAGS = (
    "--iree-hal-target-device",
    "--iree-hal-local-target-device-backends",
    "--iree-llvmcpu-target-cpu",
    "--iree-llvmcpu-target-cpu-features",
    "--iree-llvmcpu-target-triple",
    "--iree-vulkan-target",
    "--iree-cuda-target",
    "--iree-hal-dump-executable-sources-to",
    "--mlir-print-debuginfo",
    "--iree-scheduling-dump-statistics-format",
    "--iree-scheduling-dump-statistics-file",
    "-o",
)
PIP_HINT = "pip install 'iree-base-compiler==3.13.*' 'iree-base-runtime==3.13.*'"
# flags that change how fast an engine runs, not what it computes or for which target: in
# extra_flags they are dropped where the model does not build with them (IREE 3.13's im2col
# broke the 1x1 convolutions of a squeeze-excite block at batch 1), unless strict_flags
PERFORMANCE_FLAGS = frozenset(
    {
        "--iree-global-opt-use-im2col-for-convs",
        "--iree-opt-data-tiling",
        "--iree-dispatch-creation-data-tiling",
        "--iree-dispatch-creation-experimental-set-data-tiling-ops",
        "--iree-dispatch-creation-enable-aggressive-fusion",
        "--iree-dispatch-creation-enable-fuse-padding-into-linalg-consumer-ops",
        "--iree-llvmcpu-enable-ukernels",
        "--iree-opt-level",
        "--iree-opt-aggressively-propagate-transposes",
        "--iree-opt-outer-dim-concat",
        "--iree-opt-const-expr-hoisting",
    }
)


class IreeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target_device: Literal["local", "vulkan", "cuda"] = "local"
    target_backend: Literal["llvm-cpu"] = Field("llvm-cpu", description="code generator of the local device")
    target_cpu: str = Field(
        "host",
        description="LLVM CPU name (e.g. x86-64-v3, znver3, cortex-a76); host: the build "
        "host's CPU, as a generic CPU with the features the host reports",
    )
    target_cpu_features: list[str] = Field(default_factory=list, description="LLVM features, e.g. [+avx2, +fma]")
    vulkan_target: str | None = Field(
        None, description="e.g. llvmpipe (lavapipe), valhall, rdna3, ampere; required for vulkan"
    )
    cuda_target: str = "sm_80"
    extra_flags: list[str] = Field(
        default_factory=list,
        description="passed verbatim to iree-compile, recorded; known performance flags among them "
        "(PERFORMANCE_FLAGS) are dropped where the model does not build with them, unless strict_flags",
    )
    optional_flags: list[str] = Field(
        default_factory=list,
        description="performance flags kept only where the model builds with them: one that makes "
        "iree-compile fail is dropped, with the compiler's error in the build report and a warning",
    )
    strict_flags: bool = Field(False, description="drop no flag: a build that fails with the SKU's flags fails")
    driver: Literal["local-task", "local-sync", "vulkan", "cuda"] | None = Field(
        None, description="runtime HAL driver (default: local-task, vulkan or cuda after target_device)"
    )

    @property
    def runtime_driver(self) -> str:
        return self.driver or DRIVERS[self.target_device][0]

    @property
    def droppable_flags(self) -> list[str]:
        """The flags a build may go without (in the order given): optional_flags, and the extra_flags
        that only tune speed. Target-defining flags are options of their own and never dropped."""
        if self.strict_flags:
            return []
        known = [f for f in self.extra_flags if f.split("=", 1)[0] in PERFORMANCE_FLAGS]
        return list(dict.fromkeys(known + list(self.optional_flags)))


def iree_versions() -> dict[str, str]:
    out = {}
    for package in ("iree-base-runtime", "iree-base-compiler", "onnx"):
        # a device running engines need not carry the compiler
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[package] = metadata.version(package)
    return out


class IreeMeta(EngineMeta):
    entry: str
    driver: str
    target_device: str
    inputs: list[TensorSig]
    outputs: list[TensorSig]
    compile_flags: list[str]
    dropped_flags: list[dict[str, str]] = Field(default_factory=list)
    requested_target: dict[str, Any]
    resolved_target: dict[str, Any]


def compiler_problems() -> list[str]:
    problems = []
    if importlib.util.find_spec("onnx") is None:
        problems.append("onnx is not installed (the IREE ONNX importer needs it): pip install onnx")
    if importlib.util.find_spec("iree.compiler") is None:
        return problems + [f"iree-base-compiler is not installed ({PIP_HINT})"]
    if iree_compile_path() is None:
        problems.append("iree-compile was not found in the iree-base-compiler installation (reinstall it)")
    return problems


@functools.cache
def runtime_problems(driver: str) -> tuple[str, ...]:
    """Cached per process: every stage asks, and creating a Vulkan or CUDA device takes a while."""
    if importlib.util.find_spec("iree.runtime") is None:
        return (f"iree-base-runtime is not installed ({PIP_HINT})",)
    import iree.runtime as rt

    available = rt.query_available_drivers()
    if driver not in available:
        return (
            f"IREE runtime driver {driver} is not in this iree-base-runtime "
            f"(available: {', '.join(sorted(available))})",
        )
    try:
        rt.get_driver(driver).create_default_device()
    except Exception as exc:  # the runtime raises RuntimeError/ValueError with the driver's status
        detail = first_line(exc)
        return (f"no {driver} device on this host ({detail})",)
    return ()


def iree_compile_path() -> str | None:
    from iree.compiler.tools.binaries import find_tool

    try:
        return find_tool("iree-compile")
    except Exception:  # find_tool raises a plain Exception when the binary is absent
        return None


def missing_cpu_features(required: list[str]) -> list[str]:
    """Features an engine was compiled for (``+name``, LLVM names) that this CPU does not report
    (``/proc/cpuinfo``, the probe every host target is resolved from); features without a
    reported flag are not judged."""
    return probe.missing_llvm_features(required)


def report_progress(ctx: BuildContext, label: str, fraction: float) -> None:
    if ctx.progress is not None:
        ctx.progress(label, fraction)
