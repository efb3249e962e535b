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
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.backends.base import Backend, onnx_version
from pipeline.backends.caches import seconds_per_trial
from pipeline.backends.contract import (
    BuildContext,
    BuildOutcome,
    Capabilities,
    EngineMeta,
    Runner,
    Staged,
    median_per_run,
)
from pipeline.backends.opset import OPSET_CONVERSION_RTOL, OpsetConversion, convert_opset, probe_difference
from pipeline.backends.tvm_rpc import RemoteTvmRunner, RpcOptions, connect, rpc_runner
from pipeline.core.env import SKUFORGE_TUNE, SKUFORGE_TVM_TRACKER, TVM_NUM_THREADS
from pipeline.core.errors import EnvironmentProblem, InputError, UnsupportedOp
from pipeline.core.progress import Progress
from pipeline.host import probe
from pipeline.model.graph import default_opset, fold_static_shapes, signature
from pipeline.results.reports import LayerInfo, TensorSig

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from pipeline.project.config import SkuSpec

LIBRARY = "model.so"
WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"
# tasks tuned without a valid candidate (a search space that yields none, every candidate failing to
# build or run): task name -> structural hash. Their decision is TVM's default schedule, replayed as such.
DEFAULTS = "default_schedules.json"
_PACKAGE = "apache-tvm"
_PIP = "pip install 'apache-tvm==0.27.*' psutil cloudpickle (and a C compiler, g++ or cc, to link the engine)"
_TRIPLES = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}
# A SKU for another architecture is compiled here for its triple and linked by Debian's cross GCC
# (the compiler, its apt package); the ELF machine (e_machine) its library must carry.
_CROSS_CC = {
    "aarch64": ("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu"),
    "x86_64": ("x86_64-linux-gnu-gcc", "gcc-x86-64-linux-gnu"),
}
_ELF_MACHINE = {"x86_64": 62, "aarch64": 183}
# fused-function name tokens that are not op names
_NOT_OPS = {"fused", "compute", "cast", "expand", "dims"}
# What one tuning trial costs on a 2-core runner (a candidate built in a new process, then measured
# in another): the tuning-budget warning's estimate. Measured here with the test models (docs/backends/tvm.md).
SECONDS_PER_TRIAL = 12.0
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


def _tvm() -> Any:
    try:
        import tvm
    except ImportError as exc:
        raise EnvironmentProblem("apache-tvm is not installed", hint=_PIP) from exc
    return tvm


def _version() -> str | None:
    try:
        return metadata.version(_PACKAGE)
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
    if arch in _TRIPLES:
        target["mtriple"] = _TRIPLES[arch]
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


class TvmRunner(Runner):
    """A loaded library on the Relax VM; calls are serialised (one VM, not thread-safe)."""

    def __init__(self, library: Path, meta: TvmMeta):
        super().__init__(list(meta.inputs), [o.name for o in meta.outputs])
        runtime_threads(meta.num_threads)
        tvm = _tvm()
        from tvm import relax

        self._tvm, self._dev = tvm, tvm.cpu(0)
        self._library, self._entry = library, meta.entry
        self._lock = threading.Lock()
        self._buffers: list[Any] | None = None
        self._views: list[Any] = []  # numpy arrays on the buffers' memory (None: copied by TVM)
        problem = elf_extent_problem(library)
        if problem is not None:
            raise InputError(
                f"{library} cannot be loaded: {problem}",
                hint="the library is damaged (truncated or not a library): rebuild the engine",
            )
        try:
            self._vm = relax.VirtualMachine(tvm.runtime.load_module(str(library)), self._dev)
            self._main = self._vm[meta.entry]
        except Exception as exc:  # TVMError, OSError from dlopen: a damaged or foreign library
            detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise InputError(
                f"{library} cannot be loaded by TVM {_version()}: {detail}",
                hint="the library is damaged or from another TVM build or CPU: rebuild the engine",
            ) from exc

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import numpy as np

        with self._lock:
            if self._buffers is None:  # static shapes: one device buffer per input, filled per call
                self._buffers = [
                    self._tvm.runtime.empty(feeds[s.name].shape, feeds[s.name].dtype, self._dev) for s in self.inputs
                ]
                self._views = [_host_view(b) for b in self._buffers]
            for buffer, view, sig in zip(self._buffers, self._views, self.inputs, strict=True):
                arr = feeds[sig.name]
                if view is not None and view.shape == arr.shape:  # ~1 us; Tensor.copyfrom costs ~12
                    np.copyto(view, arr)
                else:  # copyfrom refuses another shape
                    buffer.copyfrom(np.asarray(arr, order="C"))  # asarray keeps 0-d arrays 0-d
            out = self._main(*self._buffers)
            outs = [out] if hasattr(out, "shape") else list(out)
            # copied out under the lock: the VM may reuse an output's storage on the next call
            # (np.from_dlpack + copy: 1-2 us here, Tensor.numpy(): about 15)
            return {name: _to_numpy(o) for name, o in zip(self.output_names, outs, strict=True)}

    def profile_layers(self, feeds: dict[str, np.ndarray], iterations: int = 20) -> dict[str, float] | None:
        """Median ms per primitive function (build.json layer names) on a second VM over the same
        library, timed by the VM's instrument hook around each call (the VM's builtins, such as
        allocations, are left out); the first run is left out. The hook's own cost, a few
        microseconds per call, is inside the times."""
        import time

        import numpy as np
        from tvm import relax

        vm = relax.VirtualMachine(self._tvm.runtime.load_module(str(self._library)), self._dev)
        started: dict[str, float] = {}
        runs: dict[str, list[float]] = {}
        counting = False

        def instrument(func: Any, symbol: str, before: bool, ret: Any, *args: Any) -> int:
            if before:
                started[symbol] = time.perf_counter()
            elif counting and not symbol.startswith("vm.builtin."):
                runs.setdefault(symbol, []).append((time.perf_counter() - started.pop(symbol)) * 1e3)
            return 0  # VMInstrumentReturnKind.NO_OP

        vm.set_instrument(instrument)
        args = [self._tvm.runtime.tensor(np.asarray(feeds[s.name], order="C"), self._dev) for s in self.inputs]
        for i in range(iterations + 1):
            counting = i > 0
            vm[self._entry](*args)
        return {name: median_per_run(times, iterations) for name, times in runs.items()}

    def close(self) -> None:
        self._vm = self._main = self._buffers = None
        self._views = []


def _host_view(tensor: Any) -> np.ndarray | None:
    """A writable numpy array on a CPU tensor's memory; None where numpy cannot import its dtype."""
    import numpy as np

    try:
        view = np.from_dlpack(tensor)
    except (TypeError, ValueError, RuntimeError, BufferError):
        return None
    return view if view.flags.writeable else None


def _to_numpy(tensor: Any) -> np.ndarray:
    import numpy as np

    try:
        return np.from_dlpack(tensor).copy()
    except (TypeError, ValueError, RuntimeError, BufferError):  # a dtype numpy's DLPack import lacks
        return tensor.numpy()


class TvmBackend(Backend):
    name = "tvm"
    Options = TvmOptions
    Meta = TvmMeta
    capabilities = Capabilities(
        precisions=("fp32",),
        devices=("cpu",),
        runtime_package=_PACKAGE,
        per_node_precision=False,
        cache="tuning-database",
    )
    cache_files = (WORKLOADS, RECORDS, DEFAULTS)
    install_hint = _PIP
    engine_format = "skuforge-tvm-relax/1"
    runtime_keys = (_PACKAGE,)  # the library calls into the runtime of the TVM that compiled it

    @classmethod
    def _check_sku_impl(cls, sku: SkuSpec, options: TvmOptions) -> list[str]:
        problems = []
        if options.trials_per_task is not None and options.trials == 0:
            problems.append("options.trials_per_task: set with trials 0 (no tuning); set options.trials too")
        if sku.cache.require and options.trials == 0:
            problems.append("cache.require: options.trials is 0, so the build uses no tuning database; set trials")
        if sku.profiles:
            problems.append(
                f"profiles: the tvm backend compiles static shapes; pin {', '.join(sorted(sku.profiles))} "
                "in shapes instead"
            )
        if sku.target.arch not in _TRIPLES:
            problems.append(f"target.arch: {sku.target.arch} has no LLVM triple here (known: {', '.join(_TRIPLES)})")
        return problems

    def runs_remotely(self, sku: SkuSpec) -> bool:
        """A SKU naming a bench key (``options.rpc``), with the tracker set: validate and bench run
        its library on a device registered under the key (a session per run, exit 4 when none is)."""
        return self.options(sku).rpc is not None and SKUFORGE_TVM_TRACKER.is_set()

    def cross_compiles(self, sku: SkuSpec) -> bool:
        """A SKU for another architecture is compiled for its triple here and linked by a cross
        compiler; its runner (or a device through the tracker) loads and runs it."""
        return sku.target.arch != probe.host_arch()

    def environment_problems(self, sku: SkuSpec, purpose: str = "run") -> list[str]:
        try:
            tvm = _tvm()
        except EnvironmentProblem as exc:
            return [f"{exc.message} ({_PIP})"]
        problems = []
        if not tvm.runtime.enabled("llvm") and purpose == "build":
            problems.append("this TVM build has no LLVM code generator (USE_LLVM OFF)")
        if purpose == "build" and self.cross_compiles(sku):
            problems += _cross_problems(sku, self.options(sku))
        elif purpose == "build":
            if not (shutil.which("g++") or shutil.which("cc")):
                problems.append("no C compiler (g++ or cc) to link the engine library: install gcc")
            if self.options(sku).trials:
                for module in ("psutil", "cloudpickle"):
                    try:
                        __import__(module)
                    except ImportError:
                        problems.append(f"MetaSchedule tuning needs {module}: pip install {module}")
        return problems

    def versions(self) -> dict[str, str]:
        return {_PACKAGE: _version() or "unknown", "onnx": onnx_version()}

    def uses_cache(self, options: TvmOptions) -> bool:
        return options.trials > 0

    def cache_key(self, sku: SkuSpec) -> dict[str, str]:
        """A tuning database holds schedules measured for one target under one TVM version."""
        return {
            _PACKAGE: _version() or "unknown",
            "target": json.dumps(target_of(self.options(sku), sku.target.arch), sort_keys=True),
        }

    def check_cache(self, folder: Path) -> str | None:
        """Each line of MetaSchedule's JSON database is a JSON array; the defaults file maps task
        names to structural hashes."""
        defaults = folder / DEFAULTS
        if defaults.is_file():
            try:
                doc = json.loads(defaults.read_text())
            except ValueError:
                return f"{DEFAULTS} is not JSON"
            if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
                return f"{DEFAULTS} is not a map of task names to structural hashes"
        for name in (WORKLOADS, RECORDS):
            path = folder / name
            if not path.is_file():
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    return f"{name} line {number} is not JSON"
                if not isinstance(row, list) or len(row) < 2:
                    return f"{name} line {number} is not a MetaSchedule record"
        return None

    # --- build --------------------------------------------------------------------------------

    def _build_impl(self, ctx: BuildContext, staged: Staged) -> BuildOutcome:

        opts: TvmOptions = staged.options
        tvm = _tvm()
        target_json = target_of(opts, ctx.sku_spec.target.arch)
        target = tvm.target.Target(target_json)
        sig = signature(staged.model)
        imported = import_onnx(staged.model, ctx.probe_inputs)
        warnings = [w for w in [imported.warning()] if w]
        _progress(ctx, "tvm lower", 0.1)
        mod, origins = lower(imported.mod, target, imported.node_of)
        functions = primitive_functions(mod)
        database: Any = None
        tuned: set[str] = set()
        untuned = 0
        if self.uses_cache(opts):
            database, tuned, untuned = self._schedule(ctx, staged, mod, target, opts, warnings)
        _progress(ctx, "tvm compile", 0.7)
        executable = compile_module(mod, target, database, opts.opt_level)
        arch = ctx.sku_spec.target.arch
        cross = self.cross_compiles(ctx.sku_spec)
        # a cross build is linked by the target's GCC; the C compiler TVM finds otherwise links for this host
        executable.export_library(str(ctx.engine_dir / LIBRARY), **({"cc": _CROSS_CC[arch][0]} if cross else {}))
        wrong = elf_machine_problem(ctx.engine_dir / LIBRARY, arch)
        if wrong:  # a linker that ignored the triple: the device would refuse the library at load
            raise EnvironmentProblem(f"the exported library is not for {arch}: {wrong}", hint=_cross_hint(arch))
        meta = TvmMeta(
            library=LIBRARY,
            target=target_json,
            device="cpu",
            entry="main",
            inputs=sig.inputs,
            outputs=sig.outputs,
            num_threads=opts.num_threads,
            tuned=len(tuned & set(functions)),
            functions=len(functions),
            host_cpu=probe.cpu_record(),
        )
        if cross:  # this host cannot load it: the SKU's runner, or a device through the tracker, runs it
            log.info("[%s/%s] cross-compiled for %s: not loaded here", ctx.model, ctx.sku, target_json["mtriple"])
        else:
            runner = TvmRunner(ctx.engine_dir / LIBRARY, meta)
            runner.infer(ctx.probe_inputs)  # it loads and runs before it is called an engine
            runner.close()
        layers = [
            LayerInfo(
                name=fn,
                op_type=op_type_of(fn),
                precision=precision,
                device="cpu",
                kernel="tuned" if fn in tuned else "default",
                fused_from=origins.get(fn, []),
            )
            for fn, precision in functions.items()
        ]
        if not any(layer.fused_from for layer in layers):
            warnings.append("no primitive function could be traced to its ONNX nodes: fused_from is empty")
        hardware_specific = opts.target_cpu == "host"
        if hardware_specific:
            warnings.append(
                f"target_cpu host resolved to {target_json['mcpu']} with {len(target_json.get('mattr', []))} "
                "CPU features (those this host reports): the engine runs only on CPUs that have them"
            )
        options = {
            **opts.model_dump(mode="json"),
            "target": target_json,
            "functions": len(functions),
            "tuned_functions": meta.tuned,
            "untuned_tasks": untuned,  # tasks the database lacks, built with default schedules (tuning not asked for)
            "frontend_import": imported.record(),  # None: the frontend took the model as exported
        }
        return BuildOutcome(
            files=[LIBRARY],
            layers=layers,
            requested_devices=["cpu"],
            partition_boundaries=0,
            options=options,
            hardware_specific=hardware_specific,
            warnings=warnings,
            meta=meta,
        )

    def _schedule(
        self, ctx: BuildContext, staged: Staged, mod: Any, target: Any, opts: TvmOptions, warnings: list[str]
    ) -> tuple[Any, set[str], int]:
        """The tuning database for ``mod``: the trusted cache's records; a task it lacks is a miss
        (under cache.require the build fails here), tuned when tuning is asked for
        (``tuning_asked``) and built with TVM's default schedule otherwise. Returns the database,
        the primitive functions it schedules and how many tasks were left untuned."""
        session = staged.cache
        assert session is not None, "called only when the options use the cache: Backend.build opened a session"
        work = staged.work / "tuning"
        work.mkdir()
        for name in self.cache_files:
            source = session.file(name)
            if source is not None:
                shutil.copyfile(source, work / name)
        database = open_database(work)
        defaults = _read_defaults(work / DEFAULTS)
        tasks = extract_tasks(mod, target)
        missing = []
        for task in tasks:
            if has_record(database, task, target) or defaults.get(task.task_name) == task_hash(task):
                session.hit()
            else:
                missing.append(task)
        if missing and session.trusted:  # a trusted database that lacks a task: the model changed
            for task in missing:
                session.miss(f"tuning task {task.task_name}")
        untuned = 0
        if missing and tuning_asked(ctx):
            if self.cross_compiles(ctx.sku_spec) and opts.rpc is None:  # local runs would be for another CPU
                raise EnvironmentProblem(
                    f"{ctx.sku} targets {ctx.sku_spec.target.arch}: its candidates cannot be measured on this "
                    f"{probe.host_arch()} host",
                    hint="tune it on its own runner, or name the devices' tracker key (options.rpc.key)",
                )
            budget = ctx.tuning_trials or opts.trials
            log.warning(
                "[%s/%s] %s",
                ctx.model,
                ctx.sku,
                tuning_budget_warning(
                    ctx, opts, len(missing), len(tasks), budget, seconds_per_trial(session.folder.parent)
                ),
            )
            _progress(ctx, f"tvm tune {len(missing)} tasks", 0.2)
            runner, where = None, "this host"
            if opts.rpc is not None:  # measured on the bench: a SKU for a device never tunes on this host
                host, port = connect(opts.rpc)
                runner, where = rpc_runner(opts.rpc, host, port), f"the devices under RPC key {opts.rpc.key}"
            with _threads(opts.num_threads):  # candidates are measured with the threads the engine runs with
                run = tune_run(
                    missing,
                    target,
                    work,
                    budget,
                    opts.trials_per_task,
                    progress=ctx.progress,
                    runner=runner,
                    max_minutes=opts.max_minutes,
                )
            spent = run.trials
            if run.failed:
                warnings.append(f"{run.failed} of {run.measured} candidates failed to build or run on {where}")
            if run.stopped_at_budget:
                warnings.append(
                    f"tuning stopped at options.max_minutes ({opts.max_minutes:g} min) after {run.measured} "
                    "candidates: the database keeps the best found so far"
                )
            database = open_database(work)
            # a task the search found no valid schedule for keeps the default schedule: recorded so a
            # replay knows it was decided, not forgotten
            defaults.update({t.task_name: task_hash(t) for t in missing if not has_record(database, t, target)})
            (work / DEFAULTS).write_text(json.dumps(dict(sorted(defaults.items())), indent=1) + "\n")
            for name in self.cache_files:
                session.write(
                    name,
                    (work / name).read_bytes(),
                    trials=spent if name == RECORDS else None,
                    seconds=run.seconds if name == RECORDS else None,
                )
            if spent:
                warnings.append(f"tuned {spent} trials on {where}: the database records its measurements")
        elif missing:
            untuned = len(missing)
            if ctx.search:  # bisection's scratch builds take the defaults by design
                why = "lacks them" if session.trusted else f"is {session.status.state}"
                warnings.append(
                    f"{untuned} of {len(tasks)} tuning tasks have no schedule ({session.where} {why}): built "
                    f"with TVM's default schedules for them, untuned (tuning was not asked for); to tune "
                    f"({opts.trials} trials): {session.refresh_hint}, or tune only those: "
                    f"{SKUFORGE_TUNE.name}=1 skuforge build --model {ctx.model} --sku {ctx.sku}"
                )
        tuned = {t.task_name for t in tasks if has_record(database, t, target)}
        return database, tuned, untuned

    def _load_impl(self, engine_dir: Path, meta: TvmMeta, sku: SkuSpec) -> Runner:
        opts: TvmOptions = self.options(sku)
        if self.runs_remotely(sku):  # the device bench runs it, not this CPU
            assert opts.rpc is not None  # runs_remotely says so
            return RemoteTvmRunner(
                engine_dir / meta.library, list(meta.inputs), [o.name for o in meta.outputs], meta.entry, opts.rpc
            )
        missing = probe.missing_llvm_features(meta.target.get("mattr", []))
        if missing:
            raise EnvironmentProblem(
                f"{engine_dir} was compiled for CPU {meta.target.get('mcpu')} with features this CPU "
                f"lacks: {', '.join(missing)}",
                hint="rebuild it on this host (target_cpu: host), or with an options.target_cpu "
                "this CPU supports (e.g. x86-64-v3), or run it on the SKU's runner",
            )
        return TvmRunner(engine_dir / meta.library, meta)


# --- import and lowering ----------------------------------------------------------------------------


# The opset a refused model is converted to before the import is given up: the frontend picks each
# op's newest converter up to the model's opset and falls back to its oldest, so an op older than
# every converter (Resize at opset 10 with its two inputs) is read with a newer op's inputs.
RETRY_OPSET = 18
_FAILED_OP = re.compile(r"Error converting operator (\w+)")


@dataclass(frozen=True)
class Refusal:
    """Why the frontend refused one graph: the op and node it failed at (None where unknown)."""

    op: str | None
    node: str | None
    detail: str

    def __str__(self) -> str:
        where = f"{self.op} node {self.node!r}" if self.node else (self.op or "the graph")
        return f"{where}: {self.detail}"


@dataclass
class Imported:
    """The Relax module, the ONNX node each binding of main came from, the graph it was imported
    from, and, when the model as exported was refused, what was refused and what the graph
    imported went through."""

    mod: Any
    node_of: dict[Any, str]
    model: onnx.ModelProto
    refused: Refusal | None = None
    steps: list[str] = field(default_factory=list)
    conversion: OpsetConversion | None = None

    def record(self) -> dict[str, Any] | None:
        if self.refused is None:
            return None
        return {
            "refused": {"op": self.refused.op, "node": self.refused.node, "detail": self.refused.detail},
            "steps": self.steps,
            "opset_conversion": self.conversion.to_json() if self.conversion else None,
        }

    def warning(self) -> str | None:
        if self.refused is None:
            return None
        return (
            f"TVM's Relax ONNX frontend refused the model as exported ({self.refused}); built from the graph "
            f"{' then '.join(self.steps)}, its outputs on the probe batch checked against the model's"
        )


def import_onnx(model: onnx.ModelProto, probe_inputs: dict[str, np.ndarray]) -> Imported:
    """The Relax module of the ONNX model (static shapes, weights bound as constants). When the
    frontend refuses the model as exported, it is tried again on the graph with its fixed shapes
    folded to constants, then converted to RETRY_OPSET, each checked on ``probe_inputs`` with ONNX
    Runtime; UnsupportedOp (naming the op and node of the first refusal) when every graph is refused."""
    import onnx

    names = [n.name or f"{n.op_type}_{i}" for i, n in enumerate(model.graph.node)]
    foreign = [
        (f"{n.domain}.{n.op_type}", name)
        for n, name in zip(model.graph.node, names, strict=True)
        if n.domain not in ("", "ai.onnx")
    ]
    if foreign:  # no rewrite of the standard graph reaches them
        (op, node), *_ = foreign
        listed = ", ".join(f"{o} (node {n!r})" for o, n in foreign[:10])
        raise UnsupportedOp("tvm", op, node, f"TVM {_version()}'s Relax ONNX frontend has no conversion for {listed}")
    shapes = _static_input_shapes(model)
    first = _import_once(model, shapes)
    if not isinstance(first, Refusal):
        return Imported(*first, model=model)
    tried = [f"as exported: {first}"]
    current, steps, conversion = model, [], None
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    changes = fold_static_shapes(folded)
    if changes:
        step = f"with its fixed shapes folded to constants ({'; '.join(changes)})"
        try:
            worst_abs, worst_rel = probe_difference(model, folded, probe_inputs)
        except InputError as exc:
            tried.append(f"{step}: does not run ({exc.message})")
        else:
            if worst_rel <= OPSET_CONVERSION_RTOL:
                current, steps = folded, [step]
                outcome = _import_once(current, shapes)
                if not isinstance(outcome, Refusal):
                    return Imported(*outcome, model=current, refused=first, steps=steps)
                tried.append(f"{step}: {outcome}")
            else:
                tried.append(f"{step}: changed the outputs on the probe batch (max abs error {worst_abs:.3g})")
    if default_opset(current) < RETRY_OPSET:
        reason = f"TVM's Relax ONNX frontend refused the model at opset {default_opset(current)}"
        step = f"converted from opset {default_opset(current)} to {RETRY_OPSET}"
        try:
            converted, conversion = convert_opset(current, RETRY_OPSET, probe_inputs, reason)
        except InputError as exc:
            tried.append(f"{' then '.join([*steps, step])}: {exc.message}")
        else:
            steps = [*steps, step]
            outcome = _import_once(converted, shapes)
            if not isinstance(outcome, Refusal):
                return Imported(*outcome, model=converted, refused=first, steps=steps, conversion=conversion)
            tried.append(f"{' then '.join(steps)}: {outcome}")
    raise UnsupportedOp(
        "tvm",
        first.op,
        first.node,
        f"TVM {_version()}'s Relax ONNX frontend cannot convert the model, which ONNX Runtime runs. Tried the graph "
        + "; the graph ".join(tried),
        hint="build this model with another backend, or replace the op before export (upgrading apache-tvm "
        "may add the conversion)",
    )


def _static_input_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    initializers = {i.name for i in model.graph.initializer}
    shapes = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        if any(not d.HasField("dim_value") for d in dims):
            raise InputError(
                f"input {value.name!r} has a dynamic axis: the tvm backend compiles static shapes",
                hint="pin the axis in the SKU's shapes (profiles are not supported by tvm)",
            )
        shapes[value.name] = [d.dim_value for d in dims]
    return shapes


def _import_once(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> tuple[Any, dict[Any, str]] | Refusal:
    """The module and each binding's ONNX node, or where and why the frontend refused the graph."""
    from tvm.relax.frontend.onnx import onnx_frontend as frontend

    convert = frontend._get_convert_map()
    names = [n.name or f"{n.op_type}_{i}" for i, n in enumerate(model.graph.node)]
    unsupported = [
        (n.op_type, name) for n, name in zip(model.graph.node, names, strict=True) if n.op_type not in convert
    ]
    if unsupported:
        (op, node), *_ = unsupported
        listed = ", ".join(f"{o} (node {n!r})" for o, n in unsupported[:10])
        return Refusal(op, node, f"TVM {_version()}'s Relax ONNX frontend has no conversion for {listed}")
    importer = frontend.ONNXGraphImporter(shapes, "float32", keep_params_in_input=False, sanitize=True)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):  # the frontend prints the failing op's inputs to stdout
            mod = importer.from_onnx(model.graph, default_opset(model))
    except Exception as exc:  # the frontend raises whatever its converters raise
        return _refusal(model, names, importer, exc, printed.getvalue())
    producer = {out: name for node, name in zip(model.graph.node, names, strict=True) for out in node.output if out}
    outputs = [(importer._nodes[o], n) for o, n in producer.items() if o in getattr(importer, "_nodes", {})]
    node_of: dict[Any, str] = {}
    pending: list[Any] = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            pending.append(binding.var)
            made = next((n for expr, n in outputs if binding.value.same_as(expr)), None)
            if made is not None:  # the bindings since the last node's output were emitted for this node
                node_of.update({v: made for v in pending})
                pending = []
    return mod, node_of


def _refusal(model: onnx.ModelProto, names: list[str], importer: Any, exc: Exception, printed: str) -> Refusal:
    """The node the frontend failed at: it converts in graph order and records each node's outputs
    as it goes, so the first node with an output it never recorded (of the op it printed, when it
    did) is the one."""
    detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    said = _FAILED_OP.search(printed)
    op = said.group(1) if said else None
    done = getattr(importer, "_nodes", {})
    for node, name in zip(model.graph.node, names, strict=True):
        if any(out and out not in done for out in node.output) and op in (None, node.op_type):
            return Refusal(node.op_type, name, detail)
    return Refusal(op, None, detail)


def lower(mod: Any, target: Any, node_of: dict[Any, str]) -> tuple[Any, dict[str, list[str]]]:
    """Decompose, legalize, fold and fuse: each fused group becomes one TIR primitive function.
    Returns the module and, per primitive function, the ONNX nodes fused into it."""
    import tvm
    from tvm import relax

    with tvm.target.Target(target):
        mod = tvm.transform.Sequential(
            [
                relax.transform.DecomposeOpsForInference(),
                relax.transform.CanonicalizeBindings(),
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FoldConstant(),
            ]
        )(mod)
        before = _calls(mod["main"])
        mod = relax.transform.FuseOps()(mod)
        origins = _fused_origins(mod, node_of, before)
        mod = relax.transform.FuseTIR()(mod)
        mod = relax.transform.DeadCodeElimination()(mod)
    return mod, origins


def _calls(func: Any) -> list[tuple[Any, str, list[Any]]]:
    """(variable, primitive function, arguments) of each call_tir binding of ``func``."""
    from tvm import relax

    out = []
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.call_tir":
                out.append((binding.var, value.args[0].name_hint, _call_args(value)))
    return out


def _fused_origins(mod: Any, node_of: dict[Any, str], before: list[tuple[Any, str, list[Any]]]) -> dict[str, list[str]]:
    """ONNX nodes per fused group (named as FuseTIR names its primitive function) and per unfused
    primitive call. FuseOps keeps the variables of a group's inner bindings but binds the group's
    output to a new one, so a binding whose variable is unknown is found again in the module
    before fusion: the call of the same primitive function on the same arguments."""
    from tvm import relax

    def same(a: list[Any], b: list[Any]) -> bool:
        return len(a) == len(b) and all(x.same_as(y) for x, y in zip(a, b, strict=True))

    def traced(var: Any, prim: str, args: list[Any]) -> str | None:
        if var in node_of:
            return node_of[var]
        for old_var, old_prim, old_args in before:
            if old_prim == prim and same(old_args, args):
                return node_of.get(old_var)
        return None

    origins: dict[str, list[str]] = {}
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not isinstance(value, relax.Call):
                continue
            callee = value.op
            if isinstance(callee, relax.GlobalVar) and isinstance(mod[callee], relax.Function):
                group = mod[callee]
                outer = dict(zip(group.params, value.args, strict=True))  # the group's parameters are main's arguments
                names = []
                for var, prim, args in _calls(group):
                    names.append(traced(var, prim, [outer.get(a, a) for a in args]))
                origins.setdefault(callee.name_hint, list(dict.fromkeys(n for n in names if n)))
            elif getattr(callee, "name", "") == "relax.call_tir":
                name = traced(binding.var, value.args[0].name_hint, _call_args(value))
                origins.setdefault(value.args[0].name_hint, [name] if name else [])
    return origins


def _call_args(call: Any) -> list[Any]:
    """The arguments a call_tir passes to its primitive function."""
    from tvm import relax

    args = call.args[1]
    return list(args.fields) if isinstance(args, relax.Tuple) else [args]


def primitive_functions(mod: Any) -> dict[str, str]:
    """The TIR functions main calls, in call order, with the precision of what they compute (the
    element type of their output)."""
    out: dict[str, str] = {}
    for var, name, _ in _calls(mod["main"]):
        if name not in out:
            out[name] = _precision(str(getattr(var.ty, "dtype", "")))
    return out


_PRECISIONS = {
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
    "int8": "int8",
    "uint8": "int8",
    "float64": "fp64",
    "int32": "int32",
    "int64": "int64",
    "bool": "bool",
}


def _precision(dtype: str) -> str:
    return _PRECISIONS.get(dtype, dtype or "n/a")


def op_type_of(function: str) -> str:
    """The leading op of a primitive function's name: fused_conv2d1_add1_relu1 -> conv2d."""
    tokens = [t.rstrip("0123456789") or t for t in function.split("_")]
    ops = [t for t in tokens if t and t not in _NOT_OPS]
    return ops[0] if ops else function


# --- MetaSchedule ---------------------------------------------------------------------------------


def _ms() -> Any:
    from tvm.s_tir import meta_schedule as ms

    return ms


def open_database(work: Path) -> Any:
    ms = _ms()
    return ms.database.JSONDatabase(
        path_workload=str(work / WORKLOADS), path_tuning_record=str(work / RECORDS), allow_missing=True
    )


def extract_tasks(mod: Any, target: Any) -> list[Any]:
    return list(_ms().relax_integration.extract_tasks(mod, target))


def task_hash(task: Any) -> str:
    """The structural hash MetaSchedule keys workloads by, as 16 hex digits."""
    from tvm_ffi import structural_hash

    return f"{structural_hash(task.dispatched[0]) & 0xFFFFFFFFFFFFFFFF:016x}"


def _cross_hint(arch: str) -> str:
    compiler, package = _CROSS_CC[arch]
    return f"apt-get install {package} (scripts/setup.sh --with cross-{arch} as root) for {compiler}"


def _cross_problems(sku: SkuSpec, options: TvmOptions) -> list[str]:
    """What a cross build of ``sku`` lacks here: the target's GCC, and a target that names the
    device rather than this host (``host`` CPU, this host's core count)."""
    arch = sku.target.arch
    problems = []
    if not shutil.which(_CROSS_CC[arch][0]):
        problems.append(f"cross-compiling for {arch} needs {_CROSS_CC[arch][0]}: {_cross_hint(arch)}")
    if options.target_cpu == "host":
        problems.append(
            f"options.target_cpu: host is this {probe.host_arch()} CPU; name the {arch} device's (e.g. cortex-a76)"
        )
    if options.num_cores is None:
        problems.append("options.num_cores: unset means this host's cores; set the device's")
    return problems


def _read_defaults(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    doc = json.loads(path.read_text())  # check_cache vouched for it
    return {str(k): str(v) for k, v in doc.items()}


def has_record(database: Any, task: Any, target: Any) -> bool:
    mod = task.dispatched[0]
    return database.has_workload(mod) and bool(database.query_tuning_record(mod, target, task.task_name))


@dataclass(frozen=True)
class TuningRun:
    """What one tuning did: records added to the database (``trials``), candidates measured and how
    many of them failed (a build error, a run error, a device lost mid-batch), its seconds, and
    whether ``max_minutes`` ended it."""

    trials: int
    measured: int
    failed: int
    seconds: float
    stopped_at_budget: bool


def tune_run(
    tasks: list[Any],
    target: Any,
    work: Path,
    trials: int,
    per_task: int | None,
    seed: int = 0,
    progress: Progress | None = None,
    runner: Any = None,
    max_minutes: float | None = None,
) -> TuningRun:
    """Tune ``tasks`` into the JSON database in ``work`` (records already there are kept).
    Candidates are built one at a time (a 2-core runner also measures) and measured by ``runner``:
    a separate local process (LocalRunner) when None, or the devices of a tracker key
    (tvm_rpc.rpc_runner). The cost model is random, within MetaSchedule's evolutionary search, so
    small budgets need no xgboost. ``progress`` hears the trials and tasks done as they are measured
    (TuningProgress). ``max_minutes``: after the first batch measured past it, every task is
    terminated, so the search ends with what the database holds (MetaSchedule commits each
    measured batch as it goes)."""
    ms = _ms()
    from tvm.s_tir.meta_schedule.relax_integration import extracted_tasks_to_tune_contexts

    database = open_database(work)
    before = len(database.get_all_tuning_records())
    per_task = per_task or max(1, -(-trials // len(tasks)))
    # the search's own threads: the cores the schedules are for, never more than this process may use
    # (TVM's pool spin-waits: two tuning processes on 2 cores each with 2 threads crawled for minutes)
    threads = max(1, min(int(target.attrs.get("num-cores", 1)), probe.usable_cores()))
    report = TuningProgress(progress, len(tasks), tuning_budget(trials, per_task, len(tasks)), per_task)
    deadline = None if max_minutes is None else time.monotonic() + max_minutes * 60
    began = time.monotonic()
    with _tuning_logs(), report:
        contexts, weights = extracted_tasks_to_tune_contexts(
            tasks, work_dir=str(work / "logs"), num_threads=threads, seed=seed
        )
        callback = _measure_callback(ms, report, deadline)
        _tune_contexts(ms, contexts, weights, work, database, trials, per_task, callback, runner)
        report.finished()
    return TuningRun(
        trials=len(open_database(work).get_all_tuning_records()) - before,
        measured=report.trials,
        failed=report.failed,
        seconds=time.monotonic() - began,
        stopped_at_budget=report.stopped,
    )


def tuning_budget(trials: int, per_task: int | None, tasks: int) -> int:
    """The trials a tuning can measure: the global budget, or less where every task reaches its cap."""
    return min(trials, (per_task or max(1, -(-trials // tasks))) * tasks)


def tuning_budget_warning(
    ctx: BuildContext, opts: TvmOptions, missing: int, tasks: int, trials: int, per_trial: float | None = None
) -> str:
    """The one line a build says before it tunes what the database lacks: how much, about how long
    (``per_trial``: the seconds a trial cost in the SKU's last tuning, else SECONDS_PER_TRIAL), the
    ``max_minutes`` cap, and how to not tune here."""
    budget = tuning_budget(trials, opts.trials_per_task, missing)
    seconds = per_trial if per_trial else SECONDS_PER_TRIAL
    minutes = budget * seconds / 60
    basis = (
        f"{seconds:.3g} s a trial in this SKU's last tuning"
        if per_trial
        else f"~{SECONDS_PER_TRIAL:g} s a trial on a 2-core runner; no tuning of this SKU recorded yet"
    )
    cap = f", stopped at options.max_minutes ({opts.max_minutes:g} min)" if opts.max_minutes else ""
    source = "--trials" if ctx.tuning_trials else f"skus.{ctx.sku}.options.trials"
    head = (
        f"tuning {missing} of {tasks} tasks the tuning database caches/{ctx.sku}/{ctx.model} lacks: "
        f"{budget} trials ({source}), expect about {minutes:.0f} min ({basis}){cap}"
    )
    if ctx.cache_refresh:
        return f"{head}; a smaller {source} tunes faster and worse"
    return (
        f"{head}. To skip: build without {SKUFORGE_TUNE.name} (TVM's default schedules, untuned), or tune "
        f"once on the SKU's runner (skuforge cache refresh --sku {ctx.sku} --model {ctx.model}) and commit "
        f"the database; a smaller {source} tunes faster and worse"
    )


class TuningProgress:
    """Tuning's progress inside the build step, as the build's progress label: trials measured of the
    budget, tasks finished of the total, time spent and time left (``tvm tune trials 24/64, tasks
    3/12 done, 1m10s, about 2m05s left``), the fraction moving from ``start`` to ``end``. MetaSchedule
    reports each measured batch (``measured``, from a measure callback); between batches (a batch
    is up to 16 candidates, each built in a new process: minutes) a thread redraws the line every
    ``tick`` seconds so its clock never freezes. Calls to ``progress`` are serialised."""

    def __init__(
        self,
        progress: Progress | None,
        tasks: int,
        budget: int,
        per_task: int,
        start: float = 0.2,
        end: float = 0.7,
        tick: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.progress, self.tasks, self.budget, self.per_task = progress, tasks, max(1, budget), per_task
        self.start, self.end, self.tick, self.clock = start, end, tick, clock
        self.trials = 0
        self.per_task_trials: dict[int, int] = {}
        self.terminated = 0
        self.failed = 0  # candidates whose build or measurement failed
        self.stopped = False  # the time budget ended the search
        self.began = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    @property
    def tasks_done(self) -> int:
        capped = sum(1 for n in self.per_task_trials.values() if n >= self.per_task)
        return min(self.tasks, max(self.terminated, capped))

    def label(self, now: float | None = None) -> str:
        elapsed = (self.clock() if now is None else now) - self.began
        text = (
            f"tvm tune trials {self.trials}/{self.budget}, tasks {self.tasks_done}/{self.tasks} done, "
            f"{_duration(elapsed)}"
        )
        if 0 < self.trials < self.budget and self.tasks_done < self.tasks:
            text += f", about {_duration(elapsed / self.trials * (self.budget - self.trials))} left"
        return text

    def fraction(self) -> float:
        return self.start + (self.end - self.start) * min(1.0, self.trials / self.budget)

    def measured(self, task_id: int, trials: int, terminated: int) -> None:
        """A batch of ``trials`` candidates of task ``task_id`` was measured; ``terminated`` tasks
        are finished (MetaSchedule's count)."""
        with self._lock:
            self.trials += trials
            self.per_task_trials[task_id] = self.per_task_trials.get(task_id, 0) + trials
            self.terminated = max(self.terminated, terminated)
        self._report()

    def failures(self, count: int) -> None:
        """``count`` candidates of the last batch failed to build or to run."""
        with self._lock:
            self.failed += count

    def finished(self) -> None:
        """MetaSchedule returned: every task is done (tuned, its space exhausted, or the budget spent)."""
        with self._lock:
            self.terminated = self.tasks

    def _report(self) -> None:
        if self.progress is None:
            return
        with self._lock:
            self.progress(self.label(), self.fraction())

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            self._report()

    def __enter__(self) -> TuningProgress:
        self.began = self.clock()
        self._report()
        if self.progress is not None and self.tick > 0:
            self._ticker = threading.Thread(target=self._run, name="tvm-tune-progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        self._report()


def _duration(seconds: float) -> str:
    """``4m05s``; minutes always, so the label keeps its shape (a progress renderer that tells
    steps apart by the label without its digits sees one step)."""
    seconds = max(0, round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


def _measure_callback(ms: Any, report: TuningProgress, deadline: float | None = None) -> Any:
    """A MetaSchedule measure callback that tells ``report`` of each measured batch and its failed
    candidates, and past ``deadline`` (time.monotonic) terminates every task still searching."""
    from tvm.ir.utils import derived_object

    @derived_object
    class Reported(ms.measure_callback.PyMeasureCallback):
        def apply(
            self, task_scheduler: Any, task_id: int, candidates: Any, builder_results: Any, runner_results: Any
        ) -> None:
            failed = sum(
                1
                for b, r in zip(builder_results, runner_results, strict=False)
                if b.error_msg is not None or r.error_msg is not None
            )
            report.failures(failed)
            if deadline is not None and time.monotonic() >= deadline:
                report.stopped = True
                for i, task in enumerate(task_scheduler.tasks_):
                    if not task.is_terminated:
                        task_scheduler.terminate_task(i)
            finished = sum(1 for t in task_scheduler.tasks_ if t.is_terminated)
            report.measured(int(task_id), len(runner_results), finished)

    return Reported()


class _tuning_logs:
    """MetaSchedule configures its loggers (``logging.config.dictConfig``) on every tuning: a
    console handler on stdout at its logger's level (DEBUG when unset) and files in the work
    folder. Here its console shows errors only (stdout stays skuforge's, for --json; the rounds
    are in the tuning logs) unless skuforge runs with -v, and its handlers are closed and removed
    afterwards: a second tuning in one process otherwise failed on the handlers of the first."""

    NAME = "tvm.s_tir.meta_schedule"

    def __enter__(self) -> None:
        root = logging.getLogger(self.NAME)
        self._level = root.level
        root.setLevel(logging.DEBUG if logging.getLogger().isEnabledFor(logging.DEBUG) else logging.ERROR)
        self._close()

    def __exit__(self, *exc: object) -> None:
        self._close()
        logging.getLogger(self.NAME).setLevel(self._level)

    def _close(self) -> None:
        for name in [self.NAME] + [n for n in logging.root.manager.loggerDict if n.startswith(self.NAME + ".")]:
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
                handler.close()


def _tune_contexts(
    ms: Any,
    contexts: list[Any],
    weights: list[float],
    work: Path,
    database: Any,
    trials: int,
    per_task: int,
    callback: Any = None,
    runner: Any = None,
) -> None:
    callbacks = [*ms.measure_callback.MeasureCallback.create("default"), *([callback] if callback is not None else [])]
    try:
        ms.tune.tune_tasks(
            tasks=contexts,
            task_weights=weights,
            work_dir=str(work / "logs"),
            max_trials_global=trials,
            max_trials_per_task=per_task,
            num_trials_per_iter=min(per_task, 16),
            builder=ms.builder.LocalBuilder(f_build=_build_candidate, max_workers=1, timeout_sec=120),
            runner=runner if runner is not None else ms.runner.LocalRunner(timeout_sec=60),
            database=database,
            cost_model="random",
            measure_callbacks=callbacks,
        )
    except Exception as exc:  # TVMError from a search or measurement: name it, keep the cause
        detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise EnvironmentProblem(
            f"MetaSchedule tuning failed: {detail}",
            hint="set options.trials: 0 to build with default schedules, or check the runner",
        ) from exc


def _build_candidate(mod: Any, target: Any, _params: Any) -> Any:
    """MetaSchedule's default candidate build without its ``import tvm.s_tir.tensor_intrin`` (about
    23 s here, mostly CUDA intrinsics), which the builder's worker pays again for every batch:
    with it, batches ran into the build timeout."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    return tvm_build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)


def compile_module(mod: Any, target: Any, database: Any, opt_level: int) -> Any:
    """The executable: schedules from ``database`` where it has them, TVM's defaults elsewhere."""
    import tvm
    from tvm import relax

    with target, tvm.transform.PassContext(opt_level=opt_level):
        if database is not None:
            with database:
                mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
        return tvm.compile(mod, target=target)


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


class _threads:
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


def _progress(ctx: BuildContext, label: str, fraction: float) -> None:
    if ctx.progress:
        ctx.progress(label, fraction)


def tuning_asked(ctx: BuildContext) -> bool:
    """Whether a build searches schedules for the tasks its database lacks: asked for by a cache
    refresh, an explicit trial budget (``tuning_trials``) or SKUFORGE_TUNE, never in a scratch
    build (``search`` False). Otherwise a model new to a tuned SKU builds in seconds with default
    schedules instead of tuning for hours."""
    return ctx.search and (ctx.cache_refresh or bool(ctx.tuning_trials) or SKUFORGE_TUNE.get())
