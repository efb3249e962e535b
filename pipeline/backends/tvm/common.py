"""What every part of the TVM backend shares: the SKU options, the engine metadata, the target,
the ELF checks of a built library, the runtime thread pool."""

from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.backends.contract import (
    BuildContext,
    EngineMeta,
)
from pipeline.backends.tvm.loading import import_tvm
from pipeline.backends.tvm.rpc import RpcOptions
from pipeline.core.env import TVM_NUM_THREADS
from pipeline.core.errors import EnvironmentProblem
from pipeline.host import probe
from pipeline.results.reports import TensorSig

if TYPE_CHECKING:
    pass


LIBRARY = "model.so"
WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"
# tasks tuned without a valid candidate (a search space that yields none, every candidate failing to
# build or run): task name -> structural hash. Their decision is TVM's default schedule, replayed as such.
DEFAULTS = "default_schedules.json"
PACKAGE = "apache-tvm"
PIP_HINT = "pip install 'apache-tvm==0.27.*' psutil cloudpickle (and a C compiler, g++ or cc, to link the engine)"
TRIPLES = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}
# A SKU for another architecture is compiled here for its triple and linked by Debian's cross GCC
# (the compiler, its apt package); the ELF machine (e_machine) its library must carry.
CROSS_CC = {
    "aarch64": ("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu"),
    "x86_64": ("x86_64-linux-gnu-gcc", "gcc-x86-64-linux-gnu"),
}
_ELF_MACHINE = {"x86_64": 62, "aarch64": 183}
# fused-function name tokens that are not op names
NOT_OPS = {"fused", "compute", "cast", "expand", "dims"}
# What one tuning trial costs on a 2-core runner (a candidate searched, built in the builder process, then
# measured in another): the tuning-budget warning's estimate until a SKU's tuning is recorded. The ship
# models took about 1 s a trial here (docs/backends/tvm.md); twice that for a slower runner.
SECONDS_PER_TRIAL = 2.0
log = logging.getLogger(__name__)


class TvmOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target_kind: Literal["llvm"] = Field(
        "llvm", description="TVM target kind (the PyPI wheel's runtime has LLVM CPU only)"
    )
    target_cpu: str = Field(
        "host",
        description="LLVM CPU (-mcpu), e.g. x86-64-v3, znver3, cortex-a76; host: the "
        "generic CPU of the architecture with the features this host reports",
    )
    target_cpu_features: list[str] = Field(
        default_factory=list, description="LLVM features (-mattr), e.g. [+avx2, +fma]"
    )
    num_cores: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="cores the schedules are tuned for (target num-cores); "
        "None: this host's (then part of the cache key)",
    )
    trials: int = Field(
        0,
        ge=0,
        le=100_000,
        description="MetaSchedule trials for a model without a database (0: TVM's default schedules, no database)",
    )
    trials_per_task: int | None = Field(
        None, ge=1, description="cap per tuning task (default: trials spread over the tasks)"
    )
    opt_level: int = Field(3, ge=0, le=3)
    num_threads: int = Field(0, ge=0, description="TVM runtime threads (0: TVM's default, one per physical core)")
    rpc: RpcOptions | None = Field(
        None,
        description="a device bench: tuning measures candidates, and validate and bench run the engine, on the "
        "devices registered under this tracker key (the tracker's address: SKUFORGE_TVM_TRACKER)",
    )
    max_minutes: float | None = Field(
        None, gt=0, le=10_000, description="tuning stops at this many minutes and keeps the best schedules found"
    )


class TvmMeta(EngineMeta):
    library: str
    target: dict[str, Any]
    device: Literal["cpu"]
    entry: str
    inputs: list[TensorSig]
    outputs: list[TensorSig]
    num_threads: int
    tuned: int = Field(description="primitive functions scheduled from the tuning database")
    functions: int = Field(description="primitive functions in the engine")


def tvm_module() -> Any:
    try:
        return import_tvm()
    except ImportError as exc:
        raise EnvironmentProblem("apache-tvm is not installed", hint=PIP_HINT) from exc


def tvm_version() -> str | None:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return None


def target_of(options: TvmOptions, arch: str) -> dict[str, Any]:
    """The TVM target (JSON form) of the options; ``host`` resolves to the architecture's generic
    CPU with the features this host reports, as the IREE backend does."""
    cpu, features = probe.resolve_llvm_target(options.target_cpu, options.target_cpu_features, arch)
    target: dict[str, Any] = {
        "kind": options.target_kind,
        "mcpu": cpu,
        "num-cores": options.num_cores or probe.usable_cores(),
    }
    if arch in TRIPLES:
        target["mtriple"] = TRIPLES[arch]
    if features:
        target["mattr"] = features
    return target


def elf_machine_problem(path: Path, arch: str) -> str | None:
    """Why the library at ``path`` is not code for ``arch``: its ELF header's e_machine names another."""
    import struct

    with open(path, "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return f"{path.name} is not an ELF shared library"
    machine = struct.unpack_from("<H" if head[5] == 1 else ">H", head, 18)[0]
    if machine != _ELF_MACHINE[arch]:
        return f"{path.name} has ELF machine {machine}, not {arch}'s {_ELF_MACHINE[arch]}"
    return None


def elf_extent_problem(path: Path) -> str | None:
    """Why a shared library cannot be mapped safely: not ELF, or a program segment or the section
    table reaching past the end of the file (a truncated library: dlopen maps it and the first
    touch of the missing pages kills the process with SIGBUS, before TVM can refuse it)."""
    import struct

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
            return "not an ELF shared library"
        wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
        if wide and len(head) < 64:
            return "truncated ELF header"
        if wide:
            phoff, shoff = struct.unpack_from(order + "QQ", head, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x36)
        else:
            phoff, shoff = struct.unpack_from(order + "II", head, 0x1C)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x2A)
        if shoff + shnum * shentsize > size:
            return f"its section table ends at byte {shoff + shnum * shentsize}, past the file's {size} bytes"
        if phoff + phnum * phentsize > size:
            return f"its program headers end at byte {phoff + phnum * phentsize}, past the file's {size} bytes"
        f.seek(phoff)
        table = f.read(phnum * phentsize)
    for i in range(phnum):
        entry = table[i * phentsize : (i + 1) * phentsize]
        if wide:
            offset, filesz = (
                struct.unpack_from(order + "Q", entry, 8)[0],
                struct.unpack_from(order + "Q", entry, 0x20)[0],
            )
        else:
            offset, filesz = struct.unpack_from(order + "I", entry, 4)[0], struct.unpack_from(order + "I", entry, 16)[0]
        if offset + filesz > size:
            return f"segment {i} ends at byte {offset + filesz}, past the file's {size} bytes (truncated)"
    return None


def runtime_threads(count: int) -> str | None:
    """Give TVM's thread pool ``count`` threads (0: TVM's default), as TVM_NUM_THREADS, which the
    pool reads once, when it starts (the first parallel kernel of the process), for the whole
    process: the first engine loaded decides, and a variable the user set wins. Measured here on
    the transformer example, called from Python: 465 us per call with the default pool (its workers
    sleep between calls and are woken for every parallel kernel), 63 us with one thread. Returns
    the value in effect."""
    if count and not TVM_NUM_THREADS.is_set():
        TVM_NUM_THREADS.set(str(count))
    return TVM_NUM_THREADS.raw()


class child_threads:
    """TVM_NUM_THREADS for a child process (MetaSchedule's measuring runner); 0 leaves it."""

    def __init__(self, count: int):
        self.count = count

    def __enter__(self) -> None:
        self._before = TVM_NUM_THREADS.raw()
        if self.count:
            TVM_NUM_THREADS.set(str(self.count))

    def __exit__(self, *exc: object) -> None:
        if self.count:
            if self._before is None:
                TVM_NUM_THREADS.unset()
            else:
                TVM_NUM_THREADS.set(self._before)


def report_progress(ctx: BuildContext, label: str, fraction: float) -> None:
    if ctx.progress:
        ctx.progress(label, fraction)
