"""Reproducibility: build an engine a second time and compare it with the first.

The second build runs in a new Python process, as a rebuild by `skuforge build` would: a
compiler's process-wide state must not count (OpenVINO names the nodes it makes with a counter
per process, so two builds in one process never match). It writes to a temporary folder, with a
temporary copy of the SKU's cache folder as the first build left it (what the next rebuild
starts from), so the check never touches the real engine or cache. Identical engine files:
``bitwise``. Otherwise both engines' layer listings and their outputs on the first golden
samples must be identical bit for bit: ``equivalent`` (the report names the files that differ);
else ``differs``, with what differed. Files that differ with identical layers on a host that
cannot run the engine (a cross-compiled SKU): ``unverified``.
"""

from __future__ import annotations

import multiprocessing
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from pipeline.backends import get_backend
from pipeline.core.errors import EnvironmentProblem, GateFailed, InputError, ServiceError, SkuforgeError
from pipeline.engine.build import build_engine
from pipeline.engine.hostcheck import sku_host_problems
from pipeline.project.artifacts import layout, load_arrays, log, read_report, run_plan
from pipeline.project.config import Pair, SkuSpec
from pipeline.project.data import LABELS, run_dataset
from pipeline.results.reports import (
    FileRecord,
    LayerInfo,
    OutputDiff,
    PrepareReport,
    Reproducibility,
    ReproducibilityLevel,
    ReproducibilityVerdict,
)

if TYPE_CHECKING:
    import numpy as np

    from pipeline.core.progress import Progress
    from pipeline.engine.build import Built

# Golden samples both engines run: the default golden set, enough to exercise every kernel path a
# batch takes without doubling a large model's validate time
SAMPLES = 32
RANK = {level: i for i, level in enumerate(get_args(ReproducibilityVerdict))} | {"none": 0}

FLOAT_MAX = 1.7976931348623157e308  # JSON has no infinity: a NaN or inf on one side only reads as this

Rebuild = Callable[[Path, Path], "Built"]  # (engine_dir, cache_dir) -> the second build
# a failure of the second build is re-raised in this process as the class of its exit code
_BY_EXIT = {cls.exit_code: cls for cls in (GateFailed, InputError, EnvironmentProblem, ServiceError)}


def wanted(sku_spec: SkuSpec, asked: bool = False) -> bool:
    """Whether a build checks: asked for (``--check-reproducible``), or the SKU checks or requires a level."""
    spec = sku_spec.reproducibility
    return asked or spec.check or spec.require != "none"


def meets(verdict: ReproducibilityVerdict, required: ReproducibilityLevel) -> bool:
    return RANK[verdict] >= RANK[required]


def check(
    pair: Pair,
    first: Built,
    engine_dir: Path,
    rebuild: Rebuild | None = None,
    progress: Progress | None = None,
) -> Reproducibility:
    """Build again into a temporary folder and compare with ``first`` (in ``engine_dir``).

    ``rebuild`` defaults to ``build_engine`` in a new process (``in_new_process``), with the nodes
    ``first`` kept precise (a remedy during the build may have added to params.yaml's)."""
    registry, model, sku = pair.registry, pair.model, pair.sku
    required = pair.sku_spec.reproducibility.require
    rebuild = rebuild or in_new_process(pair, first.keep_precise)
    with tempfile.TemporaryDirectory(prefix="skuforge-repro-") as tmp:
        cache, second_dir = Path(tmp) / "cache", Path(tmp) / "engine"
        source = layout(registry).cache_dir(model, sku)
        if source.is_dir():
            shutil.copytree(source, cache, symlinks=True)
        else:
            cache.mkdir()
        started = time.perf_counter()
        if progress:
            progress("reproducibility: second build", 0.0)
        second = rebuild(second_dir, cache)
        seconds = time.perf_counter() - started
        if progress:
            progress("reproducibility: second build", 1.0)
        files = differing_files(first.files, second.files)
        added, removed, changed = layer_changes(first.outcome.layers, second.outcome.layers)
        not_run = sku_host_problems(pair.sku_spec, "run") if files else []
        outputs, samples = ([], 0) if not files or not_run else output_diffs(pair, engine_dir, second_dir)
    verdict: ReproducibilityVerdict = (
        "bitwise"
        if not files
        else "differs"
        if added or removed or changed or outputs
        else "unverified"
        if not_run
        else "equivalent"
    )
    result = Reproducibility(
        verdict=verdict,
        required=required,
        passed=meets(verdict, required),
        differing_files=files,
        layers_added=added,
        layers_removed=removed,
        layers_changed=changed,
        outputs=outputs,
        samples=samples,
        not_run=not_run,
        second_build_seconds=round(seconds, 3),
    )
    log(model, sku).info("reproducible: %s%s", verdict, f" ({'; '.join(describe(result))})" if files else "")
    return result


def in_new_process(pair: Pair, keep_precise: tuple[str, ...] | None = None) -> Rebuild:
    """``build_engine`` in a new (spawned) Python process (the pair pickled to it); its failures keep
    their exit code."""
    model, sku = pair.model, pair.sku

    def rebuild(engine_dir: Path, cache_dir: Path) -> Built:
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            try:
                built, failure = pool.submit(_build, pair, engine_dir, cache_dir, keep_precise).result()
            except BrokenProcessPool as exc:
                raise EnvironmentProblem(
                    f"{model}/{sku}: the reproducibility check's second build died (a crash or the OOM killer)",
                    hint="run skuforge build --check-reproducible again; "
                    "if it dies again, the compiler crashes on a rebuild",
                ) from exc
        if failure is not None:
            code, message, hint = failure
            raise _BY_EXIT.get(code, EnvironmentProblem)(
                f"{model}/{sku}: the reproducibility check's second build failed where the first passed: {message}",
                hint,
            )
        assert built is not None, "_build returns either the build or its failure"
        return built

    return rebuild


def _build(
    pair: Pair, engine_dir: Path, cache_dir: Path, keep_precise: tuple[str, ...] | None
) -> tuple[Built | None, tuple[int, str, str | None] | None]:
    """In the new process. SkuforgeError subclasses do not all unpickle, so failures travel as data."""

    try:
        return build_engine(pair, engine_dir, cache_dir=cache_dir, keep_precise=keep_precise), None
    except SkuforgeError as exc:
        return None, (exc.exit_code, exc.message, exc.hint)


def require(result: Reproducibility, model: str, sku: str, report: Path) -> None:
    """GateFailed (exit 1) when the verdict is below the SKU's ``reproducibility.require``."""
    if result.passed:
        return
    raise GateFailed(
        f"{model}/{sku}: the engine is not reproducible at the required level {result.required!r} "
        f"(verdict {result.verdict!r}):\n" + "\n".join(f"  - {line}" for line in describe(result)),
        hint=f"see reproducibility in {report}; remove what varies between builds (a timestamp, a "
        f"temporary path, a nondeterministic pass) or lower skus.{sku}.reproducibility.require",
    )


def describe(result: Reproducibility) -> list[str]:
    """One line per kind of difference, for messages and logs."""
    lines = [f"engine files differ: {', '.join(result.differing_files)}"] if result.differing_files else []
    for what, names in (
        ("added", result.layers_added),
        ("removed", result.layers_removed),
        ("changed", result.layers_changed),
    ):
        if names:
            lines.append(f"layers {what} ({len(names)}): {', '.join(names[:10])}{' …' if len(names) > 10 else ''}")
    lines += [
        f"output {o.output}: {o.differing:.2%} of elements differ in their bits, max abs diff {o.max_abs_diff:.3g} "
        f"(on {result.samples} golden samples)"
        for o in result.outputs
    ]
    if result.not_run:
        lines.append(f"outputs not compared: this host cannot run the engine ({'; '.join(result.not_run)})")
    elif result.differing_files and not lines[1:]:
        lines.append(f"layers and outputs on {result.samples} golden samples are identical bit for bit")
    return lines


def differing_files(first: list[FileRecord], second: list[FileRecord]) -> list[str]:
    """Paths of engine files whose bytes differ, or that only one build wrote."""
    a, b = ({f.path: f.sha256 for f in files} for files in (first, second))
    return sorted(p for p in a.keys() | b.keys() if a.get(p) != b.get(p))


def layer_changes(first: list[LayerInfo], second: list[LayerInfo]) -> tuple[list[str], list[str], list[str]]:
    """Layers added, removed and changed (each field that differs), matched by name; a name that
    repeats is matched by its occurrence (``name#2``). Same layers in another order: ``(order)``."""
    a, b = _keyed(first), _keyed(second)
    changed = []
    for key in (k for k in a if k in b):
        x, y = a[key].to_json(), b[key].to_json()
        changed += [f"{key}: {field} {x[field]!r} -> {y[field]!r}" for field in x if x[field] != y[field]]
    if not changed and a.keys() == b.keys() and list(a) != list(b):
        changed.append("(order): the same layers in another order")
    return [k for k in b if k not in a], [k for k in a if k not in b], changed


def _keyed(layers: list[LayerInfo]) -> dict[str, LayerInfo]:
    seen: Counter[str] = Counter()
    keyed = {}
    for layer in layers:
        seen[layer.name] += 1
        keyed[layer.name if seen[layer.name] == 1 else f"{layer.name}#{seen[layer.name]}"] = layer
    return keyed


def output_diffs(pair: Pair, first_dir: Path, second_dir: Path) -> tuple[list[OutputDiff], int]:
    """Both engines on the first golden samples: the outputs whose bits differ, and the sample count."""
    model = pair.model
    out = layout(pair.registry)
    prep = read_report(out.report(model, None, "prepare"), PrepareReport, "prepare")
    in_idx, out_idx, batch = run_plan(pair, prep.signature)
    golden = load_arrays(out.split(model, "golden"), "data")
    golden.pop(LABELS, None)
    samples = min(SAMPLES, len(golden[pair.spec.inputs[0].name]))
    golden = {k: v[:samples] for k, v in golden.items()}
    sku_spec = pair.sku_spec
    backend = get_backend(sku_spec.backend)
    got = []
    for folder in (first_dir, second_dir):
        with backend.load(folder, sku_spec) as runner:
            got.append(run_dataset(runner.infer, golden, in_idx, out_idx, batch))
    diffs = [output_diff(name, got[0].get(name), got[1].get(name)) for name in sorted(got[0].keys() | got[1].keys())]
    return [d for d in diffs if d is not None], samples


def output_diff(name: str, first: np.ndarray | None, second: np.ndarray | None) -> OutputDiff | None:
    """None when the two arrays are identical bit for bit (dtype, shape and bytes)."""
    import numpy as np

    if first is not None and second is not None and first.dtype == second.dtype and first.shape == second.shape:
        if first.tobytes() == second.tobytes():
            return None
        bits = f"u{first.dtype.itemsize}" if first.dtype.itemsize in (1, 2, 4, 8) else None
        a, b = np.ascontiguousarray(first).reshape(-1), np.ascontiguousarray(second).reshape(-1)
        differing = float(np.mean(a.view(bits) != b.view(bits))) if bits else 1.0
        x, y = a.astype(np.float64), b.astype(np.float64)
        diff = np.where(np.isnan(x) & np.isnan(y), 0.0, np.abs(x - y))
        largest = float(np.nan_to_num(diff, nan=np.inf).max(initial=0.0))
        return OutputDiff(output=name, max_abs_diff=largest if np.isfinite(largest) else FLOAT_MAX, differing=differing)
    return OutputDiff(output=name, max_abs_diff=FLOAT_MAX, differing=1.0)
