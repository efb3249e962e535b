"""IREE: ONNX imported to MLIR, compiled ahead of time into a VM flatbuffer (``module.vmfb``) for a
CPU (``llvm-cpu``), a Vulkan (SPIR-V) or a CUDA device, run through ``iree.runtime``.

IREE cross-compiles: the compiler builds any target on any host, and only running the engine
needs the device. The one exception is ``target_cpu: host``, which compiles for the build host's
CPU: such a SKU is built on its target hardware. "host" is resolved here, not by LLVM: the
architecture's generic CPU plus the features the host reports (``pipeline.host.probe``). LLVM's
own host detection goes by the CPU's name, and a name implies features a virtual machine may hide
(an Emerald Rapids guest without AMX is still "emeraldrapids", which implies AMX).

The build report lists the dispatches (fusion groups) the compiler produced, read from the
executable sources it dumps: the op and element types are in each dispatch's name, and the ONNX
nodes fused into it are in the MLIR locations the importer attaches to every op.

The package on its seams: ``common`` (options, engine metadata, versions, host checks),
``compiler`` (import to MLIR, iree-compile, their failures), ``dispatches`` (the dispatch report),
``runner`` (the VM on a device), ``backend`` (the backend contract).
"""

from pipeline.backends.iree.backend import IreeBackend
from pipeline.backends.iree.common import VMFB, IreeMeta, IreeOptions, missing_cpu_features
from pipeline.backends.iree.compiler import (
    ImportRefused,
    compile_error,
    compile_flags,
    import_error,
    import_failure,
    import_onnx,
    to_mlir,
)
from pipeline.backends.iree.dispatches import dispatch_op_type, dispatch_precision, parse_dispatches
from pipeline.backends.iree.runner import IreeRunner

__all__ = [
    "VMFB",
    "ImportRefused",
    "IreeBackend",
    "IreeMeta",
    "IreeOptions",
    "IreeRunner",
    "compile_error",
    "compile_flags",
    "dispatch_op_type",
    "dispatch_precision",
    "import_error",
    "import_failure",
    "import_onnx",
    "missing_cpu_features",
    "parse_dispatches",
    "to_mlir",
]
