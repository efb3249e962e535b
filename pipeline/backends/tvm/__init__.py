"""Apache TVM: the ONNX model through the Relax frontend, fused and compiled for an LLVM CPU target,
its kernels scheduled by MetaSchedule from the SKU's checked-in tuning database.

Build: ``relax.frontend.onnx`` (a model it refuses is tried again with its fixed shapes folded
to constants, then converted to a newer opset; UnsupportedOp when every graph is refused) ->
inference decompositions -> legalize, fold, fuse (each fused group of ops one TIR primitive
function, the "layers" of the report) -> MetaSchedule: every primitive function is a tuning task,
looked up in the database of ``caches/<sku>/<model>/``; a task not found there is a miss (the
build fails when the SKU requires its cache), tuned with the SKU's trial budget
(``options.trials``) and added when tuning is asked for (``skuforge cache refresh``, an explicit
budget, SKUFORGE_TUNE=1), else built with TVM's default schedule and a warning -> ``MetaScheduleApplyDatabase`` -> the
executable exported as a shared library (``model.so``) that ``tvm.runtime.load_module`` and the
Relax VM load. ``options.trials: 0`` builds with TVM's default schedules and no database.

The report names each fused primitive function, the ONNX nodes it came from (recovered by
following the frontend's bindings through the fusion pass), its precision, and whether its
schedule came from the database ("tuned") or TVM's default ("default").

The package on its seams: ``common`` (options, engine metadata, target, ELF checks, thread pool),
``runner`` (a library on the Relax VM), ``importer`` (ONNX to Relax, lowering, the primitive
functions' ONNX origins), ``tuning`` (MetaSchedule), ``rpc`` (the tracker and remote runners),
``backend`` (the backend contract: build, load, cross builds).
"""

from pipeline.backends.tvm.backend import TvmBackend
from pipeline.backends.tvm.common import (
    DEFAULTS,
    LIBRARY,
    RECORDS,
    WORKLOADS,
    TvmMeta,
    TvmOptions,
    elf_extent_problem,
    elf_machine_problem,
    runtime_threads,
    target_of,
)
from pipeline.backends.tvm.importer import import_onnx, lower, op_type_of, primitive_functions
from pipeline.backends.tvm.runner import TvmRunner
from pipeline.backends.tvm.tuning import (
    TuningProgress,
    compile_module,
    extract_tasks,
    open_database,
    tune_run,
    tuning_budget,
    tuning_budget_warning,
)

__all__ = [
    "DEFAULTS",
    "LIBRARY",
    "RECORDS",
    "WORKLOADS",
    "TuningProgress",
    "TvmBackend",
    "TvmMeta",
    "TvmOptions",
    "TvmRunner",
    "compile_module",
    "elf_extent_problem",
    "elf_machine_problem",
    "extract_tasks",
    "import_onnx",
    "lower",
    "op_type_of",
    "open_database",
    "primitive_functions",
    "runtime_threads",
    "target_of",
    "tune_run",
    "tuning_budget",
    "tuning_budget_warning",
]
