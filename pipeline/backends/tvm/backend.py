"""The TVM backend: build (import, lower, tune or replay, compile, export), load, cross builds."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.backends.base import Backend, onnx_version
from pipeline.backends.caches import seconds_per_trial
from pipeline.backends.contract import (
    BuildContext,
    BuildOutcome,
    Capabilities,
    Runner,
    Staged,
)
from pipeline.backends.emulated import RpcDevice
from pipeline.backends.tvm.common import (
    CROSS_CC,
    DEFAULTS,
    LIBRARY,
    PACKAGE,
    PIP_HINT,
    RECORDS,
    TRIPLES,
    WORKLOADS,
    TvmMeta,
    TvmOptions,
    child_threads,
    elf_machine_problem,
    report_progress,
    target_of,
    tvm_module,
    tvm_version,
)
from pipeline.backends.tvm.importer import import_onnx, lower, op_type_of, primitive_functions
from pipeline.backends.tvm.rpc import RemoteTvmRunner, RpcOptions, connect, rpc_runner
from pipeline.backends.tvm.runner import TvmRunner
from pipeline.backends.tvm.tuning import (
    compile_module,
    cross_hint,
    cross_problems,
    extract_tasks,
    has_record,
    open_database,
    read_defaults,
    task_hash,
    tune_run,
    tuning_asked,
    tuning_budget_warning,
)
from pipeline.core.env import SKUFORGE_TUNE, SKUFORGE_TVM_TRACKER
from pipeline.core.errors import EnvironmentProblem, InputError
from pipeline.host import probe
from pipeline.model.graph import signature
from pipeline.results.reports import LayerInfo

if TYPE_CHECKING:
    from pipeline.project.config import SkuSpec

log = logging.getLogger(__name__)


def _check_device_library(library: Path, sku: SkuSpec) -> None:
    """A library goes to the SKU's device only if it is code for the device's architecture (an
    engine built for this host, copied over the SKU's, is refused here, not by the device's loader)."""
    wrong = elf_machine_problem(library, sku.target.arch)
    if wrong:
        raise InputError(
            f"{library} is not code for the SKU's {sku.target.arch} devices: {wrong}",
            hint="rebuild the engine for the SKU (skuforge build, or dvc repro)",
        )


EMULATED_KEY = "emulated-aarch64"  # the tracker key of an emulated device when the SKU names none
EMULATED_SESSION_S = 1800  # one validation's session on an emulated device (41-43 s per example pair here)


class TvmBackend(Backend):
    name = "tvm"
    Options = TvmOptions
    Meta = TvmMeta
    capabilities = Capabilities(
        precisions=("fp32",),
        devices=("cpu",),
        runtime_package=PACKAGE,
        per_node_precision=False,
        cache="tuning-database",
    )
    cache_files = (WORKLOADS, RECORDS, DEFAULTS)
    install_hint = PIP_HINT
    engine_format = "skuforge-tvm-relax/1"
    runtime_keys = (PACKAGE,)  # the library calls into the runtime of the TVM that compiled it

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
        if sku.target.arch not in TRIPLES:
            problems.append(f"target.arch: {sku.target.arch} has no LLVM triple here (known: {', '.join(TRIPLES)})")
        return problems

    emulation = True  # through TVM's RPC: an emulated aarch64 rpc_server registered with a loopback tracker

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
            tvm = tvm_module()
        except EnvironmentProblem as exc:
            return [f"{exc.message} ({PIP_HINT})"]
        problems = []
        if not tvm.runtime.enabled("llvm") and purpose == "build":
            problems.append("this TVM build has no LLVM code generator (USE_LLVM OFF)")
        if purpose == "build" and self.cross_compiles(sku):
            problems += cross_problems(sku, self.options(sku))
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
        return {PACKAGE: tvm_version() or "unknown", "onnx": onnx_version()}

    def uses_cache(self, options: TvmOptions) -> bool:
        return options.trials > 0

    def cache_key(self, sku: SkuSpec) -> dict[str, str]:
        """A tuning database holds schedules measured for one target under one TVM version."""
        return {
            PACKAGE: tvm_version() or "unknown",
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
        tvm = tvm_module()
        target_json = target_of(opts, ctx.sku_spec.target.arch)
        target = tvm.target.Target(target_json)
        sig = signature(staged.model)
        imported = import_onnx(staged.model, ctx.probe_inputs)
        warnings = [w for w in [imported.warning()] if w]
        report_progress(ctx, "tvm lower", 0.1)
        mod, origins = lower(imported.mod, target, imported.node_of)
        functions = primitive_functions(mod)
        database: Any = None
        tuned: set[str] = set()
        untuned = 0
        if self.uses_cache(opts):
            database, tuned, untuned = self._schedule(ctx, staged, mod, target, opts, warnings)
        report_progress(ctx, "tvm compile", 0.7)
        executable = compile_module(mod, target, database, opts.opt_level)
        arch = ctx.sku_spec.target.arch
        cross = self.cross_compiles(ctx.sku_spec)
        # a cross build is linked by the target's GCC; the C compiler TVM finds otherwise links for this host
        executable.export_library(str(ctx.engine_dir / LIBRARY), **({"cc": CROSS_CC[arch][0]} if cross else {}))
        wrong = elf_machine_problem(ctx.engine_dir / LIBRARY, arch)
        if wrong:  # a linker that ignored the triple: the device would refuse the library at load
            raise EnvironmentProblem(f"the exported library is not for {arch}: {wrong}", hint=cross_hint(arch))
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
        defaults = read_defaults(work / DEFAULTS)
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
                    f"{probe.host_arch()} host (nor under emulation: timings under QEMU say nothing of the device)",
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
            report_progress(ctx, f"tvm tune {len(missing)} tasks", 0.2)
            runner, where = None, "this host"
            if opts.rpc is not None:  # measured on the bench: a SKU for a device never tunes on this host
                host, port = connect(opts.rpc)
                runner, where = rpc_runner(opts.rpc, host, port), f"the devices under RPC key {opts.rpc.key}"
            with child_threads(opts.num_threads):  # candidates are measured with the threads the engine runs with
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
            _check_device_library(engine_dir / meta.library, sku)
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

    def _load_emulated_impl(self, engine_dir: Path, meta: TvmMeta, sku: SkuSpec) -> Runner:
        """The library through TVM's tracker to an emulated aarch64 rpc_server registered under the
        SKU's key (its ``options.rpc``, else ``EMULATED_KEY``), as to a board on a device bench."""
        rpc = self.options(sku).rpc
        _check_device_library(engine_dir / meta.library, sku)
        options = RpcOptions(
            key=rpc.key if rpc else EMULATED_KEY,
            session_timeout_s=max(rpc.session_timeout_s if rpc else 0, EMULATED_SESSION_S),
        )
        device = RpcDevice(options.key, str(engine_dir))
        try:
            runner = RemoteTvmRunner(
                engine_dir / meta.library,
                list(meta.inputs),
                [o.name for o in meta.outputs],
                meta.entry,
                options,
                tracker=device.tracker,
                on_close=device.close,
                device_death=device.death,
            )
        except BaseException:
            device.close()
            raise
        runner.emulation = device.record
        return runner
