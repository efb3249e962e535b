"""MetaSchedule: the tuning tasks, the database replayed or extended, the search under a budget."""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import shutil
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.backends.contract import (
    BuildContext,
)
from pipeline.backends.tvm.common import CROSS_CC, RECORDS, SECONDS_PER_TRIAL, WORKLOADS, TvmOptions
from pipeline.backends.tvm.loading import import_tvm
from pipeline.core.env import SKUFORGE_TUNE
from pipeline.core.errors import EnvironmentProblem
from pipeline.core.progress import Progress
from pipeline.host import probe

if TYPE_CHECKING:
    from pipeline.project.config import SkuSpec

log = logging.getLogger(__name__)


def _ms() -> Any:
    import_tvm()
    from tvm.s_tir import meta_schedule as ms

    return ms


_INTRINSICS = "tvm.s_tir.tensor_intrin"
_intrinsics_lock = threading.Lock()


def import_intrinsics() -> None:
    """What MetaSchedule imports to tune (TuneContext imports tvm.s_tir.tensor_intrin), made fast.

    That import parses about 500 TVMScript functions (CUDA, ROCm, Hexagon ... intrinsics), each
    calling inspect.stack(); for each frame of a pseudo-file (``<ast>``, ``<string>``, ``<frozen
    importlib...>``) inspect.getmodule scans every module in sys.modules for one with that file: 88 s
    of CPU in a skuforge process here (2155 modules), so every tuning began with a minute and a half
    of nothing. While it imports, those lookups are answered at once with what the scan concludes,
    None: no module has such a file, and a frame has no ``__name__`` to fall back on (6.8 s of CPU).
    Where a module does claim a pseudo-file, the scan runs as it is."""
    with _intrinsics_lock:
        if _INTRINSICS in sys.modules:
            return
        if any(_pseudo(getattr(m, "__file__", None)) for m in list(sys.modules.values())):
            importlib.import_module(_INTRINSICS)
            return
        getmodule = inspect.getmodule

        def answered(obj: object, _filename: str | None = None) -> types.ModuleType | None:
            if _pseudo(_filename) and inspect.isframe(obj):
                return None
            return getmodule(obj, _filename)

        setattr(inspect, "getmodule", answered)  # noqa: B010 - a module attribute, swapped for the import
        try:
            importlib.import_module(_INTRINSICS)
        finally:
            setattr(inspect, "getmodule", getmodule)  # noqa: B010


def _pseudo(filename: object) -> bool:
    return isinstance(filename, str) and filename.startswith("<") and filename.endswith(">")


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


def cross_hint(arch: str) -> str:
    compiler, package = CROSS_CC[arch]
    return f"apt-get install {package} (scripts/setup.sh --with cross-{arch} as root) for {compiler}"


def cross_problems(sku: SkuSpec, options: TvmOptions) -> list[str]:
    """What a cross build of ``sku`` lacks here: the target's GCC, and a target that names the
    device rather than this host (``host`` CPU, this host's core count)."""
    arch = sku.target.arch
    problems = []
    if not shutil.which(CROSS_CC[arch][0]):
        problems.append(f"cross-compiling for {arch} needs {CROSS_CC[arch][0]}: {cross_hint(arch)}")
    if options.target_cpu == "host":
        problems.append(
            f"options.target_cpu: host is this {probe.host_arch()} CPU; name the {arch} device's (e.g. cortex-a76)"
        )
    if options.num_cores is None:
        problems.append("options.num_cores: unset means this host's cores; set the device's")
    return problems


def read_defaults(path: Path) -> dict[str, str]:
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
    (rpc.rpc_runner). The cost model is random, within MetaSchedule's evolutionary search, so
    small budgets need no xgboost. ``progress`` hears the trials and tasks done as they are measured
    (TuningProgress). ``max_minutes``: after the first batch measured past it, every task is
    terminated, so the search ends with what the database holds (MetaSchedule commits each
    measured batch as it goes)."""
    ms = _ms()
    from tvm.s_tir.meta_schedule.relax_integration import extracted_tasks_to_tune_contexts

    import_intrinsics()  # what the tune contexts import, in seconds instead of a minute and a half

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
            tasks, work_dir=str(work / "logs"), num_threads=threads, seed=seed, strategy=search_strategy(ms)
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


# The search's population. The cost model is random, so the evolutionary search's selection is a
# random pick from its population (mutations of the best measured schedules and fresh samples):
# MetaSchedule's default of 512, evolved 4 times, picks from the same distribution as 64 at about
# eight times the search time per batch (2 trials of the test CNN: 31 s, 18 s with 64).
POPULATION = 64
# candidates one builder process builds before it is replaced (PopenPoolExecutor's
# maximum_process_uses): MetaSchedule starts a new process for every batch (for a known leak in
# long-lived workers), each paying TVM's import (about 4 s); 128 is 8 batches of 16
CANDIDATES_PER_BUILDER = 128


def search_strategy(ms: Any) -> Any:
    """The evolutionary search, its population sized for a random cost model (POPULATION)."""
    return ms.search_strategy.EvolutionarySearch(population_size=POPULATION)


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
    builder = _pooled_builder(ms, timeout_sec=120)
    try:
        ms.tune.tune_tasks(
            tasks=contexts,
            task_weights=weights,
            work_dir=str(work / "logs"),
            max_trials_global=trials,
            max_trials_per_task=per_task,
            num_trials_per_iter=min(per_task, 16),
            builder=builder,
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
    finally:
        builder.close()


def _pooled_builder(ms: Any, timeout_sec: float) -> Any:
    """MetaSchedule's LocalBuilder (one worker, ``_build_candidate``) whose worker process serves
    CANDIDATES_PER_BUILDER candidates instead of one batch: a 2-trial tuning of 5 tasks started three
    processes (the sanity check and two batches), each importing TVM. A worker that dies or times
    out is started again at the next candidate (PopenWorker). ``close()`` ends the worker."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.builder import local_builder
    from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

    @derived_object
    class PooledBuilder(ms.builder.LocalBuilder._cls):
        _pool: Any = None

        def _executor(self) -> Any:
            if self._pool is None:
                self._pool = PopenPoolExecutor(
                    max_workers=1, timeout=self.timeout_sec, maximum_process_uses=CANDIDATES_PER_BUILDER
                )
            return self._pool

        def close(self) -> None:
            if self._pool is not None:
                self._pool.shutdown()
            self._pool = None

        def _sanity_check(self) -> None:
            def check(f_build: Any, f_export: Any) -> None:
                local_builder.get_global_func_with_default_on_worker(name=f_build, default=None)
                local_builder.get_global_func_with_default_on_worker(name=f_export, default=None)

            self._executor().submit(check, self.f_build, self.f_export).result()

        def build(self, build_inputs: list[Any]) -> list[Any]:
            results = []
            inputs = [
                (self.f_build, self.f_export, b.mod, b.target, local_builder._serialize_params(b.params))
                for b in build_inputs
            ]
            for done in self._executor().map_with_error_catching(lambda x: local_builder._worker_func(*x), inputs):
                if done.status == StatusKind.COMPLETE:
                    results.append(ms.builder.BuilderResult(done.value, None))
                elif done.status == StatusKind.TIMEOUT:
                    results.append(
                        ms.builder.BuilderResult(
                            None, f"LocalBuilder: Timeout, killed after {self.timeout_sec} seconds"
                        )
                    )
                else:
                    results.append(ms.builder.BuilderResult(None, f"LocalBuilder: An exception occurred\n{done.value}"))
            return results

    return PooledBuilder(f_build=_build_candidate, max_workers=1, timeout_sec=timeout_sec)


def _build_candidate(mod: Any, target: Any, _params: Any) -> Any:
    """MetaSchedule's default candidate build without its ``import tvm.s_tir.tensor_intrin`` (about
    23 s here, mostly CUDA intrinsics), which each new builder process would pay again: with it,
    batches ran into the build timeout."""
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


def tuning_asked(ctx: BuildContext) -> bool:
    """Whether a build searches schedules for the tasks its database lacks: asked for by a cache
    refresh, an explicit trial budget (``tuning_trials``) or SKUFORGE_TUNE, never in a scratch
    build (``search`` False). Otherwise a model new to a tuned SKU builds in seconds with default
    schedules instead of tuning for hours."""
    return ctx.search and (ctx.cache_refresh or bool(ctx.tuning_trials) or SKUFORGE_TUNE.get())
